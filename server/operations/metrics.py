"""Prometheus metrics for /metrics, in a registry of Sluice's own.

Counters and histograms are updated where things happen (handlers, the
driver's core events). Gauges that mirror live state (queue depth, engine
running/waiting, KV-cache use) are read at scrape time by a collector, so
they are never stale and cost nothing between scrapes; so are the per-caller
token and service totals, which the core keeps anyway (batching.CallerStats).

Per LoRA adapter (label `adapter` of `sluice_requests_total`, bounded: only
configured adapter names): requests by endpoint and status.

Fields the APIs accepted and ignored (server/wire/ignored.py), by API and
field (label `field`, bounded: only names that module lists, else `other`).

Per caller (label `caller`: only configured names, server/callers.py
`CallerDirectory.label`; without keys every `user`-named caller is one label,
`user`, since the name is the client's own string): requests by status (429
included), queue wait, queued / backlogged / in-flight work, prompt and
generated tokens, service (prompt + 2 x generated, the fair-share unit),
engine seconds (`sluice_caller_engine_seconds_total`, no `model` label: the
usage ledger's running totals, server/operations/usage.py) and
the fair-share counter itself (of a label that stands for several callers:
the least of theirs, the one served next). Share of service per caller, in PromQL:

    sum by (caller) (rate(sluice_caller_service_total[5m]))
      / ignoring(caller) group_left sum(rate(sluice_caller_service_total[5m]))

Per model (with --models; label `model`, bounded: only the models file's
names, never a request's string): every series above that belongs to one
model's engine or core (requests, latencies, tokens, queue, engine, callers;
a refusal before its model is known has `model=""`), and the models' own:
state (`sluice_model_state{model,state}` is 1 for the state it is in),
loads, failed loads, unloads, the last load's seconds and the requests that
hold the model (waiting for its load included). With --model there is no
`model` label: the series are as before the models file existed.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batching import CallerStats, DedupeHit, Ended, Outcome, Refusal, Released, WarmCounters
from batching.pressure import RankStats
from batching.step_share import StepCounters
from server.operations.ignored_log import IgnoredFields

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The *_created series double the scrape size and nobody here reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Latency buckets from 1 ms to 60 s: TTFT on a loaded CPU test bed reaches
# seconds, on a GPU tens of milliseconds.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_WAIT = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5, 30)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# The status page's sampler drains the recent observations once a second; the
# bound only matters when no sampler runs (a benchmark's app, a unit test).
_RECENT = 4096


# Live values, per model: its `model` label (None: no label, with --model) and
# its values by name (server/app.py `_live`).
LiveRows = Sequence[tuple[str | None, dict[str, Any]]]


class _LiveCollector(Collector):
    """Gauges read from live objects at scrape time; with several models, each
    family holds one sample per model, labelled."""

    def __init__(
        self, read: Callable[[], LiveRows | Mapping[str, Any]], label: Callable[[str], str]
    ) -> None:
        self._read = read
        self._label = label

    def collect(self) -> Iterable[Metric]:
        rows = self._read()
        if isinstance(rows, Mapping):  # one model's values, unlabelled
            yield from self._families(rows)
            return
        if not rows:
            return
        if len(rows) == 1 and rows[0][0] is None:
            yield from self._families(rows[0][1])
            return
        merged: dict[str, Metric] = {}
        for model, values in rows:
            for fam in self._families(values, ready=False):
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                for sample in fam.samples:
                    out.samples.append(
                        sample._replace(labels={**sample.labels, "model": model or ""})
                    )
        yield from merged.values()
        yield GaugeMetricFamily(
            "sluice_ready", "1 when /ready answers 200", value=rows[0][1]["ready"]
        )
        yield from _model_families([v["entry"] for _, v in rows if "entry" in v])

    def _families(self, v: Mapping[str, Any], *, ready: bool = True) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "sluice_queue_requests", "Requests waiting in Sluice's queue", value=v["queue_requests"]
        )
        yield GaugeMetricFamily(
            "sluice_queue_tokens",
            "Tokens (prompt + max new) of requests waiting in Sluice's queue",
            value=v["queue_tokens"],
        )
        yield GaugeMetricFamily(
            "sluice_pending_requests",
            "Requests admitted and not finished (queued + in the engine)",
            value=v["pending_requests"],
        )
        yield GaugeMetricFamily(
            "sluice_engine_requests_running",
            "Requests running in the engine",
            value=v["engine_running"],
        )
        yield GaugeMetricFamily(
            "sluice_engine_requests_waiting",
            "Requests waiting in the engine's scheduler",
            value=v["engine_waiting"],
        )
        yield GaugeMetricFamily(
            "sluice_engine_kv_cache_usage", "Engine KV-cache use, 0..1", value=v["kv_cache_usage"]
        )
        yield CounterMetricFamily(
            "sluice_engine_preemptions",
            "Requests preempted by the engine",
            value=v["preemptions"],
        )
        yield CounterMetricFamily(
            "sluice_engine_adapter_wait_steps",
            "Engine steps in which a LoRA adapter had waiting requests and none running "
            "(vLLM's per-step waiting_lora_adapters / running_lora_adapters): its work "
            "waited for an adapter slot or load. Counted once per step (per DP rank)",
            value=v.get("adapter_wait_steps", 0),
        )
        yield CounterMetricFamily(
            "sluice_engine_steps",
            "Engine steps whose scheduler stats reached Sluice (once per step per DP rank)",
            value=v.get("engine_steps", 0),
        )
        tokens = CounterMetricFamily(
            "sluice_engine_step_tokens",
            "Tokens the engine's steps scheduled, by kind: prefill (prompt tokens, whole "
            "prompts and chunks) and decode (vLLM's iteration details)",
            labels=["kind"],
        )
        tokens.add_metric(["prefill"], v.get("prefill_tokens", 0))
        tokens.add_metric(["decode"], v.get("decode_tokens", 0))
        yield tokens
        yield CounterMetricFamily(
            "sluice_engine_step_seconds",
            "Seconds the engine's steps ran, from the scheduled batch to its output (vLLM's "
            "iteration details, summed over DP ranks); its rate against 1 is the share of "
            "time the engine spent in steps rather than between them",
            value=v.get("step_seconds", 0.0),
        )
        yield from _step_share(v.get("step_share"))
        room = v.get("room")
        yield CounterMetricFamily(
            "sluice_engine_steps_held",
            "Engine steps that ran while Sluice's backlog held work (the under-fed "
            "share's denominator)",
            value=room.steps_held if room is not None else 0,
        )
        yield CounterMetricFamily(
            "sluice_engine_underfed_steps",
            "Engine steps that left token budget and a running slot unused while "
            "Sluice's backlog held work that would have fit (batching/room.py, underfed); "
            "judged per DP rank",
            value=room.underfed_steps if room is not None else 0,
        )
        yield CounterMetricFamily(
            "sluice_engine_underfed_policy_steps",
            "Of the under-fed steps, those beside work that Sluice's policy for a short "
            "turn's room held (the short-prompt KV reserve, one long prefill beside "
            "another caller's work; batching/room.py rules 4-5): that policy's cost",
            value=room.underfed_policy_steps if room is not None else 0,
        )
        held = CounterMetricFamily(
            "sluice_backlog_held_seconds",
            "Time Sluice's backlog held work, by the rule that held it (batching/room.py)",
            labels=["rule"],
        )
        for rule, seconds in room.held_seconds if room is not None else ():
            held.add_metric([rule], seconds)
        yield held
        yield CounterMetricFamily(
            "sluice_engine_prefix_cache_queries",
            "Prompt tokens looked up in the engine's prefix cache",
            value=v["prefix_queries"],
        )
        yield CounterMetricFamily(
            "sluice_engine_prefix_cache_hits",
            "Prompt tokens found in the engine's prefix cache",
            value=v["prefix_hits"],
        )
        if ready:
            yield GaugeMetricFamily("sluice_ready", "1 when /ready answers 200", value=v["ready"])
        yield GaugeMetricFamily(
            "sluice_backlog_generations",
            "Eligible generations Sluice holds until the engine has room",
            value=v["backlog"],
        )
        yield GaugeMetricFamily(
            "sluice_engine_unstarted",
            "Generations released to the engine without a first output yet",
            value=v["unstarted"],
        )
        yield from _caller_families(v.get("callers") or (), self._label)
        yield from _rank_families(v.get("ranks") or ())
        yield from _placement_families(v.get("placements") or ())
        yield from _warm_families(v.get("warm"))


# The model states sluice_model_state spells out (server/engines/registry.py State).
_STATES = (
    "unloaded",
    "waiting",
    "loading",
    "loaded",
    "unloading",
    "sleeping",
    "failed",
    "restarting",
)


def _model_families(entries: Sequence[Any]) -> Iterable[Metric]:
    """The models' own series (with --models): state, loads, unloads, holds."""
    state = GaugeMetricFamily(
        "sluice_model_state",
        "1 for the state the model is in (unloaded, waiting, loading, loaded, unloading, "
        "sleeping, failed, restarting), 0 for the others",
        labels=["model", "state"],
    )
    loads = CounterMetricFamily(
        "sluice_model_loads", "Engine loads that succeeded", labels=["model"]
    )
    failures = CounterMetricFamily(
        "sluice_model_load_failures", "Engine loads that failed", labels=["model"]
    )
    unloads = CounterMetricFamily(
        "sluice_model_unloads", "Unloads (idle, or to make room; sleeps included)", labels=["model"]
    )
    seconds = GaugeMetricFamily(
        "sluice_model_load_seconds", "How long the last load took", labels=["model"]
    )
    held = GaugeMetricFamily(
        "sluice_model_requests_held",
        "Requests holding the model (waiting for its load included): it is not unloaded",
        labels=["model"],
    )
    for e in entries:
        for name in _STATES:
            state.add_metric([e.name, name], 1.0 if e.state.value == name else 0.0)
        loads.add_metric([e.name], float(e.loads))
        failures.add_metric([e.name], float(e.failures))
        unloads.add_metric([e.name], float(e.unloads))
        if e.load_seconds is not None:
            seconds.add_metric([e.name], float(e.load_seconds))
        held.add_metric([e.name], float(e.leases))
    yield from (state, loads, failures, unloads, seconds, held)


