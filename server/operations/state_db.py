"""The state database: what must outlive a restart, in SQLite under --state-dir.

Why this module exists: the Responses API's stored responses, the Batch APIs'
files, batches and lines, and each caller's usage must survive a restart. They live in one
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
    "USAGE_TABLES",
    "JobRow",
    "ResponseRow",
    "StateDB",
    "UsageRow",
    "UsageSum",
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
    # The Batch API (server/api/openai_batches/runner.py): uploaded files (their bytes on disk
    # under files/), batches (the API's object as JSON, its state beside it), and
    # one row per finished line, written once: a line running at a kill has none
    # and runs again, so every custom_id is in the output exactly once.
    """
    CREATE TABLE files (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        owner TEXT,
        created REAL NOT NULL,
        purpose TEXT NOT NULL,
        body BLOB NOT NULL
    );
    CREATE TABLE batches (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        owner TEXT,
        created REAL NOT NULL,
        status TEXT NOT NULL,
        body BLOB NOT NULL
    );
    CREATE TABLE batch_lines (
        batch_id TEXT NOT NULL,
        line INTEGER NOT NULL,
        status INTEGER NOT NULL,
        body BLOB NOT NULL,
        PRIMARY KEY (batch_id, line)
    );
    """,
    # Usage per caller (server/operations/usage.py): counts added per bucket, in
    # minute rows (kept 2 days) and hour rows (kept 400 days). An empty string
    # stands for no adapter and no batch, so that the key has no NULLs.
    "".join(
        f"""
    CREATE TABLE {table} (
        bucket INTEGER NOT NULL,
        caller TEXT NOT NULL,
        model TEXT NOT NULL,
        adapter TEXT NOT NULL,
        kind TEXT NOT NULL,
        api TEXT NOT NULL,
        class TEXT NOT NULL,
        batch_id TEXT NOT NULL,
        requests INTEGER NOT NULL,
        prompt_tokens INTEGER NOT NULL,
        cached_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        engine_seconds REAL NOT NULL,
        block_seconds REAL NOT NULL,
        PRIMARY KEY (bucket, caller, model, adapter, kind, api, class, batch_id)
    ) WITHOUT ROWID;
    """
        for table in ("usage_minutes", "usage_hours")
    ),
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


# The usage tables (server/operations/usage.py): minute rows, hour rows.
USAGE_TABLES: Final = ("usage_minutes", "usage_hours")
# (bucket, caller, model, adapter, kind, api, class, batch_id, requests, prompt_tokens,
# cached_tokens, completion_tokens, engine_seconds, block_seconds): one row to add.
UsageRow = tuple[int, str, str, str, str, str, str, str, int, int, int, int, float, float]
# What a usage query answers per group: (bucket, caller, model, batch, api, requests,
# prompt_tokens, cached_tokens, completion_tokens, engine_seconds, block_seconds);
# caller, model, batch and api are None when not grouped by.
UsageSum = tuple[
    int, str | None, str | None, bool | None, str | None, int, int, int, int, float, float
]


@dataclass(frozen=True, slots=True)
class ResponseRow:
    """One stored response as the table holds it."""

    id: str
    owner: str | None
    created: float  # wall-clock seconds (time.time()): it must mean the same after a restart
    size: int
    body: bytes
    conversation: bytes


@dataclass(frozen=True, slots=True)
class JobRow:
    """A file's or a batch's row: `body` its API object (JSON); `status` a
    batch's (a file's purpose for files)."""

    id: str
    owner: str | None
    created: float
    status: str
    body: bytes


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

    # -- files and batches (the Batch API) ---------------------------------
    async def put_job(self, table: str, row: JobRow) -> None:
        """Insert or replace a file's or a batch's row (`table`: files or batches)."""
        await self._run(self._put_job, _table(table), row)

    def _put_job(self, table: str, row: JobRow) -> None:
        col = "purpose" if table == "files" else "status"
        with self._db() as db:
            db.execute(
                f"INSERT INTO {table} (id, owner, created, {col}, body) VALUES (?, ?, ?, ?, ?)"
                f" ON CONFLICT(id) DO UPDATE SET {col} = excluded.{col}, body = excluded.body",
                (row.id, row.owner, row.created, row.status, row.body),
            )

    async def get_job(self, table: str, job_id: str) -> JobRow | None:
        return await self._run(self._get_job, _table(table), job_id)

    def _get_job(self, table: str, job_id: str) -> JobRow | None:
        col = "purpose" if table == "files" else "status"
        r = (
            self._db()
            .execute(f"SELECT id, owner, created, {col}, body FROM {table} WHERE id = ?", (job_id,))
            .fetchone()
        )
        return None if r is None else JobRow(r[0], r[1], r[2], r[3], r[4])

    async def list_jobs(
        self, table: str, *, owner: str | None, everyone: bool, statuses: Sequence[str] = ()
    ) -> list[JobRow]:
        """Rows newest first: `owner`'s (`everyone`: all), only `statuses` if given."""
        return await self._run(self._list_jobs, _table(table), owner, everyone, tuple(statuses))

    def _list_jobs(
        self, table: str, owner: str | None, everyone: bool, statuses: tuple[str, ...]
    ) -> list[JobRow]:
        col = "purpose" if table == "files" else "status"
        where, args = [], []
        if not everyone:
            where.append("owner IS ?")
            args.append(owner)
        if statuses:
            where.append(f"{col} IN ({','.join('?' * len(statuses))})")
            args.extend(statuses)
        sql = f"SELECT id, owner, created, {col}, body FROM {table}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._db().execute(sql + " ORDER BY seq DESC", args)
        return [JobRow(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    async def delete_job(self, table: str, job_id: str) -> None:
        await self._run(self._delete_job, _table(table), job_id)

    def _delete_job(self, table: str, job_id: str) -> None:
        with self._db() as db:
            db.execute("BEGIN")
            db.execute(f"DELETE FROM {table} WHERE id = ?", (job_id,))
            if table == "batches":
                db.execute("DELETE FROM batch_lines WHERE batch_id = ?", (job_id,))

    async def put_line(self, batch_id: str, line: int, status: int, body: bytes) -> None:
        """A batch line's result, once (a second write of one line is ignored)."""
        await self._run(self._put_line, batch_id, line, status, body)

    def _put_line(self, batch_id: str, line: int, status: int, body: bytes) -> None:
        with self._db() as db:
            db.execute(
                "INSERT OR IGNORE INTO batch_lines (batch_id, line, status, body)"
                " VALUES (?, ?, ?, ?)",
                (batch_id, line, status, body),
            )

    async def line_statuses(self, batch_id: str) -> dict[int, int]:
        """Line number -> the HTTP status of its result, for the lines done."""
        return await self._run(self._line_statuses, batch_id)

    def _line_statuses(self, batch_id: str) -> dict[int, int]:
        sql = "SELECT line, status FROM batch_lines WHERE batch_id = ?"
        return {r[0]: r[1] for r in self._db().execute(sql, (batch_id,))}

    async def line_bodies(
        self, batch_id: str, after: int, limit: int
    ) -> list[tuple[int, int, bytes]]:
        """(line, status, body) of the done lines after line `after`, in line order."""
        return await self._run(self._line_bodies, batch_id, after, limit)

    def _line_bodies(self, batch_id: str, after: int, limit: int) -> list[tuple[int, int, bytes]]:
        sql = (
            "SELECT line, status, body FROM batch_lines WHERE batch_id = ? AND line > ?"
            " ORDER BY line LIMIT ?"
        )
        return [(r[0], r[1], r[2]) for r in self._db().execute(sql, (batch_id, after, limit))]

    # -- usage (server/operations/usage.py) --------------------------------
    async def add_usage(
        self,
        minutes: Sequence[UsageRow],
        hours: Sequence[UsageRow],
        prune: tuple[int, int] | None = None,
    ) -> None:
        """Add the rows' counts to the minute and hour tables (a new key is
        inserted) and, with `prune` (minute cut, hour cut), delete the rows of
        buckets before those cuts: one transaction."""
        await self._run(self._add_usage, tuple(minutes), tuple(hours), prune)

    def _add_usage(
        self,
        minutes: tuple[UsageRow, ...],
        hours: tuple[UsageRow, ...],
        prune: tuple[int, int] | None,
    ) -> None:
        with self._db() as db:
            db.execute("BEGIN")
            for table, rows in zip(USAGE_TABLES, (minutes, hours), strict=True):
                db.executemany(
                    f"INSERT INTO {table} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT DO UPDATE SET"
                    " requests = requests + excluded.requests,"
                    " prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
                    " cached_tokens = cached_tokens + excluded.cached_tokens,"
                    " completion_tokens = completion_tokens + excluded.completion_tokens,"
                    " engine_seconds = engine_seconds + excluded.engine_seconds,"
                    " block_seconds = block_seconds + excluded.block_seconds",
                    rows,
                )
            if prune is not None:
                for table, cut in zip(USAGE_TABLES, prune, strict=True):
                    db.execute(f"DELETE FROM {table} WHERE bucket < ?", (cut,))

    async def usage_totals(self, since: int) -> dict[str, tuple[int, float]]:
        """Per caller: (prompt + completion tokens, engine seconds) of the hour
        rows of buckets from `since` on."""
        return await self._run(self._usage_totals, since)

    def _usage_totals(self, since: int) -> dict[str, tuple[int, float]]:
        sql = (
            "SELECT caller, SUM(prompt_tokens + completion_tokens), SUM(engine_seconds)"
            " FROM usage_hours WHERE bucket >= ? GROUP BY caller"
        )
        return {r[0]: (r[1], r[2]) for r in self._db().execute(sql, (since,))}

    async def usage_sums(
        self,
        table: str,
        *,
        kind: str,
        start: int,
        end: int,
        width: int,
        by_caller: bool,
        by_model: bool,
        by_batch: bool,
        by_api: bool = False,
        callers: Sequence[str] | None = None,
        models: Sequence[str] | None = None,
        batch: bool | None = None,
    ) -> list[UsageSum]:
        """The counts of `kind` in buckets of `width` seconds (UTC-aligned) from
        `start` to `end` (exclusive), grouped by bucket and the fields asked
        for: an adapter's rows count as the model of its own name (the name a
        client sent). `callers`, `models`: only those (None: all); `batch`:
        only batch lines (True) or only the rest (False)."""
        args = (kind, start, end, width, by_caller, by_model, by_batch, by_api)
        filters = (
            None if callers is None else tuple(callers),
            None if models is None else tuple(models),
            batch,
        )
        return await self._run(self._usage_sums, _usage_table(table), args, filters)

    def _usage_sums(
        self,
        table: str,
        args: tuple[str, int, int, int, bool, bool, bool, bool],
        filters: tuple[tuple[str, ...] | None, tuple[str, ...] | None, bool | None],
    ) -> list[UsageSum]:
        kind, start, end, width, by_caller, by_model, by_batch, by_api = args
        callers, models, batch = filters
        name = "CASE WHEN adapter != '' THEN adapter ELSE model END"
        is_batch = "batch_id != ''"
        where = ["kind = ?", "bucket >= ?", "bucket < ?"]
        params: list[object] = [kind, start, end]
        if callers is not None:
            where.append(f"caller IN ({','.join('?' * len(callers))})")
            params.extend(callers)
        if models is not None:
            where.append(f"{name} IN ({','.join('?' * len(models))})")
            params.extend(models)
        if batch is not None:
            where.append(is_batch if batch else "batch_id = ''")
        sql = (
            f"SELECT (bucket / {int(width)}) * {int(width)},"
            f" {'caller' if by_caller else 'NULL'},"
            f" {name if by_model else 'NULL'},"
            f" {is_batch if by_batch else 'NULL'},"
            f" {'api' if by_api else 'NULL'},"
            " SUM(requests), SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens),"
            " SUM(engine_seconds), SUM(block_seconds)"
            f" FROM {table} WHERE {' AND '.join(where)}"
            " GROUP BY 1, 2, 3, 4, 5 ORDER BY 1, 2, 3, 4, 5"
        )
        return [
            (r[0], r[1], r[2], None if r[3] is None else bool(r[3]), *r[4:])
            for r in self._db().execute(sql, params)
        ]

    async def usage_by_caller(self, since: int) -> dict[str, tuple[int, int, float]]:
        """Per caller: (requests, prompt + completion tokens, engine seconds) of
        the minute rows of buckets from `since` on (the status page's view)."""
        return await self._run(self._usage_by_caller, since)

    def _usage_by_caller(self, since: int) -> dict[str, tuple[int, int, float]]:
        sql = (
            "SELECT caller, SUM(requests), SUM(prompt_tokens + completion_tokens),"
            " SUM(engine_seconds) FROM usage_minutes WHERE bucket >= ? GROUP BY caller"
        )
        return {r[0]: (r[1], r[2], r[3]) for r in self._db().execute(sql, (since,))}


def _usage_table(name: str) -> str:
    """One of the two usage tables, never a name from outside."""
    if name not in USAGE_TABLES:
        raise ValueError(f"no usage table {name!r}")
    return name


def _table(name: str) -> str:
    """One of the two job tables, never a name from outside."""
    if name not in ("files", "batches"):
        raise ValueError(f"no job table {name!r}")
    return name
