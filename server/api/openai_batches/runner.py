"""The Batch API's runner: a batch's lines sent through the app's own door, durably.

Why this module exists: issue 42. Each line's body goes, unchanged, as an HTTP
request to its synchronous endpoint through the internal door
(server/http/door.py): its answer is exactly what that endpoint gives, under
the caller's share and limits, behind interactive work. The input file
streams from disk (`in_flight` lines in the engine's queue, never the file
in memory). A line refused for overload (429, 503: the caller's limits, the
watchdog, a drain) is sent again after its Retry-After; any other answer is
its result (an error-file line when not 2xx).

Budgets (batching/budgets.py): while a batch's caller has spent its budget,
the batch pauses: no new line is sent, and a line refused 429 for the budget
(it raced the spend of another) waits too; none is failed for it. The
pause sleeps until the budget resets (or a SIGHUP's new budgets, a cancel,
the batch's expiry), then the lines go on; lines already sent finish.

Durability (server/operations/state_db.py): a line's result is one row, written
once when its answer has come whole; a line running at a kill has none and
runs again after the restart, so every `custom_id` is in the output exactly
once. A drain (SIGTERM) stops new lines; the rest resume at the next start.
Batch states and their transitions: output.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web

from server.api.openai_batches.output import (
    RUNNING,
    error_result,
    failed_validation,
    file_object,
    needs,
    result_line,
    with_status,
)
from server.api.openai_batches.parse import Line, LineError, check_line
from server.api.openai_batches.quota import Quota
from server.errors import SluiceError
from server.http.door import BATCH_HEADER, CALLER_HEADER, DOOR_HEADER, Door
from server.operations.state_db import JobRow, StateDB
from server.wire.fields import full_match
from server.wire.request import Limits

__all__ = ["BATCHES", "Batches", "new_id", "read_chunks"]

log = logging.getLogger("sluice.batches")

_RETRY_MIN, _RETRY_MAX = 0.5, 30.0
_MAX_ERRORS: Final = 100  # validation errors kept per batch (OpenAI lists some, not all)
_CHUNK: Final = 256  # lines read from disk at a time
_COUNTS_EVERY: Final = 1.0  # seconds between request_counts updates
_SECONDS: Final = re.compile(r"[0-9]{1,6}", re.ASCII)  # a Retry-After we follow


def new_id(prefix: str) -> str:
    """An unguessable id (`file-...`, `batch_...`): 24 random hex characters."""
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass
class _Run:
    """One running batch's live state (not durable: rebuilt from the rows)."""

    batch: dict[str, Any]
    owner: str | None
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    done: dict[int, int] = field(default_factory=dict)  # line -> status


