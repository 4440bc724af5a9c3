"""Endings: how many running generations end within the engine's next steps.

Why this module exists: room.py rule 2 keeps in vLLM's queue what the engine's next
steps will take, and a step takes, besides the slots its last step left free, the
slots that the steps until a release reaches the engine free. Those are not a
multiple of the last step's free slots: equal requests started together end
together, so one step frees a hundred slots and the next none, and a release sized
on the one before (issue 27's first feed: twice the free slots) then waits in vLLM's
queue until the next group ends, seconds later (a quarter of the requests at data
parallelism c=512, bench/results/issue27-cpu.md). A generation's end is known ahead
in engine steps: vLLM decodes one token per running request per step, so one whose
first output came at step s ends by step s + max_new_tokens - 1 (sooner on a stop
or EOS: rule 2's spare covers those).

Sans-IO like the rest of the core: the clock is one rank's engine step count, given
by the caller; nothing here reads time.
"""

from __future__ import annotations

import heapq

__all__ = ["Endings"]


# A generation still running this many steps past its predicted end (preempted and
# recomputing, or its first output heard late) stops counting: a late one would
# otherwise hold its place in the feed for as long as it runs.
GRACE = 2.0

_LATER, _SOON, _LATE = 0, 1, 2


class Endings:
    """Started generations by the engine step by which they end.

    `soon` counts those whose end falls between `GRACE` steps ago and the horizon
    (the step clock plus the look-ahead). Each generation moves later -> soon -> late
    as the clock passes; two heaps keep that O(log n) a start and an advance, O(1) an
    end (an ended one's heap entries are dropped when they surface).
    """

    __slots__ = ("_ahead", "_clock", "_gens", "_later", "_soon", "_soon_heap")

    def __init__(self, ahead: float) -> None:
        self._ahead = ahead  # steps looked ahead
        self._clock = 0.0  # this rank's engine steps so far
        self._gens: dict[str, tuple[float, int]] = {}  # id -> (end step, state)
        self._later: list[tuple[float, str]] = []  # heap: not yet within the horizon
        self._soon_heap: list[tuple[float, str]] = []  # heap: within it, until late
        self._soon = 0

    @property
    def ahead(self) -> float:
        return self._ahead

    @ahead.setter
    def ahead(self, steps: float) -> None:
        """A new look-ahead; entries move at once."""
        self._ahead = steps
        self.advance(0.0)

    @property
    def soon(self) -> int:
        """Running generations that end within the look-ahead (and are not late)."""
        return self._soon

    def start(self, gen_id: str, max_new_tokens: int) -> None:
        """`gen_id` produced its first output at the current step: it ends by
        `max_new_tokens - 1` steps from now."""
        end = self._clock + max(0, max_new_tokens - 1)
        if end <= self._clock + self._ahead:
            self._gens[gen_id] = (end, _SOON)
            heapq.heappush(self._soon_heap, (end, gen_id))
            self._soon += 1
        else:
            self._gens[gen_id] = (end, _LATER)
            heapq.heappush(self._later, (end, gen_id))

    def end(self, gen_id: str) -> None:
        """`gen_id` ended (or never started: a no-op)."""
        entry = self._gens.pop(gen_id, None)
        if entry is not None and entry[1] == _SOON:
            self._soon -= 1

    def advance(self, steps: float) -> None:
        """The engine ran `steps` more steps on this rank."""
        self._clock += steps
        gens = self._gens
        horizon = self._clock + self._ahead
        later, soon = self._later, self._soon_heap
        while later and later[0][0] <= horizon:
            end, gen_id = heapq.heappop(later)
            if gens.get(gen_id) == (end, _LATER):
                gens[gen_id] = (end, _SOON)
                heapq.heappush(soon, (end, gen_id))
                self._soon += 1
        late = self._clock - GRACE
        while soon and soon[0][0] < late:
            end, gen_id = heapq.heappop(soon)
            if gens.get(gen_id) == (end, _SOON):
                gens[gen_id] = (end, _LATE)
                self._soon -= 1
