"""OpenAI's Files and Batches routes: /v1/files and /v1/batches.

Why this module exists: bulk work's interface (issue 42), in the shapes the
`openai` client reads. A caller sees only its own files and batches (another's
id is a 404, as an unknown one; ids are unguessable); the admin key
(--admin-key-file) sees all. Uploads stream to disk, bounded by
--batch-file-max-bytes (a 413 past it). A batch is validated and run by the
runner (server/api/openai_batches/runner.py) in the background.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from typing import Any, Final

import orjson
from aiohttp import web

from server.api.openai_batches.output import RUNNING, batch_object, file_deleted, page
from server.api.openai_batches.parse import MAX_LINES, parse_batch_create
from server.api.openai_batches.runner import BATCHES, new_id
from server.errors import SluiceError
from server.http.multipart import read_form
from server.http.pipeline import json_response
from server.operations.state_db import JobRow
from server.state import ADMIN, CALLER, SETTINGS
from server.wire.fields import full_match

__all__ = [
    "cancel_batch",
    "create_batch",
    "delete_file",
    "file_content",
    "get_batch",
    "get_file",
    "list_batches",
    "list_files",
    "upload_file",
]

# The purposes OpenAI's upload takes (the `openai` client's FilePurpose); only
# "batch" files can be a batch's input. "batch_output" is not one: only the
# server writes it, on a batch's results.
PURPOSES: Final = frozenset({"batch", "user_data", "assistants", "fine-tune", "vision", "evals"})
_LIMIT: Final = re.compile(r"[0-9]{1,6}", re.ASCII)  # a list's `limit`, matched whole
# This API's batch ids; the runner also runs Anthropic's Message Batches
# (server/api/anthropic_batches/, ids msgbatch_...), which these routes do not show.
BATCH_PREFIX: Final = "batch_"


def _owner(request: web.Request) -> str | None:
    return request.get(CALLER)


def _visible(request: web.Request, row: JobRow | None) -> bool:
    return row is not None and (bool(request.get(ADMIN)) or row.owner == _owner(request))


def _not_found(kind: str, job_id: str) -> SluiceError:
    return SluiceError(f"No such {kind}: '{job_id}'.", status=404, code="not_found")


def _limit(request: web.Request, default: int, most: int) -> int:
    raw = request.query.get("limit")
    if raw is None:
        return default
    if not full_match(_LIMIT, raw) or not 1 <= int(raw) <= most:
        raise SluiceError(
            f"limit must be a whole number from 1 to {most}", status=400, param="limit"
        )
    return int(raw)


def _page(request: web.Request, rows: list[JobRow], default: int, most: int) -> web.Response:
    """Rows (newest first) as a cursor page: those after `after`, `limit` of them."""
    limit = _limit(request, default, most)
    after = request.query.get("after")
    if after is not None:
        ids = [r.id for r in rows]
        rows = rows[ids.index(after) + 1 :] if after in ids else []
    objects = [orjson.loads(r.body) for r in rows[:limit]]
    return json_response(orjson.dumps(page(objects, len(rows) > limit)))


# -- files ------------------------------------------------------------------------


async def upload_file(request: web.Request) -> web.Response:
    """POST /v1/files (multipart: `purpose`, `file`). Its bytes are reserved in
    the caller's quota as they come (runner.py `Batches.store`): concurrent
    uploads of one caller never keep more than --batch-disk-per-caller."""
    batches = request.app[BATCHES]
    most = request.app[SETTINGS].batch_file_max_bytes
    owner = _owner(request)
    quota = await batches.quota()
    if quota.used(owner) >= quota.limit:
        raise _over_quota(quota.limit)
    file_id = new_id("file-")

    async def store(filename: str, chunks: AsyncIterator[bytes]) -> tuple[str, int]:
        # The body's length bounds the file's: reserved at once (runner.py `store`).
        expect = min(request.content_length or 0, most)
        size = await batches.store(file_id, owner, _bounded(chunks, most), _over_quota, expect)
        return filename, size

    try:
        form = await read_form(request, store, text=frozenset({"purpose"}))
        purpose = form.fields.get("purpose")
        if purpose not in PURPOSES:
            raise SluiceError(
                f"purpose must be one of {', '.join(sorted(PURPOSES))}",
                status=400,
                param="purpose",
            )
        if form.file is None:
            raise SluiceError("the `file` part is missing", status=400, param="file")
        filename, size = form.file
        obj = await batches.register(file_id, owner, purpose, filename, size)
    except BaseException:
        await batches.remove_file(file_id)
        raise
    return json_response(orjson.dumps(obj))


def _over_quota(quota: int) -> SluiceError:
    return SluiceError(
        f"your files would be over {quota} bytes (--batch-disk-per-caller): delete some "
        "(DELETE /v1/files/{id}) first",
        status=413,
        param="file",
        code="quota_exceeded",
    )


async def _bounded(chunks: AsyncIterator[bytes], most: int) -> AsyncIterator[bytes]:
    """The file part's bytes; a 413 past `most` (--batch-file-max-bytes)."""
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > most:
            raise SluiceError(
                f"the file is over {most} bytes (--batch-file-max-bytes)",
                status=413,
                param="file",
                code="file_too_large",
            )
        yield chunk