def _rank_families(ranks: Sequence[RankStats]) -> Iterable[Metric]:
    """Per data-parallel rank: running, waiting, KV use (none with one rank)."""
    if not ranks:
        return
    families = (
        ("sluice_engine_rank_requests_running", "Requests running on one DP rank", "running"),
        ("sluice_engine_rank_requests_waiting", "Requests waiting on one DP rank", "waiting"),
        ("sluice_engine_rank_kv_cache_usage", "One DP rank's KV-cache use, 0..1", "kv_cache_usage"),
    )
    for name, doc, attr in families:
        g = GaugeMetricFamily(name, doc, labels=["rank"])
        for i, r in enumerate(ranks):
            g.add_metric([str(i)], float(getattr(r, attr)))
        yield g
    counters = (
        (
            "sluice_engine_rank_prefix_cache_queries",
            "Prompt tokens looked up in one DP rank's prefix cache",
            "prefix_cache_queries_total",
        ),
        (
            "sluice_engine_rank_prefix_cache_hits",
            "Prompt tokens found in one DP rank's prefix cache",
            "prefix_cache_hits_total",
        ),
    )
    for name, doc, attr in counters:
        c = CounterMetricFamily(name, doc, labels=["rank"])
        for i, r in enumerate(ranks):
            c.add_metric([str(i)], float(getattr(r, attr)))
        yield c


