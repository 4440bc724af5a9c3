"""Anthropic's Message Batches routes: /v1/messages/batches.

Why this module exists: Anthropic's bulk interface (issue 42), in the shapes
the `anthropic` client reads, on the OpenAI Batch API's machinery. Creating
a batch checks every request (parse.py), writes them as a JSONL input file
in the OpenAI line shape (`{"custom_id", "method", "url": "/v1/messages",
"body": params}`) beside the uploads, and adds an OpenAI batch over
/v1/messages with Anthropic's 24 h window and an id of its own prefix
(`msgbatch_`); the runner (server/api/openai_batches/runner.py) runs it
unchanged. These routes show only such batches, as Anthropic's objects
(output.py); the OpenAI routes do not show them. A caller sees only its own
(another's id is a 404, as an unknown one); the admin key sees all. Errors
are Anthropic's shape (server/http/middleware.py, by path).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any, Final

import orjson
from aiohttp import web

from server.api.anthropic_batches.output import (
    ENDPOINT,
    ID_PREFIX,
    WINDOW,
    deleted,
    ended,
    message_batch,
    page,
    result,
    unrun_error,
)
from server.api.anthropic_batches.parse import Request, parse_create
from server.api.openai_batches.output import batch_object
from server.api.openai_batches.parse import BatchCreate, parse_window
from server.api.openai_batches.runner import BATCHES, new_id, read_chunks
from server.api.openai_chat.endpoint import read_body
from server.errors import SluiceError
from server.http.pipeline import json_response
from server.operations.state_db import JobRow
from server.state import ADMIN, CALLER, RUNTIME, SETTINGS
from server.wire.fields import full_match

__all__ = [
    "batch_results",
    "cancel_batch",
    "create_batch",
    "delete_batch",
    "get_batch",
    "list_batches",
]

_LINES: Final = 1024  # lines written or read at a time
_MOST: Final = 1000  # a list page's largest `limit`, as Anthropic's
_LIMIT: Final = re.compile(r"[0-9]{1,6}", re.ASCII)  # a list's `limit`, matched whole


def _owner(request: web.Request) -> str | None:
    return request.get(CALLER)


def _visible(request: web.Request, row: JobRow | None) -> bool:
    return (
        row is not None
        and row.id.startswith(ID_PREFIX)
        and (bool(request.get(ADMIN)) or row.owner == _owner(request))
    )


def _results_url(request: web.Request, batch_id: str) -> str:
    """The results route's absolute URL, as this request reached the server
    (its scheme and host, and --root-path)."""
    root = request.app[SETTINGS].root_path
    return f"{request.scheme}://{request.host}{root}/v1/messages/batches/{batch_id}/results"


def _view(request: web.Request, batch: dict[str, Any]) -> web.Response:
    body = message_batch(batch, _results_url(request, batch["id"]))
    return json_response(orjson.dumps(body))


async def _batch(request: web.Request) -> tuple[dict[str, Any], JobRow]:
    batch_id = request.match_info["batch_id"]
    row = await request.app[BATCHES].db.get_job("batches", batch_id)
    if row is None or not _visible(request, row):
        raise SluiceError(f"No such message batch: '{batch_id}'.", status=404, code="not_found")
    return orjson.loads(row.body), row


async def _jsonl(requests: Sequence[Request]) -> AsyncIterator[bytes]:
    """The requests as the input file's lines (OpenAI's line shape), in chunks."""
    for start in range(0, len(requests), _LINES):
        yield b"".join(
            orjson.dumps(
                {
                    "custom_id": r.custom_id,
                    "method": "POST",
                    "url": ENDPOINT,
                    "body": orjson.Fragment(r.params),
                }
            )
            + b"\n"
            for r in requests[start : start + _LINES]
        )


async def create_batch(request: web.Request) -> web.Response:
    """POST /v1/messages/batches: `requests` of `custom_id` and `params`."""
    requests = parse_create(await read_body(request), request.app[RUNTIME].limits)
    batches = request.app[BATCHES]
    owner = _owner(request)
    batch_id, file_id = new_id(ID_PREFIX), new_id("file-")
    # Its input file is its caller's bytes: reserved in its quota as it is written.
    size = await batches.store(file_id, owner, _jsonl(requests), _over_quota)
    try:
        await batches.register(file_id, owner, "batch", f"{batch_id}_requests.jsonl", size)
        create = BatchCreate(file_id, ENDPOINT, parse_window(WINDOW), WINDOW, None)
        batch = batch_object(batch_id, create, int(time.time()))
        batch["request_counts"] = {"total": len(requests), "completed": 0, "failed": 0}
        await batches.add_batch(batch, owner)
    except BaseException:
        await batches.remove_file(file_id)
        raise
    return _view(request, batch)


def _over_quota(quota: int) -> SluiceError:
    return SluiceError(
        f"your files would be over {quota} bytes (--batch-disk-per-caller): delete some "
        "message batches (or files) first",
        status=413,
        code="quota_exceeded",
    )


async def get_batch(request: web.Request) -> web.Response:
    return _view(request, (await _batch(request))[0])


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit")
    if raw is None:
        return 20
    if not full_match(_LIMIT, raw) or not 1 <= int(raw) <= _MOST:
        raise SluiceError(f"limit must be a whole number from 1 to {_MOST}", param="limit")
    return int(raw)


async def list_batches(request: web.Request) -> web.Response:
    """GET /v1/messages/batches: newest first; `after_id` the page after an
    id, `before_id` the page just before one, `limit` of them."""
    limit = _limit(request)
    rows = await request.app[BATCHES].db.list_jobs(
        "batches", owner=_owner(request), everyone=bool(request.get(ADMIN))
    )
    rows = [r for r in rows if r.id.startswith(ID_PREFIX)]
    ids = [r.id for r in rows]
    after, before = request.query.get("after_id"), request.query.get("before_id")
    if before is not None:  # the `limit` just before it (an unknown id: none)
        end = ids.index(before) if before in ids else 0
        start = max(0, end - limit)
        chosen, more = rows[start:end], start > 0
    else:  # the `limit` after it (none: from the newest; an unknown id: none)
        start = 0 if after is None else ids.index(after) + 1 if after in ids else len(ids)
        chosen, more = rows[start : start + limit], start + limit < len(rows)
    objects = []
    for row in chosen:
        batch = orjson.loads(row.body)
        objects.append(message_batch(batch, _results_url(request, batch["id"])))
    return json_response(orjson.dumps(page(objects, more)))


async def cancel_batch(request: web.Request) -> web.Response:
    """POST /v1/messages/batches/{id}/cancel: `canceling`, then `ended` with
    the requests not run counted `canceled`."""
    batch, row = await _batch(request)
    return _view(request, await request.app[BATCHES].cancel(batch, row.owner))


async def delete_batch(request: web.Request) -> web.Response:
    """DELETE /v1/messages/batches/{id}: an ended batch, its files and results
    (a batch still processing is a 400: cancel it first, as Anthropic's)."""
    batch, row = await _batch(request)
    if not ended(batch):
        raise SluiceError(
            f"message batch {row.id} is still processing: cancel it, and delete it once ended",
            status=400,
        )
    batches = request.app[BATCHES]
    await batches.db.delete_job("batches", row.id)
    for key in ("input_file_id", "output_file_id", "error_file_id"):
        if batch.get(key):
            await batches.remove_file(batch[key])
    return json_response(orjson.dumps(deleted(row.id)))


async def batch_results(request: web.Request) -> web.StreamResponse:
    """GET /v1/messages/batches/{id}/results: one line per request (JSONL),
    converted from the runner's output and error files as they stream."""
    batch, _ = await _batch(request)
    if not ended(batch):
        raise SluiceError(
            f"message batch {batch['id']} has not ended: its results are not ready", status=400
        )
    batches = request.app[BATCHES]
    resp = web.StreamResponse(headers={"Content-Type": "application/x-jsonl"})
    await resp.prepare(request)
    seen: set[str] = set()
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            async with aclosing(read_chunks(batches.file_path(batch[key]), _LINES)) as chunks:
                async for chunk in chunks:
                    out = [result(raw) for raw in chunk if raw.strip()]
                    seen.update(custom_id for custom_id, _ in out)
                    await resp.write(b"".join(line + b"\n" for _, line in out))
    if batch["status"] == "failed":  # the requests it never ran are errored
        errors = (batch.get("errors") or {}).get("data") or [{}]
        why = errors[0].get("message") or "the batch failed"
        path = batches.file_path(batch["input_file_id"])
        async with aclosing(read_chunks(path, _LINES)) as chunks:
            async for chunk in chunks:
                ids = [orjson.loads(raw)["custom_id"] for raw in chunk if raw.strip()]
                lost = [unrun_error(i, why) + b"\n" for i in ids if i not in seen]
                await resp.write(b"".join(lost))
    await resp.write_eof()
    return resp
