"""What a server's /metrics says over a point: prefix-cache work, the engine's running
count, Sluice's step counters and the front's CPU.

Why it exists: the runner scrapes both servers before and after a point (and the
running count while it runs); these turn the scrapes into a record's metrics.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

from bench.report.systems import NOHOLD, SLUICE, VLLM


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


# Twice a second: a DP point at c=256 runs 20-60 s here, and each scrape of
# vLLM's /metrics costs its API process a few ms.
RUNNING_POLL_S = 0.5

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
