"""The engine's LoRA slots reach the backlog, and steps that waited for an adapter
are counted (server/engines/vllm_adapter.py `max_loras`, `adapter_waited`;
server/operations/metrics.py).

On replayed engine configurations (vLLM's own `create_engine_config` on the flags; no
engine starts) and vLLM's own SchedulerStats, through its stat-logger adapter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

from server.cli import parse_serve_args
from server.engines.interface import ModelInfo
from server.engines.vllm_adapter import _stat_logger_factory, _StatsBox, engine_config, max_loras
from server.operations.metrics import Metrics
from server.settings import engine_capacity
from tests.unit.test_engine_config import _flags
from tests.unit.test_scale_capacity import dp_stat_loggers


def test_max_loras_from_vllms_lora_config(demo_model_dir: Path) -> None:
    on = _flags(demo_model_dir, "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8")
    config = engine_config(parse_serve_args(on, {}).engine_args)
    assert max_loras(config) == 3
    off = engine_config(parse_serve_args(_flags(demo_model_dir), {}).engine_args)
    assert off.lora_config is None
    assert max_loras(off) == 0


def test_the_capacity_carries_max_loras() -> None:
    info = ModelInfo("m", 4096, None, 0, max_num_seqs=128, max_loras=2)
    assert engine_capacity(info).max_loras == 2
    assert engine_capacity(ModelInfo("m", 4096, None, 0)).max_loras == 0


def _sched(waiting: dict[str, int], running: dict[str, int]) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=sum(running.values()),
        num_waiting_reqs=sum(waiting.values()),
        kv_cache_usage=0.1,
        prefix_cache_stats=PrefixCacheStats(),
        waiting_lora_adapters=waiting,
        running_lora_adapters=running,
    )


def test_a_step_counts_when_an_adapter_waits_with_none_running() -> None:
    box = _StatsBox()
    log = _stat_logger_factory(box)(None, 0)
    log.record(_sched({}, {}), None)  # LoRA off, or nothing waiting
    log.record(_sched({"a": 2}, {"a": 3}), None)  # a waits beside its own running work
    log.record(_sched({"a": 0}, {"a": 3}), None)
    assert box.get().adapter_wait_steps_total == 0
    log.record(_sched({"c": 4}, {"a": 3, "b": 1}), None)  # c has no slot
    log.record(_sched({"c": 4, "d": 1}, {"a": 3, "b": 1}), None)  # one step, not two
    assert box.get().adapter_wait_steps_total == 2
    assert box.get().steps_total == 5  # the share's denominator: every step


def test_each_rank_counts_its_own_steps() -> None:
    box, adapter = dp_stat_loggers()
    adapter.record(_sched({"c": 1}, {"a": 1}), None, engine_idx=0)
    adapter.record(_sched({"c": 1}, {"c": 1}), None, engine_idx=1)
    adapter.record(_sched({"b": 1}, {}), None, engine_idx=1)
    assert box.get().adapter_wait_steps_total == 2


def test_the_counter_is_exported_with_its_definition() -> None:
    m = Metrics()
    m.watch(lambda: {**_LIVE, "adapter_wait_steps": 7, "engine_steps": 40})
    text = m.render().decode()
    assert "sluice_engine_adapter_wait_steps_total 7.0" in text
    assert "sluice_engine_steps_total 40.0" in text
    assert "# HELP sluice_engine_adapter_wait_steps_total Engine steps in which" in text


_LIVE = {
    "queue_requests": 0,
    "queue_tokens": 0,
    "pending_requests": 0,
    "engine_running": 0,
    "engine_waiting": 0,
    "kv_cache_usage": 0.0,
    "ranks": (),
    "preemptions": 0,
    "prefix_queries": 0,
    "prefix_hits": 0,
    "ready": 1,
    "backlog": 0,
    "unstarted": 0,
    "callers": (),
}


def test_the_adapter_wait_flag(demo_cache_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--demo-cache-dir", str(demo_cache_root)]
    assert parse_serve_args(base, {}).core.adapter_wait == 0.0
    s = parse_serve_args([*base, "--backlog-adapter-wait", "0.25"], {})
    assert s.core.adapter_wait == 0.25
    with pytest.raises(SystemExit) as exit_:
        parse_serve_args([*base, "--backlog-adapter-wait", "-1"], {})
    assert exit_.value.code == 2
    assert "adapter wait" in capsys.readouterr().err
