"""server/engines/vllm_adapter.py's lighten_output_path on vLLM's own stat-logger manager.

Issue 27, item 3: what vLLM's in-process output path computes for every output
and Sluice never uses is taken out once the engine is built; what Sluice reads
(its own stat logger) stays.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm import envs
from vllm.v1.metrics.loggers import (
    PerEngineStatLoggerAdapter,
    PrometheusStatLogger,
    StatLoggerManager,
)

from server.cli import parse_serve_args
from server.engines.vllm_adapter import (
    _stat_logger_factory,
    _StatsBox,
    engine_config,
    lighten_output_path,
)


@pytest.fixture
def clean_envs() -> Iterator[None]:
    """The process's vLLM environment reads uncached again afterwards."""
    envs.disable_envs_cache()
    yield
    envs.disable_envs_cache()


def test_vllms_prometheus_logger_goes_and_sluices_stays(
    demo_model_dir: Path, clean_envs: None
) -> None:
    flags = ["--model", str(demo_model_dir), "--max-model-len", "8192"]
    config = engine_config(parse_serve_args(flags, {}).engine_args)
    box = _StatsBox()
    # As AsyncLLM builds it: Sluice's factory, vLLM's defaults and its Prometheus logger.
    manager = StatLoggerManager(config, [0], custom_stat_loggers=[_stat_logger_factory(box)])
    assert any(isinstance(lg, PrometheusStatLogger) for lg in manager.stat_loggers)
    before = [lg for lg in manager.stat_loggers if not isinstance(lg, PrometheusStatLogger)]
    assert not envs._is_envs_cache_enabled()

    lighten_output_path(SimpleNamespace(logger_manager=manager))

    assert manager.stat_loggers == before
    assert any(isinstance(lg, PerEngineStatLoggerAdapter) for lg in manager.stat_loggers)
    assert envs._is_envs_cache_enabled()


def test_an_engine_without_a_logger_manager_is_left_as_it_is(clean_envs: None) -> None:
    llm = SimpleNamespace()
    lighten_output_path(llm)
    assert vars(llm) == {}
    assert envs._is_envs_cache_enabled()
