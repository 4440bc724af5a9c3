"""Anthropic's Message Batches objects, pure: a stored batch seen as Anthropic's.

Why this module exists: the `anthropic` client reads `MessageBatch`,
`MessageBatchIndividualResponse` and `DeletedMessageBatch`, and nothing else.
A Message Batch is stored as an OpenAI Batch API batch over /v1/messages (the
runner, server/api/openai_batches/runner.py, runs it unchanged), so this module
maps one to the other, from plain values:

1. `processing_status`: validating, in_progress and finalizing are
   `in_progress`; cancelling is `canceling`; completed, failed, expired and
   cancelled are `ended`.
2. `request_counts`: succeeded and errored are the lines done (2xx or not)
   as they come; processing the rest while it runs; once ended the rest are
   `canceled` (cancelled), `expired` (expired) or `errored` (failed).
3. Times are RFC 3339 strings (UTC, whole seconds): created, expires (the
   24 h window), ended (the end state's time), cancel_initiated (cancelling's).
   `archived_at` is null: results stay until the batch is deleted.
4. `results_url` is set once ended: the absolute URL of the results route.
5. A result line: a 2xx answer is `succeeded` with the Messages body as its
   `message`; any other answer `errored` with the endpoint's Anthropic error
   body (and its request id); a line its batch's end left unrun is
   `canceled` or `expired`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, Final

import orjson

__all__ = [
    "ENDPOINT",
    "ID_PREFIX",
    "WINDOW",
    "deleted",
    "ended",
    "message_batch",
    "page",
    "result",
    "rfc3339",
    "unrun_error",
]

ENDPOINT: Final = "/v1/messages"  # the stored batch's endpoint
ID_PREFIX: Final = "msgbatch_"  # a Message Batch's id: this and 24 random hex characters
WINDOW: Final = "24h"  # Anthropic's: results within 24 hours, else the rest expire

_STATUS: Final = {
    "validating": "in_progress",
    "in_progress": "in_progress",
    "finalizing": "in_progress",
    "cancelling": "canceling",
    "completed": "ended",
    "failed": "ended",
    "expired": "ended",
    "cancelled": "ended",
}
_ENDED_AT: Final = ("completed_at", "failed_at", "expired_at", "cancelled_at")
# Where a batch's end counts the lines it never ran (rule 2).
_UNRUN: Final = {"cancelled": "canceled", "expired": "expired", "failed": "errored"}


def rfc3339(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    when = dt.datetime.fromtimestamp(int(seconds), dt.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def ended(batch: dict[str, Any]) -> bool:
    return _STATUS[batch["status"]] == "ended"


def _counts(batch: dict[str, Any]) -> dict[str, int]:
    counts = batch["request_counts"]
    total, ok, failed = counts["total"], counts["completed"], counts["failed"]
    out = {"processing": 0, "succeeded": ok, "errored": failed, "canceled": 0, "expired": 0}
    rest = max(0, total - ok - failed)
    if ended(batch):
        key = _UNRUN.get(batch["status"])
        if key is not None:
            out[key] += rest
    else:
        out["processing"] = rest
    return out


def message_batch(batch: dict[str, Any], results_url: str) -> dict[str, Any]:
    """The stored (OpenAI-shaped) `batch` as Anthropic's `MessageBatch`;
    `results_url` its results route's absolute URL (shown once ended)."""
    end = next((batch[k] for k in _ENDED_AT if batch.get(k) is not None), None)
    return {
        "id": batch["id"],
        "type": "message_batch",
        "processing_status": _STATUS[batch["status"]],
        "request_counts": _counts(batch),
        "ended_at": rfc3339(end) if ended(batch) else None,
        "created_at": rfc3339(batch["created_at"]),
        "expires_at": rfc3339(batch["expires_at"]),
        "archived_at": None,
        "cancel_initiated_at": rfc3339(batch.get("cancelling_at")),
        "results_url": results_url if ended(batch) else None,
    }


def deleted(batch_id: str) -> dict[str, Any]:
    return {"id": batch_id, "type": "message_batch_deleted"}


def page(objects: Sequence[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A list page, as Anthropic's: `after_id` the last id, `before_id` the first."""
    return {
        "data": list(objects),
        "has_more": has_more,
        "first_id": objects[0]["id"] if objects else None,
        "last_id": objects[-1]["id"] if objects else None,
    }


def result(line: bytes) -> tuple[str, bytes]:
    """A line of the runner's output or error file (OpenAI's batch output
    shape) as Anthropic's result line (rule 5): its custom_id and the line."""
    obj = orjson.loads(line)
    custom_id = obj["custom_id"]
    response = obj.get("response")
    if response is None:
        code = (obj.get("error") or {}).get("code")
        kind = "expired" if code == "batch_expired" else "canceled"
        return custom_id, _line(custom_id, {"type": kind})
    body = response.get("body")
    if 200 <= response["status_code"] < 300:
        return custom_id, _line(custom_id, {"type": "succeeded", "message": body})
    if not (isinstance(body, dict) and body.get("type") == "error"):
        shown = orjson.dumps(body).decode()
        body = {"type": "error", "error": {"type": "api_error", "message": shown}}
    error = {**body, "request_id": response.get("request_id")}
    return custom_id, _line(custom_id, {"type": "errored", "error": error})


def unrun_error(custom_id: str, message: str) -> bytes:
    """The result of a request its failed batch never ran."""
    error = {"type": "error", "error": {"type": "api_error", "message": message}}
    return _line(custom_id, {"type": "errored", "error": error})


def _line(custom_id: str, outcome: dict[str, Any]) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "result": outcome})
