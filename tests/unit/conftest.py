"""Fixtures for handler tests: the real app on a real loopback socket, run with
the server options `sluice serve` uses, with a fake engine from tests/fakes.py
standing in for vLLM."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from batching import CoalescerConfig
from server.app import build_app
from server.http.middleware import server_options
from server.settings import Settings
from server.state import RUNTIME, Phase
from tests.fakes import FakeEngine

AppFactory = Callable[..., Any]


@pytest.fixture
async def make_client() -> AsyncIterator[AppFactory]:
    """make_client(engine=None, **settings) -> (client, app, engine), ready to serve."""
    clients: list[TestClient[Any, Any]] = []

    async def make(engine: FakeEngine | None = None, wait_ready: bool = True, **overrides: Any):
        """Keyword arguments set Settings fields, or the coalescer's when they
        name a CoalescerConfig field (window=..., adaptive=...)."""
        engine = engine or FakeEngine()
        core_fields = {f.name for f in dataclasses.fields(CoalescerConfig)}
        core = {k: overrides.pop(k) for k in list(overrides) if k in core_fields}
        settings = dataclasses.replace(
            Settings(model_name="fake", model_path="/models/fake"),
            core=CoalescerConfig(**core),
            **overrides,
        )
        app = build_app(settings, engine)
        server = TestServer(app)
        # TestServer ignores its constructor's server arguments; start_server
        # takes them (handler_cancellation is on there already, as in serve()).
        await server.start_server(**server_options())
        client: TestClient[Any, Any] = TestClient(server)
        await client.start_server()
        clients.append(client)
        if wait_ready:
            import asyncio

            for _ in range(500):
                if app[RUNTIME].phase is Phase.READY:
                    break
                await asyncio.sleep(0.01)
        return client, app, engine

    yield make
    for c in clients:
        await c.close()