def _placement_families(placements: Sequence[tuple[str, int, int]]) -> Iterable[Metric]:
    """Releases placed on each DP rank, by why (batching/prefix.py Placed): none
    with one rank."""
    if not placements:
        return
    c = CounterMetricFamily(
        "sluice_engine_rank_placements",
        "Generations released to one DP rank, by why: prefix (it followed its prompt's "
        "leading blocks, batching/prefix.py P2), load (no known prefix, or "
        "--no-prefix-placement: placed by room, P1), bound (its prefix's rank was too "
        "busy, P3)",
        labels=["rank", "why"],
    )
    for why, rank, n in placements:
        c.add_metric([str(rank), why], float(n))
    yield c


def _warm_families(w: object) -> Iterable[Metric]:
    """The prefix-warm release order (batching/warm.py): what it did and its bound
    (zeros where the core reported none)."""
    if not isinstance(w, WarmCounters):
        w = WarmCounters()
    yield CounterMetricFamily(
        "sluice_prefix_order_releases",
        "Generations released before others the order put first, because the engine "
        "was believed to hold their prompt's leading blocks (batching/warm.py W3)",
        value=w.releases,
    )
    yield CounterMetricFamily(
        "sluice_prefix_order_saved_tokens",
        "Prompt tokens the engine's prefix cache held of the generations released for "
        "warmth: the prefill they did not compute (the engine's own count)",
        value=w.saved,
    )
    yield GaugeMetricFamily(
        "sluice_prefix_order_passed_max_seconds",
        "The longest any request waited from the first time a warmer one passed it to "
        "its own release (bounded by --short-first-max-delay's rule: only work that "
        "arrived within it passes)",
        value=w.passed_max,
    )
    record = CounterMetricFamily(
        "sluice_prefix_order_record_tokens",
        "The warm order's record of cached blocks against the engine: prompt tokens "
        "it predicted cached at release (predicted), those the engine reported cached "
        "(cached), and those predicted and not cached (overbelief)",
        labels=["kind"],
    )
    record.add_metric(["predicted"], float(w.predicted))
    record.add_metric(["cached"], float(w.cached))
    record.add_metric(["overbelief"], float(w.overbelief))
    yield record


