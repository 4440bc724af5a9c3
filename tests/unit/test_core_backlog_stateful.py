"""Stateful property tests of the backlog: callers, engine room, fair release.

Hypothesis drives random sequences of add / cancel / due (with random engine KV use) /
started / finished / state changes / caller reloads against a coalescer with window 0
(so after a due() every admitted generation is eligible) and a small engine, and checks
after every step:

* exactly once: every admitted subscriber ends exactly once, DISPATCHED exactly when
  it is in a returned batch; caller refusals exactly when the model says;
* gauges (backlog, engine waiting, per-caller queued / backlog / in flight) match;
* max_concurrency: a caller never gets a release that takes it past its cap;
* work conservation: after due(), nothing that could go is left behind: either the
  engine has no slot, or every backlogged caller that is not capped and has work that
  fits the room is held back only by the fairness floor (a blocked caller's counter
  plus its head's cost, backlog.py rule 3); with nothing in flight, the backlog is empty;
* the aging bound (order.py rule 3, backlog.py rule 3): no generation is released
  while one of its caller's same-priority generations that arrived more than
  max_delay before it is still held: nobody waits more than its bound beyond
  first-come-first-served within its caller;
* release order: each caller's releases of a round go in release-key order among
  what fitted (the key recomputed here from its definition, not from order.py);
* open-ended charges (coalescer.py rule 12): pending tokens equal the sum of each
  held or flying generation's charge, prompt + max_new or prompt + the caller's
  running estimate, which this model keeps itself;
* no starvation: a drain (finish everything, call due()) empties the backlog in at most
  one round per backlogged generation.

A second machine keeps two equal-weight callers backlogged the whole time and checks
the fairness bound of backlog.py: their counters never differ by more than
(2 + 3S) x U, S the engine's slots (3S bounds either caller's generations in flight:
the running ones and the engine's queue of two steps and a spare, room.py rule 2)
and U the largest request's cost, prompt + 2 x max_new. Some requests are open-ended
(charged an estimate): the bound is unchanged (backlog.py, "Open-ended requests").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batching import (
    AdmissionState,
    Admitted,
    CallerPolicy,
    Callers,
    Coalescer,
    CoalescerConfig,
    DedupeHit,
    Ended,
    EngineCapacity,
    EngineLoad,
    EngineStep,
    Outcome,
    RefusalReason,
    Refused,
    ReleaseOrder,
    ReleaseReason,
    Request,
    group_key,
)
from batching.endings import GRACE
from batching.room import POLICY as POLICY_RULES
from batching.room import EngineView, Room

M = group_key("m")
NAMES = ("a", "b", "c")


@dataclass
class Gen:
    request: Request
    seq: int
    charge: int  # prompt + charged new tokens
    subs: list[str] = field(default_factory=list)

    @property
    def caller(self) -> str:
        return self.request.caller

    @property
    def ptok(self) -> int:
        return len(self.request.prompt_tokens)


@dataclass
class Flying:
    caller: str
    ptok: int
    subs: int
    charge: int
    open_ended: bool
    new: int  # max_new_tokens
    started: bool = False
    end: float | None = None  # once started: the engine step it ends by (endings.py)


def release_key(order: ReleaseOrder, r: Request, seq: int) -> tuple[int, float, int]:
    """order.py rules 1-2, written out again: priority, then arrival plus the length
    class's tokens over the exchange rate, capped at max_delay, then admission."""
    lc = order.length_class
    cls = math.ceil(len(r.prompt_tokens) / lc) * lc
    return (r.priority, r.arrival + min(cls / order.exchange_rate, order.max_delay), seq)


POLICY = st.builds(
    CallerPolicy,
    name=st.just("x"),
    weight=st.sampled_from([1.0, 1.0, 2.0]),
    max_concurrency=st.none() | st.integers(1, 2),
    max_queued=st.none() | st.integers(2, 6),
)


def table(policies: list[CallerPolicy]) -> Callers:
    return Callers(
        tuple(
            CallerPolicy(n, p.weight, p.max_concurrency, p.max_queued)
            for n, p in zip(NAMES, policies, strict=True)
        )
    )


