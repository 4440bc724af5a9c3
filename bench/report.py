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
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLUICE = "sluice"
VLLM = "vllm"
RAW = "raw"
SYSTEMS: tuple[str, ...] = (SLUICE, VLLM, RAW)
SYSTEM_TITLES: dict[str, str] = {SLUICE: "Sluice", VLLM: "vLLM server", RAW: "raw engine"}

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
    "prefill_tokens": "prefill tokens computed",
    "prefix_queries": "prompt tokens looked up",
    "prefix_hits": "prefix-cache hit tokens",
    "short_ttft_p50": "short TTFT p50 (ms)",
    "short_ttft_p95": "short TTFT p95 (ms)",
    "short_ttft_p99": "short TTFT p99 (ms)",
    "medium_ttft_p95": "medium TTFT p95 (ms)",
    "long_ttft_p95": "long TTFT p95 (ms)",
    "short_failed": "short failed",
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


def plot_points(
    records: Iterable[Record], scenarios: Sequence[str]
) -> dict[str, list[tuple[float, float]]]:
    """(req/s, TTFT p99) medians per system over the load-sweep points, sorted by load."""
    recs = list(records)
    series: dict[str, list[tuple[float, float]]] = {}
    for sc in scenarios:
        table = aggregate(recs, sc)
        for point in table.points:
            for system in table.systems():
                thr = table.get(point, system, "req_s")
                p99 = table.get(point, system, "ttft_p99")
                if thr is not None and p99 is not None:
                    series.setdefault(system, []).append((thr.median, p99.median))
    for pts in series.values():
        pts.sort()
    return series


def write_plot(series: Mapping[str, Sequence[tuple[float, float]]], path: Path, title: str) -> str:
    """Throughput against TTFT p99, a line per system. Returns a status message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed in this environment"
    if not series:
        return "plot skipped: no throughput/TTFT points"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, pts in series.items():
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        ax.plot(xs, ys, marker="o", label=SYSTEM_TITLES.get(system, system))
    ax.set_xlabel("request throughput (req/s)")
    ax.set_ylabel("TTFT p99 (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written: {path}"
