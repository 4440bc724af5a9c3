"""The LoRA benchmark point (issue 20): its plan, its metrics and its targets."""

from __future__ import annotations

import pytest

from bench import report as rp
from bench.report import targets as tg
from bench.scenarios import (
    ADAPTER_DIR,
    DEFAULT_SCENARIOS,
    FULL,
    LORA,
    LORA_ADAPTERS,
    LORA_CALLERS,
    LORA_POINT,
    QUICK,
    build_plan,
)


def test_plan_four_callers_each_on_its_own_adapter() -> None:
    assert LORA not in DEFAULT_SCENARIOS  # it makes and serves adapters: ask by name
    plan = build_plan((LORA,), FULL, max_model_len=8192)
    (point,) = plan.points
    assert point.callers == LORA_CALLERS
    for job, adapter in zip(point.jobs, LORA_ADAPTERS, strict=True):
        a = job.args
        assert a[a.index("--lora-modules") + 1] == adapter
        assert a[a.index("--max-concurrency") + 1] == "16"
        assert a[a.index("--random-input-len") + 1] == "128"
        assert a[a.index("--random-output-len") + 1] == "64"
    assert point.engine is not None
    flags = point.engine.flags
    assert flags[flags.index("--max-loras") + 1] == "2"
    assert [f for f in flags if f.startswith("a")] == [
        f"{a}={ADAPTER_DIR}/{a}" for a in LORA_ADAPTERS
    ]
    assert point.counters == (
        ("adapter_wait_steps", "sluice_engine_adapter_wait_steps_total"),
        ("engine_steps", "sluice_engine_steps_total"),
        ("step_s", "sluice_engine_step_seconds_total"),
        ("held_steps", "sluice_engine_steps_held_total"),
        ("underfed_steps", "sluice_engine_underfed_steps_total"),
        ("underfed_policy_steps", "sluice_engine_underfed_policy_steps_total"),
    )
    quick = build_plan((LORA,), QUICK, max_model_len=8192).points[0]
    assert quick.jobs[0].args[quick.jobs[0].args.index("--num-prompts") + 1] == "32"


def _log(starts: list[float], lat: float, out: int, ins: int = 128) -> rp.RequestLog:
    n = len(starts)
    return rp.RequestLog(tuple(starts), (lat,) * n, (0.1,) * n, (out,) * n, ("",) * n, (ins,) * n)


def test_shares_count_only_while_every_caller_ran() -> None:
    callers = ("x", "y")
    logs = {
        # x: 10 requests over 0-10 s; y starts at 2 s and runs on to 20 s.
        "x": _log([float(i) for i in range(10)], 1.0, 64),
        "y": _log([2.0 + i for i in range(18)], 1.0, 64),
    }
    results = {"x": {"ttft_p95": 80.0}, "y": {"ttft_p95": 300.0}}
    m = rp.share_metrics(results, logs, callers)
    # The span: y's first start (2 s) to x's last end (10 s); x ends 2..10 s in it
    # (9 requests: ends 2, 3, ... 10), y ends 3..10 s (8 requests).
    assert m["span_s"] == pytest.approx(8.0)
    assert m["req_s"] == pytest.approx(17 / 8)
    assert m["x_share"] == pytest.approx(9 / 17)
    assert m["share_dev"] == pytest.approx(abs(9 / 17 * 2 - 1))
    assert m["worst_ttft_p95"] == 300.0


def test_issue20_targets() -> None:
    def rec(system: str, req_s: float, worst: float, shares: tuple[float, ...]) -> rp.Record:
        m = {"req_s": req_s, "worst_ttft_p95": worst}
        m |= {f"{c}_share": s for c, s in zip(LORA_CALLERS, shares, strict=True)}
        m["share_dev"] = max(abs(s * 4 - 1) for s in shares)
        return rp.Record(LORA, LORA_POINT, system, 1, m)

    recs = [
        rec(rp.SLUICE, 9.6, 900.0, (0.24, 0.26, 0.25, 0.25)),
        rec(rp.VLLM, 10.0, 4000.0, (0.45, 0.45, 0.05, 0.05)),
    ]
    rows = tg.issue20(recs)
    assert [v for _, _, v in rows] == ["met", "met", "met"]
    recs[0] = rec(rp.SLUICE, 9.0, 5000.0, (0.19, 0.31, 0.25, 0.25))
    assert [v for _, _, v in tg.issue20(recs)] == ["MISSED", "MISSED", "MISSED"]
    assert any(name.startswith("issue 20") for name, _ in tg.TARGET_SETS)