class BacklogMachine(RuleBasedStateMachine):
    # The engine's prefix-cache block (0: off, no warm order); test_core_warm.py's
    # machines set it and give prompts prefixes (`prefix`).
    PREFIX_BLOCK = 0

    def prefix(self, caller: str, plen: int) -> tuple[int, ...]:
        """A prompt's leading block hashes (none: warm.py W5, today's order)."""
        return ()

    @initialize(
        seqs=st.integers(1, 4),
        step=st.sampled_from([0, 12, 40]),
        kv=st.sampled_from([0, 60, 150]),
        reserve=st.sampled_from([0.0, 0.0, 0.4]),
        delay=st.sampled_from([0.0, 0.02, 0.05, 10.0]),
        rate=st.sampled_from([100.0, 1000.0, math.inf]),
        lclass=st.sampled_from([1, 16]),
        policies=st.lists(POLICY, min_size=3, max_size=3),
        dedupe=st.booleans(),
        feed=st.sampled_from([1.0, 2.0]),
        chunk=st.sampled_from([0, 0, 4, 16]),
    )
    def setup(
        self,
        seqs: int,
        step: int,
        kv: int,
        reserve: float,
        delay: float,
        rate: float,
        lclass: int,
        policies: list[CallerPolicy],
        dedupe: bool,
        feed: float,
        chunk: int,
    ) -> None:
        self.callers = table(policies)
        self.cfg = CoalescerConfig(
            window=0.0,
            dedupe=dedupe,
            release_lone=False,
            callers=self.callers,
            engine=EngineCapacity(
                max_seqs=seqs,
                step_tokens=step,
                kv_tokens=kv,
                prefill_chunk=chunk,
                prefix_block=self.PREFIX_BLOCK,
            ),
            order=ReleaseOrder(rate, delay, lclass),
            kv_reserve_short=reserve,
            short_prompt_tokens=8,
            feed_steps=feed,
        )
        self.co = Coalescer(self.cfg)
        self.now = 0.0
        self.kv_usage = 0.0
        self.prefilled = 0  # prompt tokens the engine's steps prefilled of unstarted work
        self.last_step: EngineStep | None = None  # the engine's latest step reported
        self.steps = 0  # the engine steps reported (endings.py's clock)
        self.queued_callers: set[str] = set()
        self.n = 0
        self.seq = 0
        self.queued: dict[str, Gen] = {}  # generation id -> Gen (queued or backlogged)
        self.sub_gen: dict[str, str] = {}  # queued subscriber -> generation id
        self.sub_req: dict[str, Request] = {}
        self.flying: dict[str, Flying] = {}
        self.ended: set[str] = set()
        self.dispatched_now: set[str] = set()
        self.eligible = False  # a due() ran outside CRITICAL since the last add
        self.estimate = {n: 256.0 for n in NAMES}  # coalescer.py rule 12, modelled

    # -- model helpers ---------------------------------------------------------

    def _policy(self, name: str) -> CallerPolicy:
        return self.callers.get(name)

    def _queued_of(self, name: str) -> int:
        return sum(1 for r in self.sub_req.values() if r.caller == name)

    def _flying_of(self, name: str) -> int:
        return sum(1 for f in self.flying.values() if f.caller == name)

    def _backlog_of(self, name: str) -> list[Gen]:
        return [g for g in self.queued.values() if g.caller == name]

    def _capped(self, name: str) -> bool:
        mc = self._policy(name).max_concurrency
        return mc is not None and self._flying_of(name) >= mc

    def _room(self, released: list[Gen], book: bool = True) -> Room:
        """The room as the core saw it at the start of the last due(), with that
        call's releases booked (the engine's waiting share applies to the older)."""
        now_released = {g.request.id for g in released}
        unstarted = [
            f for gid, f in self.flying.items() if not f.started and gid not in now_released
        ]
        cap, feed = self.cfg.engine, self.cfg.feed_steps
        running = sum(1 for f in self.flying.values() if f.started)
        # Room rule 2's endings, modelled: started work that ends by the step a
        # release reaches and is not late, at most what the last step ran.
        horizon, late = self.steps + feed - 1, self.steps - GRACE
        ending = sum(
            1 for f in self.flying.values() if f.end is not None and late <= f.end <= horizon
        )
        ending = min(ending, self.last_step.running if self.last_step else running)
        short = self.cfg.short_prompt_tokens
        flew = {f.caller for gid, f in self.flying.items() if gid not in now_released}
        busy = len(flew | self.queued_callers)  # room.py rule 5: callers with work
        room = Room(
            cap,
            len(self.flying) - len(now_released),
            len(unstarted),
            sum(f.ptok for f in unstarted),
            sum(cap.feed_size(f.ptok, feed) for f in unstarted),
            # The spare is the core's own (set by the steps it judged under-fed).
            EngineView.of(cap, [self.last_step], running, *self.co.feed_spare, ending),
            self.kv_usage,
            self.prefilled,
            self.cfg.kv_reserve_short,
            self.cfg.short_prompt_tokens,
            feed,
            None,
            None,
            0.0,
            sum(1 for f in unstarted if cap.multi_step(f.ptok, short)),
            self.cfg.long_prefills if busy > 1 else 0,
        )
        if book:
            for g in released:
                room.take(g.ptok)
        return room

    def _counter(self, name: str) -> float:
        st_ = self.co.caller(name)
        return 0.0 if st_ is None else st_.counter

    def _absorb(self, events: list[object]) -> None:
        for ev in events:
            if isinstance(ev, Ended):
                sid = ev.request_id
                assert sid in self.sub_gen and sid not in self.ended, sid
                assert ev.caller == self.sub_req[sid].caller
                self.ended.add(sid)
                event(f"ended: {ev.outcome.value}")
                if ev.outcome is Outcome.DISPATCHED:
                    assert sid in self.dispatched_now
                    self.dispatched_now.discard(sid)
                gid = self.sub_gen.pop(sid)
                del self.sub_req[sid]
                g = self.queued[gid]
                g.subs.remove(sid)
                if not g.subs:
                    del self.queued[gid]
            elif isinstance(ev, DedupeHit):
                assert self.cfg.dedupe
        assert not self.dispatched_now

    # -- rules -------------------------------------------------------------------

    @rule(
        caller=st.sampled_from(NAMES),
        plen=st.integers(0, 30),
        new=st.integers(0, 400),
        priority=st.integers(-1, 1),
        ttl=st.none() | st.sampled_from([0.01, 0.05]),
        fp=st.sampled_from([None, None, "g"]),
        open_ended=st.booleans(),
    )
    def add(
        self,
        caller: str,
        plen: int,
        new: int,
        priority: int,
        ttl: float | None,
        fp: str | None,
        open_ended: bool,
    ) -> None:
        self.n += 1
        rid = f"r{self.n}"
        prompt = (1,) * plen  # few distinct prompts: duplicates happen
        r = Request(
            rid,
            M,
            prompt,
            new,
            self.now,
            priority=priority,
            deadline=None if ttl is None else self.now + ttl,
            fingerprint=fp,
            caller=caller,
            open_ended=open_ended,
            prefix=self.prefix(caller, plen),
        )
        got = self.co.add(r, self.now)
        p = self._policy(caller)
        expect: RefusalReason | None = None
        if self.co.state is AdmissionState.DRAINING:
            expect = RefusalReason.DRAINING
        elif self.co.state is not AdmissionState.OK:
            expect = RefusalReason.MEMORY
        elif p.max_queued is not None:
            mc = p.max_concurrency or 0
            used = min(self._flying_of(caller), mc)
            if self._queued_of(caller) + used >= p.max_queued + mc:
                expect = RefusalReason.CALLER_LIMIT
        if expect is not None:
            assert isinstance(got, Refused) and got.reason is expect, (got, expect)
            event(f"refused: {expect.value}")
            self.co.pop_events()
            return
        assert isinstance(got, Admitted), got
        join = None
        if fp is not None and self.cfg.dedupe:
            for gid, g in self.queued.items():
                if (g.request.prompt_tokens, g.request.fingerprint) == (prompt, fp):
                    join = gid
        assert got.joined == join
        if join is None:
            self.seq += 1
            est = min(new, max(1, round(self.estimate[caller])))
            self.queued[rid] = Gen(r, self.seq, plen + (est if open_ended else new))
            self.eligible = False
        gid = join or rid
        self.queued[gid].subs.append(rid)
        self.sub_gen[rid] = gid
        self.sub_req[rid] = r
        self._absorb(self.co.pop_events())

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from([*sorted(self.sub_gen), "nope"]))
        assert self.co.cancel(rid, self.now) is (rid in self.sub_gen)
        self._absorb(self.co.pop_events())

    @rule(
        dt=st.sampled_from([0.0, 0.005, 0.01, 0.03]),
        kv=st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0]),
        waiting=st.sampled_from([0, 0, 1, 3]),
        report=st.booleans(),
        decode=st.sampled_from([0, 1, 5]),
        prefill=st.sampled_from([0, 0, 5, 40]),
    )
    def due(
        self,
        dt: float,
        kv: float,
        waiting: int = 0,
        report: bool = False,
        decode: int = 0,
        prefill: int = 0,
    ) -> None:
        """One release round; with `report`, after an engine step that ran the
        started work (at most its slots), `decode` tokens per request, and
        `prefill` prompt tokens of the unstarted work (room.py rule 3)."""
        self.now += dt
        self.kv_usage = kv
        before = {n: self._flying_of(n) for n in NAMES}
        queued_subs = dict(self.sub_req)  # callers queued at the round's start, less expiries
        steps: list[EngineStep] = []
        if report:
            seqs = self.cfg.engine.max_seqs
            running = sum(1 for f in self.flying.values() if f.started)
            running = min(running, seqs) if seqs else running
            self.last_step = EngineStep(0, prefill, running * decode, running, running, waiting, kv)
            steps.append(self.last_step)
            self.steps += 1
            unstarted = sum(f.ptok for f in self.flying.values() if not f.started)
            self.prefilled = min(self.prefilled + prefill, unstarted)
        batches = self.co.due(self.now, EngineLoad(len(self.flying), waiting, kv), steps)
        events = self.co.pop_events()
        expired = {
            e.request_id for e in events if isinstance(e, Ended) and e.outcome is Outcome.EXPIRED
        }
        self.queued_callers = {r.caller for sid, r in queued_subs.items() if sid not in expired}
        if self.co.state is AdmissionState.CRITICAL:
            assert batches == []
            self._absorb(events)
            return
        released: list[Gen] = []
        for b in batches:
            event(f"batch: {b.reason.value}")
            assert b.reason in (ReleaseReason.IMMEDIATE, ReleaseReason.BACKLOG)
            for e in b.entries:
                g = self.queued[e.request.id]
                assert list(e.subscribers) == [s for s in g.subs if s not in expired]
                self.dispatched_now.update(e.subscribers)
                released.append(g)
        self._absorb(events)
        for g in released:
            self.flying[g.request.id] = Flying(
                g.caller,
                g.ptok,
                len(g.subs),
                g.charge,
                g.request.open_ended,
                g.request.max_new_tokens,
            )
        self.eligible = True
        if released and self.queued:
            event("released some, held some")
        # max_concurrency: no release took a caller past its cap.
        for name in NAMES:
            got = sum(1 for g in released if g.caller == name)
            mc = self._policy(name).max_concurrency
            if got and mc is not None:
                assert before[name] + got <= mc, (name, before[name], got, mc)
        # The aging bound: nothing released while a same-caller, same-priority
        # generation that arrived more than max_delay before it is still held.
        delay = self.cfg.order.max_delay
        for g in released:
            r = g.request
            for h in self._backlog_of(g.caller):
                hr = h.request
                if hr.priority == r.priority and hr.arrival < r.arrival:
                    event("released past an older held request")
                    assert not hr.arrival + delay < r.arrival, (hr, r, delay)
        # Release order within a caller: by key, among what fitted in its turn; a
        # release with a larger key than a held one is only one the room let pass.
        for name in NAMES:
            mine = [g for g in released if g.caller == name]
            keys = [release_key(self.cfg.order, g.request, g.seq) for g in mine]
            held = [release_key(self.cfg.order, h.request, h.seq) for h in self._backlog_of(name)]
            if keys != sorted(keys) or (held and keys and max(keys) > min(held)):
                event("key order bent by the room")
        self._check_released_fit(released)
        self._check_work_conserving(released)

    def _check_released_fit(self, released: list[Gen]) -> None:
        """Safety: each release of the round fitted the room as the model sees it,
        with the round's earlier releases booked (the first may go to an idle engine,
        room.py rule 1)."""
        room = self._room(released, book=False)
        for g in released:
            assert room.fits(g.ptok), (g.request.id, g.ptok)
            room.take(g.ptok)

    def _check_work_conserving(self, released: list[Gen]) -> None:
        if not self.queued:
            return
        assert self.flying, "the engine is idle while the backlog holds work"
        room = self._room(released)
        if room.full:
            event("held: no slot")
            return
        floor = math.inf
        unblocked: list[str] = []
        for name in NAMES:
            mine = self._backlog_of(name)
            if not mine or self._capped(name):
                continue
            ranked = sorted(mine, key=lambda g: release_key(self.cfg.order, g.request, g.seq))
            head = ranked[0]
            blocked = not self._fits_rule_3(ranked, room)
            if blocked:
                w = self._policy(name).weight
                cost = (head.ptok + 2 * (head.charge - head.ptok)) / w
                # A policy rule's hold adds the reserve (backlog.py rule 3). The rule
                # that holds the head now held it in the round or came before it in
                # room.blocks(): the rules only tighten as a round books releases,
                # so this floor is never above the core's.
                if room.blocks(head.ptok) in POLICY_RULES:
                    cost += room.reserved / w
                floor = min(floor, self._counter(name) + max(cost, 1.0 / w))
            else:
                unblocked.append(name)
        for name in unblocked:
            event("held: fairness floor")
            assert self._counter(name) >= floor, (name, self._counter(name), floor)

    def _fits_rule_3(self, ranked: list[Gen], room: Room) -> bool:
        """backlog.py rule 3: something among the first 32 in key order fits, that
        arrived at most max_delay after each one before it."""
        barrier = math.inf
        for g in ranked[:32]:
            if g.request.arrival > barrier:
                return False
            if room.fits(g.ptok):
                return True
            barrier = min(barrier, g.request.arrival + self.cfg.order.max_delay)
        return False

    def _leaves_engine_queue(self, f: Flying, prefilled: int) -> None:
        """room.py rule 3, modelled: an unstarted generation leaves the engine's queue
        after `prefilled` of its tokens were prefilled."""
        f.started = True
        if any(not g.started for g in self.flying.values()):
            self.prefilled = max(0, self.prefilled - prefilled)
        else:
            self.prefilled = 0

    @precondition(lambda self: any(not f.started for f in self.flying.values()))
    @rule(data=st.data(), cached=st.sampled_from([0, 0, 3, 50]))
    def started(self, data: st.DataObject, cached: int) -> None:
        gid = data.draw(st.sampled_from(sorted(g for g, f in self.flying.items() if not f.started)))
        assert self.co.started(gid, self.now, cached) is True
        f = self.flying[gid]
        f.end = self.steps + max(0, f.new - 1)
        self._leaves_engine_queue(f, f.ptok - min(cached, f.ptok))

    @precondition(lambda self: bool(self.flying))
    @rule(data=st.data(), every=st.booleans(), tokens=st.integers(0, 300))
    def finished(self, data: st.DataObject, every: bool, tokens: int) -> None:
        done = sorted(self.flying) if every else [data.draw(st.sampled_from(sorted(self.flying)))]
        for gid in done:
            assert self.co.finished(gid, self.now, tokens) is True
            f = self.flying[gid]
            if not f.started:  # an abort: counted as all prefilled
                self._leaves_engine_queue(f, f.ptok)
            del self.flying[gid]
            if f.open_ended:
                est = self.estimate[f.caller]
                self.estimate[f.caller] = est + (tokens - est) / 16
        assert self.co.finished("nope", self.now) is False

    @rule(state=st.sampled_from([AdmissionState.OK] * 6 + list(AdmissionState)))
    def set_state(self, state: AdmissionState) -> None:
        self.co.state = state

    @rule(policies=st.lists(POLICY, min_size=3, max_size=3))
    def reload(self, policies: list[CallerPolicy]) -> None:
        self.callers = table(policies)
        self.co.set_callers(self.callers)

    @rule()
    def drain(self) -> None:
        """No starvation: with the engine finishing everything, the backlog empties."""
        self.co.state = AdmissionState.OK
        for _ in range(len(self.queued) + 2):
            for gid, f in list(self.flying.items()):
                if not f.started:
                    self.co.started(gid, self.now)
                    self._leaves_engine_queue(f, f.ptok)
                self.co.finished(gid, self.now, 1)
                if f.open_ended:
                    est = self.estimate[f.caller]
                    self.estimate[f.caller] = est + (1 - est) / 16
            self.flying.clear()
            self.due(0.01, 0.0)
            if not self.queued:
                break
        assert not self.queued, "the backlog did not drain"

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def gauges_match_the_model(self) -> None:
        if not hasattr(self, "co"):
            return
        co = self.co
        assert co.queued_requests == len(self.sub_gen)
        assert co.queued_generations == len(self.queued)
        assert co.in_flight == len(self.flying)
        assert co.engine_waiting == sum(1 for f in self.flying.values() if not f.started)
        if self.eligible:
            assert co.backlog_generations == len(self.queued)
        for name in NAMES:
            s = co.caller(name)
            if s is None:
                continue
            assert s.queued == self._queued_of(name)
            assert s.in_flight == self._flying_of(name)
            if self.eligible:
                assert s.backlog == len(self._backlog_of(name))
        charged = sum(g.charge for g in self.queued.values())
        charged += sum(f.charge for f in self.flying.values())
        assert co.pending_tokens == charged, (co.pending_tokens, charged)
        c = co.counters
        assert c.dispatched + c.cancelled + c.expired + c.rejected == len(self.ended)
        assert c.admitted == len(self.ended) + len(self.sub_gen)


