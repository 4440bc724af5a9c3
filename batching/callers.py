"""Callers: who sent a request, their share of the engine, and their own limits.

Why this module exists: several services share one engine, and one of them must not
be able to push the others' work behind its own. The server names the caller of every
request (`Request.caller`: its API key's name, or the OpenAI `user` field); this
module holds what the core knows about each name, as frozen values the server builds
from its callers file (and rebuilds on SIGHUP), plus the small mutable state the core
keeps per caller.

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
  prompt + max_new_tokens; `finished(tokens=...)` gives back the unused part of
  max_new_tokens, and a request that leaves before dispatch gets all of it back. A
  request that does not fit is refused (CALLER_LIMIT) with Retry-After the time until
  the bucket holds enough; one larger than the whole bucket can never fit (TOO_LARGE).
  A duplicate that joins a queued generation costs nothing.
* Policies change with `Coalescer.set_callers()`: new limits apply to the next
  admission and release; queued work, counters and buckets (clamped to the new
  capacity) stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .drain import DrainRate

if TYPE_CHECKING:
    from ._records import Gen

__all__ = ["DEFAULT_CALLER", "CallerPolicy", "CallerStats", "Callers", "TokenBucket"]

DEFAULT_CALLER = "default"


@dataclass(frozen=True, slots=True)
class CallerPolicy:
    """One caller's weight and limits (None = no limit of that kind)."""

    name: str
    weight: float = 1.0
    max_concurrency: int | None = None
    max_queued: int | None = None
    tokens_per_minute: int | None = None

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


class TokenBucket:
    """tokens_per_minute as a bucket (see the module docstring)."""

    __slots__ = ("at", "capacity", "level", "rate")

    def __init__(self, per_minute: int) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.at = -math.inf  # full until first used: refilling from -inf stays full

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
            self.at = now

    def wait(self, cost: int, now: float) -> float:
        """Seconds until `cost` tokens fit (0.0: they fit now)."""
        self._refill(now)
        missing = cost - self.level
        return missing / self.rate if missing > 0 else 0.0

    def take(self, cost: int) -> None:
        self.level -= cost

    def give(self, tokens: int) -> None:
        self.level = min(self.capacity, self.level + tokens)

    def resize(self, per_minute: int) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = min(self.level, self.capacity)


class CallerState:
    """The core's mutable record of one caller (private to batching/).

    `levels` maps a priority to a heap of (prompt tokens, admission seq, backlog seq,
    generation); `prios` lists the priorities with a heap, sorted; `aged` is a heap of
    (admission seq, backlog seq, generation), oldest first, for the age bound. Entries
    go stale when a generation leaves the backlog and are skipped (their backlog seq
    no longer matches the generation's).
    """

    __slots__ = (
        "admitted",
        "aged",
        "backlog",
        "bucket",
        "counter",
        "drain",
        "generated_tokens",
        "in_flight",
        "levels",
        "name",
        "policy",
        "prios",
        "prompt_tokens",
        "queued",
        "refused",
        "weight",
    )

    def __init__(self, policy: CallerPolicy, name: str) -> None:
        self.name = name
        self.policy = policy
        self.weight = policy.weight
        tpm = policy.tokens_per_minute
        self.bucket = None if tpm is None else TokenBucket(tpm)
        self.drain = DrainRate()
        self.counter = 0.0
        self.levels: dict[int, list[tuple[int, int, int, Gen]]] = {}
        self.prios: list[int] = []
        self.aged: list[tuple[int, int, Gen]] = []
        self.backlog = 0
        self.queued = 0
        self.in_flight = 0
        self.admitted = 0
        self.refused = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0

    def set_policy(self, policy: CallerPolicy) -> None:
        if self.policy.max_queued is None and policy.max_queued is not None:
            self.drain = DrainRate()  # it was not measured without the limit
        self.policy = policy
        self.weight = policy.weight
        tpm = policy.tokens_per_minute
        if tpm is None:
            self.bucket = None
        elif self.bucket is None:
            self.bucket = TokenBucket(tpm)
        else:
            self.bucket.resize(tpm)

    def capped(self) -> bool:
        mc = self.policy.max_concurrency
        return mc is not None and self.in_flight >= mc

    def stats(self) -> CallerStats:
        return CallerStats(
            self.name,
            self.weight,
            self.queued,
            self.backlog,
            self.in_flight,
            self.counter,
            self.admitted,
            self.refused,
            self.prompt_tokens,
            self.generated_tokens,
            self.prompt_tokens + 2 * self.generated_tokens,
        )