def _caller_families(
    callers: Iterable[CallerStats], label: Callable[[str], str] = str
) -> Iterable[Metric]:
    """Per-caller series from the core's snapshot (read at scrape time), by
    metric label: the callers one label stands for are summed (the counter:
    their least)."""
    gauges = {
        "queued": ("sluice_caller_queued", "Requests waiting in Sluice (window and backlog)"),
        "backlog": ("sluice_caller_backlog", "Generations held in the backlog"),
        "in_flight": ("sluice_caller_in_flight", "Generations released and not finished"),
        "counter": ("sluice_caller_fair_share_counter", "Fair-share (virtual token) counter"),
    }
    counters = {
        "prompt_tokens": ("sluice_caller_prompt_tokens", "Prompt tokens released to the engine"),
        "generated_tokens": ("sluice_caller_generated_tokens", "Tokens generated"),
        "service": ("sluice_caller_service", "Service received: prompt + 2 x generated tokens"),
    }
    rows: dict[str, dict[str, float]] = {}
    for c in callers:
        row = rows.setdefault(label(c.name), {})
        for attr in (*gauges, *counters):
            v = float(getattr(c, attr))
            old = row.get(attr)
            row[attr] = v if old is None else min(old, v) if attr == "counter" else old + v
    families: list[tuple[str, GaugeMetricFamily | CounterMetricFamily]] = [
        (attr, GaugeMetricFamily(name, doc, labels=["caller"]))
        for attr, (name, doc) in gauges.items()
    ]
    families += [
        (attr, CounterMetricFamily(name, doc, labels=["caller"]))
        for attr, (name, doc) in counters.items()
    ]
    for name, row in rows.items():
        for attr, fam in families:
            fam.add_metric([name], row[attr])
    for _, fam in families:
        yield fam


