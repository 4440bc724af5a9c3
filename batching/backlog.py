"""The backlog: eligible work held until the engine has room, released fairly.

Why this module exists: once the window has made a generation eligible, the order in
which the backlog reaches the engine decides who waits. It is kept per caller and
released in this order (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024, for the first rule):

1. Fair share. Each caller has a virtual token counter: service / weight, where
   service is prompt tokens (charged at release) plus 2 x generated tokens (charged
   when the generation finishes: the core learns the count only then). The
   backlogged caller with the least counter goes next. A caller whose backlog was
   empty (idle, or new) starts at the least counter of the backlogged callers, or,
   if there are none, at the counter the last served caller had: it cannot bank
   credit while idle.
2. Within a caller: priority (lower first, vLLM's convention), then the shorter
   prompt, then admission order.
3. Age bound: a generation that has waited `age_bound` seconds since its arrival
   goes first within its caller (the oldest first), ahead of shorter and
   higher-priority work, and that caller then releases nothing else until the
   engine has room for it.
4. No head-of-line blocking: if a caller's first generation does not fit the engine
   room (room.py) and is not overdue, the caller's first generation in rule-2 order
   that does fit goes instead (each priority's shortest is tried, in priority order).
   A caller none of whose work fits is blocked for the round; the next caller by
   counter is tried, but only while its counter is below the blocked caller's counter
   plus the blocked head's cost ((prompt + 2 x max_new) / weight). Past that, the
   round ends and the room that frees next goes to the blocked caller: skipping it
   costs it at most one request's worth of service, so it cannot starve.
5. A caller at its max_concurrency is passed over (it does not block others).

Fairness bound (tested in tests/unit/test_core_backlog_stateful.py): a caller is only
served while its counter is below every other backlogged caller's counter plus one
request cost U (the largest (prompt + 2 x max_new) / weight), so while two callers stay
backlogged, the counter of the one served never passes the other's by more than 2 U
at a release. Generated tokens are charged at finish, so counters also jump when work
in flight ends: with at most F generations of a caller in flight, the difference is
at most (2 + F) U at any time.

Cost: a push or a release is O(log n) heap work in the caller's own heaps plus
O(backlogged callers) to pick the caller; stale heap entries are skipped lazily.
"""

from __future__ import annotations

import math
from bisect import insort
from collections.abc import Iterator
from heapq import heappop, heappush

from ._records import BACKLOG, GONE, Gen
from .callers import CallerState
from .room import Room

__all__ = ["Backlog"]


class Backlog:
    __slots__ = ("_bseq", "active", "age_bound", "n", "vt")

    def __init__(self, age_bound: float) -> None:
        self.age_bound = age_bound
        # Callers with a non-empty backlog (a dict for O(1) removal and stable order).
        self.active: dict[CallerState, None] = {}
        self.n = 0  # generations in the backlog
        self.vt = 0.0  # counter of the caller served last, before its charge (rule 1)
        self._bseq = 0

    # -- in and out ---------------------------------------------------------

    def push(self, gen: Gen) -> None:
        """`gen` became eligible: put it in its caller's backlog."""
        c = gen.caller
        if not c.backlog:
            active = self.active
            lo = min(o.counter for o in active) if active else self.vt
            c.counter = max(c.counter, lo)
            active[c] = None
        c.backlog += 1
        self.n += 1
        self._bseq = b = self._bseq + 1
        gen.bseq = b
        gen.state = BACKLOG
        prio = gen.request.priority
        heap = c.levels.get(prio)
        if heap is None:
            heap = c.levels[prio] = []
            insort(c.prios, prio)
        heappush(heap, (gen.ptok, gen.seq, b, gen))
        if self.age_bound != math.inf:
            heappush(c.aged, (gen.seq, b, gen))

    def discard(self, gen: Gen) -> None:
        """`gen` left the backlog without being picked (cancel, expiry)."""
        gen.state = GONE
        self._out(gen.caller)

    def _out(self, c: CallerState) -> None:
        c.backlog -= 1
        self.n -= 1
        if not c.backlog:
            del self.active[c]
            c.levels.clear()  # only stale entries are left
            c.prios.clear()
            c.aged.clear()

    def clear(self) -> None:
        for c in self.active:
            c.backlog = 0
            c.levels.clear()
            c.prios.clear()
            c.aged.clear()
        self.active.clear()
        self.n = 0

    def served(self, gen: Gen) -> None:
        """A generation is released: charge its prompt to its caller (rule 1) and count
        it in flight at once, so that max_concurrency holds within one round (rule 5)."""
        c = gen.caller
        self.vt = c.counter
        c.counter += gen.ptok / c.weight
        c.in_flight += 1

    # -- order --------------------------------------------------------------

    def _overdue(self, c: CallerState, now: float) -> Gen | None:
        """The caller's oldest backlogged generation, if it is past the age bound."""
        aged = c.aged
        while aged:
            _, b, g = aged[0]
            if g.bseq == b and g.state == BACKLOG:
                return g if g.request.arrival + self.age_bound <= now else None
            heappop(aged)
        return None

    def _first(self, c: CallerState, room: Room | None) -> Gen | None:
        """The caller's first generation in rule-2 order that fits `room` (any if None)."""
        prios = c.prios
        levels = c.levels
        i = 0
        while i < len(prios):
            heap = levels[prios[i]]
            while heap:
                e = heap[0]
                g = e[3]
                if g.bseq == e[2] and g.state == BACKLOG:
                    break
                heappop(heap)
            if not heap:
                del levels[prios[i]]
                del prios[i]
                continue
            if room is None or room.fits(g.ptok):
                return g
            i += 1
        return None

    def pick(self, now: float, room: Room) -> Iterator[Gen]:
        """Yield generations to release, in order, while `room` allows (rules 1-5).

        Each yielded generation has left the backlog (state GONE); the consumer books
        it in `room` and calls `served()`. Stops at the first point where nothing more
        may go.
        """
        active = self.active
        blocked: set[CallerState] = set()
        floor = math.inf  # rule 4: the counter others may not reach while one is blocked
        aged = self.age_bound != math.inf
        while active and not room.full:
            best: CallerState | None = None
            head: Gen | None = None
            if len(active) == 1 and not blocked:  # the common case, without the key
                best = next(iter(active))
                mc = best.policy.max_concurrency
                if mc is not None and best.in_flight >= mc:
                    return
                head = self._overdue(best, now) if aged else None
                overdue = head is not None
                if head is None:
                    head = self._first(best, None)
            else:
                overdue = False
                key: tuple[float, int, int, int] | None = None
                for c in active:
                    if c in blocked or c.capped():
                        continue
                    g = self._overdue(c, now) if aged else None
                    late = g is not None
                    if g is None:
                        g = self._first(c, None)
                    assert g is not None  # an active caller has a live entry
                    k = (c.counter, g.request.priority, g.ptok, g.seq)
                    if key is None or k < key:
                        best, head, overdue, key = c, g, late, k
                if best is None or best.counter >= floor:
                    return
            assert head is not None  # an active caller has a live entry
            if overdue:
                gen = head if room.fits(head.ptok) else None
            elif room.fits(head.ptok):
                gen = head
            else:
                gen = self._first(best, room)
            if gen is None:
                blocked.add(best)
                cost = (head.ptok + 2 * head.request.max_new_tokens) / best.weight
                floor = min(floor, best.counter + max(cost, 1.0 / best.weight))
                continue
            gen.state = GONE
            self._out(best)
            yield gen
