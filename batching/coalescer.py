"""The coalescer: admission, the coalescing window, the backlog, release to the engine.

Why this module exists: it is the one queue Sluice owns, and the only place where
policy happens. It is sans-IO (h11 style): the driver passes `now` in, calls `due()`
when `next_deadline()` comes (or right after `add()`), and submits what comes back.

Why it is one module of ~1,200 lines (issue 29 weighed a split into admission, the
window and release, and kept it whole): its thirteen rules are one state machine
over one set of records (`Gen`, `Group`, `CallerState`). Each public call (`add`,
`due`, `cancel`, `started`, `finished`) moves a generation between the window, the
backlog and the engine and keeps, as one step, the counts every rule reads
(pending requests and tokens, a caller's queue, the unstarted prompts the room
judges): split by rule, each module would write the others' counts, and the
invariant "every admitted subscriber ends exactly once" would have no single
home. What does stand alone has left it, each with its rules on top: the release
order (order.py), the per-caller backlog (backlog.py), the engine's room
(room.py), fair share (callers.py), the admission pressure (pressure.py), the
drain rate (drain.py), LoRA slots (adapters.py), the records (_records.py).

Rules:

1. Admission is bounded by `max_pending_requests` (subscribers) and
   `max_pending_tokens` (prompt + max_new of generations), counting queued plus in
   flight (released and not yet `finished()`). Over a limit the request is refused at
   once with a `retry_after` of excess / measured drain rate (see drain.py), clamped to
   [retry_after_min, retry_after_max]. A duplicate that joins a queued generation costs
   one request and no tokens. Every admitted subscriber ends exactly once, as
   DISPATCHED, CANCELLED, EXPIRED or REJECTED, reported as an `Ended` event.
2. Callers (callers.py): a request over its caller's own `max_queued` or
   `tokens_per_minute` is refused with CALLER_LIMIT and a `retry_after` from that
   caller's own drain; other callers are not affected. The caller's limits are checked
   before the global ones (the more specific answer wins).
3. Window: a group's queued requests become eligible when its oldest one has waited
   `window` (DEADLINE), or as soon as the group holds `max_batch_seqs` entries or
   `max_batch_tokens` prompt tokens (SIZE_CAP / TOKEN_CAP, at the next `due()`;
   `next_deadline()` then returns the time the cap was reached). `window == 0` makes
   everything eligible at the next `due()` (IMMEDIATE). A deadline takes the whole
   group; a cap takes, in rule-6 order, batches while the rest still reaches a cap.
4. A batch holds one GroupKey.
5. Backlog (backlog.py, room.py): eligible generations wait in their caller's backlog
   and `due()` releases them only while the engine's next steps will take them (its
   queue fed for the steps room.py rule 2 says, KV room). The driver reports a
   generation's first output with `started()`, its end with `finished()`, and the
   engine's stats and the steps it ran with each `due(now, load, steps)`; the backlog
   is not time-driven, so while `backlog_generations` is non-zero the driver calls
   `due()` after each of those. Each step is judged against what the backlog held
   beside it (room.underfed), and the time the backlog held work is integrated by the
   rule that held it (`room_counters`).
   With nothing in flight the first backlogged generation always goes (the engine
   never idles while Sluice holds work). With the engine capacity unknown (all 0)
   and no caller's max_concurrency in the way, nothing is held: eligible means
   released, in the order it became eligible.
6. Order of release: fair share between callers (virtual token counters), then the
   release key (order.py: priority, then short-first with continuous aging capped at
   `order.max_delay`, then admission order), computed once at admission and used by
   the window's cut, the backlog and the engine priority; no head-of-line blocking;
   see backlog.py.
7. Batches: when everything that became eligible goes at once (empty backlog, room
   for all of it, no max_concurrency), each cut of rule 3 is one batch. Otherwise the
   generations one `due()` releases are grouped by (GroupKey, reason), in order of
   first release, and split by the caps (a lone request over the token cap forms a
   batch by itself). A batch's reason is why its generations became eligible if the
   same `due()` call released them, and BACKLOG if they waited in the backlog.
8. `cancel()` and expiry (`Request.deadline`) remove queued work (window or backlog)
   before release in O(1) / O(log n): heaps are cleaned lazily.
9. Dedupe: a request whose (key, prompt_tokens, fingerprint) equals a queued
   generation's (fingerprint not None) subscribes to it, whatever its caller (the
   output is the same; the generation keeps its owner's place and is charged to its
   owner, the joined request counts as queued for its own caller). The generation
   keeps its first request's data even if that caller cancels; it leaves only with
   its last subscriber. Each subscriber keeps its own deadline.
10. Adaptive: if `due()` gets an `EngineLoad` with running == 0 and waiting == 0, and
   the core itself has nothing in flight, every queued group becomes eligible now
   (EARLY): with an idle engine, waiting out the window is pure latency. The in-flight
   check is an addition to the plain load test: the driver's snapshot can be older
   than our own last release, and a stale "idle" must not turn the window off under
   load.
   Lone arrivals (`release_lone`): a request admitted more than `window` after the
   previous admission of its class (interactive or background, classes.py) becomes
   eligible at the next `due()` (LONE), with whatever its group holds. At that
   arrival rate no company is expected within the window, so waiting would only add
   latency; the requests that follow it closely wait out their window as usual, so a
   burst still coalesces behind its first request. Per class, because the other
   class is no company: background work never goes before an interactive request
   (rule 6), and a batch's lines, admitted as others end, made a third of a chat
   caller's turns beside it wait the whole window (issue 49; 10 ms, the turn's whole
   alone TTFT on a fast CPU).
11. Admission states: SHEDDING refuses new work (MEMORY); CRITICAL refuses new work
   and `due()` releases nothing (expiry still runs; `next_deadline()` then reports
   expiry times only, so a driver does not spin); DRAINING refuses (DRAINING) and keeps
   releasing. After changing the state, the driver should call `due()` again.
12. Open-ended requests (`Request.open_ended`: the client set no max_tokens, so
   max_new_tokens is the rest of the context): admission charges prompt + the
   caller's running mean of generated tokens of its open-ended generations (256
   before the first finishes; weight 1/16 per finish), bounded by max_new_tokens,
   against the caller's tokens_per_minute and max_pending_tokens, instead of the
   whole context. `finished()` reconciles: the caller's bucket gets back what was
   charged and not generated, or gives up the excess (it may go below 0 and refills
   from there). The pending-token count drops by the charge, as before.
13. LoRA slots (`engine.max_loras` > 0, backlog.py rule 5, adapters.py): the distinct
   adapters in flight stay within `max_loras`, so nothing released waits in vLLM's
   queue for an adapter slot; a caller waiting for one waits at most `adapter_wait`
   seconds before an adapter in flight is drained for it. Base-model work takes no
   slot. With `max_loras` 0 (LoRA off) nothing here applies.

Queries (`next_deadline()`, the gauges) have no side effects: the calls that change
state (`due()`, `cancel()`) leave the window and expiry heaps' tops live.

Performance: the hot path (add + due + finished) uses plain dicts, lists and heaps and
allocates, per request, one internal record, one subscriber dict, two backlog entries,
the `Admitted`, the `Entry` and the `Ended` event. See bench/core_bench.py for numbers.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import replace
from heapq import heappop, heappush

from . import _fast
from ._records import BACKLOG, GONE, QUEUED, CallerState, Gen, Group
from .adapters import AdapterSlots, SlotView
from .backlog import Backlog
from .callers import Callers, CallerStats
from .classes import is_background
from .config import CoalescerConfig
from .drain import DrainRate
from .endings import Endings
from .events import (
    Counters,
    DedupeHit,
    Ended,
    Event,
    Refusal,
    RoomCounters,
)
from .keys import GroupKey
from .prefix import Placed, PrefixMap, choose
from .room import POLICY, EngineCapacity, EngineView, Hold, Room, place, rooms, underfed
from .types import (
    AdmissionState,
    Admitted,
    Batch,
    EngineLoad,
    EngineStep,
    Outcome,
    RefusalReason,
    Refused,
    ReleaseReason,
    Request,
)
from .warm import HASHED, TTL, WarmCounters, warmth
from .warm import capacity as warm_capacity

__all__ = ["Coalescer"]

_KEEP_GROUPS = 64  # empty groups kept for reuse (see Coalescer.__init__)
# room.py rule 2: the share of the feed's spare a step with waiting work left takes off.
# Modelled at the c=384 spread (bench/room_sim.py): under-fed steps 10.8% of the held
# ones at 1/16, 5.1% at 1/64, 2.7% at 1/256, 1.0% at 0, with the engine's waiting
# queue at 1.8, 2.3, 2.7 and 3.4 requests on average (vLLM's server: 245).
_SPARE_DECAY = 1.0 / 256.0

_OK = AdmissionState.OK
_CRITICAL = AdmissionState.CRITICAL
_DISPATCHED = Outcome.DISPATCHED
_DEADLINE = ReleaseReason.DEADLINE
_IMMEDIATE = ReleaseReason.IMMEDIATE
_SIZE_CAP = ReleaseReason.SIZE_CAP
_TOKEN_CAP = ReleaseReason.TOKEN_CAP
_EARLY = ReleaseReason.EARLY
_LONE = ReleaseReason.LONE
_BACKLOG = ReleaseReason.BACKLOG


def _order(g: Gen) -> tuple[int, float, int]:
    return g.key


def _batch_end(gens: list[Gen], i: int, max_seqs: int, max_tok: int) -> tuple[int, int]:
    """Where the batch starting at `gens[i]` ends within the caps (rule 7), and its
    prompt tokens: at most `max_seqs` entries and `max_tok` prompt tokens, except that
    a lone entry over the token cap forms a batch by itself."""
    j = i
    bt = 0
    stop = min(len(gens), i + max_seqs)
    while j < stop:
        p = gens[j].ptok
        if bt + p > max_tok and j > i:
            break
        bt += p
        j += 1
    return j, bt


# Prefix placement's memory (prefix.py): (block, rank) entries kept, and for how
# long. 65,536 blocks of 16 tokens is about a million tokens per rank pair, more than
# the demo's KV cache holds; 10 minutes is longer than a conversation's think time
# and shorter than a busy cache keeps an idle prefix.
PREFIX_BLOCKS = 65_536
PREFIX_TTL = 600.0


class Coalescer:
    """Sans-IO admission and batching policy; see the module docstring for the rules."""

    def __init__(self, config: CoalescerConfig) -> None:
        self._config = config
        self._state = _OK
        self._seq = 0
        self._batch_id = 0
        self._round = 0  # due() calls, to tell "eligible now" from "waited"
        # Groups stay when they empty (a new Group per request cost 0.3 us with window
        # 0) unless there are more than _KEEP_GROUPS, so invented adapters cannot leak.
        self._groups: dict[GroupKey, Group] = {}
        self._ready: list[Group] = []
        self._ready_at = 0.0  # when the first group in _ready reached a cap
        self._lone: list[Gen] = []  # lone arrivals, eligible at the next due()
        self._lone_at = 0.0  # when the first of them was admitted
        # Time of the latest admission of each class (rule 10): [interactive, background].
        self._last_add = [-math.inf, -math.inf]
        self._gens: dict[str, Gen] = {}  # queued + backlogged, by request id
        self._subs: dict[str, Gen] = {}  # their subscribers
        self._dedupe: dict[Hashable, Gen] = {}
        self._in_flight: dict[str, Gen] = {}
        # Heaps of (time, seq, item); seq is unique, so items are never compared.
        self._wheap: list[tuple[float, int, Gen]] = []  # window deadlines
        self._xheap: list[tuple[float, int, Request]] = []  # subscriber expiries
        self._q_reqs = 0
        self._q_tokens = 0
        self._f_reqs = 0
        self._f_tokens = 0
        self._events: list[Event] = []
        self._drain = DrainRate()
        self._callers: dict[str, CallerState] = {}
        self._backlog = Backlog(
            config.order.max_delay, AdapterSlots(config.engine.max_loras, config.adapter_wait)
        )
        # What became eligible in the current due() call: (generations, reason) cuts,
        # each within the batch caps, in order.
        self._fresh: list[tuple[list[Gen], ReleaseReason]] = []
        self._uncapped = self._no_caps()
        self._known = config.engine.known  # any engine number known: room.py applies
        self._kv_usage = 0.0  # from the latest EngineLoad
        self._kv_usage_least: float | None = None  # its least-used DP rank's (room rule 6)
        # Prompt tokens the engine's steps prefilled of the unstarted generations
        # (room.py rule 3): in its KV use already.
        self._prefilled = 0
        # Each data-parallel rank's latest step (room.py rule 2; None: none yet), and
        # the spare slots and step tokens the steps set.
        self._last_steps: list[EngineStep | None] = [None] * config.engine.ranks
        self._spare_slots = 0.0
        self._spare_tokens = 0.0
        self._slot_bound = False  # the last round's feed ran short of slots, not budget
        # Each rank's started generations by the step they end by: the slots the
        # engine's next steps free (room.py rule 2), and the unstarted generations
        # placed on it (rule 6's placement).
        self._endings = [Endings(config.feed_steps - 1) for _ in range(config.engine.ranks)]
        self._unstarted_rank = [0] * config.engine.ranks
        self._unstarted_n = 0  # released generations without a first output yet
        self._unstarted_tokens = 0  # their prompt tokens
        self._unstarted_feed = 0  # what the engine's next steps prefill of them (rule 2)
        self._unstarted_long = 0  # of them, prompts that take more than a step's chunk (rule 5)
        # Background work in flight, unstarted, and its unstarted feed (room.py rule 8).
        self._bg_flying = self._bg_unstarted = self._bg_feed = 0
        self._n_admitted = 0
        self._n_refused = 0
        self._n_dispatched = 0
        self._n_cancelled = 0
        self._n_expired = 0
        self._n_rejected = 0
        self._n_batches = 0
        # Prefix placement (prefix.py): blocks placed per rank; placements by
        # (why, rank), counted with more than one rank.
        self._prefix = PrefixMap(capacity=PREFIX_BLOCKS, ttl=PREFIX_TTL)
        self._placements: dict[tuple[Placed, int], int] = {}
        # The prefix-warm order's record (warm.py W6), sized from the KV cache, and
        # its counters: the longest pass, the record's predictions and their error.
        self._warm = PrefixMap(capacity=self._warm_size(config.engine), ttl=TTL)
        self._passed_max = 0.0
        self._w_predicted = self._w_cached = self._w_over = self._w_saved = 0
        self._n_generations = 0
        self._n_dedupe = 0
        # The engine's steps and what the backlog held beside them (RoomCounters).
        self._n_steps = 0
        self._n_steps_held = 0
        self._n_underfed = 0
        self._n_underfed_policy = 0  # of those, beside work rules 4-5 held (room.POLICY)
        self._held_by: Hold | None = None  # the rule that held work since `_held_at`
        self._held_at = 0.0
        self._held_s: dict[Hold, float] = dict.fromkeys(Hold, 0.0)

    # -- state, gauges, callers ----------------------------------------------------

    @property
    def state(self) -> AdmissionState:
        return self._state

    @state.setter
    def state(self, value: AdmissionState) -> None:
        self._state = value

    @property
    def config(self) -> CoalescerConfig:
        return self._config

    @config.setter
    def config(self, value: CoalescerConfig) -> None:
        """Replace the tunables (the server does once the engine has resolved its
        limits). Queued work stays and keeps its release key; a new order applies
        to what is admitted afterwards."""
        self._config = value
        self._known = value.engine.known
        self._backlog.max_delay = value.order.max_delay
        self._set_slots()
        self._refeed()
        self._apply_callers()

    @property
    def capacity(self) -> EngineCapacity:
        """The engine's capacity (room.py)."""
        return self._config.engine

    @capacity.setter
    def capacity(self, value: EngineCapacity) -> None:
        self._config = replace(self._config, engine=value)
        self._known = value.known
        self._set_slots()
        self._refeed()

    def _refeed(self) -> None:
        """The engine capacity or the feed steps changed: recount room.py rule 2's
        unstarted tokens and each rank's unstarted generations, forget steps and
        endings of ranks that are gone, and set the endings' look-ahead."""
        cfg = self._config
        size, steps = cfg.engine.feed_size, cfg.feed_steps
        multi, short = cfg.engine.multi_step, cfg.short_prompt_tokens
        ranks = cfg.engine.ranks
        unstarted = [g for g in self._in_flight.values() if not g.started]
        self._unstarted_feed = sum(size(g.ptok, steps) for g in unstarted)
        self._bg_feed = sum(size(g.ptok, steps) for g in unstarted if not g.interactive)
        self._unstarted_long = sum(1 for g in unstarted if multi(g.ptok, short))
        per_rank = [0] * ranks
        for g in unstarted:
            if g.rank < ranks:
                per_rank[g.rank] += 1
        self._unstarted_rank = per_rank
        self._last_steps = (self._last_steps + [None] * ranks)[:ranks]
        self._warm.capacity = self._warm_size(cfg.engine)
        ahead = steps - 1
        self._endings = (self._endings + [Endings(ahead) for _ in range(ranks)])[:ranks]
        for e in self._endings:
            e.ahead = ahead

    def _set_slots(self) -> None:
        """The engine's max_loras and the slot wait (rule 13); slots in flight stay."""
        slots = self._backlog.slots
        slots.max_loras = self._config.engine.max_loras
        slots.wait = self._config.adapter_wait

    def _no_caps(self) -> bool:
        p = self._config.callers
        return not (p.default.max_concurrency or any(q.max_concurrency for q in p.policies))

    @property
    def queued_requests(self) -> int:
        """Queued subscribers (window and backlog)."""
        return self._q_reqs

    @property
    def queued_tokens(self) -> int:
        return self._q_tokens

    @property
    def queued_generations(self) -> int:
        return len(self._gens)

    @property
    def backlog_generations(self) -> int:
        """Eligible generations held back until the engine has room."""
        return self._backlog.n

    @property
    def engine_waiting(self) -> int:
        """Released generations without a first output: waiting inside the engine."""
        return self._unstarted_n

    @property
    def pending_requests(self) -> int:
        """Queued plus in-flight subscribers: what max_pending_requests bounds."""
        return self._q_reqs + self._f_reqs

    @property
    def pending_tokens(self) -> int:
        return self._q_tokens + self._f_tokens

    @property
    def in_flight(self) -> int:
        """Released generations not yet finished."""
        return len(self._in_flight)

    def adapter_slots(self, now: float) -> SlotView:
        """The LoRA slots at `now` (rule 13; a query)."""
        return self._backlog.slots.view(now)

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
        )

    @property
    def feed_spare(self) -> tuple[float, float]:
        """Room.py rule 2's spare (slots, step tokens) the engine's steps have set."""
        return self._spare_slots, self._spare_tokens

    @property
    def places_prefix(self) -> bool:
        """Does a release follow its prompt's prefix (prefix.py)? Only with more than
        one data-parallel rank and prefix placement on: the server hashes a prompt's
        blocks only then (with one rank it costs nothing)."""
        return self._config.prefix_placement and self._config.engine.ranks > 1

    @staticmethod
    def _warm_size(engine: EngineCapacity) -> int:
        return warm_capacity(engine.kv_tokens, engine.prefix_block, engine.ranks)

    @property
    def orders_prefix(self) -> bool:
        """Does a release prefer a warm prefix (warm.py)? With `prefix_order` on and
        the engine's prefix cache on (its block size known)."""
        cfg = self._config
        return cfg.prefix_order and cfg.engine.prefix_block > 0

    @property
    def prefix_tokens(self) -> int | None:
        """How many of a prompt's leading tokens the server hashes into
        `Request.prefix`: all (None) for prefix placement, the first `HASHED`
        blocks for the warm order alone (W5), 0 for neither (nothing hashed)."""
        if self.places_prefix:
            return None
        if self.orders_prefix:
            return HASHED * self._config.engine.prefix_block
        return 0

    @property
    def warm_counters(self) -> WarmCounters:
        """The warm order's releases, longest pass and the record's error (warm.py)."""
        return WarmCounters(
            releases=self._backlog.warm_releases,
            saved=self._w_saved,
            passed_max=self._passed_max,
            predicted=self._w_predicted,
            cached=self._w_cached,
            overbelief=self._w_over,
        )

    @property
    def placements(self) -> tuple[tuple[str, int, int], ...]:
        """Releases placed on a data-parallel rank, cumulative: (why: prefix.Placed's
        value, rank, count), in rank then why order (none with one rank)."""
        return tuple(
            (why.value, rank, n)
            for (why, rank), n in sorted(
                self._placements.items(), key=lambda kv: (kv[0][1], kv[0][0].value)
            )
        )

    @property
    def room_counters(self) -> RoomCounters:
        return RoomCounters(
            steps=self._n_steps,
            steps_held=self._n_steps_held,
            underfed_steps=self._n_underfed,
            held_seconds=tuple((h.value, s) for h, s in self._held_s.items()),
            underfed_policy_steps=self._n_underfed_policy,
        )

    def callers(self) -> tuple[CallerStats, ...]:
        """A snapshot of every caller seen so far."""
        return tuple(c.stats() for c in self._callers.values())

    def caller(self, name: str) -> CallerStats | None:
        c = self._callers.get(name)
        return None if c is None else c.stats()

    def most_at_once(self, caller: str) -> tuple[int, int]:
        """The most requests and tokens `caller` could ever have admitted at once
        (rules 1-2; a query): the global bounds, the caller's max_queued plus its
        max_concurrency, its tokens_per_minute. A submission of several requests
        together (an embeddings request's inputs) beyond either number is refused
        at every retry, so the server refuses it whole (413) instead of with a
        Retry-After it could never meet."""
        cfg = self._config
        policy = cfg.callers.get(caller)
        requests, tokens = cfg.max_pending_requests, cfg.max_pending_tokens
        if policy.max_queued is not None:
            requests = min(requests, policy.max_queued + (policy.max_concurrency or 0))
        if policy.tokens_per_minute is not None:
            tokens = min(tokens, policy.tokens_per_minute)
        return requests, tokens

    def set_callers(self, callers: Callers) -> None:
        """Replace the policy table (SIGHUP); queued work and counters stay."""
        self._config = replace(self._config, callers=callers)
        self._apply_callers()

    def _apply_callers(self) -> None:
        callers = self._config.callers
        for c in self._callers.values():
            c.set_policy(callers.get(c.name))
        self._uncapped = self._no_caps()

    def _caller(self, name: str) -> CallerState:
        c = self._callers.get(name)
        if c is None:
            c = self._callers[name] = CallerState(self._config.callers.get(name), name)
        return c

    def pop_events(self) -> list[Event]:
        events = self._events
        self._events = []
        return events

    # -- admission ---------------------------------------------------------------

    def add(self, request: Request, now: float) -> Admitted | Refused:
        cfg = self._config
        rid = request.id
        c = self._callers.get(request.caller) or self._caller(request.caller)
        if self._state is not _OK:
            return self._refuse_state(c, rid, now)
        if rid in self._subs or rid in self._gens or rid in self._in_flight:
            # A reused id would corrupt the maps keyed by it. Ids of joined duplicates
            # are not tracked once dispatched (nothing is keyed by them any more).
            return self._refuse(
                c, rid, RefusalReason.DUPLICATE_ID, 0.0, f"request id {rid!r} is in use", now
            )
        policy = c.policy
        if policy.max_queued is not None and self._over_queue(c):
            return self._refuse_caller_queue(c, rid, now)
        fp = request.fingerprint
        dkey: Hashable = None
        if fp is not None and cfg.dedupe:
            dkey = (request.key, request.prompt_tokens, fp)
            gen = self._dedupe.get(dkey)
            if gen is not None:
                if self._q_reqs + self._f_reqs >= cfg.max_pending_requests:
                    return self._refuse_requests(c, rid, now)
                self._last_add[is_background(request.priority)] = now
                return self._join(gen, request, c)
        ptok = len(request.prompt_tokens)
        new = c.expect(request.max_new_tokens) if request.open_ended else request.max_new_tokens
        tokens = ptok + new
        bucket = c.bucket
        if bucket is not None:
            wait = bucket.wait(tokens, now)
            if wait > 0:
                if tokens > bucket.capacity:
                    return self._refuse(
                        c,
                        rid,
                        RefusalReason.TOO_LARGE,
                        0.0,
                        f"request needs {tokens} tokens (prompt + max_tokens, or an "
                        f"estimate without it); caller "
                        f"{c.name!r} may use {policy.tokens_per_minute} per minute",
                        now,
                    )
                return self._refuse(
                    c,
                    rid,
                    RefusalReason.CALLER_LIMIT,
                    self._clamp(wait),
                    f"caller {c.name!r} is over its tokens_per_minute",
                    now,
                )
        if self._q_reqs + self._f_reqs >= cfg.max_pending_requests:
            return self._refuse_requests(c, rid, now)
        if self._q_tokens + self._f_tokens + tokens > cfg.max_pending_tokens:
            if tokens > cfg.max_pending_tokens:
                return self._refuse(
                    c,
                    rid,
                    RefusalReason.TOO_LARGE,
                    0.0,
                    f"request needs {tokens} tokens (prompt + max_tokens); "
                    f"the limit is {cfg.max_pending_tokens}",
                    now,
                )
            excess = self._q_tokens + self._f_tokens + tokens - cfg.max_pending_tokens
            return self._refuse(
                c,
                rid,
                RefusalReason.QUEUE_FULL_TOKENS,
                self._retry_after(excess, self._drain.tokens_per_s),
                "the token queue is full",
                now,
            )
        if bucket is not None:
            bucket.take(tokens)
        self._seq = seq = self._seq + 1
        key = request.key
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = Group(key)
        order = cfg.order.key(request.priority, ptok, request.arrival, seq)
        gen = Gen(request, group, c, seq, ptok, new, order, dkey)
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
        c.queued += 1
        c.admitted += 1
        heappush(self._wheap, (request.arrival + cfg.window, seq, gen))
        cls = is_background(request.priority)
        if cfg.release_lone and now - self._last_add[cls] > cfg.window > 0:
            if not self._lone:
                self._lone_at = now
            self._lone.append(gen)
        self._last_add[cls] = now
        if request.deadline is not None:
            heappush(self._xheap, (request.deadline, seq, request))
        if (
            not group.ready
            and cfg.window  # window 0: the window heap takes it anyway (IMMEDIATE)
            and (group.n >= cfg.max_batch_seqs or group.ptok >= cfg.max_batch_tokens)
        ):
            group.ready = True
            if not self._ready:
                self._ready_at = now
            self._ready.append(group)
        return _fast.admitted(rid, None)

    def _join(self, gen: Gen, request: Request, c: CallerState) -> Admitted:
        rid = request.id
        gen.subs[rid] = request
        self._subs[rid] = gen
        self._q_reqs += 1
        self._n_admitted += 1
        self._n_dedupe += 1
        c.queued += 1
        c.admitted += 1
        self._seq = seq = self._seq + 1
        if request.deadline is not None:
            heappush(self._xheap, (request.deadline, seq, request))
        joined = gen.request.id
        self._events.append(DedupeHit(rid, joined))
        return Admitted(rid, joined)

    @staticmethod
    def _over_queue(c: CallerState) -> bool:
        """Rule 2: queued + in flight would pass max_queued + max_concurrency."""
        mq = c.policy.max_queued
        if mq is None:
            return False
        mc = c.policy.max_concurrency
        if mc is None:
            return c.queued >= mq
        return c.queued + min(c.in_flight, mc) >= mq + mc

    def _clamp(self, t: float) -> float:
        cfg = self._config
        return min(max(t, cfg.retry_after_min), cfg.retry_after_max)

    def _retry_after(self, excess: float, rate: float | None) -> float:
        if rate is None or rate <= 0:
            return self._clamp(self._config.retry_after_default)
        return self._clamp(excess / rate)

    def _refuse(
        self,
        c: CallerState,
        rid: str,
        reason: RefusalReason,
        retry_after: float,
        message: str,
        now: float,
    ) -> Refused:
        self._n_refused += 1
        c.refused += 1
        self._events.append(Refusal(rid, reason, retry_after, now, c.name))
        return Refused(reason, retry_after, message)

    def _refuse_requests(self, c: CallerState, rid: str, now: float) -> Refused:
        excess = self._q_reqs + self._f_reqs + 1 - self._config.max_pending_requests
        return self._refuse(
            c,
            rid,
            RefusalReason.QUEUE_FULL_REQUESTS,
            self._retry_after(excess, self._drain.requests_per_s),
            "the request queue is full",
            now,
        )

    def _refuse_caller_queue(self, c: CallerState, rid: str, now: float) -> Refused:
        p = c.policy
        mc = p.max_concurrency or 0
        used = min(c.in_flight, mc)
        excess = c.queued + used + 1 - ((p.max_queued or 0) + mc)
        return self._refuse(
            c,
            rid,
            RefusalReason.CALLER_LIMIT,
            self._retry_after(excess, c.drain.requests_per_s),
            f"caller {c.name!r} has {c.queued} requests waiting (max_queued {p.max_queued})",
            now,
        )

    def _refuse_state(self, c: CallerState, rid: str, now: float) -> Refused:
        if self._state is AdmissionState.DRAINING:
            # The server is going away: the client should go elsewhere or come back
            # after a restart; the drain rate says nothing about that.
            return self._refuse(
                c,
                rid,
                RefusalReason.DRAINING,
                self._retry_after(0.0, None),
                "the server is shutting down",
                now,
            )
        # Memory frees as queued work drains through the engine: suggest the time it
        # takes to drain what is queued now (at least retry_after_min).
        return self._refuse(
            c,
            rid,
            RefusalReason.MEMORY,
            self._retry_after(self._q_tokens, self._drain.tokens_per_s),
            "the server is low on memory",
            now,
        )

    # -- leaving before release ----------------------------------------------------

    def _sub_caller(self, gen: Gen, sreq: Request) -> CallerState:
        owner = gen.caller
        return owner if sreq.caller == owner.name else self._callers[sreq.caller]

    def cancel(self, request_id: str, now: float) -> bool:
        """The caller left while queued. True if it was queued (and is now CANCELLED)."""
        gen = self._subs.pop(request_id, None)
        if gen is None:
            return False
        sreq = gen.subs.pop(request_id)
        self._q_reqs -= 1
        self._n_cancelled += 1
        self._sub_caller(gen, sreq).queued -= 1
        self._events.append(
            Ended(request_id, Outcome.CANCELLED, now - sreq.arrival, now, sreq.caller)
        )
        if not gen.subs:
            self._drop(gen)
        self._tidy()
        return True

    def _drop(self, gen: Gen) -> None:
        """Remove a queued or backlogged generation whose last subscriber left."""
        state = gen.state
        if state == QUEUED:
            group = gen.group
            group.n -= 1
            group.ptok -= gen.ptok
            if not group.n:
                self._forget(group)
        elif state == BACKLOG:
            self._backlog.discard(gen)
        gen.state = GONE
        del self._gens[gen.request.id]
        if gen.dkey is not None and self._dedupe.get(gen.dkey) is gen:
            del self._dedupe[gen.dkey]
        self._q_tokens -= gen.tokens
        bucket = gen.caller.bucket
        if bucket is not None:
            bucket.give(gen.tokens)  # never reached the engine

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
            self._sub_caller(gen, req).queued -= 1
            self._events.append(Ended(rid, Outcome.EXPIRED, now - req.arrival, now, req.caller))
            if not gen.subs:
                self._drop(gen)

    def reject_queued(self, now: float) -> list[str]:
        """End every queued subscriber as REJECTED (engine died, drain deadline)."""
        ids: list[str] = []
        events = self._events
        for gen in self._gens.values():
            gen.state = GONE
            bucket = gen.caller.bucket
            if bucket is not None:
                bucket.give(gen.tokens)
            for sid, sreq in gen.subs.items():
                ids.append(sid)
                events.append(Ended(sid, Outcome.REJECTED, now - sreq.arrival, now, sreq.caller))
        for c in self._callers.values():
            c.queued = 0
        self._backlog.clear()
        self._n_rejected += len(ids)
        self._gens.clear()
        self._subs.clear()
        self._dedupe.clear()
        self._groups.clear()
        self._ready = []
        self._lone = []
        self._wheap.clear()
        self._xheap.clear()
        self._q_reqs = 0
        self._q_tokens = 0
        return ids

    # -- release -----------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """Earliest time `due()` could make something eligible or expire it.

        May lie in the past (a cap was reached, or `due()` was not called): call
        `due()` at once then. In CRITICAL only expiry times count. The backlog is
        released on events, not on time (rule 5). A query: it reads the heaps' tops,
        which `_tidy()` keeps live.
        """
        xheap = self._xheap
        best = xheap[0][0] if xheap else None
        if self._state is _CRITICAL:
            return best
        if self._ready and (best is None or self._ready_at < best):
            best = self._ready_at
        if self._lone and (best is None or self._lone_at < best):
            best = self._lone_at
        wheap = self._wheap
        if wheap and (best is None or wheap[0][0] < best):
            best = wheap[0][0]
        return best

    def _tidy(self) -> None:
        """Drop what went stale at the tops of the deadline heaps and lists, so that
        `next_deadline()` reads only live times and a driver is not woken for
        nothing. Called at the end of every call that can make them stale."""
        xheap = self._xheap
        subs = self._subs
        while xheap:
            req = xheap[0][2]
            gen = subs.get(req.id)
            if gen is not None and gen.subs.get(req.id) is req:
                break
            heappop(xheap)
        if self._ready:
            # Groups that fell under the caps again (cancels, expiries).
            cfg = self._config
            for group in self._ready:
                if group.n < cfg.max_batch_seqs and group.ptok < cfg.max_batch_tokens:
                    group.ready = False
            self._ready = [g for g in self._ready if g.ready]
        if self._lone:
            self._lone = [g for g in self._lone if g.state == QUEUED]
        wheap = self._wheap
        while wheap and wheap[0][2].state != QUEUED:
            heappop(wheap)

    def due(
        self, now: float, load: EngineLoad | None = None, steps: Sequence[EngineStep] = ()
    ) -> list[Batch]:
        """Expire, make due work eligible, then release what the engine has room for.

        `steps` are the engine steps reported since the previous call: each is judged
        against what the backlog held meanwhile (rule 5) before anything changes.
        """
        out: list[Batch] = []
        if steps:
            self._judge(steps)
        if self._held_by is not None and now > self._held_at:
            self._held_s[self._held_by] += now - self._held_at
        self._held_at = now
        xheap = self._xheap
        if xheap and xheap[0][0] <= now:
            self._expire(now)
        if self._state is _CRITICAL:
            self._held_by = None  # held by the admission state, not by a room rule
            self._tidy()
            return out
        if load is not None:
            self._kv_usage = load.kv_usage
            self._kv_usage_least = load.kv_usage_least
        # Decided before this call releases anything (see rule 10).
        idle = (
            load is not None
            and self._config.adaptive
            and load.running == 0
            and load.waiting == 0
            and not self._in_flight
        )
        self._round += 1
        fresh = self._fresh  # what becomes eligible now, in order
        if self._ready:
            ready = self._ready
            self._ready = []
            for group in ready:
                group.ready = False
                if group.n:
                    self._cut(group, None)
        if self._lone:
            lone = self._lone
            self._lone = []
            for gen in lone:
                if gen.state == QUEUED:
                    self._cut(gen.group, _LONE)
        wheap = self._wheap
        if wheap and wheap[0][0] <= now:
            reason = _IMMEDIATE if self._config.window == 0 else _DEADLINE
            while wheap and wheap[0][0] <= now:
                gen = heappop(wheap)[2]
                if gen.state == QUEUED:
                    self._cut(gen.group, reason)
        if idle and self._q_reqs:
            for group in list(self._groups.values()):
                if group.n:
                    self._cut(group, _EARLY)
        backlog = self._backlog
        if fresh:
            self._fresh = []
            if not backlog.n and self._uncapped and (not self._known or self._room_for(fresh, now)):
                self._release_fresh(fresh, now, out)
            else:
                rnd = self._round
                push = backlog.push
                for gens, why in fresh:
                    for g in gens:
                        g.reason = why
                        g.round = rnd
                        push(g)
        if backlog.n:
            self._release(now, out)
        self._held_by = backlog.held_by if backlog.n else None
        if out:
            self._drain.busy(now)
        self._tidy()
        return out

    def _judge(self, steps: Sequence[EngineStep]) -> None:
        """Count the engine's steps, and the under-fed ones (room.underfed) beside what
        the backlog held since the previous `due()`; keep each rank's latest."""
        last = self._last_steps
        prefilled = self._prefilled
        for s in steps:
            if 0 <= s.rank < len(last):
                last[s.rank] = s
            prefilled += s.prefill_tokens
        self._prefilled = min(prefilled, self._unstarted_tokens)
        self._n_steps += len(steps)
        endings = self._endings
        for s in steps:
            if 0 <= s.rank < len(endings):
                endings[s.rank].advance(1.0)
        if not self._backlog.n:
            return
        self._n_steps_held += len(steps)
        room = self._room(self._held_at)
        held = self._held_prompt(room)
        if not held:
            return
        cap = self._config.engine
        fed = self._held_by is Hold.FEED
        policy = room.blocks(held) in POLICY
        # Rule 3's pending KV, a rank's share (the room counts it over all ranks).
        pending = room.kv_pending // cap.ranks
        for s in steps:
            if underfed(s, cap, held, pending):
                self._n_underfed += 1
                self._n_underfed_policy += policy
                if fed:
                    self._respare(s, self._slot_bound)
            elif s.waiting:
                self._spare_slots -= self._spare_slots * _SPARE_DECAY
                self._spare_tokens -= self._spare_tokens * _SPARE_DECAY

    def _respare(self, step: EngineStep, slot_bound: bool) -> None:
        """Room.py rule 2's spare: an under-fed step while the feed held work adds
        what it left unused, of the dimension the feed ran short of."""
        cap = self._config.engine
        if slot_bound and cap.max_seqs:
            unused = max(0, cap.max_seqs - step.requests)
            self._spare_slots = min(cap.max_seqs * cap.ranks, self._spare_slots + unused)
        elif cap.step_tokens:
            unused = max(0, cap.step_tokens - step.tokens)
            self._spare_tokens = min(cap.step_tokens * cap.ranks, self._spare_tokens + unused)

    def _held_prompt(self, room: Room) -> int:
        """The smallest prompt among the callers' first generations that wait for
        engine room (not at their caller's max_concurrency, not for a LoRA slot); 0
        if none."""
        best = 0
        for g in self._backlog.heads():
            if room.admits(g.request.key.adapter) and (not best or g.ptok < best):
                best = g.ptok
        return best

    def _cut(self, group: Group, reason: ReleaseReason | None) -> None:
        """Make a group's queued generations eligible (rule 3), in rule-6 order.

        reason None: a cap was reached; take batches only while the rest still reaches
        a cap, and keep the rest queued. Otherwise take the whole group.
        """
        cfg = self._config
        max_seqs = cfg.max_batch_seqs
        max_tok = cfg.max_batch_tokens
        gens = group.gens
        if group.n != len(gens):
            gens = [g for g in gens if g.state == QUEUED]
        if len(gens) > 1:
            gens.sort(key=_order)
        n = len(gens)
        left = group.ptok
        fresh = self._fresh
        i = 0
        while i < n:
            if reason is None and n - i < max_seqs and left < max_tok:
                break
            j, bt = _batch_end(gens, i, max_seqs, max_tok)
            left -= bt
            why = reason or (_SIZE_CAP if j - i >= max_seqs else _TOKEN_CAP)
            fresh.append((gens[i:j] if (i or j < n) else gens, why))
            i = j
        rest = gens[i:] if i else gens
        group.gens = rest
        group.n = len(rest)
        group.ptok = left
        if not rest:
            self._forget(group)

    def _forget(self, group: Group) -> None:
        """An empty group: keep it for reuse unless there are too many."""
        if len(self._groups) > _KEEP_GROUPS and self._groups.get(group.key) is group:
            del self._groups[group.key]

    def _release(self, now: float, out: list[Batch]) -> None:
        """Release backlogged generations while the engine has room (rules 5-7)."""
        backlog = self._backlog
        room = self._room(now)
        released: list[Gen] = []
        serve = backlog.served
        warm = None
        # One rank: a release is recorded as it is picked, so its siblings are warm
        # for the round's next pick (warm.py W3); with DP, once _emit placed it.
        now_record = False
        if self.orders_prefix:
            record, ranks = self._warm, self._config.engine.ranks
            now_record = ranks == 1

            def warm(g: Gen) -> int:
                return warmth(record, g.request.prefix, ranks, now)

        for g in backlog.pick(now, room, warm, self._config.warm.min_gain):
            room.take(g.ptok, g.request.key.adapter, g.interactive)
            serve(g)
            released.append(g)
            if now_record and g.request.prefix:
                self._warm_record(g, 0, now)
        self._slot_bound = room.slot_bound
        self._round_done(released, now, out)

    def _room(self, now: float) -> Room:
        cfg = self._config
        in_flight = len(self._in_flight)
        return Room(
            cfg.engine,
            in_flight,
            self._unstarted_n,
            self._unstarted_tokens,
            self._unstarted_feed,
            EngineView.of(
                cfg.engine,
                self._last_steps,
                in_flight - self._unstarted_n,
                self._spare_slots,
                self._spare_tokens,
                sum(self._ending()),
            ),
            self._kv_usage,
            self._prefilled,
            cfg.kv_reserve_short,
            cfg.short_prompt_tokens,
            cfg.feed_steps,
            self._kv_usage_least,
            self._backlog.slots,
            now,
            self._unstarted_long,
            cfg.long_prefills if self._callers_busy() > 1 else 0,
            (self._bg_flying, self._bg_unstarted, self._bg_feed) if cfg.interactive_first else None,
        )

    def _ending(self) -> list[int]:
        """Each rank's running generations that end within the feed's steps
        (endings.py), at most what its last step left running: more cannot end."""
        last = self._last_steps
        share = (len(self._in_flight) - self._unstarted_n) // max(1, len(last))
        return [
            min(e.soon, s.running if s is not None else share)
            for e, s in zip(self._endings, last, strict=False)
        ]

    def _callers_busy(self) -> int:
        """Callers with work in flight or queued (room.py rule 5), counted up to two."""
        n = 0
        for c in self._callers.values():
            if c.in_flight or c.queued:
                n += 1
                if n > 1:
                    break
        return n

    def _room_for(self, fresh: list[tuple[list[Gen], ReleaseReason]], now: float) -> bool:
        """Would the engine take all of `fresh` now (the backlog being empty)?"""
        room = self._room(now)
        for gens, _ in fresh:
            for g in gens:
                adapter = g.request.key.adapter
                if not (room.fits(g.ptok, g.interactive) and room.admits(adapter)):
                    return False
                room.take(g.ptok, adapter, g.interactive)
        return True

    def _release_fresh(
        self, fresh: list[tuple[list[Gen], ReleaseReason]], now: float, out: list[Batch]
    ) -> None:
        """Rule 5 when everything that became eligible fits: release it, in order.

        The backlog is empty, no caller has a max_concurrency and the engine has room
        for all of it, so nothing is held and the order within the round is the order
        of eligibility; each cut is already within the caps and goes as one batch.
        Skipping the backlog's heaps keeps the common case cheap.
        """
        backlog = self._backlog
        wake = backlog.wake
        served = backlog.served
        for gens, why in fresh:
            for g in gens:
                wake(g.caller)  # an idle caller starts at the floor here too (rule 1)
                served(g)
            self._emit(gens, why, now, out)

    def _round_done(self, released: list[Gen], now: float, out: list[Batch]) -> None:
        """Emit this round's batches (rule 7)."""
        if not released:
            return
        rnd = self._round
        if len(released) == 1:
            g = released[0]
            why = (g.reason or _BACKLOG) if g.round == rnd else _BACKLOG
            self._emit(released, why, now, out)
            return
        batches: dict[tuple[GroupKey, ReleaseReason], list[Gen]] = {}
        for g in released:
            why = (g.reason or _BACKLOG) if g.round == rnd else _BACKLOG
            k = (g.group.key, why)
            lst = batches.get(k)
            if lst is None:
                batches[k] = [g]
            else:
                lst.append(g)
        for (_, why), gens in batches.items():
            for part in self._split(gens):
                self._emit(part, why, now, out)

    def _split(self, gens: list[Gen]) -> list[list[Gen]]:
        """Generations of one key, in order, as batches within the caps (rule 7)."""
        cfg = self._config
        max_seqs = cfg.max_batch_seqs
        max_tok = cfg.max_batch_tokens
        n = len(gens)
        if n <= max_seqs and sum(g.ptok for g in gens) <= max_tok:
            return [gens]
        parts = []
        i = 0
        while i < n:
            j = _batch_end(gens, i, max_seqs, max_tok)[0]
            parts.append(gens[i:j])
            i = j
        return parts

    def _emit(self, gens: list[Gen], reason: ReleaseReason, now: float, out: list[Batch]) -> None:
        """Release generations as one batch: move them from queued to in flight."""
        events = self._events
        subs_map = self._subs
        gens_map = self._gens
        in_flight = self._in_flight
        dedupe = self._dedupe
        entries = []
        tokens = 0
        ptok = 0
        feed = 0
        longs = 0
        cfg = self._config
        size, steps = cfg.engine.feed_size, cfg.feed_steps
        multi, short = cfg.engine.multi_step, cfg.short_prompt_tokens
        nsubs = 0
        unstarted = self._unstarted_rank
        ranks = len(unstarted)
        ending = self._ending() if ranks > 1 else []
        record = self._warm if self.orders_prefix else None
        for g in gens:
            g.state = GONE
            req = g.request
            rid = req.id
            del gens_map[rid]
            if g.dkey is not None and dedupe.get(g.dkey) is g:
                del dedupe[g.dkey]
            in_flight[rid] = g
            c = g.caller  # in flight already (Backlog.served)
            if c.policy.max_queued is not None:
                c.drain.busy(now)
            subs = g.subs
            if len(subs) == 1 and rid in subs:  # the common case: its owner alone
                del subs_map[rid]
                c.queued -= 1
                events.append(_fast.ended(rid, _DISPATCHED, now - req.arrival, now, req.caller))
            else:
                for sid, sreq in subs.items():
                    del subs_map[sid]
                    self._sub_caller(g, sreq).queued -= 1
                    events.append(
                        _fast.ended(sid, _DISPATCHED, now - sreq.arrival, now, sreq.caller)
                    )
            nsubs += len(subs)
            tokens += g.tokens
            ptok += g.ptok
            fed = size(g.ptok, steps)
            feed += fed
            longs += multi(g.ptok, short)
            if not g.interactive:  # room.py rule 8
                self._bg_flying += 1
                self._bg_unstarted += 1
                self._bg_feed += fed
            rank = None
            if ranks > 1:
                rank = place(cfg.engine, self._last_steps, ending, unstarted, g.ptok)
                why = Placed.LOAD
                if req.prefix and cfg.prefix_placement:
                    rank, why = self._follow(req.prefix, rank, ending, g.ptok, now)
                pk = (why, rank)
                self._placements[pk] = self._placements.get(pk, 0) + 1
                g.rank = rank
            if g.passed is not None:
                self._passed_max = max(self._passed_max, now - g.passed)
            if record is not None and req.prefix and g.predicted < 0:
                self._warm_record(g, g.rank, now)
            unstarted[g.rank] += 1
            entries.append(_fast.entry(req, tuple(subs), g.key, rank))
        self._q_reqs -= nsubs
        self._f_reqs += nsubs
        self._q_tokens -= tokens
        self._f_tokens += tokens
        self._unstarted_n += len(gens)
        self._unstarted_tokens += ptok
        self._unstarted_feed += feed
        self._unstarted_long += longs
        self._n_dispatched += nsubs
        self._n_generations += len(gens)
        self._n_batches += 1
        self._batch_id = bid = self._batch_id + 1
        key = gens[0].request.key
        events.append(_fast.released(bid, key, reason, len(gens), tokens, now))
        out.append(_fast.batch(bid, key, tuple(entries), reason, now, tokens))

    def _follow(
        self, prefix: tuple[int, ...], fallback: int, ending: list[int], ptok: int, now: float
    ) -> tuple[int, Placed]:
        """Prefix placement (prefix.py P1-P4) over room.py's choice `fallback`: the
        rank and why; the placement is recorded in the map at `now`."""
        last, unstarted = self._last_steps, self._unstarted_rank
        n = len(unstarted)
        room = rooms(self._config.engine, last, ending, unstarted, ptok)
        loads = [(s.running if s is not None else 0) + unstarted[r] for r, s in enumerate(last)]
        c = choose(self._prefix.held(prefix, n, now), room, loads[:n], fallback)
        self._prefix.placed(prefix, c.rank, now)
        return c.rank, c.placed

    def _warm_record(self, g: Gen, rank: int, now: float) -> None:
        """warm.py W6: what the record believes cached of `g`'s prompt (its error is
        measured at `started()`), then `g`'s blocks held on `rank` from `now`."""
        prefix, cfg = g.request.prefix, self._config
        held = warmth(self._warm, prefix, cfg.engine.ranks, now) * cfg.engine.prefix_block
        g.predicted = min(held, g.ptok - 1) if held else 0
        self._warm.placed(prefix, rank, now)

    # -- after release -------------------------------------------------------------

    def started(self, request_id: str, now: float, cached: int = 0) -> bool:
        """A released generation produced its first output: it left the engine's queue.

        `cached` is how many of its prompt tokens the engine's prefix cache held (vLLM's
        num_cached_tokens): those it did not prefill. Returns False for an unknown,
        finished or already started id (a no-op).
        """
        gen = self._in_flight.get(request_id)
        if gen is None or gen.started:
            return False
        gen.started = True
        if gen.predicted >= 0:  # warm.py W6: the record's error
            hit = min(max(0, cached), gen.ptok)
            self._w_predicted += gen.predicted
            self._w_cached += hit
            self._w_over += max(0, gen.predicted - hit)
            if gen.for_warmth:
                self._w_saved += hit
        if gen.rank < len(self._endings):
            self._endings[gen.rank].start(request_id, gen.request.max_new_tokens)
        self._leaves_engine_queue(gen, gen.ptok - min(max(0, cached), gen.ptok))
        return True

    def _leaves_engine_queue(self, gen: Gen, prefilled: int) -> None:
        """A released generation is no longer unstarted (room.py rules 2-3), after the
        engine prefilled `prefilled` of its prompt tokens."""
        cfg = self._config
        fed = cfg.engine.feed_size(gen.ptok, cfg.feed_steps)
        self._unstarted_n -= 1
        if not gen.interactive:
            self._bg_unstarted -= 1
            self._bg_feed -= fed
        if gen.rank < len(self._unstarted_rank):
            self._unstarted_rank[gen.rank] -= 1
        self._unstarted_tokens -= gen.ptok
        self._unstarted_feed -= fed
        self._unstarted_long -= cfg.engine.multi_step(gen.ptok, cfg.short_prompt_tokens)
        self._prefilled = max(0, self._prefilled - prefilled) if self._unstarted_n else 0

    def finished(self, request_id: str, now: float, tokens: int | None = None) -> bool:
        """A released generation (by `Entry.request.id`) ended in the engine.

        Frees its pending capacity, charges its generated tokens to its caller's fair
        share (2 per token), gives the unused part of max_new_tokens back to the
        caller's tokens_per_minute (or takes what an open-ended one generated beyond
        its estimate, rule 12), and feeds the drain-rate estimators. `tokens` is
        how many tokens it generated (the driver's completion count); the core adds
        the prompt itself, so the rate is in the same unit as admission (prompt +
        output). None means "unknown" and counts max_new_tokens; pass 0 for a
        generation that never reached the engine. Returns False for an unknown or
        already finished id (a no-op), so the driver may report an abort and a final
        output for the same generation.
        """
        gen = self._in_flight.pop(request_id, None)
        if gen is None:
            return False
        if not gen.interactive:
            self._bg_flying -= 1
        if gen.rank < len(self._endings):
            self._endings[gen.rank].end(request_id)
        n = len(gen.subs)
        self._f_reqs -= n
        self._f_tokens -= gen.tokens
        if not gen.started:
            # Ended before its first output (an abort): how much of it the engine had
            # prefilled is not known; all of it, so the KV estimate errs high.
            self._leaves_engine_queue(gen, gen.ptok)
        req = gen.request
        generated = req.max_new_tokens if tokens is None else tokens
        c = gen.caller
        c.in_flight -= 1
        self._backlog.ended(gen)
        c.generated_tokens += generated
        c.charge(2 * generated)
        charged = gen.new
        if c.bucket is not None and generated != charged:  # rule 12's reconcile too
            if generated < charged:
                c.bucket.give(charged - generated)
            else:
                c.bucket.take(generated - charged)
        if req.open_ended and tokens is not None:
            c.learn(tokens)
        drained = gen.ptok + generated
        self._drain.finished(drained, n, now, not self._in_flight)
        if c.policy.max_queued is not None:  # its drain only prices its own 429s
            c.drain.finished(drained, n, now, not c.in_flight)
        return True
