"""Critical memory aborts running work: the watchdog as the app wires it.

The app is built with the production `watchdog_factory`, so the policy reads
the engine's statistics through the same `EngineReader` and its abort
requests reach `abort_for_memory` through the same `on_abort` callback. The
fake engine's statistics say what a thrashing vLLM would: KV cache 99% used
and preemptions rising. Each new preemption seen in CRITICAL asks for one
abort, and the server picks the lowest-priority request first, then the
newest.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson
from aiohttp.test_utils import TestClient, TestServer

from batching.pressure import EngineStats, PressureConfig
from server.app import build_app, watchdog_factory
from server.settings import Settings
from server.state import MODELS, RUNTIME, AdmissionState, Phase
from tests.fakes import FakeEngine
from tests.support import until

# Host memory and VRAM cannot decide here: only the engine's KV reading can, and
# one preemption at a full cache counts as a storm (the defaults want 100 in 5 s).
KV_ONLY = PressureConfig(
    host_critical_available_mib=0,
    host_shed_available_mib=1,
    host_leave_available_mib=2,
    preempt_leave=1,
    preempt_shed=1,
    preempt_critical=1,
)


def _thrashing(preemptions: int) -> EngineStats:
    return EngineStats(0.99, running=3, waiting=0, preemptions_total=preemptions)


def _chat(priority: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": f"p{priority}"}],
        "max_tokens": 2000,  # 20 s at the fake's 10 ms per token: nothing ends by itself
        "priority": priority,
        "stream": stream,
    }


async def _events(resp: Any, into: list[dict[str, Any]]) -> None:
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: {"):
            into.append(orjson.loads(line[6:]))


async def test_critical_memory_aborts_lowest_priority_then_newest() -> None:
    engine = FakeEngine(step=0.01, max_model_len=4096)
    settings = dataclasses.replace(
        Settings(model_name="fake", model_path="/models/fake"),
        pressure=KV_ONLY,
        watchdog_interval=0.01,
    )
    app = build_app(settings, engine, watchdog_factory=watchdog_factory(settings))
    client: TestClient[Any, Any] = TestClient(TestServer(app, handler_cancellation=True))
    await client.start_server()
    try:
        await until(lambda: app[RUNTIME].phase is Phase.READY, what="ready")
        # Oldest first: a stream at priority 0, a plain request at priority 5
        # (the lowest), then the newest, a stream at priority 0.
        oldest = await client.post("/v1/chat/completions", json=_chat(0, True))
        await until(
            lambda: len(app[MODELS].default.driver.running_generations()) == 1, what="oldest"
        )
        low = asyncio.ensure_future(client.post("/v1/chat/completions", json=_chat(5, False)))
        await until(lambda: len(app[MODELS].default.driver.running_generations()) == 2, what="low")
        newest = await client.post("/v1/chat/completions", json=_chat(0, True))
        await until(
            lambda: len(app[MODELS].default.driver.running_generations()) == 3, what="newest"
        )
        gens = {g.priority: g for g in app[MODELS].default.driver.running_generations()}
        oldest_events: list[dict[str, Any]] = []
        newest_events: list[dict[str, Any]] = []
        readers = [
            asyncio.ensure_future(_events(oldest, oldest_events)),
            asyncio.ensure_future(_events(newest, newest_events)),
        ]

        engine.stats_value = _thrashing(1)
        await until(lambda: app[RUNTIME].admission is AdmissionState.CRITICAL, what="critical")
        assert engine.aborted == []  # entering CRITICAL aborts nothing by itself

        engine.stats_value = _thrashing(2)  # still preempting: one abort
        r = await asyncio.wait_for(low, 5)
        assert r.status == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert (await r.json())["error"]["code"] == "memory"
        assert engine.aborted == [gens[5].engine_id]

        engine.stats_value = _thrashing(3)  # one more: now the newest of priority 0
        await until(lambda: len(engine.aborted) == 2, what="second abort")
        await asyncio.wait_for(readers[1], 5)
        assert newest_events[-1]["error"]["code"] == "memory"
        assert not any("error" in e for e in oldest_events)

        await asyncio.sleep(0.1)  # no new preemptions: no more aborts
        assert len(engine.aborted) == 2
        assert [g.priority for g in app[MODELS].default.driver.running_generations()] == [0]
        metrics = (await (await client.get("/metrics")).text()).splitlines()
        assert 'sluice_rejections_total{reason="memory_abort"} 2.0' in metrics
        readers[0].cancel()
        oldest.close()
    finally:
        await client.close()
