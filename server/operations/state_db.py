"""The state database: what must outlive a restart, in SQLite under --state-dir.

Why this module exists: the Responses API's stored responses (and, next, the
Batch APIs' files, batches and lines) must survive a restart. They live in one
embedded SQLite file, ``state.db``, opened with the standard ``sqlite3``
module. SQLite blocks, so this module owns the one connection on one worker
thread and every call runs there, off the event loop, in the order it was
made: a read queued after a write sees it. WAL with ``synchronous=NORMAL``: a
commit is in the WAL (the OS's page cache) when it returns, so it survives a
kill of the process (SIGKILL, OOM); a power loss may lose the last commits.
The schema is versioned (``schema_version``); ``MIGRATIONS[i]`` takes the
database from version i to i+1, and each is run once, in its own transaction.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sqlite3
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

__all__ = [
    "DB_NAME",
    "MIGRATIONS",
    "ResponseRow",
    "StateDB",
    "prepare_state_dir",
]

T = TypeVar("T")
DB_NAME: Final = "state.db"

# Version i -> i + 1. Append; never edit one that has shipped.
MIGRATIONS: Final[tuple[str, ...]] = (
    """
    CREATE TABLE responses (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        owner TEXT,
        created REAL NOT NULL,
        size INTEGER NOT NULL,
        body BLOB NOT NULL,
        conversation BLOB NOT NULL
    );
    """,
)


def prepare_state_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) if missing; ValueError with one line when it
    cannot hold the database (a file, not writable)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"--state-dir {path} is not a directory") from None
    except OSError as exc:
        raise ValueError(f"--state-dir {path} cannot be created: {exc.strerror}") from None
    if not stat.S_ISDIR(path.stat().st_mode):
        raise ValueError(f"--state-dir {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--state-dir {path} is not writable")
    db = path / DB_NAME
    if db.exists() and not os.access(db, os.R_OK | os.W_OK):
        raise ValueError(f"--state-dir {path}: {DB_NAME} is not writable")
    return path


@dataclass(frozen=True, slots=True)
class ResponseRow:
    """One stored response as the table holds it."""

    id: str
    owner: str | None
    created: float  # wall-clock seconds (time.time()): it must mean the same after a restart
    size: int
    body: bytes
    conversation: bytes


class StateDB:
    """One connection, one worker thread; ``path`` None: in memory (tests, no state dir)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="state-db")
        self._conn: sqlite3.Connection | None = None

    # -- lifecycle ---------------------------------------------------------
    async def open(self) -> int:
        """Open, migrate; the schema version."""
        return await self._run(self._open)

    async def close(self) -> None:
        await self._run(self._close)
        self._pool.shutdown(wait=True)

    def _open(self) -> int:
        target = str(self.path / DB_NAME) if self.path is not None else ":memory:"
        conn = sqlite3.connect(target, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = conn.execute("SELECT version FROM schema_version").fetchone()
        version = row[0] if row is not None else 0
        if row is None:
            conn.execute("INSERT INTO schema_version VALUES (0)")
        if version > len(MIGRATIONS):
            conn.close()
            raise RuntimeError(
                f"{target} has schema version {version}, newer than this Sluice ({len(MIGRATIONS)})"
            )
        for i in range(version, len(MIGRATIONS)):
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in MIGRATIONS[i].split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute("UPDATE schema_version SET version = ?", (i + 1,))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        self._conn = conn
        return len(MIGRATIONS)

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("the state database is not open")
        return self._conn

    # -- stored responses --------------------------------------------------
    async def responses_index(self) -> list[tuple[str, str | None, float, int]]:
        """(id, owner, created, size) of every stored response, oldest first."""
        return await self._run(self._index)

    def _index(self) -> list[tuple[str, str | None, float, int]]:
        sql = "SELECT id, owner, created, size FROM responses ORDER BY seq"
        return [(r[0], r[1], r[2], r[3]) for r in self._db().execute(sql)]

    def put_response(self, row: ResponseRow, drop: Sequence[str]) -> asyncio.Future[None]:
        """Insert ``row`` and delete ``drop`` in one transaction; queued at once
        (callable from synchronous code on the loop), awaited by whoever must
        know it is written."""
        return asyncio.wrap_future(self._pool.submit(self._put, row, tuple(drop)))

    def _put(self, row: ResponseRow, drop: tuple[str, ...]) -> None:
        db = self._db()
        with db:
            db.execute("BEGIN")
            db.executemany("DELETE FROM responses WHERE id = ?", [(i,) for i in drop])
            db.execute(
                "INSERT OR REPLACE INTO responses (id, owner, created, size, body, conversation)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (row.id, row.owner, row.created, row.size, row.body, row.conversation),
            )

    async def get_response(self, response_id: str) -> ResponseRow | None:
        return await self._run(self._get, response_id)

    def _get(self, response_id: str) -> ResponseRow | None:
        r = (
            self._db()
            .execute(
                "SELECT id, owner, created, size, body, conversation FROM responses WHERE id = ?",
                (response_id,),
            )
            .fetchone()
        )
        return None if r is None else ResponseRow(r[0], r[1], r[2], r[3], r[4], r[5])

    async def delete_responses(self, ids: Sequence[str]) -> None:
        if ids:
            await self._run(self._delete, tuple(ids))

    def _delete(self, ids: tuple[str, ...]) -> None:
        db = self._db()
        with db:
            db.execute("BEGIN")
            db.executemany("DELETE FROM responses WHERE id = ?", [(i,) for i in ids])
