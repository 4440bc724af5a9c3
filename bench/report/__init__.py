"""The pure half of the benchmark: parse the client's results, aggregate, render.

Why it exists: everything here is deterministic data handling (no processes, no
sockets, no vLLM import), so it is unit-tested (tests/unit/test_bench_report.py)
and can re-render a report from saved records (`python -m bench --report-only`).

A *record* is one measurement: one system (sluice, vllm or raw) at one scenario
point in one repetition, with a flat dict of metrics. Points are repeated; the
report gives the median and the spread (min-max) of each metric, and the ratio of
medians Sluice/vLLM and Sluice/raw.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLUICE = "sluice"
VLLM = "vllm"
RAW = "raw"
# Issue 27: Sluice with --no-hold-backlog, every eligible request straight to vLLM's
# queue (`--systems sluice,vllm,nohold`): what holding the backlog costs.
NOHOLD = "nohold"
SYSTEMS: tuple[str, ...] = (SLUICE, VLLM, RAW, NOHOLD)
# The systems that are Sluice, held backlog or not: its flags, /ready, its counters.
SLUICE_SYSTEMS: tuple[str, ...] = (SLUICE, NOHOLD)
SYSTEM_TITLES: dict[str, str] = {
    SLUICE: "Sluice",
    VLLM: "vLLM server",
    RAW: "raw engine",
    NOHOLD: "Sluice, no held backlog",
}

# Metrics taken from the client's --save-result JSON (vllm bench serve), renamed
# to the short keys used in the tables. Percentile keys exist because the client
# is run with --metric-percentiles 50,95,99 and --percentile-metrics ttft,tpot,itl,e2el.
CLIENT_METRICS: dict[str, str] = {
    "req_s": "request_throughput",
    "out_tok_s": "output_throughput",
    "ttft_p50": "p50_ttft_ms",
    "ttft_p95": "p95_ttft_ms",
    "ttft_p99": "p99_ttft_ms",
    "tpot_p50": "p50_tpot_ms",
    "itl_p99": "p99_itl_ms",
    "e2el_p99": "p99_e2el_ms",
    "duration_s": "duration",
    "completed": "completed",
    "failed": "failed",
    "input_tokens": "total_input_tokens",
    "output_tokens": "total_output_tokens",
}

# Display names and whether bigger is better (for the reader; ratios are plain).
METRIC_TITLES: dict[str, str] = {
    "req_s": "req/s",
    "out_tok_s": "output tok/s",
    "ttft_p50": "TTFT p50 (ms)",
    "ttft_p95": "TTFT p95 (ms)",
    "ttft_p99": "TTFT p99 (ms)",
    "tpot_p50": "TPOT p50 (ms)",
    "itl_p99": "ITL p99 (ms)",
    "e2el_p99": "E2E latency p99 (ms)",
    "failed": "failed requests",
    "front_cpu_ms": "front CPU per request (ms)",
    "running_peak": "engine running (peak)",
    "running_p50": "engine running (median)",
    "running_mean": "engine running (mean)",
    "engine_steps": "engine steps (Sluice)",
    "step_ms": "engine time per step (ms, Sluice)",
    "in_steps": "engine time in steps per second of the point (Sluice, summed over ranks)",
    "held_steps": "engine steps beside a held backlog (Sluice)",
    "underfed_steps": "of those, under-fed (Sluice)",
    "underfed_share": "under-fed share of those steps (Sluice)",
    "underfed_policy_steps": (
        "of the under-fed, beside work the reserve or the long-prefill bound held (Sluice)"
    ),
    "underfed_rest_share": "under-fed share beside work the other rules held (Sluice)",
    "prefill_tokens": "prefill tokens computed",
    "prefix_queries": "prompt tokens looked up",
    "prefix_hits": "prefix-cache hit tokens",
    "short_ttft_p50": "short TTFT p50 (ms)",
    "short_ttft_p95": "short TTFT p95 (ms)",
    "short_ttft_p99": "short TTFT p99 (ms)",
    "medium_ttft_p95": "medium TTFT p95 (ms)",
    "long_ttft_p95": "long TTFT p95 (ms)",
    "short_failed": "short failed",
    "chat_ttft_p50": "chat TTFT p50 (ms)",
    "chat_ttft_p95": "chat TTFT p95 (ms)",
    "chat_ttft_p99": "chat TTFT p99 (ms)",
    "chat_completed": "chat completed",
    "chat_failed": "chat failed (refused)",
    "chat_beside_flood": "chat requests sent while the flood ran (share)",
    "flood_span_completed": "flood completed during the chat span",
    "flood_span_req_s": "flood req/s during the chat span",
    "flood_span_tok_s": "flood output tok/s during the chat span",
    "flood_completed": "flood completed (all)",
    "flood_failed": "flood failed (refused)",
    "flood_req_s": "flood req/s (its whole run)",
    "medium_failed": "medium failed",
    "long_failed": "long failed",
    "ttft_max": "TTFT max (ms)",
    "completed": "completed",
    "short_third_ttft_p95": "shortest third's TTFT p95 (ms)",
    "long_third_ttft_p99": "longest third's TTFT p99 (ms)",
    "bulk_span_completed": "bulk completed during the chat span",
    "bulk_span_req_s": "bulk req/s during the chat span",
    "bulk_a_span_completed": "bulk_a (weight 1) completed during the chat span",
    "bulk_b_span_completed": "bulk_b (weight 3) completed during the chat span",
    "bulk_b_per_a": "bulk_b / bulk_a completed (weights 3:1)",
    "chat_beside_bulk": "chat requests sent while the bulk callers ran (share)",
}


def parse_client_result(data: Mapping[str, Any]) -> dict[str, float]:
    """Flat metrics from one `vllm bench serve --save-result` JSON document.

    Missing keys are skipped (a newer client may rename one); values that are
    not numbers (None for goodput, say) are skipped too.
    """
    out: dict[str, float] = {}
    for short, key in CLIENT_METRICS.items():
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[short] = float(value)
    return out


@dataclass(frozen=True, slots=True)
class Spread:
    """Median and range of one metric over repetitions."""

    median: float
    low: float
    high: float
    n: int


def spread(values: Iterable[float]) -> Spread | None:
    """Median, min and max of the finite values; None when there are none."""
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return None
    return Spread(statistics.median(vals), min(vals), max(vals), len(vals))


def ratio(num: Spread | None, den: Spread | None) -> float | None:
    """Ratio of medians, None when either side is missing or the denominator is 0."""
    if num is None or den is None or den.median == 0:
        return None
    return num.median / den.median


# ------------------------------------------------------------------ mixed load


@dataclass(frozen=True, slots=True)
class MixedClass:
    """One class of the mixed load: its share and its lengths."""

    role: str
    share: float
    input_len: int
    output_len: int


@dataclass(frozen=True, slots=True)
class MixedJob:
    """One of the concurrent client processes of the mixed load."""

    role: str
    input_len: int
    output_len: int
    request_rate: float
    num_prompts: int


def mixed_classes(max_model_len: int) -> tuple[MixedClass, ...]:
    """70% short chat turns, 20% medium summaries, 10% long documents.

    Input lengths scale with the context: 1/128, 1/16 and 1/2 of it (64, 512,
    4096 tokens at 8,192; 256, 2,048, 16,384 at 32,768). Outputs are short for
    chat and longer for summaries.
    """
    ctx = max(256, max_model_len)
    return (
        MixedClass("short", 0.70, max(16, ctx // 128), 64),
        MixedClass("medium", 0.20, ctx // 16, 128),
        MixedClass("long", 0.10, ctx // 2, 128),
    )


def split_mixed(
    classes: Sequence[MixedClass], total_rate: float, duration_s: float
) -> list[MixedJob]:
    """Split a fixed total Poisson rate over the classes, by share.

    Each class gets `share x total_rate` requests per second and as many prompts
    as that rate sends in `duration_s` (at least one), so the three clients run
    for about the same time and the short requests see the long ones all along.
    """
    if total_rate <= 0 or duration_s <= 0:
        raise ValueError("mixed load needs a positive rate and duration")
    total_share = sum(c.share for c in classes)
    if not math.isclose(total_share, 1.0, abs_tol=1e-6):
        raise ValueError(f"mixed-load shares sum to {total_share}, not 1")
    jobs = []
    for c in classes:
        rate = c.share * total_rate
        jobs.append(
            MixedJob(
                role=c.role,
                input_len=c.input_len,
                output_len=c.output_len,
                request_rate=rate,
                num_prompts=max(1, round(rate * duration_s)),
            )
        )
    return jobs


def combine_mixed(results: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """One record from the per-class client results of a mixed-load run.

    Total request throughput is all completions over the longest duration (the
    three clients run at the same time); per-class TTFT percentiles are kept
    under `<role>_ttft_pNN`.
    """
    out: dict[str, float] = {}
    completed = sum(r.get("completed", 0.0) for r in results.values())
    duration = max((r.get("duration_s", 0.0) for r in results.values()), default=0.0)
    out_tokens = sum(r.get("output_tokens", 0.0) for r in results.values())
    if duration > 0:
        out["req_s"] = completed / duration
        out["out_tok_s"] = out_tokens / duration
    out["failed"] = sum(r.get("failed", 0.0) for r in results.values())
    for role, r in results.items():
        for p in ("ttft_p50", "ttft_p95", "ttft_p99"):
            if p in r:
                out[f"{role}_{p}"] = r[p]
        if "failed" in r:
            out[f"{role}_failed"] = r["failed"]
    return out


def pooled_metrics(
    results: Mapping[str, Mapping[str, float]], logs: Mapping[str, RequestLog]
) -> dict[str, float]:
    """Several callers' jobs as one burst: req/s over the longest job, and the TTFT
    percentiles of every answered request of them all (from per-request detail)."""
    out = combine_mixed(results)
    ttfts = [log.ttfts[i] * 1000 for log in logs.values() for i in log.ok()]
    if ttfts:
        out["ttft_p50"] = percentile(ttfts, 50)
        out["ttft_p99"] = percentile(ttfts, 99)
    return out


# ------------------------------------------------------- per-request detail


@dataclass(frozen=True, slots=True)
class RequestLog:
    """The per-request lists of a `--save-detailed` client result.

    Times are the client's `time.perf_counter()` (CLOCK_MONOTONIC on Linux,
    one clock for every process on the machine), so two concurrent client
    processes' requests can be placed on one time line. A failed request has
    latency 0 and its error text (the HTTP reason, such as "Service
    Unavailable", or a traceback).
    """

    starts: tuple[float, ...]
    latencies: tuple[float, ...]
    ttfts: tuple[float, ...]  # seconds
    output_lens: tuple[int, ...]
    errors: tuple[str, ...]
    input_lens: tuple[int, ...] = ()  # prompt tokens (the client's count); () if not saved

    @classmethod
    def from_result(cls, data: Mapping[str, Any]) -> RequestLog | None:
        """The lists of a client result, or None when it was saved without detail."""
        starts = data.get("start_times")
        if not isinstance(starts, list):
            return None
        n = len(starts)
        lat = list(data.get("latencies") or [0.0] * n)
        ttfts = list(data.get("ttfts") or [0.0] * n)
        outs = list(data.get("output_lens") or [0] * n)
        errs = list(data.get("errors") or [""] * n)
        ins = list(data.get("input_lens") or [])
        if not len(lat) == len(ttfts) == len(outs) == len(errs) == n or len(ins) not in (0, n):
            raise ValueError("client result: per-request lists of different lengths")
        return cls(
            tuple(float(x) for x in starts),
            tuple(float(x or 0.0) for x in lat),
            tuple(float(x or 0.0) for x in ttfts),
            tuple(int(x or 0) for x in outs),
            tuple(str(e or "") for e in errs),
            tuple(int(x or 0) for x in ins),
        )

    def ok(self) -> list[int]:
        """Indices of the successful requests."""
        return [i for i, e in enumerate(self.errors) if not e]

    def span(self) -> tuple[float, float] | None:
        """First start to last end over all requests (a refused one ends at its start)."""
        if not self.starts:
            return None
        ends = [s + lat for s, lat in zip(self.starts, self.latencies, strict=True)]
        return min(self.starts), max(ends)

    def error_counts(self) -> dict[str, int]:
        """Failed requests by the first line of their error (at most 80 characters)."""
        out: dict[str, int] = {}
        for e in self.errors:
            if e:
                key = e.strip().splitlines()[-1 if "Traceback" in e else 0][:80] or "(empty)"
                out[key] = out.get(key, 0) + 1
        return out


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation (numpy's default, which the
    client uses for its own percentiles)."""
    if not values:
        return math.nan
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def noisy_metrics(
    results: Mapping[str, Mapping[str, float]],
    logs: Mapping[str, RequestLog],
    floods: Sequence[str] = ("flood",),
) -> dict[str, float]:
    """One record of a noisy-neighbour point from its `chat` and `flood` jobs.

    The chat caller's TTFT percentiles, completions and refusals (the client's
    own numbers, prefixed `chat_`). With a flood beside it: the chat caller's
    TTFT percentiles again, over only its answered requests sent while the flood
    ran (the flood's client starts a few seconds after the chat client: it
    builds 2,000-token prompts first; and it may end before it); the share of
    chat requests sent while the flood ran; the flood's requests that completed
    inside the chat job's span (first chat request sent to last chat request
    done) and their rate, which does not depend on how long the flood runs on
    after the chat job ends; and the flood's own totals.

    Several flood jobs (`floods`: the three-caller point's bulk callers) get
    these per job, under their own role; "beside" is then from the first of
    them starting to the last ending.
    """
    out: dict[str, float] = {}
    chat = results.get("chat", {})
    for k in ("ttft_p50", "ttft_p95", "ttft_p99", "completed", "failed"):
        if k in chat:
            out[f"chat_{k}"] = chat[k]
    if not any(f in results for f in floods):
        return out
    for f in floods:
        for k in ("completed", "failed", "req_s"):
            if k in results.get(f, {}):
                out[f"{f}_{k}"] = results[f][k]
    chat_log = logs.get("chat")
    flood_logs = [logs[f] for f in floods if f in logs]
    if chat_log is None or len(flood_logs) != len(floods):
        return out
    chat_span = chat_log.span()
    flood_spans = [sp for fl in flood_logs if (sp := fl.span()) is not None]
    if chat_span is None or len(flood_spans) != len(floods):
        return out
    lo, hi = chat_span
    for f, fl in zip(floods, flood_logs, strict=True):
        done = [i for i in fl.ok() if lo <= fl.starts[i] + fl.latencies[i] <= hi]
        out[f"{f}_span_completed"] = float(len(done))
        if hi > lo:
            out[f"{f}_span_req_s"] = len(done) / (hi - lo)
            out[f"{f}_span_tok_s"] = sum(fl.output_lens[i] for i in done) / (hi - lo)
    f_lo, f_hi = min(sp[0] for sp in flood_spans), max(sp[1] for sp in flood_spans)
    beside = [i for i, s in enumerate(chat_log.starts) if f_lo <= s <= f_hi]
    out[f"chat_beside_{'_'.join(floods)}"] = len(beside) / len(chat_log.starts)
    answered = set(chat_log.ok())
    ttfts = [chat_log.ttfts[i] * 1000 for i in beside if i in answered]
    if ttfts:
        for p in (50, 95, 99):
            out[f"chat_ttft_p{p}"] = percentile(ttfts, p)
    return out


def three_caller_metrics(
    results: Mapping[str, Mapping[str, float]],
    logs: Mapping[str, RequestLog],
    bulk: Sequence[str],
) -> dict[str, float]:
    """The noisy neighbour's view with the bulk callers as its floods, plus the
    bulk work as one (completed and req/s during the chat span) and the second
    bulk caller's completions per the first's (their weights' ratio, if shared
    as weighted)."""
    out = noisy_metrics(results, logs, bulk)
    if f"chat_beside_{'_'.join(bulk)}" in out:
        out["chat_beside_bulk"] = out.pop(f"chat_beside_{'_'.join(bulk)}")
    spans = [out.get(f"{b}_span_completed") for b in bulk]
    if all(n is not None for n in spans):
        out["bulk_span_completed"] = sum(n or 0.0 for n in spans)
        rates = [out.get(f"{b}_span_req_s") for b in bulk]
        if all(r is not None for r in rates):
            out["bulk_span_req_s"] = sum(r or 0.0 for r in rates)
        first, second = spans[0] or 0.0, spans[-1] or 0.0
        if first > 0:
            out["bulk_b_per_a"] = second / first
    return out


def share_metrics(
    results: Mapping[str, Mapping[str, float]],
    logs: Mapping[str, RequestLog],
    callers: Sequence[str],
) -> dict[str, float]:
    """Callers side by side (the LoRA point): each one's TTFT p95 (the client's), the
    worst of them, and each one's share of service while all of them ran.

    The span is from the last caller's first request sent to the first caller's last
    request done: a caller that finishes early (or starts late) would otherwise
    count time when it was not competing. Service is fair share's: prompt + 2 x
    generated tokens (the client's counts) of the requests that ended inside the
    span; `share_dev` is the largest |share x callers - 1| (0.2: a share 20% off an
    equal one). `req_s` is every caller's completions in the span per second.
    """
    out: dict[str, float] = {}
    worst = -math.inf
    for c in callers:
        for k in ("ttft_p95", "completed", "failed"):
            if k in results.get(c, {}):
                out[f"{c}_{k}"] = results[c][k]
        worst = max(worst, results.get(c, {}).get("ttft_p95", -math.inf))
    if worst > -math.inf:
        out["worst_ttft_p95"] = worst
    spans = [sp for c in callers if c in logs and (sp := logs[c].span()) is not None]
    if len(spans) != len(callers):
        return out
    lo, hi = max(sp[0] for sp in spans), min(sp[1] for sp in spans)
    if hi <= lo:
        return out
    service: dict[str, float] = {}
    done_n = 0
    for c in callers:
        lg = logs[c]
        done = [i for i in lg.ok() if lo <= lg.starts[i] + lg.latencies[i] <= hi]
        done_n += len(done)
        ins = lg.input_lens
        service[c] = sum((ins[i] if ins else 0) + 2 * lg.output_lens[i] for i in done)
    total = sum(service.values())
    out["req_s"] = done_n / (hi - lo)
    out["span_s"] = hi - lo
    if total > 0:
        n = len(callers)
        for c in callers:
            out[f"{c}_share"] = service[c] / total
        out["share_dev"] = max(abs(service[c] / total * n - 1.0) for c in callers)
    return out


def spread_metrics(result: Mapping[str, float], detail: RequestLog | None) -> dict[str, float]:
    """One record of the spread-lengths backlog: the client's numbers plus, from
    per-request detail, the largest TTFT and the TTFT tails of the shortest and
    longest thirds of the answered requests by prompt length (ties at a third's
    edge go by order)."""
    out = dict(result)
    if detail is None or not detail.input_lens:
        return out
    ok = detail.ok()
    if not ok:
        return out
    out["ttft_max"] = max(detail.ttfts[i] for i in ok) * 1000
    by_len = sorted(ok, key=lambda i: detail.input_lens[i])
    third = len(by_len) // 3
    if third:
        out["short_third_ttft_p95"] = percentile(
            [detail.ttfts[i] * 1000 for i in by_len[:third]], 95
        )
        out["long_third_ttft_p99"] = percentile(
            [detail.ttfts[i] * 1000 for i in by_len[-third:]], 99
        )
    return out


# ----------------------------------------------------------------- /metrics


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of each sample name over its label sets, from Prometheus text format."""
    out: dict[str, float] = {}
    for raw_line in text.splitlines():
        line = raw_line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[: line.index("{")], line[line.rindex("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


PREFIX_METRICS: dict[str, tuple[str, str]] = {
    SLUICE: (
        "sluice_engine_prefix_cache_queries_total",
        "sluice_engine_prefix_cache_hits_total",
    ),
    VLLM: ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
}
PREFIX_METRICS[NOHOLD] = PREFIX_METRICS[SLUICE]


def prefill_delta(
    system: str, before: Mapping[str, float], after: Mapping[str, float]
) -> dict[str, float]:
    """Prompt tokens looked up, hit, and actually computed between two scrapes."""
    q_name, h_name = PREFIX_METRICS[system]
    if q_name not in after or h_name not in after:
        return {}
    queries = after[q_name] - before.get(q_name, 0.0)
    hits = after[h_name] - before.get(h_name, 0.0)
    return {"prefix_queries": queries, "prefix_hits": hits, "prefill_tokens": queries - hits}


# The engine's running count on each server's /metrics (summed over vLLM's
# per-engine label sets by parse_prometheus: one series per DP rank).
RUNNING_METRICS: dict[str, str] = {
    SLUICE: "sluice_engine_requests_running",
    VLLM: "vllm:num_requests_running",
}
RUNNING_METRICS[NOHOLD] = RUNNING_METRICS[SLUICE]


def running_summary(samples: Sequence[float]) -> dict[str, float]:
    """Peak and median of the running counts sampled while a point ran."""
    if not samples:
        return {}
    return {
        "running_peak": max(samples),
        "running_p50": statistics.median(samples),
        "running_mean": statistics.fmean(samples),
    }


def underfed_share(metrics: Mapping[str, float]) -> dict[str, float]:
    """Issue 27: the share of Sluice's engine steps beside a held backlog that were
    under-fed, and that share less the steps beside work that only Sluice's policy
    for a short turn's room held (room.py rules 4-5; none when no step ran beside a
    held backlog)."""
    held = metrics.get("held_steps")
    if not held:
        return {}
    underfed = metrics.get("underfed_steps", 0.0)
    rest = underfed - metrics.get("underfed_policy_steps", 0.0)
    return {"underfed_share": underfed / held, "underfed_rest_share": rest / held}


def step_time(metrics: Mapping[str, float], elapsed: float) -> dict[str, float]:
    """Issue 27: the engine's mean step time (ms) and its time in steps per second
    of the point (`elapsed`), from Sluice's step counters over the point: a held
    backlog's longer steps show in the first, gaps between steps in the second.
    Empty when no step or no step time was counted."""
    steps, seconds = metrics.get("engine_steps"), metrics.get("step_s")
    if not steps or seconds is None or elapsed <= 0:
        return {}
    return {"step_ms": 1000.0 * seconds / steps, "in_steps": seconds / elapsed}


def front_cpu(seconds: float, jobs: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The server process's own CPU time over a point (`seconds`), in ms per request
    its jobs completed (issue 27: what the front spends beside the engine). Empty
    when nothing completed."""
    done = sum(j.get("completed", 0.0) for j in jobs)
    return {"front_cpu_ms": 1000 * seconds / done} if done > 0 else {}


