"""server.engines.driver.Driver on its own: a real batching.Coalescer and the FakeEngine, no HTTP.

What a caller may do to a Ticket (wait, read, leave at any point) must never
leave a request running in the engine, and refusals and failures reach every
waiting caller as a SluiceError with the right status.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from batching import (
    AdmissionState,
    Coalescer,
    CoalescerConfig,
    EngineCapacity,
    EngineStep,
    Request,
    group_key,
)
from server.engines.driver import Driver, Ticket
from server.errors import SluiceError
from server.wire.request import Sampling
from tests.fakes import FakeEngine
from tests.support import until

pytestmark = pytest.mark.timeout(30)

KEY = group_key("fake")


class _Stop(Exception):
    pass


@contextlib.asynccontextmanager
async def running(
    engine: FakeEngine | None = None, capacity: EngineCapacity | None = None, **config: Any
) -> AsyncIterator[tuple[Driver, FakeEngine]]:
    """A Driver running in its own task group; every task is cancelled on exit.
    `capacity` is the core's engine room (none by default: nothing held)."""
    engine = engine or FakeEngine()
    if capacity is not None:
        config["engine"] = capacity
    # As the server wires them: one switch for both adaptive rules.
    config.setdefault("release_lone", config.get("adaptive", True))
    driver = Driver(Coalescer(CoalescerConfig(**config)), engine)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(driver.run(), name="driver")
            yield driver, engine
            raise _Stop  # cancels the driver and any pump task it started
    except* _Stop:
        pass
    engine.shutdown()


_ids = iter(range(1_000_000))


def submit(
    driver: Driver,
    *,
    max_tokens: int = 5,
    prompt: tuple[int, ...] = (1, 2, 3),
    fingerprint: Any = None,
    rid: str | None = None,
) -> Ticket:
    now = driver.now()
    req = Request(
        id=rid or f"r{next(_ids)}",
        key=KEY,
        prompt_tokens=prompt,
        max_new_tokens=max_tokens,
        arrival=now,
        deadline=now + 60,
        fingerprint=fingerprint,
    )
    return driver.submit(
        req, FakeEngine.sampling_params(Sampling(max_tokens=max_tokens), max_tokens)
    )


async def read_all(ticket: Ticket) -> list[Any]:
    gen = await ticket.wait()
    return [out async for out in gen.outputs(ticket.id)]


async def settled(driver: Driver, engine: FakeEngine) -> None:
    """Nothing queued, nothing running, nothing left in the engine."""
    await until(lambda: not engine.unfinished, what=f"engine empty: {engine.unfinished}")
    await until(driver.idle.is_set, what="driver idle")
    assert driver.core.queued_requests == 0
    assert driver.core.pending_requests == 0
    assert driver.running_generations() == []
    assert not driver.busy


# ---------------------------------------------------------------------------


async def test_submit_wait_read_to_the_end() -> None:
    async with running(window=0) as (driver, engine):
        t = submit(driver, max_tokens=4)
        outs = await read_all(t)
        t.leave()
        assert [o.finished for o in outs] == [False, False, False, True]
        assert engine.added == [t.id] and engine.aborted == []
        await settled(driver, engine)


async def test_draining_refuses_new_submits_with_503() -> None:
    async with running(window=0) as (driver, engine):
        driver.set_state(AdmissionState.DRAINING)
        with pytest.raises(SluiceError) as info:
            submit(driver)
        assert info.value.status == 503
        assert info.value.retry_after is not None and info.value.retry_after >= 1
        assert "Retry-After" in info.value.headers()
        driver.set_state(AdmissionState.OK)  # draining is final
        with pytest.raises(SluiceError):
            submit(driver)
        assert engine.added == []


async def test_draining_lets_admitted_work_finish() -> None:
    async with running(window=0.05, adaptive=False) as (driver, engine):
        t = submit(driver, max_tokens=3)
        driver.set_state(AdmissionState.DRAINING)
        assert len(await read_all(t)) == 3
        t.leave()
        await settled(driver, engine)


