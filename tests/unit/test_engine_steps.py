"""The engine's steps reach the core and /metrics (issue 27, item 1): each rank's
step from vLLM's own SchedulerStats with its iteration details, through its
per-engine stat-logger adapter (server/engines/vllm_adapter.py); the flag that makes vLLM report
them; its per-step log line kept out of the journal; the counters exported."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerIterationDetails, SchedulerStats

from batching import EngineStep, RoomCounters
from server.cli import parse_serve_args
from server.engines.vllm_adapter import (
    _LongestStep,
    _NoIterationLines,
    _stat_logger_factory,
    _StatsBox,
    engine_config,
)
from server.operations.metrics import Metrics
from tests.unit.test_engine_config import _flags
from tests.unit.test_engine_lora_slots import _LIVE
from tests.unit.test_scale_capacity import dp_stat_loggers


def _sched(
    ctx: tuple[int, int] | None = (2, 700),
    gen: tuple[int, int] = (40, 40),
    running: int = 41,
    waiting: int = 3,
    skipped: int = 0,
    kv: float = 0.25,
    dummy: bool = False,
    elapsed_ms: float = 12.5,
) -> SchedulerStats:
    details = None
    if ctx is not None:
        details = SchedulerIterationDetails(
            iteration_index=7,
            num_ctx_requests=ctx[0],
            num_ctx_tokens=ctx[1],
            num_generation_requests=gen[0],
            num_generation_tokens=gen[1],
            elapsed_ms=elapsed_ms,
            is_dummy=dummy,
        )
    return SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_skipped_waiting_reqs=skipped,
        kv_cache_usage=kv,
        prefix_cache_stats=PrefixCacheStats(),
        iteration_details=details,
    )


def test_a_step_with_iteration_details_becomes_an_engine_step() -> None:
    box = _StatsBox()
    woken: list[int] = []
    box.on_step = lambda: woken.append(1)
    log = _stat_logger_factory(box)(None, 0)
    log.record(_sched(skipped=2), None)
    assert box.take_steps() == [EngineStep(0, 700, 40, 42, 41, 5, 0.25)]
    assert box.take_steps() == []  # taken once
    assert woken == [1]
    s = box.get()
    assert (s.steps_total, s.prefill_tokens_total, s.decode_tokens_total) == (1, 700, 40)
    assert s.step_seconds_total == 0.0125  # elapsed_ms 12.5


def test_steps_without_details_or_dummy_ones_are_no_engine_steps() -> None:
    box = _StatsBox()
    woken: list[int] = []
    box.on_step = lambda: woken.append(1)
    log = _stat_logger_factory(box)(None, 0)
    log.record(_sched(ctx=None), None)  # the flag off, or a step that scheduled nothing
    log.record(_sched(dummy=True), None)  # a DP rank keeping in step with the others
    assert box.take_steps() == [] and woken == []
    s = box.get()
    assert (s.steps_total, s.prefill_tokens_total) == (2, 0)  # stats still arrived
    assert s.step_seconds_total == 0.0  # a dummy step's time is not a step's


def test_the_longest_step_of_the_last_minute_is_kept() -> None:
    """What a health check waits for (server/engines/restarts.py, rule 1)."""
    box = _StatsBox()
    log = _stat_logger_factory(box)(None, 0)
    for ms in (12.5, 2000.0, 500.0):
        log.record(_sched(elapsed_ms=ms), None)
    assert box.get().longest_step_s == 2.0
    window = _LongestStep(60.0)
    assert [window.add(t, s) for t, s in ((0, 2.0), (30, 0.5), (61, 0.1), (95, 0.2))] == [
        2.0,
        2.0,
        0.5,  # the 2 s step left the window
        0.2,
    ]


def test_each_rank_reports_its_own_steps() -> None:
    box, adapter = dp_stat_loggers()
    adapter.record(_sched(running=10), None, engine_idx=0)
    adapter.record(_sched(ctx=(1, 100), running=20, kv=0.5), None, engine_idx=1)
    steps = box.take_steps()
    assert [(s.rank, s.prefill_tokens, s.running, s.kv_usage) for s in steps] == [
        (0, 700, 10, 0.25),
        (1, 100, 20, 0.5),
    ]
    assert box.get().prefill_tokens_total == 800


def test_sluice_turns_vllms_iteration_details_on(demo_model_dir: Path) -> None:
    on = parse_serve_args(_flags(demo_model_dir), {}).engine_args
    assert on.enable_logging_iteration_details is True
    asked_off = _flags(demo_model_dir, "--no-enable-logging-iteration-details")
    args = parse_serve_args(asked_off, {}).engine_args
    assert args.enable_logging_iteration_details is True  # the room needs them
    assert engine_config(args).observability_config.enable_logging_iteration_details


def test_vllms_line_per_step_is_dropped_and_its_summary_kept() -> None:
    """vLLM 0.32's LoggingStatLogger, fed a step with details, logs one INFO line for
    it (_log_iteration_details); the filter on its logger drops that line only."""
    from vllm.v1.metrics.loggers import LoggingStatLogger

    vllm_log = logging.getLogger("vllm.v1.metrics.loggers")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    vllm_log.addHandler(handler)
    level = vllm_log.level
    vllm_log.setLevel(logging.INFO)
    try:
        stat_log = LoggingStatLogger.__new__(LoggingStatLogger)
        stat_log.engine_index = 0
        stat_log.kv_cache_device = "CPU"
        stat_log._log_iteration_details(_sched(), 0)
        assert seen and "Iteration(7)" in seen[-1]
        seen.clear()
        drop = _NoIterationLines()
        vllm_log.addFilter(drop)
        try:
            stat_log._log_iteration_details(_sched(), 0)
            vllm_log.info("Engine 000: Avg prompt throughput: 1.0 tokens/s")
        finally:
            vllm_log.removeFilter(drop)
        assert seen == ["Engine 000: Avg prompt throughput: 1.0 tokens/s"]
    finally:
        vllm_log.removeHandler(handler)
        vllm_log.setLevel(level)


def test_the_counters_are_exported_with_their_definitions() -> None:
    m = Metrics()
    room = RoomCounters(
        steps=50,
        steps_held=40,
        underfed_steps=3,
        held_seconds=(("feed", 1.5), ("kv", 0.25)),
        underfed_policy_steps=2,
    )
    m.watch(
        lambda: {
            **_LIVE,
            "prefill_tokens": 900,
            "decode_tokens": 120,
            "step_seconds": 2.5,
            "room": room,
        }
    )
    text = m.render().decode()
    assert 'sluice_engine_step_tokens_total{kind="prefill"} 900.0' in text
    assert 'sluice_engine_step_tokens_total{kind="decode"} 120.0' in text
    assert "sluice_engine_step_seconds_total 2.5" in text
    assert "sluice_engine_steps_held_total 40.0" in text
    assert "sluice_engine_underfed_steps_total 3.0" in text
    assert "sluice_engine_underfed_policy_steps_total 2.0" in text
    assert 'sluice_backlog_held_seconds_total{rule="feed"} 1.5' in text
    assert 'sluice_backlog_held_seconds_total{rule="kv"} 0.25' in text
    assert "# HELP sluice_engine_underfed_steps_total Engine steps that left token budget" in text


@pytest.fixture(autouse=True)
def _no_leftover_filter() -> Iterator[None]:
    """The engine adds its filter to vLLM's logger once, at build; a test of this
    process that built one (the output path's) leaves it: off while these run."""
    log = logging.getLogger("vllm.v1.metrics.loggers")
    left = [f for f in log.filters if isinstance(f, _NoIterationLines)]
    for f in left:
        log.removeFilter(f)
    yield
    for f in left:
        log.addFilter(f)
