"""Several models behind one front (issue 30): the real app on a loopback socket,
one fake engine per model (tests/fakes.py). A request names its model; an
on-demand model loads for it (bounded by --load-timeout) and unloads when idle
or to make room, never under work in flight; a failing load is a clear error
and the other models keep serving (server/engines/registry.py, loader.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from server.app import WatchdogFactory, build_app
from server.callers import parse_callers
from server.engines.registry import Load, ModelSpec, State
from server.http.middleware import server_options
from server.settings import Settings
from server.state import MODELS, RUNTIME, Phase
from tests.fakes import FakeEngine
from tests.support import until
from tests.unit.test_access import access_lines
from tests.unit.test_handlers import CHAT, HI, assert_error, retry_after, scrape

pytestmark = pytest.mark.timeout(30)

MIB = 2**20


def spec(name: str, load: Load = Load.START, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, path=f"/models/{name}", load=load, **kw)


def ask(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": HI, "max_tokens": 5, **kw}


@dataclasses.dataclass
class Served:
    client: TestClient[Any, Any]
    app: Any
    # Every engine object made, by model, in order (a fresh one after each unload).
    made: dict[str, list[FakeEngine]]

    def engine(self, name: str) -> FakeEngine:
        return self.made[name][-1]

    def state(self, name: str) -> State:
        entry = self.app[MODELS].get(name)
        assert entry is not None
        return entry.state


Make = Callable[..., Any]


@pytest.fixture
async def serve_models() -> AsyncIterator[Make]:
    """serve_models(specs, engine=factory or None, **settings) -> Served, ready."""
    clients: list[TestClient[Any, Any]] = []

    async def make(
        specs: tuple[ModelSpec, ...],
        engine: Callable[[ModelSpec], FakeEngine] | None = None,
        wait_ready: bool = True,
        watchdog: WatchdogFactory | None = None,
        **overrides: Any,
    ) -> Served:
        made: dict[str, list[FakeEngine]] = {s.name: [] for s in specs}

        def engines(s: ModelSpec) -> FakeEngine:
            e = engine(s) if engine is not None else FakeEngine()
            made[s.name].append(e)
            return e

        settings = dataclasses.replace(
            Settings(model_name=specs[0].name, model_path=specs[0].path),
            models=specs,
            warmup=False,
            **overrides,
        )
        app = build_app(settings, engines=engines, watchdog_factory=watchdog)
        server = TestServer(app)
        await server.start_server(**server_options())
        client: TestClient[Any, Any] = TestClient(server)
        await client.start_server()
        clients.append(client)
        if wait_ready:
            await until(lambda: app[RUNTIME].phase is Phase.READY, what="ready")
        return Served(client, app, made)

    yield make
    for c in clients:
        await c.close()


async def cards(s: Served, **kw: Any) -> dict[str, dict[str, Any]]:
    resp = await s.client.get("/v1/models", **kw)
    assert resp.status == 200, await resp.text()
    return {c["id"]: c for c in (await resp.json())["data"]}


async def test_a_request_for_an_unloaded_model_waits_for_its_load(
    serve_models: Make, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice.access")
    gate = asyncio.Event()
    s = await serve_models(
        (spec("chat"), spec("spare", Load.ON_DEMAND)),
        engine=lambda sp: FakeEngine(start_gate=gate if sp.name == "spare" else None),
    )
    listed = await cards(s)
    assert [listed["chat"]["state"], listed["spare"]["state"]] == ["loaded", "unloaded"]
    assert (listed["spare"]["load"], listed["spare"]["kind"]) == ("on-demand", "generate")
    assert not s.engine("spare").started  # nothing starts it before it is asked for

    waiting = asyncio.create_task(
        s.client.post(CHAT, json=ask("spare"), headers={"x-request-id": "m-1"})
    )
    await until(lambda: s.state("spare") is State.LOADING, what="spare loading")
    assert (await cards(s))["spare"]["state"] == "loading"
    # The loaded model keeps serving meanwhile.
    assert (await s.client.post(CHAT, json=ask("chat"))).status == 200
    assert not waiting.done()
    gate.set()
    resp = await waiting
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["model"] == "spare"
    assert s.state("spare") is State.LOADED and s.engine("spare").added
    assert not s.engine("chat").added[1:]  # spare's request ran on spare's engine only

    [line] = access_lines(caplog, "m-1")
    assert line.fields["model"] == "spare"  # type: ignore[attr-defined]
    m = scrape(await (await s.client.get("/metrics")).text())
    by = {
        (x.labels["model"], x.labels["status"]): x.value
        for x in m["sluice_requests_total"]
        if x.labels["endpoint"] == "chat"
    }
    assert by == {("chat", "200"): 1.0, ("spare", "200"): 1.0}
    states = {
        x.labels["model"]: x.labels["state"] for x in m["sluice_model_state"] if x.value == 1.0
    }
    assert states == {"chat": "loaded", "spare": "loaded"}
    assert {x.labels["model"]: x.value for x in m["sluice_model_loads_total"]} == {
        "chat": 1.0,
        "spare": 1.0,
    }


async def test_an_unknown_model_is_the_same_404_as_with_one_model(serve_models: Make) -> None:
    s = await serve_models((spec("chat"), spec("spare", Load.ON_DEMAND)))
    err = await assert_error(
        await s.client.post(CHAT, json=ask("nope")), 404, code="model_not_found"
    )
    assert "nope" in err["message"]
    assert s.state("spare") is State.UNLOADED


async def test_a_load_past_the_load_timeout_is_a_503_with_retry_after(serve_models: Make) -> None:
    gate = asyncio.Event()
    s = await serve_models(
        (spec("chat"), spec("spare", Load.ON_DEMAND)),
        engine=lambda sp: FakeEngine(start_gate=gate if sp.name == "spare" else None),
        load_timeout=0.2,
    )
    resp = await s.client.post(CHAT, json=ask("spare"))
    err = await assert_error(resp, 503, code="model_loading")
    assert "--load-timeout" in err["message"]
    retry_after(resp)
    # The load goes on without its first waiter; the next request finds it done.
    assert s.state("spare") is State.LOADING
    gate.set()
    await until(lambda: s.state("spare") is State.LOADED, what="spare loaded")
    assert (await s.client.post(CHAT, json=ask("spare"))).status == 200


async def test_a_failing_load_is_a_clear_503_and_the_others_keep_serving(
    serve_models: Make,
) -> None:
    s = await serve_models(
        (spec("chat"), spec("broken", Load.ON_DEMAND)),
        engine=lambda sp: FakeEngine(fail_start=sp.name == "broken"),
    )
    resp = await s.client.post(CHAT, json=ask("broken"))
    err = await assert_error(resp, 503, code="model_load_failed")
    assert "broken" in err["message"] and "fake engine failed to start" in err["message"]
    retry_after(resp)
    assert s.state("broken") is State.FAILED
    # Not retried per request: the next one gets the same answer at once.
    await assert_error(await s.client.post(CHAT, json=ask("broken")), 503, code="model_load_failed")
    assert len(s.made["broken"]) == 2  # the failed engine was replaced, not started again
    assert (await s.client.post(CHAT, json=ask("chat"))).status == 200
    assert (await s.client.get("/health")).status == 200
    assert (await cards(s))["broken"]["state"] == "failed"


async def test_an_idle_on_demand_model_unloads_after_its_idle_time(serve_models: Make) -> None:
    s = await serve_models((spec("chat"), spec("spare", Load.ON_DEMAND, unload_after=0.2)))
    assert (await s.client.post(CHAT, json=ask("spare"))).status == 200
    first = s.engine("spare")
    await until(lambda: s.state("spare") is State.UNLOADED, what="idle unload")
    assert first.shut_down  # its engine (and with it its memory) is gone
    assert s.state("chat") is State.LOADED  # a start model stays
    assert (await s.client.post(CHAT, json=ask("spare"))).status == 200  # loads again
    assert s.engine("spare") is not first and s.engine("spare").started


async def test_ollamas_keep_alive_sets_an_on_demand_models_idle_time(serve_models: Make) -> None:
    """registry.py rule 7: an Ollama request's keep_alive replaces the model's
    unload-after from then on (0: as soon as it is idle; negative: never); a
    model loaded at start stays whatever it says."""
    s = await serve_models((spec("chat"), spec("spare", Load.ON_DEMAND, unload_after=3600)))

    async def ollama(model: str, keep_alive: Any) -> None:
        body = {"model": model, "messages": HI, "stream": False, "keep_alive": keep_alive}
        resp = await s.client.post("/api/chat", json=body)
        assert resp.status == 200, await resp.text()

    await ollama("spare", -1)  # loads it, to stay
    entry = s.app[MODELS].get("spare")
    assert entry is not None and entry.keep_alive == -1.0
    assert s.state("spare") is State.LOADED
    await ollama("spare", 0)  # Ollama's "unload it once done"
    await until(lambda: s.state("spare") is State.UNLOADED, what="unload at keep_alive 0")
    await ollama("chat", 0)
    assert s.state("chat") is State.LOADED  # a start model stays
    await ollama("spare", "50ms")
    assert s.state("spare") is State.LOADED
    await until(lambda: s.state("spare") is State.UNLOADED, what="unload after 50 ms idle")


async def test_the_least_recently_used_idle_model_makes_room_never_a_busy_one(
    serve_models: Make,
) -> None:
    """Room for two of three on-demand models: a third unloads the least recently
    used idle one; one with a request in flight stays even when it is older."""
    first_output = asyncio.Event()
    s = await serve_models(
        tuple(spec(n, Load.ON_DEMAND, footprint=100 * MIB) for n in ("a", "b", "c")),
        engine=lambda sp: FakeEngine(first_output=first_output if sp.name == "a" else None),
        memory_budget=200 * MIB,
    )
    first_output.set()
    assert (await s.client.post(CHAT, json=ask("a"))).status == 200
    assert (await s.client.post(CHAT, json=ask("b"))).status == 200
    assert (await s.client.post(CHAT, json=ask("c"))).status == 200
    # a was used least recently: it made room for c.
    assert [s.state(n) for n in "abc"] == [State.UNLOADED, State.LOADED, State.LOADED]
    assert s.made["a"][0].shut_down

    # a again: b is now the least recently used, and goes.
    assert (await s.client.post(CHAT, json=ask("a"))).status == 200
    assert [s.state(n) for n in "abc"] == [State.LOADED, State.UNLOADED, State.LOADED]

    # A request in flight on a (its first token held back), the oldest now; then
    # b: c, younger but idle, makes room, and a keeps its engine.
    first_output.clear()
    stream = asyncio.create_task(s.client.post(CHAT, json=ask("a", stream=True)))
    await until(lambda: bool(s.engine("a").held), what="a's request in the engine")
    entry_a = s.app[MODELS].get("a")
    entry_a.last_used = 0.0  # the least recently used, were it idle
    assert (await s.client.post(CHAT, json=ask("b"))).status == 200
    assert [s.state(n) for n in "abc"] == [State.LOADED, State.LOADED, State.UNLOADED]
    first_output.set()
    resp = await stream
    assert resp.status == 200
    await resp.read()


async def test_no_room_while_every_other_model_is_busy_is_a_503(serve_models: Make) -> None:
    first_output = asyncio.Event()
    s = await serve_models(
        tuple(spec(n, Load.ON_DEMAND, footprint=100 * MIB) for n in ("a", "b")),
        engine=lambda sp: FakeEngine(first_output=first_output if sp.name == "a" else None),
        memory_budget=150 * MIB,
        load_timeout=0.3,
    )
    stream = asyncio.create_task(s.client.post(CHAT, json=ask("a", stream=True)))
    await until(lambda: bool(s.made["a"] and s.engine("a").held), what="a busy")
    resp = await s.client.post(CHAT, json=ask("b"))
    await assert_error(resp, 503)
    retry_after(resp)
    assert s.state("a") is State.LOADED and not s.engine("a").shut_down
    first_output.set()
    assert (await stream).status == 200


async def test_a_callers_models_list_hides_the_others(serve_models: Make) -> None:
    table = parse_callers(
        '[callers.team]\nkey = "sk-team"\nmodels = ["chat"]\n[callers.all]\nkey = "sk-all"\n',
        base="chat",
        models=("chat", "spare"),
    )
    s = await serve_models(
        (spec("chat"), spec("spare", Load.ON_DEMAND)),
        caller_table=table,
        core=dataclasses.replace(Settings().core, callers=table.policies),
    )
    team = {"Authorization": "Bearer sk-team"}
    assert set(await cards(s, headers=team)) == {"chat"}
    assert set(await cards(s, headers={"Authorization": "Bearer sk-all"})) == {"chat", "spare"}
    await assert_error(
        await s.client.post(CHAT, json=ask("spare"), headers=team), 404, code="model_not_found"
    )
    assert s.state("spare") is State.UNLOADED  # a hidden model is not loaded for it
    assert (await s.client.post(CHAT, json=ask("chat"), headers=team)).status == 200


async def test_the_status_page_has_a_row_per_model(serve_models: Make) -> None:
    s = await serve_models((spec("chat"), spec("spare", Load.ON_DEMAND)))
    assert (await s.client.post(CHAT, json=ask("spare"))).status == 200

    async def rows() -> dict[str, dict[str, Any]]:
        body = await (await s.client.get("/status.json")).json()
        return {m["name"]: m for m in body["models"]}

    loop = asyncio.get_running_loop()
    end = loop.time() + 5
    while (await rows()).get("spare", {}).get("loads") != 1:
        assert loop.time() < end, await rows()
        await asyncio.sleep(0.05)
    got = await rows()
    assert (got["chat"]["state"], got["spare"]["state"]) == ("loaded", "loaded")
    assert got["spare"]["load"] == "on-demand" and got["spare"]["load_s"] is not None
    page = await (await s.client.get("/")).text()
    assert 'id="models"' in page
