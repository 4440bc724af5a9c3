"""The helpers every point's own report shares: a `median [min-max]` cell (of
values, or of one metric over repetitions), a median over repetitions, a
percentile, and the page written and printed.

Why it exists: each point (bench/points/) renders its own small table; before,
each carried its own copy of these three.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def percentile(values: Sequence[float], pct: int) -> float:
    """The `pct`th percentile of `values` (statistics' exclusive method; the one
    value when there is only one)."""
    return statistics.quantiles(values, n=100)[pct - 1] if len(values) > 1 else values[0]


def spread_cell(vals: Sequence[float], fmt: str) -> str:
    """`median [min-max]` of `vals`, each number in the format `fmt` (".1f")."""
    return f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}-{max(vals):{fmt}}]"


def runs_cell(runs: Sequence[Mapping[str, Any]], key: str, fmt: str) -> str:
    """`median [min-max]` of one metric over a point's repetitions."""
    return spread_cell([r[key] for r in runs], fmt)


def median(runs: Sequence[Mapping[str, Any]], key: str) -> float:
    """The median of one metric over a point's repetitions."""
    return float(statistics.median(r[key] for r in runs))


def write_lines(out: Path, lines: Sequence[str]) -> None:
    """A point's report: written to `out`, and printed."""
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