TestBacklogMachine = BacklogMachine.TestCase
TestBacklogMachine.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class FairnessMachine(RuleBasedStateMachine):
    """Two equal-weight callers that never run out of backlogged work."""

    MAX_PROMPT = 30
    MAX_NEW = 10
    # The room's policy rules (room.py rules 4-5): with the defaults every prompt
    # here is short, so they never hold one.
    SHORT_PROMPT = CoalescerConfig().short_prompt_tokens
    CHUNK = 0
    RESERVE = CoalescerConfig().kv_reserve_short
    A_PROMPT_MIN = 0
    PREFIX_BLOCK = 0  # as BacklogMachine's

    def prefix(self, caller: str, n: int) -> tuple[int, ...]:
        """Request `n`'s leading block hashes (none: today's order)."""
        return ()

    @initialize(
        seqs=st.integers(1, 4),
        step=st.sampled_from([0, 20, 60]),
        kv=st.sampled_from([0, 80, 200]),
        delay=st.sampled_from([0.0, 0.05, 10.0]),
    )
    def setup(self, seqs: int, step: int, kv: int, delay: float) -> None:
        # The most generations in flight: the engine's queue holds the slots its
        # last step left free, those its running generations free within the feed's
        # steps (at most what it runs) and a spare of at most its slots (room.py
        # rule 2), so running plus queued stays within 3 x seqs.
        self.slots = 3 * seqs
        self.seqs = seqs
        # backlog.py rule 3: a head a policy rule holds may be passed by the reserve
        # more (R in the fairness bound; both weights are 1).
        policy_holds = self.SHORT_PROMPT < self.MAX_PROMPT
        self.allowance = kv * self.RESERVE if policy_holds else 0.0
        self.co = Coalescer(
            CoalescerConfig(
                window=0.0,
                release_lone=False,
                engine=EngineCapacity(
                    max_seqs=seqs,
                    step_tokens=step,
                    kv_tokens=kv,
                    prefill_chunk=self.CHUNK,
                    prefix_block=self.PREFIX_BLOCK,
                ),
                order=ReleaseOrder(max_delay=delay),
                kv_reserve_short=self.RESERVE,
                short_prompt_tokens=self.SHORT_PROMPT,
            )
        )
        self.now = 0.0
        self.n = 0
        self.backlog = {"a": 0, "b": 0}
        self.owner: dict[str, str] = {}
        self.flying: dict[str, int] = {}  # id -> max_new
        self.unstarted: set[str] = set()

    @rule(
        dt=st.sampled_from([0.0, 0.01, 0.03]),
        kv=st.sampled_from([0.0, 0.5, 0.9]),
        sizes=st.lists(
            st.tuples(st.integers(0, MAX_PROMPT), st.integers(0, MAX_NEW)), min_size=10, max_size=10
        ),
        report=st.booleans(),
    )
    def due(self, dt: float, kv: float, sizes: list[tuple[int, int]], report: bool) -> None:
        # Top up: at most `slots` generations leave per due(), so 5 + slots waiting
        # means neither caller's backlog ever empties (no return from idle).
        sizes_left = iter(sizes * 4)
        for name in ("a", "b"):
            while self.backlog[name] < 5 + self.slots:
                plen, new = next(sizes_left)
                if name == "b":  # b's prompts are short, a's long: a is the one
                    plen //= 3  # that finds no room while b still fits
                else:
                    plen = max(plen, self.A_PROMPT_MIN)
                self.n += 1
                rid = f"{name}{self.n}"
                # Every third request is open-ended: charged its caller's estimate.
                r = Request(
                    rid,
                    M,
                    (self.n,) * plen,
                    new,
                    self.now,
                    caller=name,
                    open_ended=self.n % 3 == 0,
                    prefix=self.prefix(name, self.n),
                )
                assert isinstance(self.co.add(r, self.now), Admitted)
                self.owner[rid] = name
                self.backlog[name] += 1
        self.now += dt
        largest_prompt = {"a": -1, "b": -1}  # per caller, among this round's releases
        steps = []
        if report:  # an engine step that ran the started work, within its slots
            running = min(len(self.flying) - len(self.unstarted), self.seqs)
            steps.append(EngineStep(0, 0, running, running, running, 0, kv))
        for b in self.co.due(self.now, EngineLoad(len(self.flying), 0, kv), steps):
            for e in b.entries:
                rid = e.request.id
                name = self.owner[rid]
                self.backlog[name] -= 1
                self.flying[rid] = e.request.max_new_tokens
                self.unstarted.add(rid)
                largest_prompt[name] = max(largest_prompt[name], len(e.request.prompt_tokens))
        self.co.pop_events()
        assert min(self.backlog.values()) > 0
        # Each release went to a caller whose counter was below the other's plus one
        # request's cost (backlog.py rule 4); counters only grow within a round, so
        # for its last release: counter now - its prompt < the other's now + U.
        largest = self.MAX_PROMPT + 2 * self.MAX_NEW
        for name, other in (("a", "b"), ("b", "a")):
            if largest_prompt[name] >= 0:
                mine, theirs = self.co.caller(name), self.co.caller(other)
                assert mine is not None and theirs is not None
                bound = largest + self.allowance
                assert mine.counter - largest_prompt[name] < theirs.counter + bound

    @precondition(lambda self: bool(self.unstarted))
    @rule(data=st.data())
    def started(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.unstarted)))
        self.co.started(rid, self.now)
        self.unstarted.discard(rid)

    @precondition(lambda self: bool(self.flying))
    @rule(data=st.data(), share=st.floats(0.0, 1.0))
    def finished(self, data: st.DataObject, share: float) -> None:
        rid = data.draw(st.sampled_from(sorted(self.flying)))
        self.co.finished(rid, self.now, int(self.flying.pop(rid) * share))
        self.unstarted.discard(rid)

    @invariant()
    def counters_stay_within_the_bound(self) -> None:
        if not hasattr(self, "co"):
            return
        a, b = self.co.caller("a"), self.co.caller("b")
        if a is None or b is None:
            return
        largest = self.MAX_PROMPT + 2 * self.MAX_NEW
        gap = abs(a.counter - b.counter)
        event(f"gap in units of the largest request: {math.ceil(gap / largest)}")
        assert gap <= (2 + self.slots) * largest + self.allowance, (a, b)
        assert a.counter == a.service and b.counter == b.service  # never lifted


