"""The report: what the benchmark's records say, as tables, panels and a Markdown page.

Why it exists: everything here is data handling, deterministic once the run is
over (no servers, no sockets, no vLLM import), so it is unit-tested
(tests/unit/test_bench_report.py) and can re-render a report from saved records
(`python -m bench --report-only`). Its rooms, by topic: systems.py (the names of
the systems compared), client.py (the client's numbers, a metric's spread),
requests.py (per-request detail), prometheus.py (what /metrics says over a
point), tables.py (records and their Markdown tables), plots.py (the panels),
cells.py (the helpers every point's own report shares), targets.py (the issues'
targets as verdicts), sections.py and markdown.py (the run's page).

This face hands on the names of the data half, so that `from bench import
report as rp` reads `rp.Record`, `rp.aggregate`, `rp.SLUICE`; the mixed load's
classes (bench/scenarios.py) come along for the tests that check them here.
"""

from __future__ import annotations

from bench.report.client import (
    CLIENT_METRICS,
    METRIC_TITLES,
    Spread,
    combine_mixed,
    parse_client_result,
    ratio,
    spread,
)
from bench.report.plots import (
    SYSTEM_COLOURS,
    BarPanel,
    LinePanel,
    Panel,
    bar_groups,
    line_series,
    panel_has_data,
    point_number,
    write_panels,
)
from bench.report.prometheus import (
    PREFIX_METRICS,
    RUNNING_METRICS,
    front_cpu,
    parse_prometheus,
    prefill_delta,
    running_summary,
    step_time,
    underfed_share,
)
from bench.report.requests import (
    RequestLog,
    noisy_metrics,
    percentile,
    pooled_metrics,
    share_metrics,
    spread_metrics,
    three_caller_metrics,
)
from bench.report.systems import NOHOLD, RAW, SLUICE, SLUICE_SYSTEMS, SYSTEM_TITLES, SYSTEMS, VLLM
from bench.report.tables import (
    Record,
    Table,
    aggregate,
    cell,
    fmt_num,
    fmt_ratio,
    fmt_spread,
    parse_spread,
    render_comparison,
    render_single,
    tables_from_markdown,
)
from bench.scenarios import MixedClass, MixedJob, mixed_classes, split_mixed

__all__ = [
    "CLIENT_METRICS",
    "METRIC_TITLES",
    "NOHOLD",
    "PREFIX_METRICS",
    "RAW",
    "RUNNING_METRICS",
    "SLUICE",
    "SLUICE_SYSTEMS",
    "SYSTEMS",
    "SYSTEM_COLOURS",
    "SYSTEM_TITLES",
    "VLLM",
    "BarPanel",
    "LinePanel",
    "MixedClass",
    "MixedJob",
    "Panel",
    "Record",
    "RequestLog",
    "Spread",
    "Table",
    "aggregate",
    "bar_groups",
    "cell",
    "combine_mixed",
    "fmt_num",
    "fmt_ratio",
    "fmt_spread",
    "front_cpu",
    "line_series",
    "mixed_classes",
    "noisy_metrics",
    "panel_has_data",
    "parse_client_result",
    "parse_prometheus",
    "parse_spread",
    "percentile",
    "point_number",
    "pooled_metrics",
    "prefill_delta",
    "ratio",
    "render_comparison",
    "render_single",
    "running_summary",
    "share_metrics",
    "split_mixed",
    "spread",
    "spread_metrics",
    "step_time",
    "tables_from_markdown",
    "three_caller_metrics",
    "underfed_share",
    "write_panels",
]
