"""The status page's data: one sample a second for 15 minutes, served as /status.json.

Why it exists: most workstations have no Prometheus, and raw /metrics text is
no picture. The page (server/http/static/) plots what this ring buffer holds, and
reads nothing else.

How it stays cheap:

* One call a second to a *snapshot* callable that copies counters and gauges
  the server keeps anyway (no scrape, no text rendering). Rates are computed
  here, from the difference of two snapshots over the monotonic time between
  them; the time axis is wall-clock seconds, as the browser shows it.
* TTFT and batch-size observations since the previous snapshot come in as a
  short sequence (the server drains a list it appends to); p50/p95 are exact
  over that second, not interpolated from histogram buckets.
* The engine's steps beside a held backlog and the under-fed ones (a step that
  left budget and a slot unused while Sluice held work that would have fit,
  batching/room.py) are rates; the time the backlog held work is a share of
  each second per rule, keyed like the ranks below.
* With data-parallel ranks (vLLM's --data-parallel-size), each rank's running,
  waiting and KV use are keyed columns ("rank 0 running", ...), so the page
  draws them only when the engine has more than one rank: one rank's numbers
  are the engine's, already plotted.
* The usage ledger (server/operations/usage.py) adds each caller's engine
  seconds a second (a keyed column, like the service per caller) and a table
  of each caller's last hour and last day (`usage`: requests, tokens, engine
  seconds), read from the state database at most every 10 s by the ledger.
* With several models (--models), each model's running, queued, KV use and
  request rate are keyed columns too ("model_running", ...), and the body
  holds a table of the models as the last sample saw them (`models`: state,
  kind, loads and the last load's seconds, the requests holding it).
* The JSON body is built at most once per sample (orjson) and cached: many
  browsers refreshing every second cost one build. So is each caller's view
  (`View`): a caller's key sees its own per-caller series and one total for
  the rest, and only the adapters it may use (server/http/status_page.py decides
  who gets which).
* Measured on the 2-core test machine (tests/unit/test_status.py): about
  50 us per sample for a busy second (200 TTFTs, 40 batches), 0.5 ms to dump
  a full 15-minute body (114 KB). The body reports the sampler's own cost.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import orjson

from batching.pressure import RankStats
from batching.step_share import StepCounters
from server.operations.usage import CallerUsage

log = logging.getLogger("sluice.status")

INTERVAL_S = 1.0
WINDOW_S = 900.0  # 15 minutes
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ModelRow:
    """One served model, as a snapshot sees it (with --models)."""

    state: str  # server/engines/registry.py State
    kind: str
    load: str  # start | on-demand
    loads: int = 0
    failures: int = 0
    unloads: int = 0
    load_seconds: float | None = None  # the last load's
    loaded_at: float | None = None  # wall clock of the last load
    error: str | None = None  # the last load's failure
    held: int = 0  # requests holding it (waiting for its load included)
    queued: float = 0.0
    running: float = 0.0
    kv_cache_usage: float | None = None
    requests: float = 0.0  # finished generation requests (cumulative)
    # Its engine's deaths (server/engines/supervisor.py): how many, the last
    # one's wall clock and cause, and the time it took to serve again.
    deaths: int = 0
    last_death: tuple[float, str] | None = None
    back_in_s: float | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the server hands the sampler once a second.

    Counters are cumulative since start; gauges are the value now; ``None``
    means "not measured here" (no NVML, no held backlog yet), which the page
    shows as an absent series rather than a zero.
    """

    state: str  # starting | ok | shedding | critical | draining | ...
    reason: str = ""
    requests: float = 0.0  # finished chat/completions requests
    prompt_tokens: float = 0.0
    generated_tokens: float = 0.0
    refusals: Mapping[str, float] = field(default_factory=dict)  # by reason
    callers: Mapping[str, float] = field(default_factory=dict)  # service by caller
    # Finished generation requests by LoRA adapter (the base model by its name).
    adapters: Mapping[str, float] = field(default_factory=dict)
    queued: float = 0.0
    backlog: float | None = None
    engine_running: float = 0.0
    engine_waiting: float = 0.0
    kv_cache_usage: float | None = None  # 0..1
    ranks: Sequence[RankStats] = ()  # data-parallel ranks, in rank order (none with one)
    gpu_free_bytes: float | None = None  # the least free of the engine's devices
    host_available_bytes: float | None = None
    ttft: Sequence[float] = ()  # seconds, observed since the previous snapshot
    batch_sizes: Sequence[int] = ()  # released since the previous snapshot
    # The engine's steps beside a held backlog and the under-fed ones, and the
    # seconds the backlog held work by rule, cumulative (batching/room.py).
    steps_held: float = 0.0
    underfed_steps: float = 0.0
    held_seconds: Mapping[str, float] = field(default_factory=dict)
    models: Mapping[str, ModelRow] = field(default_factory=dict)  # with --models
    # Releases placed per data-parallel rank and why, cumulative ("rank N prefix",
    # "rank N load", "rank N bound": batching/prefix.py; none with one rank).
    placements: Mapping[str, float] = field(default_factory=dict)
    # The Batch API's lines done and their tokens (prompt + generated), cumulative.
    batch_lines: float = 0.0
    batch_tokens: float = 0.0
    batches_running: float = 0.0  # batches being run now (validating to finalizing)
    # The usage ledger (server/operations/usage.py): each caller's engine seconds
    # since start (cumulative), and its last hour and last day as last read.
    caller_engine_seconds: Mapping[str, float] = field(default_factory=dict)
    usage: Mapping[str, CallerUsage] = field(default_factory=dict)
    # What Sluice's scheduler did with background work, summed over the engines
    # (batching/step_share.py), cumulative; None without it.
    step_share: StepCounters | None = None
    # The prefix-warm order (batching/warm.py), cumulative and summed over the
    # models: releases made for warmth, the engine's prefix-cache lookups and hits
    # (prompt tokens), and the longest any request was passed over (seconds).
    warm_releases: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    passed_max: float = 0.0


