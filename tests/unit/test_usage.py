"""The usage ledger (server/operations/usage.py): what is recorded is written,
bucketed, grouped, pruned and counted; a kill loses only what was not flushed."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from server.operations.state_db import DB_NAME, StateDB
from server.operations.usage import (
    HOUR_KEEP_S,
    MINUTE_KEEP_S,
    UsageBook,
    UsageEvent,
    UsageQuery,
)

DAY0 = 1_699_920_000  # a UTC midnight


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def event(at: float, caller: str = "alice", **kw: object) -> UsageEvent:
    fields: dict[str, object] = {
        "at": at,
        "caller": caller,
        "model": "qwen",
        "adapter": None,
        "kind": "completions",
        "request_class": "interactive",
        "batch_id": None,
        "prompt_tokens": 10,
        "cached_tokens": 4,
        "completion_tokens": 5,
        "engine_seconds": 0.5,
        "block_seconds": 2.0,
    }
    fields.update(kw)
    return UsageEvent(**fields)  # type: ignore[arg-type]


@pytest.fixture
async def db() -> AsyncIterator[StateDB]:
    db = StateDB(None)
    await db.open()
    yield db
    await db.close()


async def test_a_round_trip_in_day_buckets_with_the_empty_ones(db: StateDB) -> None:
    book = UsageBook(db, clock=Clock(DAY0 + 3 * 86400))
    book.record(event(DAY0 + 100))
    book.record(event(DAY0 + 200, prompt_tokens=20, engine_seconds=1.0))
    book.record(event(DAY0 + 2 * 86400 + 5))
    await book.flush()
    assert book.pending == 0
    page = await book.query(UsageQuery("completions", DAY0 + 50, DAY0 + 3 * 86400))
    assert [(b.start, b.end) for b in page.buckets] == [
        (DAY0 + i * 86400, DAY0 + (i + 1) * 86400) for i in range(3)
    ]
    first, empty, third = page.buckets
    assert empty.results == ()
    (r,) = first.results
    assert (r.caller, r.model, r.batch) == (None, None, None)  # not grouped by
    assert (r.requests, r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (2, 30, 8, 10)
    assert (r.engine_seconds, r.block_seconds) == (1.5, 4.0)
    assert third.results[0].requests == 1
    # The other endpoint's kind is not counted here.
    other = await book.query(UsageQuery("embeddings", DAY0, DAY0 + 86400))
    assert other.buckets[0].results == ()


async def test_minute_and_hour_buckets(db: StateDB) -> None:
    book = UsageBook(db, clock=Clock(DAY0 + 7200))
    book.record(event(DAY0 + 30))
    book.record(event(DAY0 + 59))
    book.record(event(DAY0 + 125))
    book.record(event(DAY0 + 3700))
    minutes = await book.query(UsageQuery("completions", DAY0, DAY0 + 180, width=60))
    assert [sum(r.requests for r in b.results) for b in minutes.buckets] == [2, 0, 1]
    hours = await book.query(UsageQuery("completions", DAY0, DAY0 + 7200, width=3600))
    assert [sum(r.requests for r in b.results) for b in hours.buckets] == [3, 1]


async def test_group_by_and_filters(db: StateDB) -> None:
    book = UsageBook(db, clock=Clock(DAY0 + 3600))
    book.record(event(DAY0 + 1, "alice"))
    book.record(event(DAY0 + 2, "alice", adapter="sql-lora"))
    book.record(event(DAY0 + 3, "bob", batch_id="batch_1", request_class="background"))
    book.record(event(DAY0 + 4, "bob"))

    async def groups(**kw: object) -> list[tuple[object, ...]]:
        page = await book.query(UsageQuery("completions", DAY0, DAY0 + 3600, 3600, **kw))  # type: ignore[arg-type]
        return [(r.caller, r.model, r.batch, r.requests) for r in page.buckets[0].results]

    assert await groups() == [(None, None, None, 4)]
    assert await groups(group_by=frozenset({"caller"})) == [
        ("alice", None, None, 2),
        ("bob", None, None, 2),
    ]
    # An adapter's requests are the model of its own name (what the client sent).
    assert await groups(group_by=frozenset({"model"})) == [
        (None, "qwen", None, 3),
        (None, "sql-lora", None, 1),
    ]
    assert await groups(group_by=frozenset({"caller", "batch"})) == [
        ("alice", None, False, 2),
        ("bob", None, False, 1),
        ("bob", None, True, 1),
    ]
    assert await groups(callers=frozenset({"bob"})) == [(None, None, None, 2)]
    assert await groups(models=frozenset({"sql-lora"})) == [(None, None, None, 1)]
    assert await groups(batch=True) == [(None, None, None, 1)]
    assert await groups(batch=False, callers=frozenset({"bob"})) == [(None, None, None, 1)]
    assert await groups(callers=frozenset({"carol"})) == []


async def test_retention_prunes_with_the_clock(db: StateDB) -> None:
    clock = Clock(DAY0)
    book = UsageBook(db, clock=clock)
    book.record(event(DAY0 + 10))
    await book.flush()
    q_min = UsageQuery("completions", DAY0, DAY0 + 60, width=60)
    q_hour = UsageQuery("completions", DAY0, DAY0 + 3600, width=3600)
    clock.t = DAY0 + MINUTE_KEEP_S + 120  # minute rows expired, hour rows kept
    await book.flush()
    assert (await book.query(q_min)).buckets[0].results == ()
    assert (await book.query(q_hour)).buckets[0].results[0].requests == 1
    clock.t = DAY0 + HOUR_KEEP_S + 7200
    await book.flush()
    assert (await book.query(q_hour)).buckets[0].results == ()


async def test_pruning_runs_at_most_once_a_minute(db: StateDB) -> None:
    clock = Clock(DAY0)
    book = UsageBook(db, clock=clock)
    await book.flush()  # prunes (nothing yet)
    book.record(event(DAY0 - MINUTE_KEEP_S - 600))  # already past its minute retention
    await book.flush()  # within the minute: no pruning
    q = UsageQuery("completions", DAY0 - MINUTE_KEEP_S - 600, DAY0 - MINUTE_KEEP_S, width=60)
    assert sum(r.requests for b in (await book.query(q)).buckets for r in b.results) == 1
    clock.t += 61
    await book.flush()
    assert sum(r.requests for b in (await book.query(q)).buckets for r in b.results) == 0


async def test_totals_since_counts_written_and_pending(db: StateDB) -> None:
    book = UsageBook(db, clock=Clock(DAY0 + 7200))
    book.record(event(DAY0 + 10, "alice"))  # hour 0
    book.record(event(DAY0 + 3610, "alice"))  # hour 1
    await book.flush()
    book.record(event(DAY0 + 3620, "alice", completion_tokens=100, engine_seconds=2.0))
    book.record(event(DAY0 + 3630, "bob"))
    assert await book.totals_since(DAY0 + 3600) == {"alice": (15 + 110, 2.5), "bob": (15, 0.5)}
    assert (await book.totals_since(DAY0))["alice"] == (15 + 15 + 110, 3.0)
    assert book.engine_seconds == {"alice": 3.0, "bob": 0.5}


async def test_a_kill_loses_only_what_was_not_flushed(tmp_path: Path) -> None:
    db = StateDB(tmp_path)
    await db.open()
    book = UsageBook(db, clock=Clock(DAY0 + 600))
    book.record(event(DAY0 + 1))
    book.record(event(DAY0 + 2))
    await book.flush()
    book.record(event(DAY0 + 3))  # recorded, never flushed: the kill takes it
    # A SIGKILL: the connection is never closed, nothing else is written.
    # Another connection (the next process) reads the file as it is.
    conn = sqlite3.connect(tmp_path / DB_NAME)
    (n,) = conn.execute("SELECT SUM(requests) FROM usage_minutes").fetchone()
    (h,) = conn.execute("SELECT SUM(requests) FROM usage_hours").fetchone()
    conn.close()
    assert (n, h) == (2, 2)
    db2 = StateDB(tmp_path)
    await db2.open()
    again = UsageBook(db2, clock=Clock(DAY0 + 600))
    page = await again.query(UsageQuery("completions", DAY0, DAY0 + 60, width=60))
    assert page.buckets[0].results[0].requests == 2
    await db2.close()
    await db.close()


async def test_run_flushes_on_its_period_and_when_cancelled(db: StateDB) -> None:
    import asyncio

    book = UsageBook(db, flush_seconds=0.01, clock=Clock(DAY0 + 600))
    task = asyncio.create_task(book.run())
    book.record(event(DAY0 + 1))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if book.pending == 0:
            break
    assert book.pending == 0
    assert book.recent["alice"].day_requests == 1
    book.record(event(DAY0 + 2))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert book.pending == 0
    assert (await db.usage_totals(DAY0)) == {"alice": (30, 1.0)}
