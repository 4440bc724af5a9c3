"""bench/points/embed_point.py's report: the table over servers and the ratio lines
against issue 30's targets, from recorded runs (no server here)."""

from __future__ import annotations

import argparse

from bench.points.embed_point import report
from bench.report import SLUICE, VLLM


def run(req_s: float, p99: float) -> dict[str, float]:
    return {"req_s": req_s, "p50": p99 / 2, "p99": p99, "cpu_ms": 0.5, "failed": 0}


def test_report_gives_medians_spreads_and_the_ratios_against_vllm() -> None:
    args = argparse.Namespace(repeat=3, prompts=64, concurrency=64, input_len=16, sluice_flags="")
    lines = report(
        {
            SLUICE: [run(120, 90), run(100, 100), run(130, 80)],
            VLLM: [run(100, 100), run(90, 120), run(110, 80)],
        },
        args,
    )
    rows = [line for line in lines if line.startswith(f"| {SLUICE}")]
    assert rows == [
        f"| {SLUICE} | 120.0 [100.0-130.0] | 45 [40-50] | 90 [80-100] | 0.50 [0.50-0.50] | 0 |"
    ]
    assert lines[-1] == "* req/s 1.20x vLLM's server (target >= 1.2x); p99 0.90x (target <= 1.0x)."
