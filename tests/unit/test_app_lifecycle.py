"""The app's life cycle with a fake engine: settings resolved against the
engine, task ownership, and shutdown that happens whatever went wrong."""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from server.app import build_app
from server.engines.interface import ModelInfo
from server.settings import Settings
from server.state import MODELS, RUNTIME, Phase
from tests.fakes import FakeEngine
from tests.support import until


def test_batch_caps_default_to_the_engines_resolved_limits() -> None:
    info = ModelInfo("m", 4096, 0, 0, max_num_seqs=1024, max_num_batched_tokens=8192)
    core = Settings().core_for(info)
    assert (core.max_batch_seqs, core.max_batch_tokens) == (1024, 8192)
    given = Settings(max_batch_seqs=7, max_batch_tokens=99).core_for(info)
    assert (given.max_batch_seqs, given.max_batch_tokens) == (7, 99)
    # An engine that reports nothing keeps the core's own defaults.
    unknown = Settings().core_for(ModelInfo("m", 4096, 0, 0))
    assert unknown.max_batch_seqs == Settings().core.max_batch_seqs


async def test_boot_applies_the_engine_limits_to_the_core(make_client: Any) -> None:
    engine = FakeEngine()
    engine.info = dataclasses.replace(engine.info, max_num_seqs=3, max_num_batched_tokens=77)
    _, app, _ = await make_client(engine=engine)
    cfg = app[MODELS].default.driver.core.config
    assert (cfg.max_batch_seqs, cfg.max_batch_tokens) == (3, 77)


class _CrashingWatchdog:
    async def run(self) -> None:
        raise RuntimeError("boom")

    def gpu_pids(self) -> frozenset[int] | None:  # the supervisor's look at the card
        return None


async def test_a_crashed_task_stops_the_server_and_the_engine_still_shuts_down() -> None:
    engine = FakeEngine()
    settings = Settings(model_name="fake", model_path="/models/fake", warmup=False)
    app = build_app(settings, engine, watchdog_factory=lambda _app: _CrashingWatchdog())  # type: ignore[arg-type,return-value]
    client: TestClient[Any, Any] = TestClient(TestServer(app))
    await client.start_server()
    rt = app[RUNTIME]
    try:
        await until(rt.stop.is_set, what="stop requested")
        assert rt.exit_code == 1
    finally:
        await client.close()
    assert rt.phase is Phase.STOPPED
    assert engine.shut_down
