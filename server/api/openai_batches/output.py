"""OpenAI's Files and Batches objects, pure: what the routes and the output files hold.

Why this module exists: the `openai` client reads these shapes (its types
`FileObject`, `Batch`, `BatchRequestCounts`, `BatchError`, and the batch
output line) and nothing else; they are written here once, from plain values.
A batch's states: validating -> in_progress -> finalizing -> completed, or
failed (its file did not validate), expired (its window passed), cancelling
-> cancelled. Times are whole seconds since the epoch, as OpenAI's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import orjson

from server.api.anthropic_batches.output import ID_PREFIX as MESSAGE_BATCH_PREFIX
from server.api.openai_batches.parse import BatchCreate, LineError

__all__ = [
    "FINAL",
    "RUNNING",
    "batch_object",
    "error_result",
    "failed_validation",
    "file_deleted",
    "file_object",
    "needs",
    "page",
    "result_line",
    "with_status",
]

# States in which the runner still has work (resumed after a restart).
RUNNING: Final = ("validating", "in_progress", "finalizing", "cancelling")
FINAL: Final = ("completed", "failed", "expired", "cancelled")


def file_object(
    file_id: str, *, filename: str, size: int, purpose: str, created: int
) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def needs(batch: dict[str, Any]) -> set[str]:
    """The files `batch` still needs, which cannot be deleted (issue 50): its
    output and error files while it exists; its input file while it runs, and
    a Message Batch's for as long as it exists (the server wrote it from the
    create body; the results list from it the requests a failure left unrun,
    and it goes with the batch's DELETE)."""
    keep = {batch.get("output_file_id"), batch.get("error_file_id")}
    if batch["status"] in RUNNING or str(batch["id"]).startswith(MESSAGE_BATCH_PREFIX):
        keep.add(batch.get("input_file_id"))
    return {f for f in keep if f}


def file_deleted(file_id: str) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "deleted": True}


def batch_object(batch_id: str, create: BatchCreate, now: int) -> dict[str, Any]:
    """A new batch: validating, its window from now."""
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": create.endpoint,
        "errors": None,
        "input_file_id": create.input_file_id,
        "completion_window": create.completion_window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + int(create.window),
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": create.metadata,
    }


def with_status(batch: dict[str, Any], status: str, now: int, **fields: Any) -> dict[str, Any]:
    """`batch` moved to `status` at `now` (its `<status>_at` set), with `fields`."""
    out = {**batch, **fields, "status": status}
    if f"{status}_at" in out:
        out[f"{status}_at"] = now
    return out


def failed_validation(errors: Sequence[LineError]) -> dict[str, Any]:
    """The `errors` field of a batch whose file did not validate."""
    return {"object": "list", "data": [e.json() for e in errors]}


def result_line(line_id: str, custom_id: str, request_id: str, status: int, body: bytes) -> bytes:
    """One line of a batch's output (2xx) or error file: the endpoint's own
    answer, whole, as its `response.body`."""
    return orjson.dumps(
        {
            "id": line_id,
            "custom_id": custom_id,
            "response": {
                "status_code": status,
                "request_id": request_id,
                "body": orjson.Fragment(body),
            },
            "error": None,
        }
    )


def error_result(line_id: str, custom_id: str, code: str, message: str) -> bytes:
    """An error-file line for a line that never ran (its batch expired or was
    cancelled first)."""
    return orjson.dumps(
        {
            "id": line_id,
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    )


def page(objects: Sequence[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A list page, as OpenAI's cursor pages: `after` the last id for the next."""
    return {
        "object": "list",
        "data": list(objects),
        "first_id": objects[0]["id"] if objects else None,
        "last_id": objects[-1]["id"] if objects else None,
        "has_more": has_more,
    }
