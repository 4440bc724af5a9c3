"""The client's numbers: one `vllm bench serve` result as flat metrics, and a metric's
median and spread over repetitions.

Why it exists: every scenario's record starts from the client's --save-result
JSON; the short keys and titles here are the ones every table uses.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

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
