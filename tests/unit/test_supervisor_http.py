"""One model's engine dies, the others serve and it comes back (issue 41): the
real app on a loopback socket, one fake engine per model (tests/fakes.py), the
death injected (`FakeEngine.kill`, a health check that never answers).
server/engines/supervisor.py and restarts.py; the real engines killed by
their pids are tests/integration/test_faults.py."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from batching import CoalescerConfig
from server.app import drain, reload_callers
from server.callers import load_callers
from server.engines.registry import ModelSpec, State
from server.engines.restarts import RestartPolicy
from server.operations.watchdog import NvmlReader, Watchdog
from server.state import CALLERS, MODELS, RUNTIME, Phase
from tests.fakes import FakeEngine
from tests.support import until
from tests.unit.test_handlers import CHAT, assert_error, events, retry_after
from tests.unit.test_models_http import Make, ask, serve_models, spec
from tests.unit.test_watchdog import fake_nvml

__all__ = ["serve_models"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(30)

FAST = RestartPolicy(restarts=2, window=600.0, base=0.05, cap=0.05)


async def _metrics(s: Any) -> str:
    return str(await (await s.client.get("/metrics")).text())


async def _stream(s: Any, model: str) -> Any:
    resp = await s.client.post(CHAT, json=ask(model, max_tokens=200, stream=True, temperature=1))
    assert resp.status == 200
    return resp


async def test_a_dead_engine_fails_its_own_streams_only_and_restarts(serve_models: Make) -> None:
    s = await serve_models(
        (spec("a"), spec("b")), engine=lambda _: FakeEngine(step=0.01), restarts=FAST
    )
    a = await _stream(s, "a")
    b = await _stream(s, "b")
    a_head = await a.content.readline()
    b_head = await b.content.readline()
    dead = s.engine("b")
    dead.kill()
    b_events = events((b_head + await b.content.read()).decode())
    errors = [e for e in b_events if "error" in e]
    assert len(errors) == 1 and b_events[-1] is errors[0]
    a_events = events((a_head + await a.content.read()).decode())
    assert not any("error" in e for e in a_events)
    assert a_events[-1]["choices"][0]["finish_reason"] == "length"
    # b comes back on a fresh engine; a request meanwhile waits for it.
    resp = await s.client.post(CHAT, json=ask("b"))
    assert resp.status == 200, await resp.text()
    assert s.state("b") is State.LOADED and s.engine("b") is not dead and dead.shut_down
    entry = s.app[MODELS].get("b")
    assert entry.deaths == 1 and entry.back_in_s is not None
    text = await _metrics(s)
    assert 'sluice_engine_deaths_total{cause="unknown",model="b"} 1.0' in text
    assert 'sluice_engine_restarts_total{model="b",outcome="ok"} 1.0' in text
    assert s.app[RUNTIME].phase is Phase.READY
    assert (await s.client.get("/health")).status == 200


class _Hanging(FakeEngine):
    """A fake whose health check stops answering once `hang` is set."""

    hang = False

    async def check_health(self) -> None:
        if self.hang:
            await asyncio.Event().wait()
        await super().check_health()


async def test_a_hung_engine_is_dead_and_restarts(serve_models: Make) -> None:
    s = await serve_models(
        (spec("a"), spec("b")),
        engine=lambda _: _Hanging(step=0.01),
        restarts=FAST,
        health_timeout=0.2,
    )
    hung = s.engine("b")
    assert isinstance(hung, _Hanging)
    hung.hang = True
    await until(lambda: s.app[MODELS].get("b").deaths == 1, timeout=10, what="the hang seen")
    await until(lambda: s.state("b") is State.LOADED, timeout=10, what="b back")
    assert s.engine("b") is not hung and hung.shut_down
    assert 'cause="health_check"' in await _metrics(s)
    assert (await s.client.post(CHAT, json=ask("a"))).status == 200


class _LongSteps(FakeEngine):
    """A fake whose steps take `step_s` each: a health check is answered after the
    step in progress, as an engine core answers between its steps."""

    step_s = 0.6
    checks = 0

    async def check_health(self) -> None:
        await asyncio.sleep(self.step_s)
        await super().check_health()
        self.checks += 1


async def test_an_engine_whose_steps_are_long_is_not_hung(serve_models: Make) -> None:
    """A CI run: a coding agent's 22,661-token prompt, prefilled in chunks on 2
    cores beside another test's engine, took steps past the 10 s timeout; the
    check waits for a few of the engine's own longest recent step."""
    s = await serve_models(
        (spec("a"), spec("b")),
        engine=lambda _: _LongSteps(step=0.01),
        restarts=FAST,
        health_timeout=0.2,
    )
    slow = s.engine("b")
    assert isinstance(slow, _LongSteps)
    slow.stats_value = dataclasses.replace(slow.stats_value, longest_step_s=slow.step_s)
    await until(lambda: slow.checks >= 2, timeout=10, what="two checks answered")
    assert s.app[MODELS].get("b").deaths == 0 and s.engine("b") is slow
    # a is as slow and says nothing of its steps: its check is one past the timeout.
    assert s.app[MODELS].get("a").deaths >= 1


