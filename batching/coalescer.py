"""The coalescer: admission, the coalescing window, ordering, grouping.

Why this module exists: it is the one queue Sluice owns, and the only place where
policy happens. It is sans-IO (h11 style): the driver passes `now` in, calls `due()`
when `next_deadline()` comes (or right after `add()`), and submits what comes back.

Rules:

1. Admission is bounded by `max_pending_requests` (subscribers) and
   `max_pending_tokens` (prompt + max_new of generations), counting queued plus in
   flight (dispatched and not yet `finished()`). Over a limit the request is refused at
   once with a `retry_after` of excess / measured drain rate (see drain.py), clamped to
   [retry_after_min, retry_after_max]. A duplicate that joins a queued generation costs
   one request and no tokens. Every admitted subscriber ends exactly once, as
   DISPATCHED, CANCELLED, EXPIRED or REJECTED, reported as an `Ended` event.
2. Window: a group's queued requests are released when its oldest one has waited
   `window` (DEADLINE), or as soon as the group holds `max_batch_seqs` entries or
   `max_batch_tokens` prompt tokens (SIZE_CAP / TOKEN_CAP, released by the next
   `due()`; `next_deadline()` then returns the time the cap was reached). `window == 0`
   releases everything on the next `due()` (IMMEDIATE). A deadline release takes the
   whole group, split into as many batches as the caps demand, so nothing waits longer
   than its window plus one `due()` call.
3. A batch holds one GroupKey.
4. Batch order: priority (lower first), then shorter prompt, then admission order.
   A split takes a prefix of that order; a lone request over the token cap forms a
   batch by itself.
5. `cancel()` and expiry (`Request.deadline`) remove queued work before dispatch in
   O(1) / O(log n): heaps are cleaned lazily (stale entries are skipped on pop).
6. Dedupe: a request whose (key, prompt_tokens, fingerprint) equals a queued
   generation's (fingerprint not None) subscribes to it. The generation keeps its first
   request's data even if that caller cancels; it leaves only with its last subscriber.
   Each subscriber keeps its own deadline.
7. Shared prefixes (see prefix.py): in a released batch, entries that share a whole
   first KV block with an earlier entry are held back `prefix_follow_delay` behind
   their leader and then released as their own batch (PREFIX_FOLLOW), unless that
   prefix was released within `prefix_memory` seconds. Held followers still count as
   queued; they can be cancelled, can expire, and can be joined by duplicates.
8. Adaptive: if `due()` gets an `EngineLoad` with running == 0 and waiting == 0, and
   the core itself has nothing in flight, every queued group is released now (EARLY):
   with an idle engine, waiting out the window is pure latency. The in-flight check is
   an addition to the plain load test: the driver's snapshot can be older than our own
   last dispatch, and a stale "idle" must not turn the window off under load. Held
   prefix followers keep their (few milliseconds of) delay.
   Lone arrivals (`release_lone`): a request admitted more than `window` after the
   previous admission is released by the next `due()` (LONE), with whatever its group
   holds. At that arrival rate no company is expected within the window, so waiting
   would only add latency (a busy engine takes it at its next step either way); the
   requests that follow it closely wait out their window as usual, so a burst still
   coalesces behind its first request.
9. Admission states: SHEDDING refuses new work (MEMORY); CRITICAL refuses new work
   and `due()` releases nothing (expiry still runs; `next_deadline()` then reports
   expiry times only, so a driver does not spin); DRAINING refuses (DRAINING) and keeps
   releasing. After changing the state, the driver should call `due()` again.

Performance: the hot path (add + due + finished) uses plain dicts, lists and heaps and
allocates, per request, one internal record, one subscriber dict, the heap entry, the
`Admitted`, the `Entry` and the `Ended` event. See bench/core_bench.py for numbers.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from heapq import heappop, heappush

from . import _fast
from .config import CoalescerConfig
from .drain import DrainRate
from .events import (
    Counters,
    DedupeHit,
    Ended,
    Event,
    PrefixLeader,
    Refusal,
)
from .keys import GroupKey
from .prefix import PrefixMemory, block_key, plan_followers, shared_blocks
from .types import (
    AdmissionState,
    Admitted,
    Batch,
    EngineLoad,
    Entry,
    Outcome,
    RefusalReason,
    Refused,
    ReleaseReason,
    Request,
)

__all__ = ["Coalescer"]

# Generation states. Plain ints: compared on the hot path, never exported.
_QUEUED = 0  # in its group, waiting for the window
_HELD = 1  # a prefix follower waiting for its release time (not in a group any more)
_GONE = 2  # dispatched, or dropped when its last subscriber left

_KEEP_GROUPS = 64  # empty groups kept for reuse (see Coalescer.__init__)

_OK = AdmissionState.OK
_CRITICAL = AdmissionState.CRITICAL
_DISPATCHED = Outcome.DISPATCHED
_DEADLINE = ReleaseReason.DEADLINE
_IMMEDIATE = ReleaseReason.IMMEDIATE
_SIZE_CAP = ReleaseReason.SIZE_CAP
_TOKEN_CAP = ReleaseReason.TOKEN_CAP
_EARLY = ReleaseReason.EARLY
_LONE = ReleaseReason.LONE
_FOLLOW = ReleaseReason.PREFIX_FOLLOW


class _Gen:
    """One queued generation (mutable, private)."""

    __slots__ = ("dkey", "group", "ptok", "request", "seq", "state", "subs", "tokens")

    def __init__(
        self, request: Request, group: _Group, seq: int, ptok: int, tokens: int, *, dkey: Hashable
    ) -> None:
        self.request = request
        self.group = group
        self.seq = seq
        self.ptok = ptok
        self.tokens = tokens
        self.dkey = dkey  # dedupe key, or None
        self.state = _QUEUED
        # Subscriber id -> its own Request (for its arrival and deadline). Dict order
        # is subscription order, so the first caller stays first.
        self.subs: dict[str, Request] = {request.id: request}


class _Group:
    """Queued generations of one GroupKey (mutable, private).

    `gens` may hold stale (_GONE) records after cancels; `n` and `ptok` count the live
    ones only, and a release filters the list.
    """

    __slots__ = ("gens", "key", "n", "ptok", "ready")

    def __init__(self, key: GroupKey) -> None:
        self.key = key
        self.gens: list[_Gen] = []
        self.n = 0
        self.ptok = 0
        self.ready = False  # a cap was reached; released by the next due()


def _order(g: _Gen) -> tuple[int, int, int]:
    return (g.request.priority, g.ptok, g.seq)


class Coalescer:
    """Sans-IO admission and batching policy; see the module docstring for the rules."""

    def __init__(self, config: CoalescerConfig) -> None:
        self.config = config
        self._state = _OK
        self._seq = 0
        self._batch_id = 0
        # Groups stay when they empty (a new _Group per request cost 0.3 us with window
        # 0) unless there are more than _KEEP_GROUPS, so invented adapters cannot leak.
        self._groups: dict[GroupKey, _Group] = {}
        self._ready: list[_Group] = []
        self._ready_at = 0.0  # when the first group in _ready reached a cap
        self._lone: list[_Gen] = []  # lone arrivals, released by the next due()
        self._lone_at = 0.0  # when the first of them was admitted
        self._last_add = -math.inf  # time of the latest admission (rule 8)
        self._gens: dict[str, _Gen] = {}  # queued + held generations, by request id
        self._subs: dict[str, _Gen] = {}  # queued + held subscribers
        self._dedupe: dict[Hashable, _Gen] = {}
        self._in_flight: dict[str, _Gen] = {}
        # Heaps of (time, seq, item); seq is unique, so items are never compared.
        self._wheap: list[tuple[float, int, _Gen]] = []  # window deadlines
        self._xheap: list[tuple[float, int, Request]] = []  # subscriber expiries
        self._held: list[tuple[float, int, list[_Gen]]] = []  # prefix followers
        self._q_reqs = 0
        self._q_tokens = 0
        self._f_reqs = 0
        self._f_tokens = 0
        self._events: list[Event] = []
        self._drain = DrainRate()
        self._memory = PrefixMemory(config.prefix_memory)
        self._n_admitted = 0
        self._n_refused = 0
        self._n_dispatched = 0
        self._n_cancelled = 0
        self._n_expired = 0
        self._n_rejected = 0
        self._n_batches = 0
        self._n_generations = 0
        self._n_dedupe = 0
        self._n_leaders = 0
        self._n_followers = 0

    # -- state and gauges --------------------------------------------------------

    @property
    def state(self) -> AdmissionState:
        return self._state

    @state.setter
    def state(self, value: AdmissionState) -> None:
        self._state = value

    @property
    def queued_requests(self) -> int:
        """Queued subscribers (including held prefix followers)."""
        return self._q_reqs

    @property
    def queued_tokens(self) -> int:
        return self._q_tokens

    @property
    def queued_generations(self) -> int:
        return len(self._gens)

    @property
    def pending_requests(self) -> int:
        """Queued plus in-flight subscribers: what max_pending_requests bounds."""
        return self._q_reqs + self._f_reqs

    @property
    def pending_tokens(self) -> int:
        return self._q_tokens + self._f_tokens

    @property
    def in_flight(self) -> int:
        """Dispatched generations not yet finished."""
        return len(self._in_flight)

    @property
    def drain_rate(self) -> float | None:
        """Measured tokens finished per second of busy time; None until known."""
        return self._drain.tokens_per_s

    @property
    def counters(self) -> Counters:
        return Counters(
            admitted=self._n_admitted,
            refused=self._n_refused,
            dispatched=self._n_dispatched,
            cancelled=self._n_cancelled,
            expired=self._n_expired,
            rejected=self._n_rejected,
            batches=self._n_batches,
            generations=self._n_generations,
            dedupe_hits=self._n_dedupe,
            prefix_leaders=self._n_leaders,
            prefix_followers=self._n_followers,
        )

    def pop_events(self) -> list[Event]:
        events = self._events
        self._events = []
        return events

    # -- admission ---------------------------------------------------------------

    def add(self, request: Request, now: float) -> Admitted | Refused:
        cfg = self.config
        rid = request.id
        if self._state is not _OK:
            return self._refuse_state(rid, now)
        if rid in self._subs or rid in self._gens or rid in self._in_flight:
            # A reused id would corrupt the maps keyed by it. Ids of joined duplicates
            # are not tracked once dispatched (nothing is keyed by them any more).
            return self._refuse(
                rid, RefusalReason.DUPLICATE_ID, 0.0, f"request id {rid!r} is in use", now
            )
        fp = request.fingerprint
        dkey: Hashable = None
        if fp is not None and cfg.dedupe:
            dkey = (request.key, request.prompt_tokens, fp)
            gen = self._dedupe.get(dkey)
            if gen is not None:
                if self._q_reqs + self._f_reqs >= cfg.max_pending_requests:
                    return self._refuse_requests(rid, now)
                self._last_add = now
                return self._join(gen, request)
        ptok = len(request.prompt_tokens)
        tokens = ptok + request.max_new_tokens
        if self._q_reqs + self._f_reqs >= cfg.max_pending_requests:
            return self._refuse_requests(rid, now)
        if self._q_tokens + self._f_tokens + tokens > cfg.max_pending_tokens:
            if tokens > cfg.max_pending_tokens:
                return self._refuse(
                    rid,
                    RefusalReason.TOO_LARGE,
                    0.0,
                    f"request needs {tokens} tokens (prompt + max_tokens); "
                    f"the limit is {cfg.max_pending_tokens}",
                    now,
                )
            excess = self._q_tokens + self._f_tokens + tokens - cfg.max_pending_tokens
            return self._refuse(
                rid,
                RefusalReason.QUEUE_FULL_TOKENS,
                self._retry_after(excess, self._drain.tokens_per_s),
                "the token queue is full",
                now,
            )
        self._seq = seq = self._seq + 1
        key = request.key
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(key)
        gen = _Gen(request, group, seq, ptok, tokens, dkey=dkey)
        group.gens.append(gen)
        group.n += 1
        group.ptok += ptok
        self._gens[rid] = gen
        self._subs[rid] = gen
        if dkey is not None:
            self._dedupe[dkey] = gen
        self._q_reqs += 1
        self._q_tokens += tokens
        self._n_admitted += 1
        heappush(self._wheap, (request.arrival + cfg.window, seq, gen))
        if cfg.release_lone and now - self._last_add > cfg.window > 0:
            if not self._lone:
                self._lone_at = now
            self._lone.append(gen)
        self._last_add = now
        if request.deadline is not None:
            heappush(self._xheap, (request.deadline, seq, request))
        if (
            not group.ready
            and cfg.window  # window 0: the window heap releases it anyway (IMMEDIATE)
            and (group.n >= cfg.max_batch_seqs or group.ptok >= cfg.max_batch_tokens)
        ):
            group.ready = True
            if not self._ready:
                self._ready_at = now
            self._ready.append(group)
        return _fast.admitted(rid, None)

    def _join(self, gen: _Gen, request: Request) -> Admitted:
        rid = request.id
        gen.subs[rid] = request
        self._subs[rid] = gen
        self._q_reqs += 1
        self._n_admitted += 1
        self._n_dedupe += 1
        self._seq = seq = self._seq + 1
        if request.deadline is not None:
            heappush(self._xheap, (request.deadline, seq, request))
        joined = gen.request.id
        self._events.append(DedupeHit(rid, joined))
        return Admitted(rid, joined)

    def _retry_after(self, excess: float, rate: float | None) -> float:
        cfg = self.config
        t = cfg.retry_after_default if rate is None or rate <= 0 else excess / rate
        return min(max(t, cfg.retry_after_min), cfg.retry_after_max)

    def _refuse(
        self, rid: str, reason: RefusalReason, retry_after: float, message: str, now: float
    ) -> Refused:
        self._n_refused += 1
        self._events.append(Refusal(rid, reason, retry_after, now))
        return Refused(reason, retry_after, message)

    def _refuse_requests(self, rid: str, now: float) -> Refused:
        excess = self._q_reqs + self._f_reqs + 1 - self.config.max_pending_requests
        return self._refuse(
            rid,
            RefusalReason.QUEUE_FULL_REQUESTS,
            self._retry_after(excess, self._drain.requests_per_s),
            "the request queue is full",
            now,
        )

    def _refuse_state(self, rid: str, now: float) -> Refused:
        if self._state is AdmissionState.DRAINING:
            # The server is going away: the client should go elsewhere or come back
            # after a restart; the drain rate says nothing about that.
            return self._refuse(
                rid,
                RefusalReason.DRAINING,
                self._retry_after(0.0, None),
                "the server is shutting down",
                now,
            )
        # Memory frees as queued work drains through the engine: suggest the time it
        # takes to drain what is queued now (at least retry_after_min).
        return self._refuse(
            rid,
            RefusalReason.MEMORY,
            self._retry_after(self._q_tokens, self._drain.tokens_per_s),
            "the server is low on memory",
            now,
        )

    # -- leaving before dispatch -------------------------------------------------

    def cancel(self, request_id: str, now: float) -> bool:
        """The caller left while queued. True if it was queued (and is now CANCELLED)."""
        gen = self._subs.pop(request_id, None)
        if gen is None:
            return False
        sreq = gen.subs.pop(request_id)
        self._q_reqs -= 1
        self._n_cancelled += 1
        self._events.append(Ended(request_id, Outcome.CANCELLED, now - sreq.arrival, now))
        if not gen.subs:
            self._drop(gen)
        return True

    def _drop(self, gen: _Gen) -> None:
        """Remove a queued or held generation whose last subscriber left."""
        if gen.state == _QUEUED:
            group = gen.group
            group.n -= 1
            group.ptok -= gen.ptok
            if not group.n:
                self._forget(group)
        gen.state = _GONE
        del self._gens[gen.request.id]
        if gen.dkey is not None and self._dedupe.get(gen.dkey) is gen:
            del self._dedupe[gen.dkey]
        self._q_tokens -= gen.tokens

    def _expire(self, now: float) -> None:
        xheap = self._xheap
        subs = self._subs
        while xheap and xheap[0][0] <= now:
            req = heappop(xheap)[2]
            rid = req.id
            gen = subs.get(rid)
            if gen is None or gen.subs.get(rid) is not req:
                continue  # stale: dispatched, cancelled, or the id was reused
            del subs[rid]
            del gen.subs[rid]
            self._q_reqs -= 1
            self._n_expired += 1
            self._events.append(Ended(rid, Outcome.EXPIRED, now - req.arrival, now))
            if not gen.subs:
                self._drop(gen)

    def reject_queued(self, now: float) -> list[str]:
        """End every queued subscriber as REJECTED (engine died, drain deadline)."""
        ids: list[str] = []
        events = self._events
        for gen in self._gens.values():
            gen.state = _GONE
            for sid, sreq in gen.subs.items():
                ids.append(sid)
                events.append(Ended(sid, Outcome.REJECTED, now - sreq.arrival, now))
        self._n_rejected += len(ids)
        self._gens.clear()
        self._subs.clear()
        self._dedupe.clear()
        self._groups.clear()
        self._ready = []
        self._lone = []
        self._wheap.clear()
        self._xheap.clear()
        self._held.clear()
        self._q_reqs = 0
        self._q_tokens = 0
        return ids

    # -- release -----------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """Earliest time `due()` could release or expire something; None if never.

        May lie in the past (a cap was reached, or `due()` was not called): call
        `due()` at once then. In CRITICAL only expiry times count.
        """
        best: float | None = None
        xheap = self._xheap
        while xheap:
            req = xheap[0][2]
            gen = self._subs.get(req.id)
            if gen is not None and gen.subs.get(req.id) is req:
                best = xheap[0][0]
                break
            heappop(xheap)
        if self._state is _CRITICAL:
            return best
        if self._ready:
            # Drop groups that fell under the caps again (cancels, expiries), so that
            # a driver is not woken for nothing.
            cfg = self.config
            for group in self._ready:
                if group.n < cfg.max_batch_seqs and group.ptok < cfg.max_batch_tokens:
                    group.ready = False
            self._ready = [g for g in self._ready if g.ready]
            if self._ready and (best is None or self._ready_at < best):
                best = self._ready_at
        if self._lone:
            self._lone = [g for g in self._lone if g.state == _QUEUED]
            if self._lone and (best is None or self._lone_at < best):
                best = self._lone_at
        wheap = self._wheap
        while wheap and wheap[0][2].state != _QUEUED:
            heappop(wheap)
        if wheap and (best is None or wheap[0][0] < best):
            best = wheap[0][0]
        held = self._held
        while held and not any(g.state == _HELD for g in held[0][2]):
            heappop(held)
        if held and (best is None or held[0][0] < best):
            best = held[0][0]
        return best

    def due(self, now: float, load: EngineLoad | None = None) -> list[Batch]:
        """Expire, then release every batch that is due at `now`, in order."""
        out: list[Batch] = []
        xheap = self._xheap
        if xheap and xheap[0][0] <= now:
            self._expire(now)
        if self._state is _CRITICAL:
            return out
        # Decided before this call dispatches anything (see rule 8).
        idle = (
            load is not None
            and self.config.adaptive
            and load.running == 0
            and load.waiting == 0
            and not self._in_flight
        )
        held = self._held
        while held and held[0][0] <= now:
            live = [g for g in heappop(held)[2] if g.state == _HELD]
            if live:
                self._emit(live, _FOLLOW, now, out)
        if self._ready:
            ready = self._ready
            self._ready = []
            for group in ready:
                group.ready = False
                if group.n:
                    self._cut(group, now, None, out)
        if self._lone:
            lone = self._lone
            self._lone = []
            for gen in lone:
                if gen.state == _QUEUED:
                    self._cut(gen.group, now, _LONE, out)
        wheap = self._wheap
        if wheap and wheap[0][0] <= now:
            reason = _IMMEDIATE if self.config.window == 0 else _DEADLINE
            while wheap and wheap[0][0] <= now:
                gen = heappop(wheap)[2]
                if gen.state == _QUEUED:
                    self._cut(gen.group, now, reason, out)
        if idle and self._q_reqs:
            for group in list(self._groups.values()):
                if group.n:
                    self._cut(group, now, _EARLY, out)
        if out:
            self._drain.busy(now)
        return out

    def _cut(
        self, group: _Group, now: float, reason: ReleaseReason | None, out: list[Batch]
    ) -> None:
        """Release a group's queued generations as batches, in order.

        reason None: a cap was reached; cut batches only while the rest still reaches
        a cap, and keep the rest queued. Otherwise release the whole group.
        """
        cfg = self.config
        max_seqs = cfg.max_batch_seqs
        max_tok = cfg.max_batch_tokens
        gens = group.gens
        if group.n != len(gens):
            gens = [g for g in gens if g.state == _QUEUED]
        if len(gens) > 1:
            gens.sort(key=_order)
        n = len(gens)
        left = group.ptok
        i = 0
        while i < n:
            if reason is None and n - i < max_seqs and left < max_tok:
                break
            j = i
            bt = 0
            stop = min(n, i + max_seqs)
            while j < stop:
                p = gens[j].ptok
                if bt + p > max_tok and j > i:
                    break
                bt += p
                j += 1
            left -= bt
            why = reason or (_SIZE_CAP if j - i >= max_seqs else _TOKEN_CAP)
            self._release(gens[i:j] if (i or j < n) else gens, why, now, out)
            i = j
        rest = gens[i:] if i else gens
        group.gens = rest
        group.n = len(rest)
        group.ptok = left
        if not rest:
            self._forget(group)

    def _forget(self, group: _Group) -> None:
        """An empty group: keep it for reuse unless there are too many."""
        if len(self._groups) > _KEEP_GROUPS and self._groups.get(group.key) is group:
            del self._groups[group.key]

    def _release(
        self, gens: list[_Gen], reason: ReleaseReason, now: float, out: list[Batch]
    ) -> None:
        """Apply the shared-prefix rule to one cut batch, then emit it."""
        block = self.config.prefix_block
        if block:
            memory = self._memory
            key = gens[0].request.key
            if len(gens) == 1:
                prompt = gens[0].request.prompt_tokens
                if len(prompt) >= block:  # as prefix.block_key, inlined (hot path)
                    memory.remember(hash((key, prompt[:block])), now)
            else:
                bkeys = [block_key(key, g.request.prompt_tokens, block) for g in gens]
                plans = plan_followers(bkeys, memory, now)
                if plans:
                    gens = self._hold_followers(gens, plans, now)
                    # Leaders are released now: remember their prefixes. Other entries
                    # in the batch have no follower here, remember them too.
                for g in gens:
                    bk = block_key(key, g.request.prompt_tokens, block)
                    if bk is not None:
                        memory.remember(bk, now)
            memory.prune(now)
        self._emit(gens, reason, now, out)

    def _hold_followers(
        self, gens: list[_Gen], plans: list[tuple[int, list[int]]], now: float
    ) -> list[_Gen]:
        block = self.config.prefix_block
        held: set[int] = set()
        for lead, followers in plans:
            prompt = gens[lead].request.prompt_tokens
            shared = min(
                shared_blocks(prompt, gens[f].request.prompt_tokens, block) for f in followers
            )
            self._events.append(PrefixLeader(gens[lead].request.id, len(followers), shared, now))
            self._n_leaders += 1
            self._n_followers += len(followers)
            held.update(followers)
        follow = [g for i, g in enumerate(gens) if i in held]  # keeps batch order
        for g in follow:
            g.state = _HELD
        self._seq = seq = self._seq + 1
        heappush(self._held, (now + self.config.prefix_follow_delay, seq, follow))
        return [g for i, g in enumerate(gens) if i not in held]

    def _emit(self, gens: list[_Gen], reason: ReleaseReason, now: float, out: list[Batch]) -> None:
        """Dispatch generations as one batch: move them from queued to in flight."""
        events = self._events
        subs_map = self._subs
        gens_map = self._gens
        in_flight = self._in_flight
        dedupe = self._dedupe
        entries: list[Entry] = []
        tokens = 0
        nsubs = 0
        for g in gens:
            g.state = _GONE
            req = g.request
            rid = req.id
            del gens_map[rid]
            if g.dkey is not None and dedupe.get(g.dkey) is g:
                del dedupe[g.dkey]
            in_flight[rid] = g
            subs = g.subs
            for sid, sreq in subs.items():
                del subs_map[sid]
                events.append(_fast.ended(sid, _DISPATCHED, now - sreq.arrival, now))
            nsubs += len(subs)
            tokens += g.tokens
            entries.append(_fast.entry(req, tuple(subs)))
        self._q_reqs -= nsubs
        self._f_reqs += nsubs
        self._q_tokens -= tokens
        self._f_tokens += tokens
        self._n_dispatched += nsubs
        self._n_generations += len(gens)
        self._n_batches += 1
        self._batch_id = bid = self._batch_id + 1
        key = gens[0].request.key
        events.append(_fast.released(bid, key, reason, len(gens), tokens, now))
        out.append(_fast.batch(bid, key, tuple(entries), reason, now, tokens))

    # -- after dispatch ----------------------------------------------------------

    def finished(self, request_id: str, now: float, tokens: int | None = None) -> bool:
        """A dispatched generation (by `Entry.request.id`) ended in the engine.

        Frees its pending capacity and feeds the drain-rate estimator. `tokens` is how
        many tokens it generated (the driver's completion count); the core adds the
        prompt itself, so the rate is in the same unit as admission (prompt + output).
        None means "unknown" and counts max_new_tokens; pass 0 for a generation that
        never reached the engine. Returns False for an unknown or already finished id
        (a no-op), so the driver may report an abort and a final output for the same
        generation.
        """
        gen = self._in_flight.pop(request_id, None)
        if gen is None:
            return False
        n = len(gen.subs)
        self._f_reqs -= n
        self._f_tokens -= gen.tokens
        drained = gen.tokens if tokens is None else gen.ptok + tokens
        self._drain.finished(drained, n, now, not self._in_flight)
        return True