class Batches:
    """Files on disk and batches run; see the module docstring."""

    def __init__(
        self,
        db: StateDB,
        files: Path,
        door: Door,
        *,
        limits: Callable[[], Limits],
        accepting: Callable[[], bool],
        in_flight: int = 256,
        disk_per_caller: int = 10 * 10**9,
        counted: Callable[[str, int], None] = lambda kind, n: None,
        running: Callable[[int], None] = lambda n: None,
        over_budget: Callable[[str | None], float | None] = lambda owner: None,
    ) -> None:
        self.db = db
        self.files = files
        self.door = door
        self._limits = limits
        self._accepting = accepting
        self.in_flight = in_flight
        self._counted = counted  # ("line" | "batch:<status>", n)
        self._running = running  # told how many batches run, as that changes
        # An owner's seconds until its budget resets while it is spent; None: it may spend.
        self._over_budget = over_budget
        self._runs: dict[str, _Run] = {}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        # Set (and replaced) by look(): paused runs look at their budget again.
        self._wake = asyncio.Event()
        self._quota = Quota(disk_per_caller)  # loaded from the files' rows at first use
        self._quota_loaded = False
        self._quota_loading = asyncio.Lock()

    @property
    def running(self) -> frozenset[str]:
        """The ids of the batches being run now."""
        return frozenset(self._runs)

    # -- files ----------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        return self.files / file_id

    async def quota(self) -> Quota:
        """The bytes each caller keeps (--batch-disk-per-caller), read from the
        files' rows once, then kept as files are written and removed."""
        if not self._quota_loaded:
            async with self._quota_loading:
                if not self._quota_loaded:
                    for row in await self.db.list_jobs("files", owner=None, everyone=True):
                        size = int(orjson.loads(row.body)["bytes"])
                        self._quota.add(row.id, row.owner, size)
                    self._quota_loaded = True
        return self._quota

    async def store(
        self,
        file_id: str,
        owner: str | None,
        chunks: AsyncIterator[bytes],
        over_quota: Callable[[int], SluiceError],
        expect: int = 0,
    ) -> int:
        """Write `owner`'s new file to disk, its bytes reserved in its quota
        before they are written (`over_quota(limit)` raised when they do not
        fit); its size. `expect`, the most the file can be (an upload's
        Content-Length), is reserved at once when it fits, so that concurrent
        uploads do not each take part of the room and all fail; past it, or
        when it does not fit, each chunk is reserved as it comes. If anything
        raises, the file and its reservation are gone again."""
        quota = await self.quota()
        path = self.file_path(file_id)
        size = 0
        fh = await _open(path, "wb")
        try:
            held = expect if expect > 0 and quota.take(file_id, owner, expect) else 0
            async for chunk in chunks:
                size += len(chunk)
                if size > held:
                    if not quota.take(file_id, owner, size - held):
                        raise over_quota(quota.limit)
                    held = size
                await asyncio.to_thread(fh.write, chunk)
        except BaseException:
            await asyncio.to_thread(fh.close)
            path.unlink(missing_ok=True)
            quota.drop(file_id)
            raise
        await asyncio.to_thread(fh.close)
        quota.shrink(file_id, held - size)  # what the file did not need
        return size

    async def register(
        self, file_id: str, owner: str | None, purpose: str, filename: str, size: int
    ) -> dict[str, Any]:
        """A stored upload's row; its object."""
        now = int(time.time())
        obj = file_object(file_id, filename=filename, size=size, purpose=purpose, created=now)
        await self.db.put_job("files", JobRow(file_id, owner, now, purpose, orjson.dumps(obj)))
        return obj

    async def count_lines(self, file_id: str) -> int:
        """The non-blank lines of a stored file (in a thread)."""
        return await asyncio.to_thread(_count_lines, self.file_path(file_id))

    async def needed_by(self, file_id: str) -> dict[str, Any] | None:
        """The batch that still needs `file_id` (output.py `needs`), or None."""
        for row in await self.db.list_jobs("batches", owner=None, everyone=True):
            batch = orjson.loads(row.body)
            if file_id in needs(batch):
                return dict(batch)
        return None

    async def sweep(self, now: float, retention: float) -> int:
        """Delete the ended batches older than `retention`, then the files older
        than it that no batch left needs (a running batch and its input file
        stay until it ends); how many."""
        cutoff = now - retention
        needed: set[str] = set()
        gone = 0
        for row in await self.db.list_jobs("batches", owner=None, everyone=True):
            if row.status not in RUNNING and row.created < cutoff:
                await self.db.delete_job("batches", row.id)
                gone += 1
            else:
                needed |= needs(orjson.loads(row.body))
        for row in await self.db.list_jobs("files", owner=None, everyone=True):
            if row.created < cutoff and row.id not in needed:
                await self.remove_file(row.id)
                gone += 1
        return gone

    async def remove_file(self, file_id: str) -> None:
        """The file gone: its row, its bytes on disk, and their count in its caller's quota."""
        quota = await self.quota()
        await self.db.delete_job("files", file_id)
        quota.drop(file_id)
        await asyncio.to_thread(self.file_path(file_id).unlink, True)

    # -- batches ----------------------------------------------------------------
    async def add_batch(self, batch: dict[str, Any], owner: str | None) -> None:
        await self._save(batch, owner)
        self._queue.put_nowait(batch["id"])

    async def cancel(self, batch: dict[str, Any], owner: str | None) -> dict[str, Any]:
        """A batch still running stops: new lines are not sent, running ones are
        abandoned (their connections close: the engine stops them), and it ends
        `cancelled` with what was done."""
        now = int(time.time())
        run = self._runs.get(batch["id"])
        if batch["status"] not in RUNNING or batch["status"] == "cancelling":
            return batch
        batch = with_status(batch, "cancelling", now)
        await self._save(batch, owner)
        if run is not None:
            run.batch = batch
            run.cancel.set()
        return batch

    def look(self) -> None:
        """The app's admission changed (new budgets): paused batches look again."""
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    async def _paused(self, run: _Run) -> None:
        """Return once the batch's owner may spend (or the batch stops): while
        its budget is spent, sleep until the reset, a look() or a cancel."""
        paused = False
        while (wait := self._over_budget(run.owner)) is not None and self._stopping(run) is None:
            if not paused:
                paused = True
                log.info(
                    "batch paused: its caller's budget is spent",
                    extra={"fields": {"batch": run.batch["id"], "resets_in_s": round(wait, 1)}},
                )
            until_expiry = run.batch["expires_at"] - time.time()
            # A little past the reset (clocks differ by rounding), never a spin.
            await _until(max(0.05, min(wait + 0.01, until_expiry)), self._wake, run.cancel)
        if paused:
            log.info("batch resumed", extra={"fields": {"batch": run.batch["id"]}})

    async def run(self) -> None:
        """Until cancelled; a task of the app's task group. Resumes the batches
        a restart left running, then runs each new one."""
        async with asyncio.TaskGroup() as tg:
            for row in reversed(await self.db.list_jobs("batches", owner=None, everyone=True)):
                if row.status in RUNNING:
                    self._start(tg, orjson.loads(row.body), row.owner)
            while True:
                batch_id = await self._queue.get()
                new = await self.db.get_job("batches", batch_id)
                if new is not None and batch_id not in self._runs:
                    self._start(tg, orjson.loads(new.body), new.owner)

    def _start(self, tg: asyncio.TaskGroup, batch: dict[str, Any], owner: str | None) -> None:
        run = _Run(batch, owner)
        self._runs[batch["id"]] = run
        self._running(len(self._runs))
        tg.create_task(self._batch(run), name=f"batch-{batch['id']}")

    async def _save(self, batch: dict[str, Any], owner: str | None) -> None:
        row = JobRow(batch["id"], owner, batch["created_at"], batch["status"], orjson.dumps(batch))
        await self.db.put_job("batches", row)

    async def _set(self, run: _Run, status: str, **fields: Any) -> None:
        run.batch = with_status(run.batch, status, int(time.time()), **fields)
        await self._save(run.batch, run.owner)
        self._counted(f"batch:{status}", 1)

    async def _batch(self, run: _Run) -> None:
        batch_id = run.batch["id"]
        try:
            if run.batch["status"] == "validating" and not await self._validate(run):
                return  # its file did not validate: failed
            if run.batch["status"] == "in_progress" and not await self._lines(run):
                return  # a drain: the rest runs after the restart
            await self._finish(run)
        except Exception:
            log.exception("batch failed", extra={"fields": {"batch": batch_id}})
            why = LineError(0, "server_error", "the batch could not be run; see the server's log")
            failure = failed_validation([why])
            try:  # it ends failed with what it completed, in its files
                await self._finish(run, failure)
            except Exception:
                log.exception("batch not finished", extra={"fields": {"batch": batch_id}})
                with contextlib.suppress(Exception):
                    await self._set(run, "failed", errors=failure)
        finally:
            self._runs.pop(batch_id, None)
            self._running(len(self._runs))

    async def _validate(self, run: _Run) -> bool:
        """Check every line (streaming the file); a file with errors fails the
        batch with the first of them, by line number."""
        path = self.file_path(run.batch["input_file_id"])
        errors, total = await asyncio.to_thread(
            _check_file, path, run.batch["endpoint"], self._limits()
        )
        if total == 0 and not errors:
            errors.append(LineError(1, "empty_file", "the input file has no lines"))
        if errors:
            await self._set(run, "failed", errors=failed_validation(errors))
            return False
        counts = {"total": total, "completed": 0, "failed": 0}
        await self._set(run, "in_progress", request_counts=counts)
        return True

    async def _read(self, run: _Run) -> AsyncGenerator[Line, None]:
        """The input file's lines (checked when the batch began; blank lines
        skipped), a chunk at a time: iterate it under `contextlib.aclosing`."""
        number = 0
        async with contextlib.aclosing(
            read_chunks(self.file_path(run.batch["input_file_id"]))
        ) as chunks:
            async for chunk in chunks:
                for raw in chunk:
                    number += 1
                    if raw.strip():
                        yield _line(number, raw)

    def _stopping(self, run: _Run) -> str | None:
        """Why no more lines are sent now: cancelled, expired, draining; None: go on."""
        if run.cancel.is_set():
            return "cancelled"
        if time.time() >= run.batch["expires_at"]:
            return "expired"
        if not self._accepting():
            return "draining"
        return None

    async def _lines(self, run: _Run) -> bool:
        """Send every line not yet done, `in_flight` at a time, until all are done
        or the batch stops; False when a drain stopped it (not an end)."""
        run.done = await self.db.line_statuses(run.batch["id"])
        room = asyncio.Semaphore(self.in_flight)
        # As many connections as lines in flight: aiohttp's default of 100 held a
        # batch of 256 lines in flight to 100 at the engine.
        connector = aiohttp.UnixConnector(path=str(self.door.path), limit=self.in_flight)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        last = time.monotonic()
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            asyncio.TaskGroup() as tg,
        ):
            sending: set[asyncio.Task[None]] = set()
            stop = tg.create_task(run.cancel.wait())
            try:
                async with contextlib.aclosing(self._read(run)) as lines:
                    async for item in lines:
                        if item.line in run.done:
                            continue
                        if self._stopping(run) is not None or not await _room(room, stop):
                            break
                        # With a place taken (the line before has ended, and been
                        # charged): while the caller's budget is spent, until it resets.
                        await self._paused(run)
                        if self._stopping(run) is not None:
                            break
                        task = tg.create_task(self._send(session, run, item, room))
                        sending.add(task)
                        task.add_done_callback(sending.discard)
                        if time.monotonic() - last >= _COUNTS_EVERY:
                            last = time.monotonic()
                            await self._counts(run)
                # The lines in flight finish, unless the batch is cancelled.
                while sending and not run.cancel.is_set():
                    await asyncio.wait({stop, *sending}, return_when=asyncio.FIRST_COMPLETED)
                for task in sending:
                    task.cancel()
            finally:
                stop.cancel()
        await self._counts(run)
        return self._stopping(run) != "draining"

    async def _send(
        self, session: aiohttp.ClientSession, run: _Run, line: Line, room: asyncio.Semaphore
    ) -> None:
        """One line until it has an answer that is not an overload refusal."""
        batch_id = run.batch["id"]
        headers = {
            DOOR_HEADER: self.door.secret,
            "content-type": "application/json",
            "x-request-id": f"{batch_id}-{line.line}",
            BATCH_HEADER: batch_id,
        }
        if run.owner is not None:
            headers[CALLER_HEADER] = run.owner
        url = f"http://sluice{run.batch['endpoint']}"
        try:
            while True:
                try:
                    async with session.post(url, data=line.body, headers=headers) as resp:
                        body = await resp.read()
                        status = resp.status
                        retry = resp.headers.get("Retry-After")
                        rid = resp.headers.get("X-Request-ID", headers["x-request-id"])
                except aiohttp.ClientError as exc:  # the door closing (a stop): again, or not
                    log.warning("batch line not sent: %s", exc)
                    status, retry = 503, None
                if status not in (429, 503, 529):
                    break
                if status == 429 and self._over_budget(run.owner) is not None:
                    await self._paused(run)  # refused for the budget: sent again after its reset
                    if self._stopping(run) is not None:
                        return
                    continue
                if self._stopping(run) is not None:
                    return
                wait = float(retry) if retry is not None and full_match(_SECONDS, retry) else 1.0
                await asyncio.sleep(min(_RETRY_MAX, max(_RETRY_MIN, wait)))
            out = result_line(
                _line_id(batch_id, line.line),
                line.custom_id,
                rid,
                status,
                body,
            )
            await self.db.put_line(batch_id, line.line, status, out)
            run.done[line.line] = status
            self._counted("line", 1)
        finally:
            room.release()

    async def _counts(self, run: _Run) -> None:
        run.batch = {**run.batch, "request_counts": _tally(run)}
        await self._save(run.batch, run.owner)

    async def _finish(self, run: _Run, failure: dict[str, Any] | None = None) -> None:
        """Write the output and error files from the line rows (in line order),
        the lines never run as the error file's `batch_expired` or
        `batch_cancelled`; then the final state (`failure`: the batch could not
        go on, it ends `failed` with these `errors` and the lines it completed)."""
        batch_id = run.batch["id"]
        run.done = await self.db.line_statuses(batch_id)
        fields: dict[str, Any] = {}
        if failure is not None:
            end, fields["errors"] = "failed", failure
        elif run.cancel.is_set() or run.batch["status"] == "cancelling":
            end = "cancelled"
        elif len(run.done) < run.batch["request_counts"]["total"]:
            end = "expired"
        else:
            end = "completed"
            if run.batch["status"] != "finalizing":
                await self._set(run, "finalizing")
        files = {"output_file_id": _Out(self, "output"), "error_file_id": _Out(self, "errors")}
        try:
            after = 0
            while rows := await self.db.line_bodies(batch_id, after, 1024):
                for line, status, body in rows:
                    out = files["output_file_id" if 200 <= status < 300 else "error_file_id"]
                    await out.write(body)
                    after = line
            if end in ("cancelled", "expired"):
                await self._list_unrun(run, end, files["error_file_id"])
        except BaseException:
            for out in files.values():
                await out.close()
                await out.discard()
            raise
        for out in files.values():
            await out.close()
        ids = {key: await out.register(batch_id, run.owner) for key, out in files.items()}
        counts = _tally(run)
        await self._set(run, end, request_counts=counts, **ids, **fields)
        log.info("batch ended", extra={"fields": {"batch": batch_id, "status": end, **counts}})

    async def _list_unrun(self, run: _Run, end: str, errors: _Out) -> None:
        """The lines a cancel or expiry left unrun, as error-file lines, from
        the input file (a file gone from the disk lists none: the batch still
        ends with what it completed)."""
        try:
            async with contextlib.aclosing(self._read(run)) as lines:
                async for item in lines:
                    if item.line not in run.done:
                        await errors.write(_never_ran(run.batch["id"], item, end))
        except FileNotFoundError:
            log.warning(
                "batch input file missing: its unrun lines are not listed",
                extra={"fields": {"batch": run.batch["id"]}},
            )