class _KilledUnnoticed(_Hanging):
    """A fake whose core was killed (its handle reports -9) before vLLM noticed:
    `errored` still False, and the health check, sent to a dead core, unanswered."""

    killed = False

    def processes(self) -> tuple[tuple[int, int | None], ...]:
        return ((4242, -9),) if self.killed else ((4242, None),)


async def test_a_health_check_unanswered_by_an_exited_core_is_its_exit(
    serve_models: Make,
) -> None:
    """The health check times out before vLLM flags the dead core (a CI run on a
    loaded machine): the death is the exit its handle reports, SIGKILL, not a hang."""
    s = await serve_models(
        (spec("a"), spec("b")),
        engine=lambda _: _KilledUnnoticed(step=0.01),
        restarts=FAST,
        health_timeout=0.2,
    )
    dead = s.engine("b")
    assert isinstance(dead, _KilledUnnoticed)
    dead.killed = dead.hang = True
    await until(lambda: s.app[MODELS].get("b").deaths == 1, timeout=10, what="the death seen")
    await until(lambda: s.state("b") is State.LOADED, timeout=10, what="b back")
    text = await _metrics(s)
    assert 'sluice_engine_deaths_total{cause="SIGKILL",model="b"} 1.0' in text, text
    assert 'cause="health_check"' not in text


async def test_past_its_budget_a_model_is_failed_and_the_others_serve(serve_models: Make) -> None:
    s = await serve_models(
        (spec("a"), spec("b")),
        engine=lambda _: FakeEngine(step=0.01),
        restarts=RestartPolicy(restarts=0),
    )
    s.engine("b").kill()
    await until(lambda: s.state("b") is State.FAILED, timeout=10, what="b failed")
    resp = await s.client.post(CHAT, json=ask("b"))
    err = await assert_error(resp, 503, code="model_failed")
    assert "`b`" in err["message"] and "--engine-restarts" in err["message"]
    retry_after(resp)
    assert (await s.client.post(CHAT, json=ask("a"))).status == 200
    ready = await s.client.get("/ready")
    assert ready.status == 200 and (await ready.json())["models"] == {"a": "loaded", "b": "failed"}
    assert not s.app[RUNTIME].stop.is_set()


async def test_an_essential_model_past_its_budget_stops_the_process(serve_models: Make) -> None:
    essential = ModelSpec(name="b", path="/models/b", essential=True)
    s = await serve_models(
        (spec("a"), essential),
        engine=lambda _: FakeEngine(step=0.01),
        restarts=RestartPolicy(restarts=0),
    )
    s.engine("b").kill()
    await until(s.app[RUNTIME].stop.is_set, timeout=10, what="stop")
    assert s.app[RUNTIME].exit_code == 1
    await assert_error(await s.client.get("/health"), 503, code="engine_dead")


