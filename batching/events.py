"""Observability records: what the core did, for metrics and logs.

Why this module exists: the core must not know about Prometheus or logging, yet every
decision it makes has to be countable. It appends small frozen records to a list; the
driver drains them with `Coalescer.pop_events()` and turns them into metrics and log
lines.

Rules:

* Every admitted subscriber produces exactly one `Ended`, with one `Outcome`. A refusal
  produces one `Refusal` and no `Ended` (the caller was never admitted).
* One `Released` per batch, emitted after the `Ended(DISPATCHED)` of its subscribers.
* `queue_wait` is measured from the subscriber's own `Request.arrival` (window and
  backlog together); `Ended` and `Refusal` name the subscriber's caller.
* Events are in the order the core made its decisions; nothing is aggregated here
  (see `Counters` for the cumulative totals).
"""

from __future__ import annotations

from dataclasses import dataclass

from .callers import DEFAULT_CALLER
from .keys import GroupKey
from .types import Outcome, RefusalReason, ReleaseReason

__all__ = ["Counters", "DedupeHit", "Ended", "Event", "Refusal", "Released", "RoomCounters"]


@dataclass(frozen=True, slots=True)
class Released:
    batch_id: int
    key: GroupKey
    reason: ReleaseReason
    size: int  # entries (generations)
    tokens: int
    at: float


@dataclass(frozen=True, slots=True)
class Ended:
    request_id: str
    outcome: Outcome
    queue_wait: float
    at: float
    caller: str = DEFAULT_CALLER  # the subscriber's own caller


@dataclass(frozen=True, slots=True)
class Refusal:
    request_id: str
    reason: RefusalReason
    retry_after: float
    at: float
    caller: str = DEFAULT_CALLER


@dataclass(frozen=True, slots=True)
class DedupeHit:
    request_id: str
    joined: str


Event = Released | Ended | Refusal | DedupeHit


@dataclass(frozen=True, slots=True)
class Counters:
    """Cumulative totals since the coalescer was built (a snapshot)."""

    admitted: int
    refused: int
    dispatched: int  # subscribers
    cancelled: int
    expired: int
    rejected: int
    batches: int
    generations: int  # dispatched generations (entries)
    dedupe_hits: int


@dataclass(frozen=True, slots=True)
class RoomCounters:
    """Cumulative totals of the engine room since the coalescer was built: the engine
    steps it was told of and what its backlog held meanwhile (room.py)."""

    steps: int  # engine steps reported to the core (each DP rank's own)
    steps_held: int  # of those, steps that ran while the backlog held work
    underfed_steps: int  # of those, under-fed ones (room.underfed)
    held_seconds: tuple[tuple[str, float], ...]  # (room.Hold value, seconds) per rule
    # Of the under-fed ones, those where Sluice's policy for a short turn's room held
    # the smallest held prompt (room.py rules 4-5: the reserve, one long prefill).
    underfed_policy_steps: int = 0