async def test_a_lagging_reader_gets_the_outputs_merged() -> None:
    """vLLM's collector merges what a slow reader has not taken: one output
    with every token and the final finish reason, read the same way."""
    async with running(window=0) as (driver, engine):
        t = submit(driver, max_tokens=6)
        gen = await t.wait()
        await until(lambda: not engine.unfinished, what="all six produced, none read")
        outs = [out async for out in gen.outputs(t.id)]
        t.leave()
        assert len(outs) == 1 and outs[0].finished
        (choice,) = outs[0].outputs
        assert choice.token_ids == [1, 2, 3, 4, 5, 6] and choice.finish_reason == "length"
        assert choice.text == "<think>hmm</think>Hello world<think>"
        assert gen.completion_tokens == 6
        await settled(driver, engine)


async def test_refusals_map_to_status() -> None:
    async with running(window=5.0, adaptive=False, max_pending_requests=1) as (driver, engine):
        t = submit(driver, rid="same")
        with pytest.raises(SluiceError) as dup:
            submit(driver, rid="same")
        assert dup.value.status == 400
        with pytest.raises(SluiceError) as full:
            submit(driver)
        assert full.value.status == 503 and full.value.retry_after is not None
        t.leave()
        await settled(driver, engine)
        assert engine.added == []


async def test_fail_queued_raises_503_in_every_waiter() -> None:
    async with running(window=5.0, adaptive=False) as (driver, engine):
        tickets = [submit(driver), submit(driver, prompt=(9, 9))]
        waits = [asyncio.create_task(t.wait()) for t in tickets]
        await asyncio.sleep(0.01)
        assert driver.core.queued_requests == 2
        n = driver.fail_queued(SluiceError("shutting down", status=503, retry_after=5))
        assert n == 2
        for w in waits:
            with pytest.raises(SluiceError) as info:
                await w
            assert info.value.status == 503
        for t in tickets:
            t.leave()  # leaving after the failure is harmless
        assert engine.added == []
        await settled(driver, engine)


async def test_fail_running_raises_503_in_readers() -> None:
    async with running(engine=FakeEngine(step=0.01), window=0) as (driver, engine):
        single = submit(driver, max_tokens=500)
        fp = ("greedy",)
        shared = [submit(driver, max_tokens=500, prompt=(7,), fingerprint=fp) for _ in range(2)]
        readers = [asyncio.create_task(read_all(t)) for t in [single, *shared]]
        await until(lambda: len(engine.unfinished) == 2, what="two engine requests")
        assert len(driver.running_generations()) == 2
        n = driver.fail_running(SluiceError("memory", status=503, retry_after=10))
        assert n == 2
        for r in readers:
            with pytest.raises(SluiceError) as info:
                await r
            assert info.value.status == 503
        for t in [single, *shared]:
            t.leave()
        assert sorted(engine.aborted) == sorted(engine.added)
        await settled(driver, engine)


async def test_engine_died_fails_queued_and_running_then_refuses() -> None:
    async with running(engine=FakeEngine(step=0.01), window=5.0, adaptive=False) as (
        driver,
        engine,
    ):
        queued = submit(driver)
        wait = asyncio.create_task(queued.wait())
        await asyncio.sleep(0.01)
        driver.engine_died(RuntimeError("boom"))
        with pytest.raises(SluiceError) as info:
            await wait
        assert info.value.status == 503
        queued.leave()
        with pytest.raises(SluiceError) as refused:
            submit(driver)
        assert refused.value.status == 503
        assert engine.added == []


