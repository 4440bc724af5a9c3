"""The backlog: eligible work held until the engine has room, released fairly.

Why this module exists: once the window has made a generation eligible, the order in
which the backlog reaches the engine decides who waits. It is kept per caller and
released in this order (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024, for the first rule):

1. Fair share. Each caller has a virtual token counter: service / weight, where
   service is prompt tokens (charged at release) plus 2 x generated tokens (charged
   when the generation finishes: the core learns the count only then), one
   `CallerState.charge()` for both. The backlogged caller with the least counter goes
   next; a tie goes to the smaller release key. A caller whose backlog was empty
   (idle, or new) starts at the least counter of the backlogged callers, or, if there
   are none, at the counter the last served caller had: it cannot bank credit while
   idle. That holds on both ways out of idleness: into the backlog, and released at
   once past an empty backlog (coalescer.py rule 5), or a new caller served only that
   way keeps its 0 and outruns everyone served before it (the bench's three_callers:
   chat starved 60 s beside two new bulk callers; tests/unit/test_core_kv_bound.py).
2. Within a caller: the release key (order.py: priority, then short-first with
   continuous aging, then admission order). There is no separate age rule: the key's
   `max_delay` is the ceiling of how far a request falls behind first-come-first-served.
3. No head-of-line blocking: if a caller's first generation does not fit the engine
   room (room.py), its first generation in key order that fits goes instead, among
   the next 32 in key order and only one that arrived at most `max_delay` after every
   generation it passes. So the bound of order.py rule 3 holds when the room skips
   the head too: a long prompt waiting for KV room is passed only by work that
   arrived within `max_delay` of it, and then holds its caller (not others) until it
   fits. A caller none of whose work fits is blocked for the round; the next caller
   by counter is tried, but only while its counter is below the blocked caller's
   counter plus the blocked head's cost ((prompt + 2 x charged new tokens) / weight).
   Past that, the round ends and the room that frees next goes to the blocked
   caller: skipping it costs it at most one request's worth of service, so it cannot
   starve. A head held by one of the room's policy rules (room.POLICY: the
   short-prompt reserve, room.py rule 4, or the long-prefill bound, rule 5) adds
   the reserve's tokens to that cost (`Room.reserved` / weight): those rules hold it
   to keep room for other callers' short turns, and the floor must not then hold
   those turns too, while the room kept for them goes unused. With one request's
   worth, a chat caller beside two bulk callers on a KV-bound engine waited in
   Sluice's queue behind a bulk caller the reserve held: its counter, pulled up to
   theirs at each wake (rule 1) and climbing a turn at a time, passed the held
   caller's within five turns (modelled, bench/room_sim.py three, steps 3x the 2-core
   demo's, 3 seeds: chat queue wait p95 0.1-1.0 s against 0-10 ms with the reserve's
   worth, chat TTFT p95 0.25-1.19 s against 0.19-0.21 s, bulk req/s and split
   unchanged; measured on a machine with 1.8x longer steps, 921 ms).
4. A caller at its max_concurrency is passed over (it does not block others).
5. LoRA slots (room.py rule 7, adapters.py; only with `max_loras` > 0). A generation
   goes only if its adapter may have a slot. A caller whose work waits only for a
   slot (its head fits the room, but no generation rule 3 may take gets a slot) is
   passed over for the round without rule 3's floor: the engine keeps running the
   adapters in flight. What bounds that instead is time: the first caller of a round
   passed over for a slot, in rule-1 order (the least-served of those waiting: the
   fair-share head among them), starts adapters.py's clock or renames its adapter;
   a round that tries every caller and passes none over stops it. `wait` seconds
   after it started, the adapter in flight longest takes no new work, and the slot
   it frees goes to that head: a round starts with the least counter, and no caller
   below it needs a new slot (adapters.py rule 4). Among callers
   of equal standing (equal counters: callers that woke together at the floor, rule
   1) work whose adapter is in flight, or on the base weights, goes first, so the
   last free slot is not spent while work on a resident adapter could go.

Fairness bound (tested in tests/unit/test_core_backlog_stateful.py): a caller is only
served while its counter is below every other backlogged caller's counter plus one
request cost U (the largest (prompt + 2 x charged new tokens) / weight), plus R (the
reserve's tokens / the least weight) where a policy rule holds the other's head
(rule 3), so while two callers stay backlogged, the counter of the one served never
passes the other's by more than 2 U + R at a release. Generated tokens are charged
at finish, so counters also jump when work in flight ends: with at most F
generations of a caller in flight, the difference is at most 2 U + R + F U' at any
time, where U' is the largest (prompt + 2 x max_new) / weight.

Open-ended requests (no max_tokens, coalescer.py rule 12) change only U: their charged
new tokens are the caller's running estimate, not the context's room, so a blocked
head's floor is not inflated to a whole context and U stays a real request's size.
The release-time bound (2 U + R) holds as before, because rule 3's floor and the charge
at release use the same charged value; the finish-time term keeps the true max_new
(U'), because a generation may still run to it, and that jump is real service.

Cost: a push or a release is O(log n) heap work in the caller's own heaps plus
O(backlogged callers) to pick the caller; stale heap entries are skipped lazily.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from heapq import heappop, heappush

from . import warm as _warm
from ._records import BACKLOG, GONE, CallerState, Gen
from .adapters import AdapterSlots
from .room import POLICY, Hold, Room

__all__ = ["Backlog"]

# Rule 3: how many of a caller's generations, in key order, are tried when its head
# does not fit. Past the head the next ones are mostly as long (they arrived within
# max_delay of it, most of a class or more behind it), so a deep scan rarely finds a
# fit and would make a blocked round O(n log n); 32 keeps it O(log n) per release.
_SCAN = 32


def _floor(c: CallerState, head: Gen, rule: Hold, room: Room) -> float:
    """Rule 3: the counter that others may not reach while `c` is blocked, its head
    held by room rule `rule`; past one request's cost, the reserve where a policy
    rule holds it."""
    cost = (head.ptok + 2 * head.new) / c.weight
    if rule in POLICY:
        cost += room.reserved / c.weight
    return c.counter + max(cost, 1.0 / c.weight)


class Backlog:
    __slots__ = ("_bseq", "active", "held_by", "max_delay", "n", "slots", "vt", "warm_releases")

    def __init__(self, max_delay: float, slots: AdapterSlots | None = None) -> None:
        self.max_delay = max_delay
        self.slots = AdapterSlots() if slots is None else slots  # rule 5
        # Callers with a non-empty backlog (a dict for O(1) removal and stable order).
        self.active: dict[CallerState, None] = {}
        self.n = 0  # generations in the backlog
        self.vt = 0.0  # counter of the caller served last, before its charge (rule 1)
        # Why the last round of `pick()` left work held (None: it held none): the rule
        # that held the first caller it could not serve, in rule-1 order.
        self.held_by: Hold | None = None
        self._bseq = 0
        self.warm_releases = 0  # releases made for warmth (warm.py W3)

    # -- in and out ---------------------------------------------------------

    def push(self, gen: Gen) -> None:
        """`gen` became eligible: put it in its caller's backlog."""
        c = gen.caller
        if not c.backlog:
            self.wake(c)
            self.active[c] = None
        c.backlog += 1
        self.n += 1
        self._bseq = b = self._bseq + 1
        gen.bseq = b
        gen.state = BACKLOG
        heappush(c.heap, (gen.key, b, gen))

    def wake(self, c: CallerState) -> None:
        """Rule 1: a caller whose backlog is empty (idle, or new) starts at the least
        counter of the backlogged callers, or at `vt` if there are none. Called when it
        enters the backlog and, by the coalescer, when its work is released at once
        without passing the backlog (an empty backlog with room for all of it): a
        caller served only that way would otherwise keep the counter it had when it
        was last backlogged, 0 if new, and bank credit against everyone else."""
        active = self.active
        lo = min(o.counter for o in active) if active else self.vt
        c.counter = max(c.counter, lo)

    def discard(self, gen: Gen) -> None:
        """`gen` left the backlog without being picked (cancel, expiry)."""
        gen.state = GONE
        self._out(gen.caller)

    def _out(self, c: CallerState) -> None:
        c.backlog -= 1
        self.n -= 1
        if not c.backlog:
            del self.active[c]
            c.heap.clear()  # only stale entries are left
            if not self.n:
                self.slots.stop()  # nobody waits for a slot (rule 5)

    def clear(self) -> None:
        for c in self.active:
            c.backlog = 0
            c.heap.clear()
        self.active.clear()
        self.n = 0
        self.slots.stop()

    def served(self, gen: Gen) -> None:
        """A generation is released: charge its prompt to its caller (rule 1) and count
        it in flight at once, so that max_concurrency holds within one round (rule 4)."""
        c = gen.caller
        self.vt = c.counter
        c.charge(gen.ptok)
        c.in_flight += 1
        c.prompt_tokens += gen.ptok
        self.slots.take(gen.request.key.adapter)

    def ended(self, gen: Gen) -> None:
        """A released generation finished: its adapter's slot may free (rule 5)."""
        self.slots.done(gen.request.key.adapter)

    def heads(self) -> Iterator[Gen]:
        """Each backlogged caller's first generation in key order, but for callers at
        their max_concurrency (stale heap tops on the way are dropped, as `pick()`
        does)."""
        for c in self.active:
            if not c.capped():
                yield self._head(c)

    # -- order --------------------------------------------------------------

    @staticmethod
    def _head(c: CallerState) -> Gen:
        """The caller's first live generation in key order (rule 2)."""
        heap = c.heap
        while True:
            _, b, g = heap[0]
            if g.bseq == b and g.state == BACKLOG:
                return g
            heappop(heap)

    def _fit(self, c: CallerState, room: Room) -> Gen | None:
        """Rule 3: the caller's first generation in key order that fits `room` and
        arrived at most max_delay after each one it passes; it leaves the heap."""
        heap = c.heap
        tried: list[tuple[tuple[int, float, int], int, Gen]] = []
        barrier = math.inf
        found: Gen | None = None
        while heap and len(tried) < _SCAN:
            e = heappop(heap)
            g = e[2]
            if g.bseq != e[1] or g.state != BACKLOG:
                continue  # stale
            arrival = g.request.arrival
            if arrival > barrier:
                tried.append(e)
                break  # it and everything after it would pass a skipped head too far
            if room.fits(g.ptok, g.interactive) and room.admits(g.request.key.adapter):
                found = g
                break
            tried.append(e)
            barrier = min(barrier, arrival + self.max_delay)
        for e in tried:
            heappush(heap, e)
        return found

    def _warmest(
        self,
        c: CallerState,
        head: Gen,
        room: Room,
        warmth: Callable[[Gen], int],
        gain: int,
        now: float,
    ) -> Gen:
        """warm.py W1-W3: the caller's head, which fits `room`, or a later generation
        of the head's priority, arrived at most max_delay after each one it passes,
        that fits and holds `gain` or more leading blocks beyond the head's; it leaves
        the heap, and those it passes are marked passed at `now`."""
        heap = c.heap
        heappop(heap)  # the head is the heap's top (_head cleaned it)
        prio = head.key[0]
        barrier = head.request.arrival + self.max_delay
        tried: list[tuple[tuple[int, float, int], int, Gen]] = []
        cands: list[Gen] = [head]
        held: list[int] = [warmth(head)]
        while heap and len(tried) < _warm.SCAN:
            e = heappop(heap)
            g = e[2]
            if g.bseq != e[1] or g.state != BACKLOG:
                continue  # stale
            tried.append(e)
            arrival = g.request.arrival
            if g.key[0] != prio or arrival > barrier:
                break  # it, and all after it, would break order.py rule 1 or 3
            barrier = min(barrier, arrival + self.max_delay)
            if room.fits(g.ptok, g.interactive) and room.admits(g.request.key.adapter):
                cands.append(g)
                held.append(warmth(g))
        i = _warm.choose(held, gain) if len(cands) > 1 else 0
        chosen = cands[i]
        if i:
            self.warm_releases += 1
            chosen.for_warmth = True
            if head.passed is None:
                head.passed = now
            heappush(heap, (head.key, head.bseq, head))
            for e in tried:
                g = e[2]
                if g is chosen:
                    continue
                if g.key < chosen.key and g.passed is None:
                    g.passed = now
                heappush(heap, e)
        else:
            for e in tried:
                heappush(heap, e)
        return chosen

    def pick(
        self,
        now: float,
        room: Room,
        warmth: Callable[[Gen], int] | None = None,
        gain: int = 1,
    ) -> Iterator[Gen]:
        """Yield generations to release, in order, while `room` allows (rules 1-5).

        Each yielded generation has left the backlog (state GONE); the consumer books
        it in `room` and calls `served()`. Stops at the first point where nothing more
        may go, and leaves in `held_by` the rule that held work then. With `warmth`
        (a generation's leading blocks believed cached), a caller's head that fits may
        yield to a warmer generation (warm.py W1-W3, `gain` its min_gain).
        """
        self.held_by = None
        held: Hold | None = None  # the rule that held the first caller blocked
        capped = False  # a caller was passed over at its max_concurrency (rule 4)
        active = self.active
        blocked: set[CallerState] = set()
        floor = math.inf  # rule 3: the counter others may not reach while one is blocked
        lora = room.loras
        waiter = False  # rule 5: a caller of this round was passed over for a slot
        slot_blocked: set[CallerState] = set()  # callers passed over for a slot
        while active and not room.full:
            best: CallerState | None = None
            head: Gen | None = None
            if len(active) == 1 and not blocked:  # the common case, without the key
                best = next(iter(active))
                mc = best.policy.max_concurrency
                if mc is not None and best.in_flight >= mc:
                    self.held_by = Hold.CALLER
                    return
                head = self._head(best)
            else:
                key: tuple[float, int, tuple[int, float, int]] | None = None
                new_slot = room.new_slot
                for c in active:
                    if c in blocked:
                        continue
                    if c.capped():
                        capped = True
                        continue
                    g = self._head(c)
                    k = (c.counter, new_slot(g.request.key.adapter), g.key)
                    if key is None or k < key:
                        best, head, key = c, g, k
                if best is None and lora and not waiter and self.slots.since is not None:
                    # Every caller was tried and none waits for a new slot (the one who
                    # did left): the clock stops, the victim reopens, and those passed
                    # over for it are tried again (once: the clock is stopped now).
                    self.slots.stop()
                    if slot_blocked:
                        blocked -= slot_blocked
                        slot_blocked.clear()
                        continue
                if best is None or best.counter >= floor:
                    self.held_by = held or (Hold.CALLER if capped else None)
                    return
            assert head is not None  # an active caller has a live entry
            adapter = head.request.key.adapter
            if room.fits(head.ptok, head.interactive) and room.admits(adapter):
                if warmth is not None and best.backlog > 1:
                    gen: Gen | None = self._warmest(best, head, room, warmth, gain, now)
                else:
                    heappop(best.heap)  # the head is the heap's top (_head cleaned it)
                    gen = head
            else:
                gen = self._fit(best, room)
            if gen is None:
                blocked.add(best)
                rule = room.blocks(head.ptok, head.interactive)
                if held is None:
                    held = rule or Hold.ADAPTER
                if rule is None:  # it waits for a LoRA slot: no floor (rule 5)
                    slot_blocked.add(best)
                    if not waiter and adapter is not None and adapter not in room.resident:
                        # The first in rule-1 order that needs a new slot; work on the
                        # victim, closed to new work, waits for nothing but its drain.
                        waiter = True
                        self.slots.start(adapter, now)
                    continue
                floor = min(floor, _floor(best, head, rule, room))
                continue
            gen.state = GONE
            self._out(best)
            if lora and gen.request.key.adapter == self.slots.wanted:
                # The wanted adapter has its slot (adapters.py rule 3), and the victim
                # is open again: those passed over for a slot are tried again.
                self.slots.stop()
                waiter = False
                blocked -= slot_blocked
                slot_blocked.clear()
            yield gen
        if active:
            self.held_by = Hold.FEED  # room.full
