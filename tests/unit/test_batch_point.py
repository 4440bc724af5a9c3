"""The batch point's report (bench/points/batch_point.py): vLLM's priority policy
beside Sluice's figures, each a ratio to its own chat caller alone."""

from __future__ import annotations

import argparse

from bench.points.batch_point import report


def _args(vllm_priority: bool = False) -> argparse.Namespace:
    return argparse.Namespace(
        repeat=2,
        lines=500,
        max_tokens=16,
        concurrency=256,
        in_flight=None,
        sluice_args="",
        against_args=None,
        vllm_priority=vllm_priority,
    )


def _sluice(alone: float, beside: float) -> dict[str, float]:
    return {
        "chat_alone_p95": alone,
        "chat_beside_p95": beside,
        "chat_beside_turns": 100,
        "chat_failed": 0,
        "batch_alone": 60.0,
        "batch_beside": 50.0,
        "closed_loop": 61.0,
    }


def test_vllms_priority_policy_gets_a_table_of_its_own_ratios() -> None:
    runs = [_sluice(10.0, 14.0), _sluice(10.0, 16.0)]
    vllm = [
        {
            "chat_alone_p95": 10.0,
            "chat_beside_p95": 500.0,
            "chat_beside_turns": 3,
            "chat_failed": 0,
            "lines_beside": 70.0,
        },
        {
            "chat_alone_p95": 20.0,
            "chat_beside_p95": 600.0,
            "chat_beside_turns": 4,
            "chat_failed": 1,
            "lines_beside": 72.0,
        },
    ]
    text = "\n".join(report(runs, [65.0, 66.0], _args(vllm_priority=True), None, vllm))
    assert "--concurrency 256 --vllm-priority`" in text  # the command that ran
    sluice, theirs = text.split("## vLLM's server, `--scheduling-policy priority`")
    assert "1.50 [1.40-1.60]x alone" in sluice
    assert "40.00 [30.00-50.00]x alone; 1 failed chat turns" in theirs
    assert "| 3, 4 |" in theirs
    assert "vLLM" not in "\n".join(report(runs, [65.0, 66.0], _args()))