@dataclass(frozen=True, slots=True)
class Sample:
    """One point of every series (rates are None on the first sample)."""

    t: float
    req_s: float | None
    prompt_tok_s: float | None
    gen_tok_s: float | None
    refusals_s: float | None
    queued: float
    backlog: float | None
    engine_running: float
    engine_waiting: float
    kv_pct: float | None
    gpu_free_mib: float | None
    host_available_mib: float | None
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    batch_mean: float | None
    batch_max: float | None
    steps_held_s: float | None  # engine steps a second beside a held backlog
    underfed_s: float | None  # of those, under-fed ones
    refusals_by_reason: Mapping[str, float]
    callers: Mapping[str, float]
    adapters: Mapping[str, float]  # req/s by LoRA adapter
    rank_queue: Mapping[str, float]  # "rank N running" / "rank N waiting"
    rank_kv_pct: Mapping[str, float]  # "rank N"
    held_pct: Mapping[str, float]  # share of the second the backlog held work, by rule
    # Data-parallel ranks: placements a second by "rank N why", and each rank's
    # prefix-cache hit rate over the second in percent ("rank N"; absent in a
    # second without lookups).
    rank_placed_s: Mapping[str, float] = field(default_factory=dict)
    rank_hit_pct: Mapping[str, float] = field(default_factory=dict)
    # Per model (with --models), by its name.
    model_running: Mapping[str, float] = field(default_factory=dict)
    model_queued: Mapping[str, float] = field(default_factory=dict)
    model_kv_pct: Mapping[str, float] = field(default_factory=dict)
    model_req_s: Mapping[str, float] = field(default_factory=dict)
    # Batch lines done a second, and their share of the tokens answered in the
    # second in percent (None in a second without any: the plot hides).
    batch_lines_s: float | None = None
    batch_share_pct: float | None = None
    batches_running: float | None = None  # None: none (the plot hides)
    # Engine seconds a second by caller: its share of the engine's time.
    caller_engine_s: Mapping[str, float] = field(default_factory=dict)
    # Interactive first (batching/step_share.py): background requests left out of a
    # step a second (held for interactive work, capped by the step budget), and the
    # mean engine step in the second with interactive work present and without
    # (None where the second had no such step, or without Sluice's scheduler).
    background_held_s: float | None = None
    background_capped_s: float | None = None
    step_present_ms: float | None = None
    step_absent_ms: float | None = None
    # The prefix-warm order: releases for warmth a second (None in a second without:
    # the plot hides), the engine's prefix-cache hits over the second in percent of
    # the prompt tokens looked up (None without lookups), and the longest pass yet.
    warm_s: float | None = None
    prefix_hit_pct: float | None = None
    passed_max_s: float | None = None