async def test_a_restart_that_fails_leaves_the_model_failed(serve_models: Make) -> None:
    made = 0

    def engines(_: ModelSpec) -> FakeEngine:
        nonlocal made
        made += 1
        # a's first, b's first, then b's restart: that one fails to start.
        return FakeEngine(step=0.01, fail_start=made == 3)

    s = await serve_models((spec("a"), spec("b")), engine=engines, restarts=FAST)
    s.engine("b").kill()
    await until(lambda: s.state("b") is State.FAILED, timeout=10, what="b failed")
    err = await assert_error(
        await s.client.post(CHAT, json=ask("b")), 503, code="model_load_failed"
    )
    assert "`b`" in err["message"] and "failed to start" in err["message"]
    assert 'outcome="failed"' in await _metrics(s)
    assert (await s.client.post(CHAT, json=ask("a"))).status == 200


async def test_during_the_start_a_request_waits_for_its_model(serve_models: Make) -> None:
    """The port is open while the engines start: /health answers, /ready says
    each model's state, and a request for a model still starting waits."""
    gate = asyncio.Event()
    s = await serve_models(
        (spec("a"),), engine=lambda _: FakeEngine(start_gate=gate), wait_ready=False
    )
    await until(lambda: s.state("a") is State.LOADING, what="a loading")
    assert s.app[RUNTIME].phase is Phase.STARTING
    assert (await s.client.get("/health")).status == 200
    err = await assert_error(await s.client.get("/ready"), 503, code="not_ready")
    assert "a: loading" in err["message"]
    pending = asyncio.create_task(s.client.post(CHAT, json=ask("a")))
    await until(lambda: s.app[MODELS].get("a").leases == 1, what="the request waiting")
    assert not pending.done()
    gate.set()
    resp = await asyncio.wait_for(pending, 10)
    assert resp.status == 200, await resp.text()


async def test_a_death_is_seen_at_once_not_at_the_next_look(serve_models: Make) -> None:
    """Between an engine's death and the supervisor's next look (every 0.5 s)
    a request for its model met the dead engine: a plain 503, where the
    restart was its answer. A request that finds its model's engine errored,
    and the driver that meets the death, tell the supervisor at once."""
    s = await serve_models(
        (spec("a"), spec("b")), engine=lambda _: FakeEngine(step=0.01), restarts=FAST
    )
    dead = s.engine("b")
    dead.kill()  # nothing in flight: only the next request meets the death
    resp = await s.client.post(CHAT, json=ask("b"))
    assert resp.status == 200, await resp.text()
    assert s.engine("b") is not dead and s.app[MODELS].get("b").deaths == 1
    # A stream that meets the death gets the restart's error, not a plain one.
    b = await _stream(s, "b")
    head = await b.content.readline()
    s.engine("b").kill()
    b_events = events((head + await b.content.read()).decode())
    assert b_events[-1]["error"]["code"] == "engine_restarting", b_events[-1]


async def test_sigterm_during_a_restart_drains_the_others_and_stops_the_restart(
    serve_models: Make,
) -> None:
    """Issue 41 item 5: the drain (a SIGTERM) ends a restart's back-off at
    once, so a request waiting for the restarted model is refused at once,
    not after the back-off (30 s here); the other model's stream finishes."""
    slow = RestartPolicy(restarts=2, window=600.0, base=30.0, cap=30.0)
    s = await serve_models(
        (spec("a"), spec("b")), engine=lambda _: FakeEngine(step=0.01), restarts=slow
    )
    a = await _stream(s, "a")
    s.engine("b").kill()
    await until(lambda: s.state("b") is State.RESTARTING, what="b restarting")
    waiting = asyncio.create_task(s.client.post(CHAT, json=ask("b")))
    await until(lambda: s.app[MODELS].get("b").leases == 1, what="a request waiting for b")
    await asyncio.wait_for(drain(s.app, 20.0), 10)
    await assert_error(await asyncio.wait_for(waiting, 1), 503, code="draining")
    a_events = events((await a.content.read()).decode())
    assert a_events[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in e for e in a_events)
    assert s.state("b") is State.FAILED and not s.engine("b").started  # never started again


