"""Records and their Markdown tables: one record per measurement, aggregated into
medians and spreads, rendered, and read back from a written report.

Why it exists: a record is one system at one scenario point in one repetition,
with a flat dict of metrics; the report gives each metric's median and spread
(min-max) and the ratio of medians Sluice/vLLM and Sluice/raw. Reading a table
back re-draws the plot of a run whose raw records are gone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.report.client import METRIC_TITLES, Spread, ratio, spread
from bench.report.systems import RAW, SLUICE, SYSTEM_TITLES, SYSTEMS, VLLM


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