class _Out:
    """One of a batch's result files being written: on disk, registered once
    closed if anything was written (an empty one is removed)."""

    def __init__(self, owner: Batches, name: str) -> None:
        self._batches = owner
        self.name = name
        self.id = new_id("file-")
        self.size = 0
        self._fh: Any = None

    async def write(self, data: bytes) -> None:
        if self._fh is None:
            self._fh = await _open(self._batches.file_path(self.id), "wb")
        await asyncio.to_thread(self._fh.write, data + b"\n")
        self.size += len(data) + 1

    async def close(self) -> None:
        if self._fh is not None:
            await asyncio.to_thread(self._fh.close)

    async def discard(self) -> None:
        """A file never registered (its batch did not end here): off the disk."""
        await asyncio.to_thread(self._batches.file_path(self.id).unlink, True)

    async def register(self, batch_id: str, owner: str | None) -> str | None:
        if not self.size:
            return None
        now = int(time.time())
        obj = file_object(
            self.id,
            filename=f"{batch_id}_{self.name}.jsonl",
            size=self.size,
            purpose="batch_output",
            created=now,
        )
        row = JobRow(self.id, owner, now, "batch_output", orjson.dumps(obj))
        quota = await self._batches.quota()
        await self._batches.db.put_job("files", row)
        quota.add(self.id, owner, self.size)  # counted, never refused: results are kept
        return self.id