TestFairnessMachine = FairnessMachine.TestCase
TestFairnessMachine.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class PolicyFairnessMachine(FairnessMachine):
    """The same two callers, where a's long prompts meet the short-prompt reserve and
    the long-prefill bound (room.py rules 4-5): the bound grows by the reserve."""

    SHORT_PROMPT = 8
    CHUNK = 16
    RESERVE = 0.3
    A_PROMPT_MIN = 17  # every one of a's prompts long for both rules

    @rule(
        dt=st.sampled_from([0.0, 0.01, 0.03]),
        kv=st.sampled_from([0.5, 0.9]),  # never empty: a's long heads stay held
        sizes=st.lists(
            st.tuples(
                st.integers(0, FairnessMachine.MAX_PROMPT),
                st.integers(0, FairnessMachine.MAX_NEW),
            ),
            min_size=10,
            max_size=10,
        ),
        report=st.booleans(),
    )
    def due(self, dt: float, kv: float, sizes: list[tuple[int, int]], report: bool) -> None:
        super().due(dt, kv, sizes, report)


TestPolicyFairnessMachine = PolicyFairnessMachine.TestCase
TestPolicyFairnessMachine.settings = TestFairnessMachine.settings


class AgingMachine(BacklogMachine):
    """The backlog machine's checks, aimed at the aging bound: mostly one caller and
    one priority, prompts of 1-120 tokens that often do not fit a small engine's step
    and KV room, and a clock that moves between arrivals, so that short prompts pass
    long ones and a long head waits for room (backlog.py rule 3)."""

    @initialize(
        seqs=st.integers(1, 3),
        step=st.sampled_from([0, 40, 100]),
        kv=st.sampled_from([0, 150, 300]),
        delay=st.sampled_from([0.0, 0.02, 0.1]),
        rate=st.sampled_from([100.0, 1000.0]),
        lclass=st.sampled_from([1, 16]),
        chunk=st.sampled_from([0, 16]),
    )
    def setup(  # type: ignore[override]
        self, seqs: int, step: int, kv: int, delay: float, rate: float, lclass: int, chunk: int
    ) -> None:
        plain = CallerPolicy("x")
        super().setup(seqs, step, kv, 0.0, delay, rate, lclass, [plain] * 3, False, 1.0, chunk)

    @rule(
        caller=st.sampled_from(["a", "a", "a", "b"]),
        plen=st.integers(1, 120),
        new=st.integers(0, 400),
        dt=st.sampled_from([0.0, 0.01, 0.05]),
        open_ended=st.booleans(),
    )
    def add(  # type: ignore[override]
        self, caller: str, plen: int, new: int, dt: float, open_ended: bool
    ) -> None:
        self.now += dt
        BacklogMachine.add(self, caller, plen, new, 0, None, None, open_ended)

    @rule()
    def cancel(self) -> None:  # type: ignore[override]
        """No cancels here: every generation stays until it is released."""


TestAgingMachine = AgingMachine.TestCase
TestAgingMachine.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