# The keyed columns that total what a caller's view may not show by name.
OTHER_CALLERS = "(other callers)"
OTHER_ADAPTERS = "(other adapters)"
OTHER_MODELS = "(other models)"


@dataclass(frozen=True, slots=True)
class View:
    """What one caller's key may see: its own name among the callers, the
    adapter columns it may use and the models it may use (None: all); the
    rest is summed into one column."""

    caller: str
    adapters: frozenset[str] | None = None
    models: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Mark:
    """A state change, placed on the time axis of every plot."""

    t: float
    state: str
    reason: str


# Sample fields sent as plain columns, and the keyed ones (a column per key).
_KEYED: tuple[str, ...] = (
    "refusals_by_reason",
    "callers",
    "adapters",
    "rank_queue",
    "rank_kv_pct",
    "held_pct",
    "rank_placed_s",
    "rank_hit_pct",
    "model_running",
    "model_queued",
    "model_kv_pct",
    "model_req_s",
    "caller_engine_s",
)
_MODEL_KEYED = ("model_running", "model_queued", "model_kv_pct", "model_req_s")
_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(Sample) if f.name not in ("t", *_KEYED))


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _rate(new: float, old: float, dt: float) -> float:
    return max(0.0, new - old) / dt


def _share(
    new: StepCounters | None, old: StepCounters | None, dt: float
) -> tuple[float | None, ...]:
    """Held and capped background requests a second, and the mean step (ms) with
    interactive work present and without, over the second (None where none)."""
    if new is None or old is None:
        return (None, None, None, None)

    def mean(seconds: float, steps: int) -> float | None:
        return 1000.0 * seconds / steps if steps > 0 else None

    return (  # none held or capped: None, so the plot hides while there is no background
        _rate(new.held, old.held, dt) or None,
        _rate(new.capped, old.capped, dt) or None,
        mean(new.seconds_present - old.seconds_present, new.steps_present - old.steps_present),
        mean(new.seconds_alone - old.seconds_alone, new.steps_alone - old.steps_alone),
    )


def _rates(new: Mapping[str, float], old: Mapping[str, float], dt: float) -> dict[str, float]:
    return {k: _rate(v, old.get(k, 0.0), dt) for k, v in new.items()}


def _rank_columns(ranks: Sequence[RankStats]) -> tuple[dict[str, float], dict[str, float]]:
    """Each rank's running and waiting, and its KV use in percent, by column key."""
    queue: dict[str, float] = {}
    kv: dict[str, float] = {}
    for i, r in enumerate(ranks):
        queue[f"rank {i} running"] = float(r.running)
        queue[f"rank {i} waiting"] = float(r.waiting)
        kv[f"rank {i}"] = 100.0 * r.kv_cache_usage
    return queue, kv


def _hit_pct(ranks: Sequence[RankStats], old: Sequence[RankStats]) -> dict[str, float]:
    """Each rank's prefix-cache hits over its lookups since the previous snapshot,
    in percent, by column key; a rank without lookups in between has none."""
    out: dict[str, float] = {}
    for i, r in enumerate(ranks):
        q0, h0 = (
            (old[i].prefix_cache_queries_total, old[i].prefix_cache_hits_total)
            if i < len(old)
            else (0, 0)
        )
        q = r.prefix_cache_queries_total - q0
        if q > 0:
            out[f"rank {i}"] = 100.0 * max(0, r.prefix_cache_hits_total - h0) / q
    return out


def _round(x: float | None) -> float | None:
    """About four significant digits (JSON has no NaN: it becomes null)."""
    if x is None or not math.isfinite(x):
        return None
    if x == 0:
        return 0.0
    return round(x, max(0, 3 - math.floor(math.log10(abs(x)))))