# ------------------------------------------------------------------ records


@dataclass(frozen=True, slots=True)
class Record:
    """One measurement: a system at a scenario point in one repetition."""

    scenario: str
    point: str
    system: str
    rep: int
    metrics: Mapping[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "point": self.point,
            "system": self.system,
            "rep": self.rep,
            "metrics": dict(self.metrics),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Record:
        return cls(d["scenario"], d["point"], d["system"], int(d["rep"]), dict(d["metrics"]))


@dataclass(slots=True)
class Table:
    """Aggregated values: (point, system) -> metric -> Spread, points in order."""

    scenario: str
    points: list[str] = field(default_factory=list)
    cells: dict[tuple[str, str], dict[str, Spread]] = field(default_factory=dict)

    def get(self, point: str, system: str, metric: str) -> Spread | None:
        return self.cells.get((point, system), {}).get(metric)

    def systems(self) -> list[str]:
        present = {s for (_, s) in self.cells}
        return [s for s in SYSTEMS if s in present] + sorted(present - set(SYSTEMS))


def aggregate(records: Iterable[Record], scenario: str) -> Table:
    """Collect one scenario's records into medians and spreads."""
    table = Table(scenario)
    values: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in records:
        if r.scenario != scenario:
            continue
        if r.point not in table.points:
            table.points.append(r.point)
        per = values.setdefault((r.point, r.system), {})
        for k, v in r.metrics.items():
            per.setdefault(k, []).append(v)
    for key, per in values.items():
        cells: dict[str, Spread] = {}
        for k, vs in per.items():
            s = spread(vs)
            if s is not None:
                cells[k] = s
        table.cells[key] = cells
    return table


def fmt_num(x: float) -> str:
    """Short human number: 3 significant digits, no exponent for usual sizes."""
    if not math.isfinite(x):
        return str(x)
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    if ax == 0:
        return "0"
    return f"{x:.3f}"


def fmt_spread(s: Spread | None) -> str:
    """`median [min–max]`, or just the median for one value; `–` when missing."""
    if s is None:
        return "–"
    if s.n == 1 or s.low == s.high:
        return fmt_num(s.median)
    return f"{fmt_num(s.median)} [{fmt_num(s.low)}–{fmt_num(s.high)}]"


def cell(text: str) -> str:
    """Text made safe for a Markdown table cell."""
    return text.replace("|", "\\|")


def fmt_ratio(r: float | None) -> str:
    return "–" if r is None else f"{r:.2f}x"


def render_comparison(table: Table, metrics: Sequence[str], point_title: str = "point") -> str:
    """A Markdown table: per point and metric, each system's median [spread] and ratios.

    Columns for a system appear only when it has data in this scenario; the
    Sluice/raw column only when the raw engine was measured.
    """
    systems = table.systems()
    has_raw = RAW in systems
    head = [point_title, "metric", *(SYSTEM_TITLES.get(s, s) for s in systems)]
    if SLUICE in systems and VLLM in systems:
        head.append("Sluice/vLLM")
    if SLUICE in systems and has_raw:
        head.append("Sluice/raw")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for point in table.points:
        for m in metrics:
            row_vals = {s: table.get(point, s, m) for s in systems}
            if all(v is None for v in row_vals.values()):
                continue
            row = [
                cell(point),
                METRIC_TITLES.get(m, m),
                *(fmt_spread(row_vals[s]) for s in systems),
            ]
            if SLUICE in systems and VLLM in systems:
                row.append(fmt_ratio(ratio(row_vals[SLUICE], row_vals[VLLM])))
            if SLUICE in systems and has_raw:
                row.append(fmt_ratio(ratio(row_vals[SLUICE], row_vals.get(RAW))))
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def render_single(table: Table, system: str, metrics: Sequence[str], point_title: str) -> str:
    """A Markdown table for one system: a row per point, a column per metric."""
    head = [point_title, *(METRIC_TITLES.get(m, m) for m in metrics)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for point in table.points:
        if (point, system) not in table.cells:
            continue
        row = [cell(point), *(fmt_spread(table.get(point, system, m)) for m in metrics)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------- plot

# One colour per system in every panel (matplotlib's tab10 blue, red and grey).
SYSTEM_COLOURS: dict[str, str] = {
    SLUICE: "#1f77b4",
    VLLM: "#d62728",
    RAW: "#7f7f7f",
    NOHOLD: "#2ca02c",
}


@dataclass(frozen=True, slots=True)
class LinePanel:
    """One metric against the scenario's own variable: the number in each point's
    name (32 in "c=32", 40 in "40 req/s"), a line per system."""

    scenario: str
    metric: str
    title: str
    xlabel: str
    log_y: bool = False
    skip: tuple[str, ...] = ()  # points left off the line (other prompt lengths)


@dataclass(frozen=True, slots=True)
class BarPanel:
    """Metrics as groups of bars, a bar per system: the classes of one point
    ("short", "medium", "long"), or one metric over a scenario's points."""

    scenario: str
    bars: tuple[tuple[str, str], ...]  # (group label, metric)
    title: str
    ylabel: str
    log_y: bool = False  # for values that differ by orders of magnitude
    only: tuple[str, ...] = ()  # these points of the scenario (default: all)


Panel = LinePanel | BarPanel


def point_number(point: str) -> float | None:
    """The first number in a point's name, or None."""
    m = re.search(r"\d+(?:\.\d+)?", point)
    return float(m.group()) if m else None


def line_series(table: Table, panel: LinePanel) -> dict[str, list[tuple[float, Spread]]]:
    """(x, spread of the metric) per system, sorted by x; points without a number
    in their name or without the metric are left out, systems without any too."""
    out: dict[str, list[tuple[float, Spread]]] = {}
    for system in table.systems():
        pts = []
        for point in table.points:
            if point in panel.skip:
                continue
            x = point_number(point)
            value = table.get(point, system, panel.metric)
            if x is not None and value is not None:
                pts.append((x, value))
        if pts:
            out[system] = sorted(pts, key=lambda p: p[0])
    return out


def bar_groups(table: Table, panel: BarPanel) -> tuple[list[str], dict[str, list[Spread | None]]]:
    """Group labels and, per system, one spread (or None) per group.

    A group is a (label, metric) of the panel at one point; with several points
    the label names the point too. Groups no system measured are left out.
    """
    labels: list[str] = []
    cells: list[dict[str, Spread]] = []
    points = [p for p in table.points if not panel.only or p in panel.only]
    for point in points:
        for label, metric in panel.bars:
            per = {s: v for s in table.systems() if (v := table.get(point, s, metric)) is not None}
            if per:
                labels.append(label if len(points) == 1 else f"{label}\n{point}")
                cells.append(per)
    systems = [s for s in table.systems() if any(s in c for c in cells)]
    return labels, {s: [c.get(s) for c in cells] for s in systems}


def panel_has_data(tables: Mapping[str, Table], panel: Panel) -> bool:
    table = tables.get(panel.scenario)
    if table is None:
        return False
    if isinstance(panel, LinePanel):
        return bool(line_series(table, panel))
    return bool(bar_groups(table, panel)[0])


def write_panels(
    tables: Mapping[str, Table], panels: Sequence[Panel], path: Path, title: str
) -> str:
    """One panel per scenario view that has data; returns a status message.

    Each point is labelled with its median and carries its min-max spread as an
    error bar; each system keeps its colour across panels (SYSTEM_COLOURS).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return "plot skipped: matplotlib is not installed in this environment"
    drawn = [p for p in panels if panel_has_data(tables, p)]
    if not drawn:
        return "plot skipped: no scenario with plottable points"
    ncols = 2 if len(drawn) <= 4 else 3
    nrows = -(-len(drawn) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 4.4 * nrows), squeeze=False)
    systems: list[str] = []
    for ax, panel in zip(axes.flat, drawn, strict=False):
        table = tables[panel.scenario]
        if isinstance(panel, LinePanel):
            used = _draw_lines(ax, table, panel)
        else:
            used = _draw_bars(ax, table, panel)
        systems += [s for s in used if s not in systems]
        ax.set_title(panel.title, fontsize=11)
        ax.grid(True, which="major", alpha=0.3)
    for ax in list(axes.flat)[len(drawn) :]:
        ax.set_visible(False)
    handles = [
        Line2D([], [], color=_colour(s), marker="o", label=SYSTEM_TITLES.get(s, s)) for s in systems
    ]
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.96), ncols=len(handles))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written: {path}"


def _colour(system: str) -> str:
    return SYSTEM_COLOURS.get(system, "#2ca02c")


# Where each system's point labels sit (offset in points, alignment): beside the
# marker, clear of the vertical error bar, so that close values do not overprint.
_LABEL_PLACES: tuple[tuple[tuple[float, float], str], ...] = (
    ((-5, 3), "right"),
    ((5, -10), "left"),
    ((-5, -11), "right"),
)


def _draw_lines(ax: Any, table: Table, panel: LinePanel) -> list[str]:
    series = line_series(table, panel)
    xs_all: set[float] = set()
    for i, (system, pts) in enumerate(series.items()):
        xs = [x for x, _ in pts]
        med = [v.median for _, v in pts]
        err = [[v.median - v.low for _, v in pts], [v.high - v.median for _, v in pts]]
        ax.errorbar(xs, med, yerr=err, color=_colour(system), marker="o", ms=4, capsize=3)
        offset, align = _LABEL_PLACES[i % len(_LABEL_PLACES)]
        for x, y in zip(xs, med, strict=True):
            ax.annotate(
                fmt_num(y),
                (x, y),
                xytext=offset,
                textcoords="offset points",
                ha=align,
                fontsize=7.5,
                color=_colour(system),
            )
        xs_all.update(xs)
    ticks = sorted(xs_all)
    if ticks and ticks[0] > 0 and ticks[-1] / ticks[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.margins(x=0.1)
    if panel.log_y:
        ax.set_yscale("log")
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(METRIC_TITLES.get(panel.metric, panel.metric))
    return list(series)


def _draw_bars(ax: Any, table: Table, panel: BarPanel) -> list[str]:
    labels, per_system = bar_groups(table, panel)
    width = 0.8 / max(1, len(per_system))
    for i, (system, values) in enumerate(per_system.items()):
        for g, v in enumerate(values):
            if v is None:
                continue
            x = g - 0.4 + width * (i + 0.5)
            ax.bar(x, v.median, width, color=_colour(system))
            ax.errorbar(
                x,
                v.median,
                yerr=[[v.median - v.low], [v.high - v.median]],
                color="black",
                capsize=3,
                lw=1,
            )
            ax.annotate(
                fmt_num(v.median),
                (x, v.high),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize=7.5,
                color=_colour(system),
            )
    ax.set_xticks(range(len(labels)), labels)
    points = [p for p in table.points if not panel.only or p in panel.only]
    if len(points) == 1:
        ax.set_xlabel(f"at {points[0]}")
    if panel.log_y:
        ax.set_yscale("log")
    ax.set_ylabel(panel.ylabel)
    return list(per_system)


# ------------------------------------------------------ tables from Markdown


def parse_spread(text: str, n: int) -> Spread | None:
    """A table cell back into a Spread: `36.8 [30.0–40.1]`, `2,919`, or `–`.

    `n` is the number of repetitions the report states; a cell without a range
    had one value or equal values.
    """
    text = text.strip()
    if text in ("", "–"):
        return None
    m = re.fullmatch(r"([-\d.,]+)(?: \[([-\d.,]+)–([-\d.,]+)\])?", text)
    if m is None:
        raise ValueError(f"not a table value: {text!r}")
    med = float(m.group(1).replace(",", ""))
    if m.group(2) is None:
        return Spread(med, med, med, n)
    return Spread(med, float(m.group(2).replace(",", "")), float(m.group(3).replace(",", "")), n)


def tables_from_markdown(md: str, scenario_titles: Mapping[str, str], n: int) -> dict[str, Table]:
    """The comparison tables of a written report (render_comparison's output under
    `## <scenario title>`), read back: for re-drawing the plot of a run whose raw
    records are gone. Values are the report's rounded medians and spreads."""
    by_title = {t: sc for sc, t in scenario_titles.items()}
    metric_by_title = {t: m for m, t in METRIC_TITLES.items()}
    system_by_title = {t: s for s, t in SYSTEM_TITLES.items()}
    tables: dict[str, Table] = {}
    table: Table | None = None
    columns: list[str | None] = []
    for line in md.splitlines():
        if line.startswith("## "):
            sc = by_title.get(line[3:].strip())
            table = tables.setdefault(sc, Table(sc)) if sc is not None else None
            columns = []
            continue
        if table is None or not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if not columns:
            columns = [system_by_title.get(c) for c in cells]
            continue
        point, metric = cells[0], metric_by_title.get(cells[1], cells[1])
        if point not in table.points:
            table.points.append(point)
        for system, text in zip(columns[2:], cells[2:], strict=True):
            value = parse_spread(text, n) if system is not None else None
            if system is not None and value is not None:
                table.cells.setdefault((point, system), {})[metric] = value
    return tables