async def test_leave_while_queued_never_reaches_engine() -> None:
    # A window no loaded machine outlasts; a full batch (2) is released at once,
    # which shows the queue moved on without the one that left.
    async with running(window=30.0, adaptive=False, max_batch_seqs=2) as (driver, engine):
        t = submit(driver)
        wait = asyncio.create_task(t.wait())
        await asyncio.sleep(0)  # the waiter is waiting
        wait.cancel()
        t.leave()
        assert driver.core.queued_requests == 0
        later = [submit(driver, prompt=(4,)), submit(driver, prompt=(5,))]
        await until(lambda: len(engine.added) == 2, what="the next full batch")
        assert t.id not in engine.added
        for x in later:
            x.leave()
        await settled(driver, engine)


async def test_leave_mid_stream_aborts() -> None:
    async with running(engine=FakeEngine(step=0.01), window=0) as (driver, engine):
        t = submit(driver, max_tokens=500)
        gen = await t.wait()
        outputs = gen.outputs(t.id)
        await anext(outputs)
        await outputs.aclose()
        t.leave()
        await until(lambda: t.id in engine.aborted, what="abort")
        await settled(driver, engine)


async def test_cancelled_reader_then_leave_aborts() -> None:
    """The handler's case: aiohttp cancels it while it awaits the next output."""
    async with running(engine=FakeEngine(step=0.05), window=0) as (driver, engine):
        t = submit(driver, max_tokens=500)
        reader = asyncio.create_task(read_all(t))
        await until(lambda: t.id in engine.unfinished, what="running")
        await asyncio.sleep(0.06)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        t.leave()
        await until(lambda: t.id in engine.aborted, what="abort")
        await settled(driver, engine)


async def test_leave_after_dispatch_before_wait_aborts() -> None:
    """A ticket resolved by dispatch but never awaited (a multi-prompt caller that
    went away while awaiting an earlier prompt) still aborts on leave()."""
    async with running(engine=FakeEngine(step=0.01), window=0) as (driver, engine):
        t = submit(driver, max_tokens=500)
        await until(t.future.done, what="dispatched")
        t.leave()  # e.g. the first of several prompts failed; this one was never awaited
        await until(lambda: t.id in engine.aborted, timeout=1.0, what="abort")
        await settled(driver, engine)


async def test_dedupe_one_reader_leaves_other_reads_everything() -> None:
    async with running(engine=FakeEngine(step=0.005), window=0.02, adaptive=False) as (
        driver,
        engine,
    ):
        a, b = (submit(driver, max_tokens=20, fingerprint=("g",)) for _ in range(2))
        ga, gb = await a.wait(), await b.wait()
        assert ga is gb and len(engine.added) == 1
        it = ga.outputs(a.id)
        await anext(it)
        await it.aclose()
        a.leave()
        outs = [o async for o in gb.outputs(b.id)]
        b.leave()
        assert len(outs) == 20 and outs[-1].finished
        assert engine.aborted == []
        await settled(driver, engine)


@pytest.mark.parametrize("seed", range(12))
async def test_any_mix_of_leaves_leaves_the_engine_empty(seed: int) -> None:
    """Random callers wait, read some outputs and leave at random points."""
    rng = random.Random(seed)
    async with running(
        engine=FakeEngine(step=0.002),
        window=rng.choice([0, 0.01, 0.03]),
        adaptive=rng.random() < 0.5,
    ) as (driver, engine):

        async def caller(t: Ticket, plan: str, k: int) -> None:
            try:
                if plan == "leave-queued":
                    await asyncio.sleep(rng.random() * 0.005)
                    return
                gen = await t.wait()
                if plan == "leave-at-once":
                    return
                n = 0
                async for _ in gen.outputs(t.id):
                    n += 1
                    if plan == "read-some" and n >= k:
                        break
            finally:
                t.leave()

        tasks = []
        cancel_later = []
        for _ in range(rng.randint(3, 10)):
            fp = ("g", rng.randint(0, 2)) if rng.random() < 0.5 else None
            prompt = (rng.randint(1, 3),) if fp else (rng.randint(1, 50),)
            t = submit(driver, max_tokens=rng.randint(1, 30), prompt=prompt, fingerprint=fp)
            plan = rng.choice(["leave-queued", "leave-at-once", "read-some", "read-all", "cancel"])
            task = asyncio.create_task(caller(t, plan, rng.randint(1, 10)))
            tasks.append(task)
            if plan == "cancel":
                cancel_later.append(task)
            await asyncio.sleep(0)  # the caller is inside its try before anything else
            await asyncio.sleep(rng.random() * 0.003)
        await asyncio.sleep(rng.random() * 0.02)
        for task in cancel_later:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await settled(driver, engine)


