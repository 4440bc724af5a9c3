"""The report's plot: one panel per scenario, a line per system against the
scenario's own variable or grouped bars, drawn with matplotlib when it is there.

Why it exists: the tables give the numbers; the panels show the shape (where a
system falls off as the load grows) at a glance.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report.client import METRIC_TITLES, Spread
from bench.report.systems import NOHOLD, RAW, SLUICE, SYSTEM_TITLES, VLLM
from bench.report.tables import Table, fmt_num

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
