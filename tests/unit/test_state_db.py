"""Stored responses in the state database: they outlive a reopen, stay their
owner's, keep the caps and the retention; the schema is versioned."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest

from server.api.openai_responses.endpoint import StoredResponses
from server.api.openai_responses.store import ResponseStore
from server.operations.state_db import DB_NAME, MIGRATIONS, StateDB, prepare_state_dir
from server.wire.request import Message

CONVO = (Message("user", "hi"), Message("assistant", "hello"))


async def _open(path: Path, **policy: float) -> StoredResponses:
    store = StoredResponses(StateDB(path), ResponseStore(**policy))  # type: ignore[arg-type]
    await store.open(now=1000.0)
    return store


async def test_a_response_outlives_a_reopen_and_stays_its_owners(tmp_path: Path) -> None:
    store = await _open(tmp_path)
    assert store.put("resp_a", "alice", b'{"id": "resp_a"}', CONVO, now=1000.0)
    await store.close()
    store = await _open(tmp_path)
    got = await store.get("resp_a", "alice", now=1001.0)
    assert got is not None and got.body == b'{"id": "resp_a"}' and got.conversation == CONVO
    assert await store.get("resp_a", "bob", now=1001.0) is None
    assert await store.get("resp_a", None, now=1001.0) is None
    assert not await store.delete("resp_a", "bob", now=1001.0)
    assert await store.delete("resp_a", "alice", now=1001.0)
    await store.close()
    store = await _open(tmp_path)
    assert await store.get("resp_a", "alice", now=1001.0) is None
    await store.close()


async def test_a_read_right_after_a_put_sees_it(tmp_path: Path) -> None:
    store = await _open(tmp_path)
    store.put("resp_b", None, b"{}", CONVO, now=1000.0)  # queued, not awaited
    assert (await store.get("resp_b", None, now=1000.0)) is not None
    await store.close()


async def test_the_caps_evict_on_disk_too(tmp_path: Path) -> None:
    store = await _open(tmp_path, max_count=2)
    for i in range(3):
        store.put(f"r{i}", None, b"{}", CONVO, now=1000.0 + i)
    await store.close()
    rows = sqlite3.connect(tmp_path / DB_NAME).execute("SELECT id FROM responses").fetchall()
    assert sorted(r[0] for r in rows) == ["r1", "r2"]


async def test_retention_with_time_as_an_argument(tmp_path: Path) -> None:
    store = await _open(tmp_path, retention=100.0)
    store.put("old", None, b"{}", CONVO, now=1000.0)
    store.put("new", None, b"{}", CONVO, now=1050.0)
    assert await store.get("old", None, now=1100.0) is None  # invisible at once
    assert await store.sweep(now=1100.0) == 1
    await store.close()
    store = StoredResponses(StateDB(tmp_path), ResponseStore(retention=100.0))
    await store.open(now=1200.0)  # "new" expired while stopped: deleted at open
    await store.close()
    assert sqlite3.connect(tmp_path / DB_NAME).execute("SELECT * FROM responses").fetchall() == []


async def test_the_schema_is_versioned_and_in_wal(tmp_path: Path) -> None:
    await (await _open(tmp_path)).close()
    conn = sqlite3.connect(tmp_path / DB_NAME)
    assert conn.execute("SELECT version FROM schema_version").fetchall() == [(len(MIGRATIONS),)]
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    conn.execute("UPDATE schema_version SET version = 99")
    conn.commit()
    with pytest.raises(RuntimeError, match="newer"):
        await StateDB(tmp_path).open()


def test_the_state_dir_is_created_0700_and_a_bad_one_refused(tmp_path: Path) -> None:
    made = prepare_state_dir(tmp_path / "a" / "state")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        prepare_state_dir(tmp_path / "file")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            prepare_state_dir(locked)
