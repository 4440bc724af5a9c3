"""Callers: who sent a request, their share of the engine, and their own limits.

Why this module exists: several services share one engine, and one of them must not
be able to push the others' work behind its own. The server names the caller of every
request (`Request.caller`: its API key's name, or the OpenAI `user` field); this
module holds what the core knows about each name, as frozen values the server builds
from its callers file (and rebuilds on SIGHUP). The mutable state the core keeps per
caller (counters, heaps, token bucket) is in _records.py with the other records.

Rules:

* `Callers` is the policy table: named `CallerPolicy`s and a `default` that every
  other name gets (including `DEFAULT_CALLER`, the name of a request that has none).
  Each distinct name still gets its own state (its own fair share and limits); the
  server keeps the number of names bounded.
* `weight` (> 0, default 1) is the caller's share of service while it is backlogged:
  the fair-share counter grows by service / weight (see backlog.py).
* `max_concurrency` (>= 1 or None) caps the caller's generations in the engine at
  once; the rest wait in the backlog. It never refuses by itself.
* `max_queued` (>= 0 or None) refuses (RefusalReason.CALLER_LIMIT) a request when the
  caller's waiting requests (window and backlog, duplicates that joined included)
  reach `max_queued` plus the `max_concurrency` slots it is not using now, i.e. when
  queued + in flight would pass max_concurrency + max_queued. Retry-After: the excess
  over the caller's own measured request drain rate (measured only while it has a
  max_queued: nothing else needs it, and it costs time on the hot path).
* `tokens_per_minute` (>= 1 or None) is a token bucket: capacity tokens_per_minute,
  refilled at tokens_per_minute / 60 per second, full at the start. Admission takes
  the generation's charge (prompt + max_new_tokens, or, for a client that set no
  max_tokens, prompt + the caller's estimate: coalescer.py rule 12); `finished(
  tokens=...)` reconciles it with what was generated (gives back the unused part, or
  takes the excess), and a request that leaves before dispatch gets all of it back. A
  request that does not fit is refused (CALLER_LIMIT) with Retry-After the time until
  the bucket holds enough; one larger than the whole bucket can never fit (TOO_LARGE).
  A duplicate that joins a queued generation costs nothing.
* `background` (default false) makes every request of the caller background work
  (classes.py rule 1: ordered behind interactive work, `service_tier` flex).
* Policies change with `Coalescer.set_callers()`: new limits apply to the next
  admission and release; queued work, counters and buckets (clamped to the new
  capacity) stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["DEFAULT_CALLER", "CallerPolicy", "CallerStats", "Callers"]

DEFAULT_CALLER = "default"


@dataclass(frozen=True, slots=True)
class CallerPolicy:
    """One caller's weight and limits (None = no limit of that kind)."""

    name: str
    weight: float = 1.0
    max_concurrency: int | None = None
    max_queued: int | None = None
    tokens_per_minute: int | None = None
    background: bool = False  # its requests are background work (classes.py rule 1)

    def __post_init__(self) -> None:
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"caller {self.name!r}: weight must be a finite number > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"caller {self.name!r}: max_concurrency must be >= 1")
        if self.max_queued is not None and self.max_queued < 0:
            raise ValueError(f"caller {self.name!r}: max_queued must be >= 0")
        if self.tokens_per_minute is not None and self.tokens_per_minute < 1:
            raise ValueError(f"caller {self.name!r}: tokens_per_minute must be >= 1")


@dataclass(frozen=True, slots=True)
class Callers:
    """The policy table: named policies, and the default for every other name."""

    policies: tuple[CallerPolicy, ...] = ()
    default: CallerPolicy = CallerPolicy(DEFAULT_CALLER)
    _by_name: dict[str, CallerPolicy] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {p.name: p for p in self.policies}
        if len(by_name) != len(self.policies):
            raise ValueError("caller names must be unique")
        object.__setattr__(self, "_by_name", by_name)

    def get(self, name: str) -> CallerPolicy:
        return self._by_name.get(name, self.default)


@dataclass(frozen=True, slots=True)
class CallerStats:
    """A snapshot of one caller, for gauges and metrics (totals are cumulative)."""

    name: str
    weight: float
    queued: int  # waiting requests (window + backlog), joined duplicates included
    backlog: int  # generations eligible and held back until the engine has room
    in_flight: int  # generations released to the engine and not finished
    counter: float  # the fair-share (virtual token) counter, weighted
    admitted: int
    refused: int
    prompt_tokens: int  # of released generations
    generated_tokens: int  # reported by finished()
    service: int  # prompt + 2 x generated: the service received, unweighted