async def _file(request: web.Request) -> JobRow:
    file_id = request.match_info["file_id"]
    row = await request.app[BATCHES].db.get_job("files", file_id)
    if row is None or not _visible(request, row):
        raise _not_found("file", file_id)
    return row


async def list_files(request: web.Request) -> web.Response:
    rows = await request.app[BATCHES].db.list_jobs(
        "files", owner=_owner(request), everyone=bool(request.get(ADMIN))
    )
    if purpose := request.query.get("purpose"):
        rows = [r for r in rows if r.status == purpose]
    if request.query.get("order") == "asc":
        rows.reverse()
    return _page(request, rows, 10_000, 10_000)


async def get_file(request: web.Request) -> web.Response:
    return json_response((await _file(request)).body)


async def file_content(request: web.Request) -> web.StreamResponse:
    row = await _file(request)
    return web.FileResponse(
        request.app[BATCHES].file_path(row.id),
        headers={"Content-Type": "application/octet-stream"},
    )


async def delete_file(request: web.Request) -> web.Response:
    """DELETE /v1/files/{id}: a 409 while a batch needs the file (output.py
    `needs`: a running batch's input, a batch's output and error files)."""
    row = await _file(request)
    batches = request.app[BATCHES]
    if (batch := await batches.needed_by(row.id)) is not None:
        raise _in_use(row.id, batch)
    await batches.remove_file(row.id)
    return json_response(orjson.dumps(file_deleted(row.id)))


def _in_use(file_id: str, batch: dict[str, Any]) -> SluiceError:
    if file_id == batch.get("input_file_id") and batch["status"] in RUNNING:
        why = "its input while it runs: cancel it, or delete the file once it has ended"
    elif batch["id"].startswith(BATCH_PREFIX):
        why = "its results, kept as long as the batch (--batch-retention)"
    else:
        why = "its requests and results, kept until the message batch is deleted"
    return SluiceError(
        f"the file {file_id} is in use by batch {batch['id']}, {why}",
        status=409,
        param="file_id",
        code="file_in_use",
    )


# -- batches ----------------------------------------------------------------------


async def create_batch(request: web.Request) -> web.Response:
    create = parse_batch_create(await request.read())
    batches = request.app[BATCHES]
    source = await batches.db.get_job("files", create.input_file_id)
    if not _visible(request, source):
        raise SluiceError(
            f"No such file: '{create.input_file_id}'.",
            status=404,
            param="input_file_id",
            code="not_found",
        )
    assert source is not None
    if source.status != "batch":
        raise SluiceError(
            f"the file {create.input_file_id} has purpose '{source.status}', not 'batch'",
            status=400,
            param="input_file_id",
        )
    lines = await batches.count_lines(source.id)
    if lines > MAX_LINES:
        raise SluiceError(
            f"the file has {lines} lines; a batch takes at most {MAX_LINES}",
            status=400,
            param="input_file_id",
            code="too_many_lines",
        )
    batch = batch_object(new_id(BATCH_PREFIX), create, int(time.time()))
    await batches.add_batch(batch, _owner(request))
    return json_response(orjson.dumps(batch))


async def _batch(request: web.Request) -> tuple[dict[str, Any], JobRow]:
    batch_id = request.match_info["batch_id"]
    row = await request.app[BATCHES].db.get_job("batches", batch_id)
    if row is None or not _visible(request, row) or not row.id.startswith(BATCH_PREFIX):
        raise _not_found("batch", batch_id)
    return orjson.loads(row.body), row


async def get_batch(request: web.Request) -> web.Response:
    return json_response((await _batch(request))[1].body)


async def list_batches(request: web.Request) -> web.Response:
    rows = await request.app[BATCHES].db.list_jobs(
        "batches", owner=_owner(request), everyone=bool(request.get(ADMIN))
    )
    rows = [r for r in rows if r.id.startswith(BATCH_PREFIX)]
    return _page(request, rows, 20, 100)


async def cancel_batch(request: web.Request) -> web.Response:
    batch, row = await _batch(request)
    batch = await request.app[BATCHES].cancel(batch, row.owner)
    return json_response(orjson.dumps(batch))