def _never_ran(batch_id: str, line: Line, end: str) -> bytes:
    """The error-file line of a line its batch's end left unrun."""
    expired = end == "expired"
    return error_result(
        _line_id(batch_id, line.line),
        line.custom_id,
        "batch_expired" if expired else "batch_cancelled",
        "the batch's completion window passed before this line ran"
        if expired
        else "the batch was cancelled before this line ran",
    )


def _line_id(batch_id: str, line: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def _check_file(path: Path, endpoint: str, limits: Limits) -> tuple[list[LineError], int]:
    """Every line of an input file checked (in a thread: the parsers are pure but
    not free): the first errors, and the count of good lines."""
    errors: list[LineError] = []
    total = 0
    seen: set[str] = set()
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            item = check_line(number, raw, endpoint, seen, limits)
            if isinstance(item, LineError):
                if len(errors) < _MAX_ERRORS:
                    errors.append(item)
            else:
                total += 1
    return errors, total


def _tally(run: _Run) -> dict[str, int]:
    """A batch's `request_counts` from its done lines: 2xx completed, the rest failed."""
    ok = sum(1 for s in run.done.values() if 200 <= s < 300)
    return {**run.batch["request_counts"], "completed": ok, "failed": len(run.done) - ok}


def _count_lines(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(1 for raw in fh if raw.strip())


async def read_chunks(path: Path, n: int = _CHUNK) -> AsyncGenerator[Sequence[bytes], None]:
    """A stored file's lines, `n` at a time, read in a thread (never the whole
    file in memory): iterate it under `contextlib.aclosing`."""
    fh = await _open(path, "rb")
    try:
        while chunk := await asyncio.to_thread(_read_lines, fh, n):
            yield chunk
    finally:
        await asyncio.to_thread(fh.close)


async def _room(room: asyncio.Semaphore, stop: asyncio.Task[Any]) -> bool:
    """A place for one more line in flight, or False if the batch is
    cancelled (`stop` done) first: a cancel does not wait for a running line
    to finish to free one (its running lines are abandoned at once)."""
    if stop.done():
        return False
    waiting = asyncio.ensure_future(room.acquire())
    await asyncio.wait({waiting, stop}, return_when=asyncio.FIRST_COMPLETED)
    if not waiting.done():
        waiting.cancel()
        return False
    if stop.done():
        room.release()  # taken as the cancel came: not used
        return False
    return True


async def _until(timeout: float, *events: asyncio.Event) -> None:
    """Until one of `events` is set, or `timeout` seconds have passed."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def _open(path: Path, mode: str) -> Any:
    """`path` opened in a thread; one opened as its caller is cancelled (a
    batch stopped at shutdown) is closed, not left to the garbage collector."""
    opening = asyncio.ensure_future(asyncio.to_thread(path.open, mode))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        opening.add_done_callback(_close_opened)
        raise


def _close_opened(opening: asyncio.Future[Any]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


def _read_lines(fh: Any, n: int) -> Sequence[bytes]:
    """Up to `n` lines of an open binary file (in a thread)."""
    out: list[bytes] = []
    for _ in range(n):
        raw = fh.readline()
        if not raw:
            break
        out.append(raw)
    return out


def _line(number: int, raw: bytes) -> Line:
    """A line checked when its batch was created: its custom_id and body."""
    obj = orjson.loads(raw)
    return Line(number, str(obj["custom_id"]), orjson.dumps(obj["body"]))


BATCHES = web.AppKey("batches", Batches)  # files and batches (/v1/files, /v1/batches)