async def test_sighup_during_a_restart_reloads_the_callers_and_leaves_the_restart(
    serve_models: Make, tmp_path: Path
) -> None:
    path = tmp_path / "callers.toml"
    path.write_text('[callers.chat]\nkey = "sk-chat"\n')
    table = load_callers(path, models=("a", "b"))
    gate = asyncio.Event()
    made = 0

    def engines(_: ModelSpec) -> FakeEngine:
        nonlocal made
        made += 1
        return FakeEngine(step=0.01, start_gate=gate if made == 3 else None)  # b's restart

    s = await serve_models(
        (spec("a"), spec("b")),
        engine=engines,
        restarts=FAST,
        caller_table=table,
        core=CoalescerConfig(callers=table.policies),
        callers_file=path,
    )
    s.engine("b").kill()
    await until(lambda: len(s.made["b"]) == 2, what="b starting again")
    path.write_text('[callers.chat]\nkey = "sk-chat-2"\n')
    assert await reload_callers(s.app) is True
    assert "chat" in s.app[CALLERS].table.names
    assert s.state("b") is State.RESTARTING  # the reload left the restart alone
    gate.set()
    await until(lambda: s.state("b") is State.LOADED, what="b back")
    key = {"Authorization": "Bearer sk-chat-2"}
    resp = await s.client.post(CHAT, json=ask("b"), headers=key)
    assert resp.status == 200, await resp.text()
    old = await s.client.post(CHAT, json=ask("b"), headers={"Authorization": "Bearer sk-chat"})
    await assert_error(old, 401)


# Above pid_max (2**22): no process of this machine's, so nothing real is signalled.
_CORE = 2**22 + 7


class _OnCard(FakeEngine):
    """A fake whose engine core (already exited, as after a kill -9) is a pid
    that NVML lists while `held` says so."""

    def processes(self) -> tuple[tuple[int, int | None], ...]:
        return ((_CORE, -9),)


async def test_on_a_gpu_the_restart_waits_until_the_card_has_let_go(serve_models: Make) -> None:
    """Issue 41 item 3: a dead engine's memory can outlive its process for a
    moment; the new engine starts only once NVML lists none of the old
    engine's processes."""
    held = {_CORE}
    looks = 0
    nvml = fake_nvml(count=1)

    def on_card(handle: int) -> list[Any]:
        nonlocal looks
        looks += 1
        return [type("P", (), {"pid": pid})() for pid in sorted(held)]

    nvml.nvmlDeviceGetComputeRunningProcesses = on_card

    def watchdog(app: Any) -> Watchdog:
        return Watchdog(gpu=NvmlReader(None, nvml=nvml), interval=60)

    s = await serve_models(
        (spec("a"), spec("b")),
        engine=lambda _: _OnCard(step=0.01),
        restarts=FAST,
        watchdog=watchdog,
    )
    dead = s.engine("b")
    dead.kill()
    await until(lambda: s.app[MODELS].get("b").deaths == 1, what="the death seen")
    await until(lambda: looks >= 5, what="the restart looking at the card")
    assert not s.engine("b").started and s.state("b") is State.RESTARTING
    held.clear()
    await until(lambda: s.state("b") is State.LOADED, what="b back once the card is free")


def test_nvml_lists_the_processes_on_the_watched_cards() -> None:
    nvml = fake_nvml(count=2)
    on = {0: [11, 12], 1: [12, 13]}
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        type("P", (), {"pid": pid})() for pid in on[h]
    ]
    assert NvmlReader("1", nvml=nvml).gpu_pids() == {12, 13}
    assert NvmlReader(None, nvml=nvml).gpu_pids() == {11, 12, 13}
    assert Watchdog().gpu_pids() is None  # no GPU reader: nothing to wait for