class _UsageCollector(Collector):
    """`sluice_caller_engine_seconds_total` read at scrape time from the usage
    ledger's running totals (server/operations/usage.py): nothing per request."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        fam = CounterMetricFamily(
            "sluice_caller_engine_seconds",
            "Engine step time attributed to each caller's requests, in seconds "
            "(its share of each step it was in)",
            labels=["caller"],
        )
        by_label: dict[str, float] = {}
        for caller, seconds in self._metrics.usage_totals().items():
            label = self._metrics.caller_label(caller)
            by_label[label] = by_label.get(label, 0.0) + seconds
        for label, seconds in sorted(by_label.items()):
            fam.add_metric([label], seconds)
        yield fam


class Metrics:
    """Sluice's metrics; one instance per app. `caller_label` turns a caller's
    name into its `caller` label (server/callers.py `CallerDirectory.label`);
    `models`: the served models' names with --models, whose series then carry
    a `model` label (None: no such label)."""

    def __init__(
        self, caller_label: Callable[[str], str] = str, models: Sequence[str] | None = None
    ) -> None:
        self.caller_label = caller_label
        self.per_model = models is not None
        m = ["model"] if self.per_model else []
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # `adapter`: the LoRA adapter a generation ran on, empty for the base
        # weights (and for a request refused before its model was resolved).
        # Bounded: only configured names reach it (server/engines/lora.py), never a
        # request's own `model` string.
        self.requests = Counter(
            "sluice_requests",
            "HTTP generation requests by endpoint, status and LoRA adapter",
            ["endpoint", "status", "adapter", *m],
            registry=r,
        )
        self.rejections = Counter(
            "sluice_rejections", "Requests refused, by reason", ["reason", *m], registry=r
        )
        self.dedupe_hits = Counter(
            "sluice_dedupe_hits", "Requests that joined an identical generation", m, registry=r
        )
        self.batches = Counter(
            "sluice_batches",
            "Batches released to the engine, by reason",
            ["reason", *m],
            registry=r,
        )
        self.ended = Counter(
            "sluice_queue_outcomes",
            "How queued requests left the queue",
            ["outcome", *m],
            registry=r,
        )
        self.batch_size = Histogram(
            "sluice_batch_size", "Generations per released batch", m, buckets=_SIZES, registry=r
        )
        self.queue_wait = Histogram(
            "sluice_queue_wait_seconds",
            "Time from admission to release to the engine, by caller",
            ["caller", *m],
            buckets=_WAIT,
            registry=r,
        )
        self.caller_requests = Counter(
            "sluice_caller_requests",
            "HTTP generation requests by caller and status (429: over its own limit)",
            ["caller", "status", *m],
            registry=r,
        )
        self.class_requests = Counter(
            "sluice_class_requests",
            "HTTP requests by class (interactive or background: batch lines, "
            "service_tier flex, background callers) and status",
            ["class", "status", *m],
            registry=r,
        )
        self.ttft = Histogram(
            "sluice_time_to_first_token_seconds",
            "Time from arrival to the first token",
            m,
            buckets=_LATENCY,
            registry=r,
        )
        self.duration = Histogram(
            "sluice_request_duration_seconds",
            "Time from arrival to the last byte",
            m,
            buckets=_LATENCY,
            registry=r,
        )
        self.generated_tokens = Counter(
            "sluice_generated_tokens", "Completion tokens sent to callers", m, registry=r
        )
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens", "Prompt tokens of answered requests", m, registry=r
        )
        # A dead engine and its restarts (server/engines/supervisor.py).
        # The Batch API (server/api/openai_batches/runner.py): lines done, and batches by the
        # state they entered (in_progress, completed, failed, expired, cancelled...).
        self.batch_lines = Counter(
            "sluice_batch_lines", "Batch lines done (any status)", registry=r
        )
        self.batch_tokens = Counter(
            "sluice_batch_tokens",
            "Prompt and generated tokens of batch lines (their share of the engine's "
            "work: against sluice_prompt_tokens + sluice_generated_tokens)",
            registry=r,
        )
        self.batch_states = Counter(
            "sluice_batch_states",
            "Batches entering a state, by state",
            ["state"],
            registry=r,
        )
        self.engine_deaths = Counter(
            "sluice_engine_deaths",
            "Engine deaths, by cause: the signal that ended its core (SIGKILL, ...), "
            "exit_N (its exit code), health_check (no answer: hung)",
            ["cause", *m],
            registry=r,
        )
        self.engine_restarts = Counter(
            "sluice_engine_restarts",
            "Restarts of a dead engine, by outcome: ok, failed (its start failed), "
            "budget_spent (not tried: --engine-restarts per window used up)",
            ["outcome", *m],
            registry=r,
        )
        self.ignored = IgnoredFields(
            Counter(
                "sluice_ignored_fields",
                "Request fields, blocks and tool types accepted and ignored, by API and "
                "field (a name Sluice lists, else other)",
                ["api", "field"],
                registry=r,
            )
        )
        # TTFTs and released batch sizes since the status sampler last looked:
        # it takes exact p50/p95 per second from them (server/operations/status_samples.py).
        self.recent_ttft: deque[float] = deque(maxlen=_RECENT)
        self.recent_batch_sizes: deque[int] = deque(maxlen=_RECENT)
        # Each caller's engine seconds since start (the app points it at the
        # usage ledger's running totals: server/operations/usage.py).
        self.usage_totals: Callable[[], Mapping[str, float]] = dict
        r.register(_UsageCollector(self))

    def model(self, name: str | None) -> tuple[str, ...]:
        """The `model` label's value for a series' labels: (name,) with --models
        ("" when the model is not known), () with --model."""
        return (name or "",) if self.per_model else ()

    def of(self, metric: Any, model: str | None) -> Any:
        """A metric whose only label (with --models) is `model`: its child for
        `model`, or the metric itself without labels."""
        return metric.labels(model or "") if self.per_model else metric

    def batch_event(self, kind: str, n: int) -> None:
        """The Batch API's runner (server/api/openai_batches/runner.py): a line done ("line"),
        or a batch entering a state ("batch:<state>")."""
        if kind == "line":
            self.batch_lines.inc(n)
        else:
            self.batch_states.labels(kind.removeprefix("batch:")).inc(n)

    def engine_event(self, kind: str, model: str, label: str) -> None:
        """A death ("death", its cause) or a restart ("restart", its outcome)."""
        metric = self.engine_deaths if kind == "death" else self.engine_restarts
        metric.labels(label, *self.model(model)).inc()

    def reject(self, reason: str, model: str | None = None) -> None:
        self.rejections.labels(reason, *self.model(model)).inc()

    def observe_ttft(self, seconds: float, model: str | None = None) -> None:
        self.of(self.ttft, model).observe(seconds)
        self.recent_ttft.append(seconds)

    def drain_recent(self) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """The TTFTs and batch sizes observed since the last call."""
        ttft, sizes = tuple(self.recent_ttft), tuple(self.recent_batch_sizes)
        self.recent_ttft.clear()
        self.recent_batch_sizes.clear()
        return ttft, sizes

    def core_events(self, model: str | None = None) -> Callable[[Iterable[Any]], None]:
        """The driver's event hook of one model's core."""
        return functools.partial(self.on_core_events, model=model)

    def on_core_events(self, events: Iterable[Any], model: str | None = None) -> None:
        """Turn the batching core's event records into metrics."""
        m = self.model(model)
        for e in events:
            if isinstance(e, Released):
                self.batches.labels(e.reason.value, *m).inc()
                self.of(self.batch_size, model).observe(e.size)
                self.recent_batch_sizes.append(e.size)
            elif isinstance(e, Ended):
                self.ended.labels(e.outcome.name.lower(), *m).inc()
                if e.outcome is Outcome.DISPATCHED:
                    self.queue_wait.labels(self.caller_label(e.caller), *m).observe(e.queue_wait)
            elif isinstance(e, Refusal):
                self.rejections.labels(e.reason.value, *m).inc()
            elif isinstance(e, DedupeHit):
                self.of(self.dedupe_hits, model).inc()

    def watch(self, read: Callable[[], LiveRows | Mapping[str, Any]]) -> None:
        """Register the live gauges (read at scrape time): one model's values,
        or per model its label and values (server/app.py `_live`)."""
        self.registry.register(_LiveCollector(read, self.caller_label))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _step_share(c: StepCounters | None) -> Iterable[Metric]:
    """What Sluice's scheduler did with background work (batching/step_share.py); zeros
    without it (--no-interactive-first)."""
    if c is None:
        c = StepCounters()
    yield CounterMetricFamily(
        "sluice_background_held",
        "Background requests left out of an engine step because interactive work waited "
        "or prefilled, in this engine or another (request-steps; batching/step_share.py rule 2)",
        value=c.held,
    )
    yield CounterMetricFamily(
        "sluice_background_capped",
        "Background requests left out of an engine step by the step budget while "
        "interactive work ran (request-steps; batching/step_share.py rule 4)",
        value=c.capped,
    )
    yield CounterMetricFamily(
        "sluice_background_preempted",
        "Background requests preempted for an interactive request's seat; they resume "
        "with a prefix-cache hit (batching/step_share.py rule 3)",
        value=c.preempted,
    )
    yield CounterMetricFamily(
        "sluice_background_floor_steps",
        "Engine steps that ran held background work because it had sat out the floor's "
        "limit of steps in a row (batching/step_share.py rule 5)",
        value=c.floor_steps,
    )
    for name, help_text, present, absent in (
        (
            "sluice_engine_class_steps",
            "Engine steps by whether interactive work was present (waiting, running, or "
            "within a second of its last request)",
            c.steps_present,
            c.steps_alone,
        ),
        (
            "sluice_engine_class_step_seconds",
            "Seconds of engine steps by whether interactive work was present; divided by "
            "sluice_engine_class_steps_total, the mean step an interactive turn shares",
            c.seconds_present,
            c.seconds_alone,
        ),
    ):
        family = CounterMetricFamily(name, help_text, labels=["interactive"])
        family.add_metric(["present"], present)
        family.add_metric(["absent"], absent)
        yield family