async def test_window_deadline_releases_even_when_the_timer_fires_early() -> None:
    """Event loops may run a timer slightly before its deadline (uvloop: up to
    1 ms). The driver's clock here lags the loop's by 2 ms, so every timer is
    "early": a batch must still go at its deadline, not when some unrelated
    wake-up (the running generation finishing) comes along."""
    loop = asyncio.get_running_loop()
    engine = FakeEngine(step=0.2)  # the first generation runs for seconds
    driver = Driver(
        Coalescer(CoalescerConfig(window=0.01)), engine, clock=lambda: loop.time() - 0.002
    )
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(driver.run(), name="driver")
            first = submit(driver, max_tokens=30)
            await first.wait()  # dispatched at once: the engine was idle
            second = submit(driver, max_tokens=2)
            await asyncio.wait_for(second.wait(), 1.0)  # the window is 10 ms
            first.leave()
            second.leave()
            raise _Stop
    except* _Stop:
        pass
    engine.shutdown()


async def test_an_engine_step_reaches_the_core_and_releases_the_room_it_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The driver hands each reported engine step to the core and looks again at
    once: the room follows the step (batching/room.py rule 2), not a timer."""
    monkeypatch.setattr("server.engines.driver.BACKLOG_RECHECK", 60.0)  # no second look
    engine = FakeEngine(step=0.05)
    cap = EngineCapacity(max_seqs=2, step_tokens=1000)
    async with running(engine, cap, window=0.0, feed_steps=1.0) as (driver, _):
        tickets = [submit(driver, max_tokens=500) for _ in range(5)]
        await until(lambda: len(engine.added) == 2)
        for t in tickets[:2]:  # their first outputs: both run (started, 25 s to go)
            outputs = (await t.wait()).outputs(t.id)
            await anext(outputs)
            await outputs.aclose()
        assert driver.core.engine_waiting == 0
        await asyncio.sleep(0.1)  # no step reported: nothing more goes
        assert len(engine.added) == 2 and driver.core.backlog_generations == 3
        # The engine says its step ran both and neither runs now: two slots free.
        engine.report_steps(EngineStep(0, 0, 2, 2, 0, 0, 0.0))
        await until(lambda: len(engine.added) == 4, timeout=2.0)
        c = driver.core.room_counters
        assert (c.steps, c.steps_held, c.underfed_steps) == (1, 1, 0)
        for t in tickets:
            t.leave()
        await settled(driver, engine)


async def test_each_request_goes_to_the_rank_the_core_placed_it_on() -> None:
    """Data parallelism: the core names a rank for each release (batching/room.py
    `place`) and the driver hands it to the engine (vLLM's data_parallel_rank); with
    one rank it names none."""
    two = EngineCapacity(max_seqs=2, step_tokens=1000, ranks=2)
    engine = FakeEngine(step=0.05)
    async with running(engine, two, window=0) as (driver, engine):
        tickets = [submit(driver, max_tokens=3) for _ in range(4)]
        for t in tickets:
            await t.wait()
        assert [engine.ranks[t.id] for t in tickets] == [0, 1, 0, 1]
        for t in tickets:
            await read_all(t)
    async with running(window=0) as (driver, engine):
        t = submit(driver)
        await read_all(t)
        assert engine.ranks[t.id] is None
