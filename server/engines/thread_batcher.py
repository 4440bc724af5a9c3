"""Coalesce small jobs from many requests into one call on a worker thread.

Tokenizing on the event loop cost a naive front about 8% of its CPU
(DESIGN.md); one thread hop per request costs wake-ups instead. The batcher
keeps at most one batch in flight: jobs that arrive while it runs wait and go
together in the next call, so under load the tokenizer sees batches of many
texts (one trip into the Rust tokenizer) and at low load a job goes at once.
A call takes at most `max_jobs`: when a burst of long prompts arrives at
once, the first of them come back (and reach the engine) while the thread
works on the rest, instead of all of them after the whole burst.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

J = TypeVar("J")
R = TypeVar("R")


class Batcher(Generic[J, R]):
    """`await submit(job)` -> its result; `work(jobs)` runs on `executor` and
    returns one result (or exception instance) per job, in order."""

    def __init__(
        self,
        executor: Executor,
        work: Callable[[list[J]], list[R | BaseException]],
        max_jobs: int = 8,
    ):
        if max_jobs < 1:
            raise ValueError("max_jobs must be >= 1")
        self._executor = executor
        self._work = work
        self._max_jobs = max_jobs
        self._pending: list[tuple[J, asyncio.Future[R]]] = []
        self._busy = False

    async def submit(self, job: J) -> R:
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((job, fut))
        if not self._busy:
            self._start()
        return await fut

    def _start(self) -> None:
        self._pending = [(j, f) for j, f in self._pending if not f.cancelled()]
        batch = self._pending[: self._max_jobs]
        del self._pending[: self._max_jobs]
        if not batch:
            return
        self._busy = True
        loop = asyncio.get_running_loop()
        done = loop.run_in_executor(self._executor, self._work, [j for j, _ in batch])
        done.add_done_callback(lambda d: self._finish(batch, d))

    def _finish(self, batch: list[tuple[J, asyncio.Future[R]]], done: Any) -> None:
        self._busy = False
        try:
            results = done.result()
        except BaseException as exc:  # the whole call failed: every job fails
            results = [exc] * len(batch)
        for (_, fut), res in zip(batch, results, strict=True):
            if fut.cancelled():
                continue
            if isinstance(res, BaseException):
                fut.set_exception(res)
            else:
                fut.set_result(res)
        if self._pending:
            self._start()
