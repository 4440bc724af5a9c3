"""server/engines/thread_batcher.py: jobs that arrive while a batch runs go together next."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from server.engines.thread_batcher import Batcher
from tests.support import until


async def test_jobs_arriving_during_a_batch_go_together() -> None:
    calls: list[list[int]] = []
    gate = threading.Event()

    def work(jobs: list[int]) -> list[int | BaseException]:
        calls.append(list(jobs))
        if len(calls) == 1:
            gate.wait(5)  # hold the first batch while more jobs arrive
        return [j * 10 for j in jobs]

    with ThreadPoolExecutor(1) as pool:
        b: Batcher[int, int] = Batcher(pool, work)
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(b.submit(i)) for i in (2, 3, 4)]
        await asyncio.sleep(0.05)
        gate.set()
        assert await first == 10
        assert await asyncio.gather(*rest) == [20, 30, 40]
    assert calls == [[1], [2, 3, 4]]


async def test_a_call_takes_at_most_max_jobs_in_order() -> None:
    calls: list[list[int]] = []
    gate = threading.Event()

    def work(jobs: list[int]) -> list[int | BaseException]:
        calls.append(list(jobs))
        if len(calls) == 1:
            gate.wait(5)
        return [-j for j in jobs]

    with ThreadPoolExecutor(1) as pool:
        b: Batcher[int, int] = Batcher(pool, work, max_jobs=2)
        first = asyncio.ensure_future(b.submit(0))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(b.submit(i)) for i in range(1, 6)]
        await asyncio.sleep(0.05)
        gate.set()
        assert await asyncio.gather(first, *rest) == [0, -1, -2, -3, -4, -5]
    assert calls == [[0], [1, 2], [3, 4], [5]]
    with pytest.raises(ValueError):
        Batcher(pool, work, max_jobs=0)


async def test_errors_are_per_job() -> None:
    def work(jobs: list[str]) -> list[str | BaseException]:
        return [ValueError(j) if j == "bad" else j.upper() for j in jobs]

    with ThreadPoolExecutor(1) as pool:
        b: Batcher[str, str] = Batcher(pool, work)
        ok = asyncio.ensure_future(b.submit("ok"))
        bad = asyncio.ensure_future(b.submit("bad"))
        assert await ok == "OK"
        with pytest.raises(ValueError, match="bad"):
            await bad


async def test_a_job_cancelled_while_it_waits_is_left_out_of_the_next_call() -> None:
    calls: list[list[str]] = []
    gate = threading.Event()

    def work(jobs: list[str]) -> list[str | BaseException]:
        calls.append(list(jobs))
        if len(calls) == 1:
            gate.wait(5)  # hold the first call while two more jobs queue
        return [j.upper() for j in jobs]

    with ThreadPoolExecutor(1) as pool:
        b: Batcher[str, str] = Batcher(pool, work)
        first = asyncio.ensure_future(b.submit("first"))
        await until(lambda: calls == [["first"]], what="the first call")
        gone = asyncio.ensure_future(b.submit("gone"))
        kept = asyncio.ensure_future(b.submit("kept"))
        await asyncio.sleep(0.01)  # both wait in the batcher behind the first call
        assert calls == [["first"]]
        gone.cancel()
        gate.set()
        assert await first == "FIRST"
        assert await asyncio.wait_for(kept, 5) == "KEPT"
    assert calls == [["first"], ["kept"]]
    assert gone.cancelled()


async def test_a_job_cancelled_during_its_call_leaves_the_others_served() -> None:
    calls: list[list[str]] = []
    gates = [threading.Event(), threading.Event()]

    def work(jobs: list[str]) -> list[str | BaseException]:
        calls.append(list(jobs))
        if len(calls) <= len(gates):
            gates[len(calls) - 1].wait(5)
        return [j.upper() for j in jobs]

    with ThreadPoolExecutor(1) as pool:
        b: Batcher[str, str] = Batcher(pool, work)
        lead = asyncio.ensure_future(b.submit("lead"))
        await until(lambda: len(calls) == 1, what="the first call")
        rest = [asyncio.ensure_future(b.submit(j)) for j in ("a", "gone", "c")]
        await asyncio.sleep(0.01)
        gates[0].set()
        assert await lead == "LEAD"
        await until(lambda: len(calls) == 2, what="the second call")
        assert calls[1] == ["a", "gone", "c"]
        rest[1].cancel()  # while the call holding it runs
        await asyncio.sleep(0)
        gates[1].set()
        assert await asyncio.wait_for(asyncio.gather(rest[0], rest[2]), 5) == ["A", "C"]
        assert await asyncio.wait_for(b.submit("after"), 5) == "AFTER"
    assert rest[1].cancelled()
