"""Drain-rate estimator: how fast the engine finishes admitted work.

Why this module exists: a refused caller gets a `Retry-After`, and a number pulled
from thin air either hammers a full server or idles a free one. The honest estimate is
"the excess over the limit divided by the measured rate at which work leaves".

Rules:

* Rates are measured from `finished()` reports only: tokens (and callers) per second of
  *busy* time. Time while nothing is in flight is not counted, so an idle night does
  not make the first burst of the morning look slow.
* The estimate is a time-weighted EWMA: a sample covering `dt` seconds gets weight
  `1 - exp(-dt / tau)` (tau = 2 s by default), so many tiny intervals and one long one
  of the same span weigh the same. The first sample is taken as is.
* A sample is closed once `min_interval` of busy time has passed, or when the engine
  goes idle; until the first one closes, `tokens_per_s` is None and callers fall back
  to a configured default.
"""

from __future__ import annotations

import math

__all__ = ["DrainRate"]


class DrainRate:
    __slots__ = (
        "_busy",
        "_reqs",
        "_rrate",
        "_t0",
        "_tau",
        "_tokens",
        "_trate",
        "min_interval",
    )

    def __init__(self, tau: float = 2.0, min_interval: float = 0.1) -> None:
        self._tau = tau
        self.min_interval = min_interval
        self._busy = False
        self._t0 = 0.0  # start of the open sample (busy time only)
        self._tokens = 0  # finished in the open sample
        self._reqs = 0
        self._trate: float | None = None
        self._rrate: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return self._trate

    @property
    def requests_per_s(self) -> float | None:
        return self._rrate

    def busy(self, now: float) -> None:
        """Work was dispatched; starts the clock if the engine was idle."""
        if not self._busy:
            self._busy = True
            self._t0 = now

    def finished(self, tokens: int, requests: int, now: float, idle: bool) -> None:
        """`tokens` and `requests` (callers) left the engine; `idle`: nothing is left."""
        if not self._busy:  # a report without a dispatch: start measuring from here
            self._busy = True
            self._t0 = now
        self._tokens += tokens
        self._reqs += requests
        dt = now - self._t0
        if idle or dt >= self.min_interval:
            if dt > 0:
                self._sample(dt)
                self._t0 = now
                self._tokens = 0
                self._reqs = 0
            # dt == 0 (finished at the dispatch instant): keep accumulating.
            if idle:
                self._busy = False

    def _sample(self, dt: float) -> None:
        trate = self._tokens / dt
        rrate = self._reqs / dt
        if self._trate is None or self._rrate is None:
            self._trate, self._rrate = trate, rrate
            return
        w = 1.0 - math.exp(-dt / self._tau)
        self._trate += w * (trate - self._trate)
        self._rrate += w * (rrate - self._rrate)
