"""LoRA slots: the adapters in flight, and how long the fair-share head may wait for one.

Why this module exists: vLLM schedules at most `max_loras` distinct adapters in one
step (vllm/v1/core/sched/scheduler.py, `scheduled_loras`: once the running requests
hold that many, a waiting request on another adapter is skipped; base-model requests
take no slot). Work Sluice released on a third adapter beside two busy ones would sit
in vLLM's own queue, where Sluice can no longer reorder or cancel it cheaply, and vLLM
frees a slot only when every running request of an adapter has ended: in a closed loop
that may be never. So the backlog keeps the adapters in flight within `max_loras` and
decides itself when one gives up its slot. The room (room.py rule 7) asks the queries
here; the backlog (backlog.py rule 5) starts and stops the clock.

Rules (`max_loras` 0: LoRA is off, every query answers as if this module did not exist):

1. In flight: an adapter holds a slot while work Sluice released on it has not
   finished (`take` at release, `done` at finish). Base-model work (adapter None)
   takes none.
2. A slot: work on adapter A may go if A holds a slot (and is not closed, rule 4), or
   fewer than `max_loras` adapters hold one.
3. The clock: when a release round passes a caller over because its work cannot get
   a slot, the clock starts (`since` = now) and names the adapter of the first such
   caller in fair-share order (`wanted`: the head among those waiting, backlog.py
   rule 5). It keeps running while someone waits for a slot (a new head renames
   `wanted`, not `since`), and stops when the wanted adapter gets a slot, when a
   round tries every caller and passes none over, or when the backlog empties. Before
   the bound, work on the adapters in flight keeps going: the engine stays busy (work
   conservation).
4. The bound: once the clock has run `wait` seconds, the adapter that has held its
   slot longest (the victim; not the wanted one) takes no new work. The victim drains
   as its work ends, and its slot goes to the head: slots free only between release
   rounds (at a finish), and each round starts with the fair-share head. So a caller
   waits for a slot at most `wait` plus the time the victim's work in flight takes to
   end: no caller starves because its adapter is not resident. Longest-held, not
   fewest in flight: a slot just given to the last head would otherwise be taken back
   at once, and the rotation is first in, first out.

`wait` trades fairness against throughput: every swap drains one adapter's batch to
empty before the next fills. The default is 0 (config.py says why: at 1 s the issue-20
point's worst caller waited 12.5 s at p95): the drain starts as soon as the head waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AdapterSlots", "SlotView", "check_wait"]


@dataclass(frozen=True, slots=True)
class SlotView:
    """A snapshot of the slots at `now` (for /metrics, the status page and tests)."""

    in_flight: tuple[tuple[str, int], ...]  # adapter, generations; longest-held first
    wanted: str | None  # the adapter the fair-share head waits for (rule 3)
    waiting_since: float | None
    victim: str | None  # closed to new work (rule 4)


class AdapterSlots:
    """The core's mutable record of adapter slots (rules 1-4)."""

    __slots__ = ("flying", "max_loras", "since", "wait", "wanted")

    def __init__(self, max_loras: int = 0, wait: float = 0.0) -> None:
        self.max_loras = max_loras
        self.wait = wait
        # Adapter -> its generations in flight; insertion order is the order in which
        # they took their slots (a dict re-appends a key that left and came back).
        self.flying: dict[str, int] = {}
        self.since: float | None = None  # rule 3's clock
        self.wanted: str | None = None

    # -- commands -------------------------------------------------------------

    def take(self, adapter: str | None) -> None:
        """Rule 1: a generation on `adapter` was released."""
        if adapter is not None and self.max_loras:
            self.flying[adapter] = self.flying.get(adapter, 0) + 1

    def done(self, adapter: str | None) -> None:
        """Rule 1: a released generation on `adapter` finished."""
        n = self.flying.get(adapter) if adapter is not None else None
        if n is None:
            return  # base weights, or LoRA off when it was released
        if n > 1:
            self.flying[adapter] = n - 1  # type: ignore[index]  # not None here
        else:
            del self.flying[adapter]  # type: ignore[arg-type]

    def start(self, adapter: str, now: float) -> None:
        """Rule 3: the head waits for a slot for `adapter`."""
        if self.since is None:
            self.since = now
        self.wanted = adapter

    def stop(self) -> None:
        """Rule 3: nobody waits for a slot (any more)."""
        self.since = None
        self.wanted = None

    # -- queries --------------------------------------------------------------

    def overdue(self, now: float) -> bool:
        """Rule 4: the head has waited `wait` seconds for a slot."""
        since = self.since
        return since is not None and now - since >= self.wait

    def victim(self, now: float) -> str | None:
        """Rule 4: the adapter closed to new work, if the clock is overdue."""
        if not self.overdue(now):
            return None
        wanted = self.wanted
        for a in self.flying:
            if a != wanted:
                return a
        return None

    def view(self, now: float) -> SlotView:
        return SlotView(tuple(self.flying.items()), self.wanted, self.since, self.victim(now))

    def admits(self, adapter: str | None, resident: set[str], now: float) -> bool:
        """Rule 2: may work on `adapter` go, with `resident` holding slots?"""
        if adapter is None or not self.max_loras:
            return True
        if adapter in resident:
            return adapter != self.victim(now)
        return len(resident) < self.max_loras


def check_wait(wait: float) -> None:
    """Validate rule 4's bound once, at configuration."""
    if not (wait >= 0 and math.isfinite(wait)):
        raise ValueError("adapter wait must be a finite number of seconds >= 0")
