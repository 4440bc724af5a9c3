"""Stateful property test of the coalescer against a small model.

Hypothesis drives random sequences of add / cancel / due (with and without an engine
load) / finished / state changes / reject_queued on a fake clock, under random small
configs, and checks after every step:

* every admitted subscriber ends exactly once (Ended events), and DISPATCHED exactly
  when it appears in a returned batch;
* refusals happen exactly when the model says they must (no spurious ones), dedupe
  joins exactly the generation the model expects;
* no batch mixes keys or exceeds the caps (except a lone oversize request), and each
  batch is ordered by the release key (priority, then arrival + the prompt's length
  class over the exchange rate, capped at max_delay, then admission order: order.py,
  recomputed here from that definition);
* after `due(now)` no subscriber is left queued past its window, unless the state is
  CRITICAL; the same holds from the first `due()` on for a generation admitted after a quiet
  spell longer than the window (the lone-arrival rule);
* pending limits are never exceeded, and all gauges match the model.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batching import (
    AdmissionState,
    Admitted,
    Batch,
    Coalescer,
    CoalescerConfig,
    DedupeHit,
    Ended,
    EngineLoad,
    Event,
    GroupKey,
    Outcome,
    RefusalReason,
    Refused,
    ReleaseOrder,
    ReleaseReason,
    Request,
    group_key,
)

KEYS = [group_key("m"), group_key("m", "lora")]
# Mostly a few fixed prompts, so that duplicates are common.
IDLE = EngineLoad(0, 0)
PROMPTS = st.sampled_from(
    [(), (0, 0, 1), (0, 0, 1, 1), (0, 0, 1, 1, 2, 2), (0, 0, 2), (1, 1, 1, 1, 1, 1, 1, 1)]
) | st.lists(st.integers(0, 2), max_size=12).map(tuple)


@dataclass
class Gen:
    request: Request
    seq: int  # admission order
    subs: list[str] = field(default_factory=list)
    lone: bool = False  # admitted after a quiet spell: the next due() releases it


class CoalescerMachine(RuleBasedStateMachine):
    @initialize(
        window=st.sampled_from([0.0, 0.01, 0.01]),
        seqs=st.integers(1, 4),
        toks=st.integers(8, 40),
        max_reqs=st.integers(1, 12),
        max_toks=st.integers(20, 300),
        dedupe=st.booleans(),
        adaptive=st.booleans(),
        lone=st.booleans(),
        order=st.builds(
            ReleaseOrder,
            st.sampled_from([100.0, 1000.0, math.inf]),
            st.sampled_from([0.0, 0.005, 1.0]),
            st.sampled_from([1, 16]),
        ),
    )
    def setup(
        self,
        window: float,
        seqs: int,
        toks: int,
        max_reqs: int,
        max_toks: int,
        dedupe: bool,
        adaptive: bool,
        lone: bool,
        order: ReleaseOrder,
    ) -> None:
        self.cfg = CoalescerConfig(
            order=order,
            window=window,
            max_batch_seqs=seqs,
            max_batch_tokens=toks,
            max_pending_requests=max_reqs,
            max_pending_tokens=max_toks,
            dedupe=dedupe,
            adaptive=adaptive,
            release_lone=lone,
        )
        self.co = Coalescer(self.cfg)
        self.now = 0.0
        self.last_add = -math.inf  # the latest admission, for the lone-arrival rule
        self.n = 0
        self.seq = 0
        self.queued: dict[str, Gen] = {}  # generation id -> Gen (queued)
        self.sub_gen: dict[str, str] = {}  # queued subscriber -> generation id
        self.sub_req: dict[str, Request] = {}
        self.flying: dict[str, tuple[int, int]] = {}  # generation id -> (subs, tokens)
        self.ended: set[str] = set()
        self.dispatched_now: set[str] = set()

    # -- helpers -------------------------------------------------------------

    def _expected_refusal(self, r: Request) -> tuple[RefusalReason | None, str | None]:
        """The model's verdict: (refusal reason or None, generation to join or None)."""
        cfg = self.cfg
        if self.co.state is AdmissionState.DRAINING:
            return RefusalReason.DRAINING, None
        if self.co.state is not AdmissionState.OK:
            return RefusalReason.MEMORY, None
        if r.id in self.sub_gen or r.id in self.queued or r.id in self.flying:
            return RefusalReason.DUPLICATE_ID, None
        pending_reqs = len(self.sub_gen) + sum(s for s, _ in self.flying.values())
        if cfg.dedupe and r.fingerprint is not None:
            for gid, g in self.queued.items():
                q = g.request
                if (q.key, q.prompt_tokens, q.fingerprint) == (
                    r.key,
                    r.prompt_tokens,
                    r.fingerprint,
                ):
                    if pending_reqs + 1 > cfg.max_pending_requests:
                        return RefusalReason.QUEUE_FULL_REQUESTS, None
                    return None, gid
        if pending_reqs + 1 > cfg.max_pending_requests:
            return RefusalReason.QUEUE_FULL_REQUESTS, None
        if self._pending_tokens() + r.tokens > cfg.max_pending_tokens:
            if r.tokens > cfg.max_pending_tokens:
                return RefusalReason.TOO_LARGE, None
            return RefusalReason.QUEUE_FULL_TOKENS, None
        return None, None

    def _pending_tokens(self) -> int:
        return sum(g.request.tokens for g in self.queued.values()) + sum(
            t for _, t in self.flying.values()
        )

    def _absorb_events(self, events: list[Event] | None = None) -> None:
        for ev in self.co.pop_events() if events is None else events:
            if isinstance(ev, Ended):
                sid = ev.request_id
                assert sid in self.sub_gen, f"{sid} ended but was not queued"
                assert sid not in self.ended, f"{sid} ended twice"
                self.ended.add(sid)
                event(f"ended: {ev.outcome.value}")
                if ev.outcome is Outcome.DISPATCHED:
                    assert sid in self.dispatched_now, f"{sid} DISPATCHED but not in a batch"
                    self.dispatched_now.discard(sid)
                gid = self.sub_gen.pop(sid)
                del self.sub_req[sid]
                g = self.queued[gid]
                g.subs.remove(sid)
                if not g.subs:
                    del self.queued[gid]
            elif isinstance(ev, DedupeHit):
                assert self.cfg.dedupe
        assert not self.dispatched_now, f"batched without DISPATCHED: {self.dispatched_now}"

    def _check_batch(self, b: Batch, expired: set[str]) -> None:
        cfg = self.cfg
        assert b.entries
        assert all(e.request.key == b.key for e in b.entries)
        assert len(b.entries) <= cfg.max_batch_seqs
        prompt = sum(len(e.request.prompt_tokens) for e in b.entries)
        assert prompt <= cfg.max_batch_tokens or len(b.entries) == 1
        assert b.tokens == sum(e.request.tokens for e in b.entries)
        o = cfg.order
        order = []
        for e in b.entries:
            r = e.request
            cls = math.ceil(len(r.prompt_tokens) / o.length_class) * o.length_class
            start = r.arrival + min(cls / o.exchange_rate, o.max_delay)
            order.append((r.priority, start, self.queued[r.id].seq))
            assert e.order[:2] == order[-1][:2]  # the key the driver hands to vLLM
        assert order == sorted(order)
        for e in b.entries:
            gid = e.request.id
            g = self.queued[gid]
            # Expiry runs first in due(): subscribers that expired in this call are gone.
            assert e.subscribers
            assert list(e.subscribers) == [s for s in g.subs if s not in expired]
            self.dispatched_now.update(e.subscribers)
            self.flying[gid] = (len(e.subscribers), e.request.tokens)
            if cfg.window == 0:
                assert b.reason is ReleaseReason.IMMEDIATE
        if b.reason is ReleaseReason.LONE:
            assert cfg.release_lone

    # -- rules ---------------------------------------------------------------

    @rule(
        specs=st.lists(
            st.tuples(
                st.sampled_from(KEYS),
                PROMPTS,
                st.integers(0, 16),
                st.integers(-1, 1),
                st.none() | st.floats(0.0, 0.05),
                st.sampled_from([None, "greedy", "greedy", "seed1"]),
                st.integers(0, 9),
            ),
            min_size=1,
            max_size=4,
        )
    )
    def add(self, specs: list[tuple[GroupKey, tuple[int, ...], int, int, Any, Any, int]]) -> None:
        for spec in specs:
            self._add_one(*spec)

    def _add_one(
        self,
        key: GroupKey,
        prompt: tuple[int, ...],
        new: int,
        priority: int,
        ttl: float | None,
        fp: Hashable | None,
        reuse: int,
    ) -> None:
        live = sorted(set(self.sub_gen) | set(self.flying))
        if reuse == 0 and live:
            rid = live[len(live) // 2]  # now and then, an id that is in use
        else:
            self.n += 1
            rid = f"r{self.n}"
        r = Request(
            rid,
            key,
            prompt,
            new,
            self.now,
            priority=priority,
            deadline=None if ttl is None else self.now + ttl,
            fingerprint=fp,
        )
        reason, join = self._expected_refusal(r)
        got = self.co.add(r, self.now)
        event(f"add: {reason.value if reason else 'joined' if join else 'admitted'}")
        if reason is not None:
            assert isinstance(got, Refused) and got.reason is reason, (got, reason)
            assert 0 <= got.retry_after <= self.cfg.retry_after_max
        else:
            assert got == Admitted(rid, join), (got, join)
            self.seq += 1
            gid = join or rid
            if join is None:
                cfg = self.cfg
                lone = cfg.release_lone and self.now - self.last_add > cfg.window > 0
                self.queued[gid] = Gen(r, self.seq, lone=lone)
            self.last_add = self.now
            self.queued[gid].subs.append(rid)
            self.sub_gen[rid] = gid
            self.sub_req[rid] = r
        self._absorb_events()

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        candidates = [*sorted(self.sub_gen), "nope"]
        rid = data.draw(st.sampled_from(candidates))
        assert self.co.cancel(rid, self.now) is (rid in self.sub_gen)
        self._absorb_events()

    @rule(
        dt=st.sampled_from([0.0, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02]),
        load=st.sampled_from([None, IDLE, IDLE, EngineLoad(1, 0), EngineLoad(0, 1)]),
    )
    def due(self, dt: float, load: EngineLoad | None) -> None:
        nd = self.co.next_deadline()
        self.now += dt
        batches = self.co.due(self.now, load)
        if nd is None and load is None:
            assert batches == [], "released although next_deadline() said nothing"
        events = self.co.pop_events()
        expired = {
            e.request_id for e in events if isinstance(e, Ended) and e.outcome is Outcome.EXPIRED
        }
        for b in batches:
            event(f"batch: {b.reason.value}, {'several' if len(b.entries) > 1 else 'one'}")
            assert b.released_at == self.now
            self._check_batch(b, expired)
        dispatched = {e.request.id for b in batches for e in b.entries}
        self._absorb_events(events)
        assert not dispatched & set(self.queued)
        if self.co.state is AdmissionState.CRITICAL:
            assert batches == []
            return
        for sid, r in self.sub_req.items():
            g = self.queued[self.sub_gen[sid]]
            # The core's own comparison.
            assert r.arrival + self.cfg.window > self.now, f"{sid} overdue at {self.now}"
            assert not g.lone, f"lone {sid} still queued at {self.now}"

    @precondition(lambda self: bool(self.flying))
    @rule(data=st.data(), every=st.booleans())
    def finished(self, data: st.DataObject, every: bool) -> None:
        done = sorted(self.flying) if every else [data.draw(st.sampled_from(sorted(self.flying)))]
        for gid in done:
            assert self.co.finished(gid, self.now) is True
            del self.flying[gid]
        assert self.co.finished("nope", self.now) is False

    # Mostly back to OK: a machine that sheds most of the time admits too little.
    @rule(state=st.sampled_from([AdmissionState.OK] * 5 + list(AdmissionState)))
    def set_state(self, state: AdmissionState) -> None:
        self.co.state = state

    @rule(go=st.integers(0, 4))
    def reject(self, go: int) -> None:
        if go:  # rare: it wipes the queue
            return
        expected = set(self.sub_gen)
        assert set(self.co.reject_queued(self.now)) == expected
        for ev in self.co.pop_events():
            assert isinstance(ev, Ended) and ev.outcome is Outcome.REJECTED
            assert ev.request_id in expected and ev.request_id not in self.ended
            self.ended.add(ev.request_id)
        self.sub_gen.clear()
        self.sub_req.clear()
        self.queued.clear()

    # -- invariants ----------------------------------------------------------

    @invariant()
    def gauges_match_the_model(self) -> None:
        if not hasattr(self, "co"):
            return
        co = self.co
        assert co.queued_requests == len(self.sub_gen)
        assert co.queued_generations == len(self.queued)
        assert co.queued_tokens == sum(g.request.tokens for g in self.queued.values())
        assert co.in_flight == len(self.flying)
        assert co.pending_requests == len(self.sub_gen) + sum(s for s, _ in self.flying.values())
        assert co.pending_tokens == self._pending_tokens()
        assert co.pending_requests <= self.cfg.max_pending_requests
        assert co.pending_tokens <= self.cfg.max_pending_tokens
        nd = co.next_deadline()
        if not self.sub_gen:
            assert nd is None
        c = co.counters
        assert c.dispatched + c.cancelled + c.expired + c.rejected == len(self.ended)
        assert c.admitted == len(self.ended) + len(self.sub_gen)


TestCoalescerMachine = CoalescerMachine.TestCase
TestCoalescerMachine.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
