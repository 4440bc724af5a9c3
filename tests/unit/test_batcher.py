"""server/batcher.py: jobs that arrive while a batch runs go together next."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from server.batcher import Batcher


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


async def test_errors_are_per_job_and_cancelled_jobs_are_skipped() -> None:
    seen: list[list[str]] = []

    def work(jobs: list[str]) -> list[str | BaseException]:
        seen.append(list(jobs))
        return [ValueError(j) if j == "bad" else j.upper() for j in jobs]

    with ThreadPoolExecutor(1) as pool:
        b: Batcher[str, str] = Batcher(pool, work)
        ok = asyncio.ensure_future(b.submit("ok"))
        bad = asyncio.ensure_future(b.submit("bad"))
        gone = asyncio.ensure_future(b.submit("gone"))
        gone.cancel()
        assert await ok == "OK"
        with pytest.raises(ValueError, match="bad"):
            await bad
        await asyncio.sleep(0.05)
    assert all("gone" not in batch for batch in seen[1:])
