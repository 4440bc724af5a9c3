"""Anthropic's Message Batches, pure: a create body's `requests`, each checked.

Why this module exists: a batch whose requests the Messages endpoint would
refuse is refused whole, before any of it runs, as Anthropic's is: a 400
naming the request by its index (`requests.3.params.max_tokens: ...`). Each
request's `params` goes through the Messages parser (parse_messages) with
the same limits as /v1/messages itself; its `custom_id` must be unique in the
batch and match Anthropic's pattern.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import orjson

from server.api.anthropic_messages.parse import parse_messages
from server.errors import SluiceError
from server.wire.fields import full_match, load_object
from server.wire.request import Limits

__all__ = ["MAX_REQUESTS", "Request", "parse_create"]

MAX_REQUESTS: Final = 100_000  # requests per batch, as Anthropic's
# Anthropic's pattern, ^[a-zA-Z0-9_-]{1,64}$, matched whole (full_match)
_CUSTOM_ID: Final = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a batch: its `custom_id` and its params (a Messages body)."""

    custom_id: str
    params: bytes


def _bad(index: int, field: str, message: str) -> SluiceError:
    return SluiceError(message, status=400, param=f"requests.{index}.{field}")


def parse_create(body: bytes, limits: Limits) -> list[Request]:
    """A POST /v1/messages/batches body as its requests, or a 400 naming the first bad one."""
    obj = load_object(body)
    requests = obj.get("requests")
    if not isinstance(requests, list) or not requests:
        raise SluiceError("requests must be a non-empty array", status=400, param="requests")
    if len(requests) > MAX_REQUESTS:
        raise SluiceError(
            f"a batch takes at most {MAX_REQUESTS} requests, got {len(requests)}",
            status=400,
            param="requests",
            code="too_many_requests",
        )
    seen: set[str] = set()
    out: list[Request] = []
    for i, item in enumerate(requests):
        if not isinstance(item, dict):
            raise SluiceError("must be an object", status=400, param=f"requests.{i}")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not full_match(_CUSTOM_ID, custom_id):
            raise _bad(i, "custom_id", "custom_id must match ^[a-zA-Z0-9_-]{1,64}$")
        if custom_id in seen:
            raise _bad(i, "custom_id", f"the custom_id {custom_id!r} is on an earlier request")
        seen.add(custom_id)
        params = item.get("params")
        if not isinstance(params, dict):
            raise _bad(i, "params", "params must be an object (a Messages request)")
        if params.get("stream"):
            raise _bad(i, "params.stream", "a batch request cannot stream")
        data = orjson.dumps(params)
        try:
            parse_messages(data, limits)
        except SluiceError as err:
            field = f"params.{err.param}" if err.param else "params"
            raise SluiceError(
                err.message, status=err.status, param=f"requests.{i}.{field}", code=err.code
            ) from None
        out.append(Request(custom_id, data))
    return out