class StatusSampler:
    """The ring buffer. ``sample()`` takes one point; ``run()`` takes one every
    ``interval`` seconds until cancelled (an owned task in the app's task
    group); ``body()`` is /status.json.

    ``info`` is static (model, engine, version, watchdog thresholds); ``wall``
    and ``mono`` are injectable clocks for tests.
    """

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        info: Mapping[str, Any],
        *,
        interval: float = INTERVAL_S,
        window: float = WINDOW_S,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (interval > 0 and window >= interval):
            raise ValueError("need interval > 0 and window >= interval")
        self._snapshot = snapshot
        self._info = dict(info)
        self.interval = interval
        self._wall, self._mono = wall, mono
        self._started = wall()
        self._size = round(window / interval)
        # The window as columns (what the page plots), appended to per sample so
        # that the body is a plain dump: building it from 900 sample objects
        # took 26 ms on the test machine, a stall of the loop per refresh.
        self.columns: dict[str, deque[float | None]] = {
            name: deque(maxlen=self._size) for name in ("t", *_COLUMNS)
        }
        self.keyed: dict[str, dict[str, deque[float | None]]] = {m: {} for m in _KEYED}
        self._last_seen: dict[tuple[str, str], int] = {}
        self._count = 0
        self.marks: deque[Mark] = deque()
        self._prev: tuple[float, Snapshot] | None = None
        self._body: bytes | None = None
        self._views: dict[View, bytes] = {}  # callers' bodies of this sample
        self._failing = False
        # Cost of sample() on the calling thread, in seconds: last and mean.
        self.cost_last = 0.0
        self._cost_sum = 0.0
        self._cost_n = 0

    # -- sampling ----------------------------------------------------------

    def sample(self) -> Sample | None:
        """Take one sample now; None when the snapshot failed (logged once)."""
        start = time.perf_counter()
        try:
            snap = self._snapshot()
        except Exception:
            if not self._failing:
                log.exception("status: snapshot failed; the page skips that second")
            self._failing = True
            return None
        self._failing = False
        now_mono, now_wall = self._mono(), self._wall()
        s = self._make(snap, now_mono, now_wall)
        prev_state = self._prev[1].state if self._prev else None
        if snap.state != prev_state:
            self.marks.append(Mark(now_wall, snap.state, snap.reason))
        self._prev = (now_mono, snap)
        self._append(s)
        oldest = self.columns["t"][0] or 0.0
        while self.marks and self.marks[0].t < oldest:
            self.marks.popleft()
        self._body = None
        self._views.clear()
        self.cost_last = time.perf_counter() - start
        self._cost_sum += self.cost_last
        self._cost_n += 1
        return s

    def _make(self, snap: Snapshot, now: float, t: float) -> Sample:
        req = prompt = gen = refused = held_steps = underfed = lines = share = None
        by_reason: dict[str, float] = {}
        callers: dict[str, float] = {}
        adapters: dict[str, float] = {}
        held: dict[str, float] = {}
        model_req: dict[str, float] = {}
        placed: dict[str, float] = {}
        hit: dict[str, float] = {}
        engine_s: dict[str, float] = {}
        bg: tuple[float | None, ...] = (None, None, None, None)
        warm_s: float | None = None
        hit_pct: float | None = None
        if self._prev is not None and now > self._prev[0]:
            old, dt = self._prev[1], now - self._prev[0]
            req = _rate(snap.requests, old.requests, dt)
            prompt = _rate(snap.prompt_tokens, old.prompt_tokens, dt)
            gen = _rate(snap.generated_tokens, old.generated_tokens, dt)
            lines = _rate(snap.batch_lines, old.batch_lines, dt) or None
            bulk = _rate(snap.batch_tokens, old.batch_tokens, dt)
            share = 100.0 * bulk / (prompt + gen) if bulk and prompt + gen > 0 else None
            by_reason = _rates(snap.refusals, old.refusals, dt)
            refused = sum(by_reason.values())
            callers = _rates(snap.callers, old.callers, dt)
            engine_s = _rates(snap.caller_engine_seconds, old.caller_engine_seconds, dt)
            adapters = _rates(snap.adapters, old.adapters, dt)
            held_steps = _rate(snap.steps_held, old.steps_held, dt)
            underfed = _rate(snap.underfed_steps, old.underfed_steps, dt)
            # Only the rules that held work in this second: a series per rule shows up
            # when it first holds, and leaves a window after it last did.
            held = {
                k: 100.0 * v
                for k, v in _rates(snap.held_seconds, old.held_seconds, dt).items()
                if v
            }
            placed = {k: v for k, v in _rates(snap.placements, old.placements, dt).items() if v}
            warm_s = _rate(snap.warm_releases, old.warm_releases, dt) or None
            looked = snap.prefix_queries - old.prefix_queries
            if looked > 0:
                hit_pct = 100.0 * max(0.0, snap.prefix_hits - old.prefix_hits) / looked
            bg = _share(snap.step_share, old.step_share, dt)
            hit = _hit_pct(snap.ranks, old.ranks)
            model_req = _rates(
                {k: m.requests for k, m in snap.models.items()},
                {k: m.requests for k, m in old.models.items()},
                dt,
            )
        ttft = sorted(snap.ttft)
        sizes = snap.batch_sizes
        rank_queue, rank_kv = _rank_columns(snap.ranks)
        return Sample(
            t=t,
            req_s=req,
            prompt_tok_s=prompt,
            gen_tok_s=gen,
            refusals_s=refused,
            queued=snap.queued,
            backlog=snap.backlog,
            engine_running=snap.engine_running,
            engine_waiting=snap.engine_waiting,
            kv_pct=None if snap.kv_cache_usage is None else 100.0 * snap.kv_cache_usage,
            gpu_free_mib=None if snap.gpu_free_bytes is None else snap.gpu_free_bytes / _MIB,
            host_available_mib=(
                None if snap.host_available_bytes is None else snap.host_available_bytes / _MIB
            ),
            ttft_p50_ms=1000.0 * quantile(ttft, 0.50) if ttft else None,
            ttft_p95_ms=1000.0 * quantile(ttft, 0.95) if ttft else None,
            batch_mean=sum(sizes) / len(sizes) if sizes else None,
            batch_max=float(max(sizes)) if sizes else None,
            steps_held_s=held_steps,
            underfed_s=underfed,
            refusals_by_reason=by_reason,
            callers=callers,
            adapters=adapters,
            rank_queue=rank_queue,
            rank_kv_pct=rank_kv,
            held_pct=held,
            rank_placed_s=placed,
            rank_hit_pct=hit,
            model_running={k: m.running for k, m in snap.models.items()},
            model_queued={k: m.queued for k, m in snap.models.items()},
            model_kv_pct={
                k: 100.0 * m.kv_cache_usage
                for k, m in snap.models.items()
                if m.kv_cache_usage is not None
            },
            model_req_s=model_req,
            batch_lines_s=lines,
            batch_share_pct=share,
            batches_running=snap.batches_running or None,
            caller_engine_s=engine_s,
            background_held_s=bg[0],
            background_capped_s=bg[1],
            step_present_ms=bg[2],
            step_absent_ms=bg[3],
            warm_s=warm_s,
            prefix_hit_pct=hit_pct,
            passed_max_s=snap.passed_max or None,
        )

    def _append(self, s: Sample) -> None:
        self._count += 1
        t = self.columns["t"]
        t.append(round(s.t, 3))
        for name in _COLUMNS:
            self.columns[name].append(_round(getattr(s, name)))
        for name in _KEYED:
            current: Mapping[str, float] = getattr(s, name)
            cols = self.keyed[name]
            for key in current:
                if key not in cols:  # new: no value before now
                    cols[key] = deque([None] * (len(t) - 1), maxlen=self._size)
                self._last_seen[name, key] = self._count
            for key in list(cols):
                if self._count - self._last_seen[name, key] >= self._size:
                    del cols[key], self._last_seen[name, key]  # gone for a whole window
                else:
                    cols[key].append(_round(current.get(key)))

    async def run(self) -> None:
        """Sample on a fixed grid until cancelled; late ticks are skipped."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            self.sample()
            next_at += self.interval
            now = loop.time()
            if next_at < now:
                next_at = now + self.interval - (now - next_at) % self.interval
            await asyncio.sleep(next_at - now)

    # -- /status.json ------------------------------------------------------

    def body(self, view: View | None = None) -> bytes:
        """The JSON document the page reads (`view`: as one caller may see it;
        None: whole), cached until the next sample."""
        if view is not None:
            body = self._views.get(view)
            if body is None:
                body = self._views[view] = orjson.dumps(self._document(view))
            return body
        if self._body is None:
            self._body = orjson.dumps(self._document())
        return self._body

    def _document(self, view: View | None = None) -> dict[str, Any]:
        last = self._prev[1] if self._prev else None
        t = self.columns["t"]
        now = t[-1] if t and t[-1] is not None else self._wall()
        series: dict[str, Any] = {name: list(col) for name, col in self.columns.items()}
        for name, cols in self.keyed.items():
            series[name] = {key: list(col) for key, col in sorted(cols.items())}
        if view is not None:
            for name in ("callers", "caller_engine_s"):
                series[name] = _only(series[name], {view.caller}.__contains__, OTHER_CALLERS)
            if view.adapters is not None:
                series["adapters"] = _only(
                    series["adapters"], view.adapters.__contains__, OTHER_ADAPTERS
                )
            if view.models is not None:
                for name in _MODEL_KEYED:
                    series[name] = _only(series[name], view.models.__contains__, OTHER_MODELS)
        models = last.models if last else {}
        if view is not None and view.models is not None:
            models = {k: m for k, m in models.items() if k in view.models}
        return {
            "info": self._info,
            "started": round(self._started, 3),
            "now": now,
            "uptime_s": round(now - self._started, 1),
            "state": last.state if last else "starting",
            "reason": last.reason if last else "",
            "interval_s": self.interval,
            "window_s": self._size * self.interval,
            "series": series,
            "marks": [
                {"t": round(m.t, 3), "state": m.state, "reason": m.reason} for m in self.marks
            ],
            "models": [_model_row(name, m) for name, m in models.items()],
            "usage": _usage_rows(last.usage if last else {}, view),
            "cost_us": {
                "last": round(self.cost_last * 1e6, 1),
                "mean": round(self._cost_sum / self._cost_n * 1e6, 1) if self._cost_n else 0.0,
            },
        }


def _model_row(name: str, m: ModelRow) -> dict[str, Any]:
    """One model's line of the page's table."""
    return {
        "name": name,
        "state": m.state,
        "kind": m.kind,
        "load": m.load,
        "loads": m.loads,
        "failures": m.failures,
        "unloads": m.unloads,
        "load_s": None if m.load_seconds is None else round(m.load_seconds, 1),
        "loaded_at": None if m.loaded_at is None else round(m.loaded_at, 3),
        "error": m.error,
        "held": m.held,
        "deaths": m.deaths,
        "died_at": None if m.last_death is None else round(m.last_death[0], 3),
        "death": None if m.last_death is None else m.last_death[1],
        "back_in_s": None if m.back_in_s is None else round(m.back_in_s, 1),
    }


def _usage_rows(usage: Mapping[str, CallerUsage], view: View | None) -> list[dict[str, Any]]:
    """The usage table: a line per caller (a caller's view: its own, and the
    others summed into one line), the last hour's and the last day's requests,
    tokens and engine seconds."""
    rows: dict[str, list[float]] = {}
    for caller, u in sorted(usage.items()):
        name = caller if view is None or caller == view.caller else OTHER_CALLERS
        values = [
            u.hour_requests,
            u.hour_tokens,
            u.hour_engine_seconds,
            u.day_requests,
            u.day_tokens,
            u.day_engine_seconds,
        ]
        row = rows.setdefault(name, [0.0] * len(values))
        for i, v in enumerate(values):
            row[i] += v
    return [
        {
            "caller": name,
            "hour_requests": int(r[0]),
            "hour_tokens": int(r[1]),
            "hour_engine_s": _round(r[2]),
            "day_requests": int(r[3]),
            "day_tokens": int(r[4]),
            "day_engine_s": _round(r[5]),
        }
        for name, r in rows.items()
    ]


def _only(
    columns: dict[str, list[float | None]], shown: Callable[[str], bool], rest: str
) -> dict[str, list[float | None]]:
    """The columns whose key is shown, and the others summed into one column
    (`rest`; absent when there are none). A point is None where every summed
    column is None (no value then), else the sum of those that have one."""
    out = {k: v for k, v in columns.items() if shown(k)}
    hidden = [v for k, v in columns.items() if not shown(k)]
    if hidden:
        out[rest] = [
            None if all(x is None for x in point) else _round(sum(x or 0.0 for x in point))
            for point in zip(*hidden, strict=True)
        ]
    return out
