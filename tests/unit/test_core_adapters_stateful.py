"""Stateful property tests of LoRA slots (adapters.py, backlog.py rule 5).

Hypothesis drives random add / due (with time steps below and past the slot wait) /
finish / cancel sequences against a coalescer with window 0, `max_loras` 2 and five
callers: three on adapters of their own, one sharing an adapter, one on the base
weights. After every step it checks:

* slots: the distinct adapters in flight (released, not finished) never exceed
  max_loras;
* exactly once: every admitted request ends exactly once, DISPATCHED exactly when it
  is in a returned batch, and no generation is released twice;
* work conservation (the engine's other numbers unknown, so only slots hold work):
  after due(), every held generation is on an adapter that may not have a slot: none
  free and not resident, or the victim (rule 4);
* the fairness bound (no starvation for want of a slot): from any state, in a closed
  loop (each finished request's caller sends another at once), once the clock has
  run past the wait and the work in flight at that time has finished, one of the
  least-counter backlogged callers has been released. A second machine runs the
  slot and exactly-once checks beside a small engine (3 slots), where room holds work
  too.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from batching import (
    CallerPolicy,
    Callers,
    Coalescer,
    CoalescerConfig,
    Ended,
    EngineCapacity,
    Outcome,
    Request,
    group_key,
)

ADAPTER = {"p": "a0", "t": "a0", "q": "a1", "r": "a2", "s": None}
MAX_LORAS = 2
WAIT = 1.0


class Slots(RuleBasedStateMachine):
    seqs = 0

    def __init__(self) -> None:
        super().__init__()
        self.co = Coalescer(
            CoalescerConfig(
                window=0.0,
                adaptive=False,
                release_lone=False,
                dedupe=False,
                feed_steps=1.0,
                adapter_wait=WAIT,
                engine=EngineCapacity(max_seqs=self.seqs, max_loras=MAX_LORAS),
                callers=Callers(tuple(CallerPolicy(n) for n in ADAPTER)),
            )
        )
        self.now = 0.0
        self.n = 0
        self.held: dict[str, Request] = {}  # admitted, not released or cancelled
        self.flying: dict[str, Request] = {}  # released, not finished (release order)
        self.released: set[str] = set()
        self.ended: dict[str, Outcome] = {}

    # -- helpers ------------------------------------------------------------

    def _events(self) -> None:
        for ev in self.co.pop_events():
            if isinstance(ev, Ended):
                assert ev.request_id not in self.ended, "ended twice"
                self.ended[ev.request_id] = ev.outcome

    def _due(self) -> list[str]:
        out = []
        for b in self.co.due(self.now):
            for e in b.entries:
                rid = e.request.id
                assert rid not in self.released, "released twice"
                assert rid in self.held
                self.released.add(rid)
                self.flying[rid] = self.held.pop(rid)
                out.append(rid)
        self._events()
        for rid in out:
            assert self.ended.get(rid) is Outcome.DISPATCHED
        return out

    def _finish(self, rid: str) -> None:
        self.flying.pop(rid)
        assert self.co.finished(rid, self.now, 4)

    # -- rules --------------------------------------------------------------

    @rule(caller=st.sampled_from(sorted(ADAPTER)), prompt=st.integers(1, 64))
    def add(self, caller: str, prompt: int) -> None:
        self.n += 1
        rid = f"{caller}{self.n}"
        r = Request(
            rid,
            group_key("m", ADAPTER[caller]),
            tuple(range(prompt)),
            4,
            self.now,
            caller=caller,
        )
        self.co.add(r, self.now)
        self.held[rid] = r
        self._events()

    @rule(dt=st.sampled_from([0.0, 0.1, 0.4, WAIT + 0.01]))
    def due(self, dt: float) -> None:
        self.now += dt
        self._due()
        self.check_conserving()

    @precondition(lambda self: self.flying)
    @rule(i=st.integers(0, 1000))
    def finish(self, i: int) -> None:
        self._finish(list(self.flying)[i % len(self.flying)])
        self._due()
        self.check_conserving()

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000))
    def cancel(self, i: int) -> None:
        rid = sorted(self.held)[i % len(self.held)]
        assert self.co.cancel(rid, self.now)
        del self.held[rid]
        self._events()
        assert self.ended[rid] is Outcome.CANCELLED

    @precondition(lambda self: self.held and not self.seqs)
    @rule()
    def fairness_bound(self) -> None:
        """Past the wait, and once the work then in flight has ended, one of the
        least-counter backlogged callers has been served."""
        self._due()  # new callers wake at the floor (backlog.py rule 1)
        if not self.held:
            return
        counters = {c.name: c.counter for c in self.co.callers()}
        waiting = {r.caller for r in self.held.values()}
        least = min(counters[c] for c in waiting)
        heads = {c for c in waiting if counters[c] == least}
        served: set[str] = set()
        self.now += WAIT + 0.01
        served |= set(self._due())
        for rid in list(self.flying):  # the work in flight now; later releases may stay
            self._finish(rid)
            self.add(rid.rstrip("0123456789"), 8)  # closed loop: it comes back at once
            served |= set(self._due())
        assert {rid.rstrip("0123456789") for rid in served} & heads, (heads, served)

    # -- invariants ---------------------------------------------------------

    @invariant()
    def slots_within_max_loras(self) -> None:
        adapters = {r.key.adapter for r in self.flying.values()} - {None}
        assert len(adapters) <= MAX_LORAS, adapters
        view = dict(self.co.adapter_slots(self.now).in_flight)
        assert set(view) == adapters

    @invariant()
    def exactly_once(self) -> None:
        assert self.released.isdisjoint(self.held)
        for rid, outcome in self.ended.items():
            assert (outcome is Outcome.DISPATCHED) == (rid in self.released)
        assert self.co.queued_generations == len(self.held)

    def check_conserving(self) -> None:
        if self.seqs:
            return  # the room holds work too: only the safety checks apply
        view = self.co.adapter_slots(self.now)
        resident = {a for a, _ in view.in_flight}
        for r in self.held.values():
            a = r.key.adapter
            assert a is not None, "base-model work held"
            if a in resident:
                assert a == view.victim, f"{a} is resident and open"
            else:
                assert len(resident) >= MAX_LORAS, f"{a} could have a slot"


class SlotsBesideRoom(Slots):
    seqs = 3


TestSlots = Slots.TestCase
TestSlots.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestSlotsBesideRoom = SlotsBesideRoom.TestCase
TestSlotsBesideRoom.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
