"""OpenAI's Batch API, pure: a batch's create body, and each line of its input file.

Why this module exists: a batch is refused, or each of its lines is, before
any of it runs, with OpenAI's errors (`code`, `line`, `message`, `param`):
a line that is not a JSON object, a `custom_id` missing or seen before, a
`method` other than POST, a `url` that is not the batch's `endpoint`, and a
`body` that the synchronous endpoint would refuse (its own parser says why:
the same message a request to it would get). The runner
(server/api/openai_batches/runner.py) then sends each line's body to that endpoint as
is: its answer is exactly what the synchronous endpoint gives.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson

from server.api.anthropic_messages.parse import parse_messages
from server.api.openai_chat.parse import parse_chat, parse_completion
from server.api.openai_responses.parse import parse_responses
from server.api.pooling.parse import parse_embeddings
from server.errors import SluiceError
from server.wire.fields import bad, full_match, load_object
from server.wire.request import Limits

__all__ = [
    "ENDPOINTS",
    "MAX_LINES",
    "BatchCreate",
    "Line",
    "LineError",
    "check_line",
    "parse_batch_create",
    "parse_window",
]

# The endpoints a batch may run, each with the parser its synchronous route uses:
# OpenAI's (ENDPOINTS, what POST /v1/batches takes), and Anthropic's Messages,
# which Anthropic's Message Batches run (server/api/anthropic_batches/).
_PARSERS: Final[dict[str, Callable[[bytes, Limits], object]]] = {
    "/v1/chat/completions": parse_chat,
    "/v1/completions": parse_completion,
    "/v1/embeddings": lambda body, limits: parse_embeddings(body),
    "/v1/responses": parse_responses,
    "/v1/messages": parse_messages,
}
ENDPOINTS: Final = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
_WINDOW: Final = re.compile(r"([1-9][0-9]*)h", re.ASCII)  # whole: full_match
MAX_WINDOW_HOURS: Final = 24 * 7
MAX_LINES: Final = 50_000  # lines per batch, as OpenAI's
MAX_METADATA: Final = 16  # OpenAI's: 16 pairs, keys up to 64 characters, values 512


@dataclass(frozen=True, slots=True)
class BatchCreate:
    input_file_id: str
    endpoint: str
    window: float  # seconds
    completion_window: str
    metadata: dict[str, str] | None


@dataclass(frozen=True, slots=True)
class LineError:
    """One of a file's validation errors, as OpenAI's `BatchError`."""

    line: int  # 1-based, as OpenAI numbers them
    code: str
    message: str
    param: str | None = None

    def json(self) -> dict[str, Any]:
        return {"code": self.code, "line": self.line, "message": self.message, "param": self.param}


def parse_window(value: object) -> float:
    """`completion_window` in seconds: OpenAI takes "24h"; any whole number of
    hours up to a week is taken here."""
    m = full_match(_WINDOW, value)
    if m is None or int(m.group(1)) > MAX_WINDOW_HOURS:
        raise bad(
            "completion_window",
            f"completion_window must be a whole number of hours such as '24h' "
            f"(at most {MAX_WINDOW_HOURS}h)",
        )
    return int(m.group(1)) * 3600.0


def parse_batch_create(body: bytes) -> BatchCreate:
    obj = load_object(body)
    file_id = obj.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise bad("input_file_id", "input_file_id must be the id of an uploaded file")
    endpoint = obj.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise bad("endpoint", f"endpoint must be one of {', '.join(ENDPOINTS)}")
    window = obj.get("completion_window", "24h")
    metadata = obj.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict)
        and len(metadata) <= MAX_METADATA
        and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items()
        )
    ):
        raise bad(
            "metadata",
            f"metadata must be up to {MAX_METADATA} string pairs (keys up to 64 "
            "characters, values up to 512)",
        )
    return BatchCreate(file_id, str(endpoint), parse_window(window), str(window), metadata)


@dataclass(frozen=True, slots=True)
class Line:
    """A line that will run: its 1-based number, `custom_id` and body."""

    line: int
    custom_id: str
    body: bytes


def check_line(
    number: int, raw: bytes, endpoint: str, seen: set[str], limits: Limits
) -> Line | LineError:
    """Line `number` (1-based) of a batch's input file; `seen` collects the
    custom_ids so far (a duplicate is an error, as OpenAI's)."""
    try:
        obj = load_object(raw)
    except SluiceError as err:
        return LineError(number, "invalid_json_line", err.message)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(number, "missing_required_parameter", "custom_id is required", "custom_id")
    if custom_id in seen:
        return LineError(
            number,
            "duplicate_custom_id",
            f"the custom_id {custom_id!r} is on an earlier line: each must be unique",
            "custom_id",
        )
    seen.add(custom_id)
    if obj.get("method", "POST") != "POST":
        return LineError(number, "invalid_request", "method must be POST", "method")
    if obj.get("url") != endpoint:
        return LineError(
            number,
            "mismatched_endpoint",
            f"url must be the batch's endpoint, {endpoint}",
            "url",
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        return LineError(number, "invalid_request", "body must be a JSON object", "body")
    if body.get("stream"):
        return LineError(number, "invalid_request", "a batch line cannot stream", "body.stream")
    data = orjson.dumps(body)
    try:
        _PARSERS[endpoint](data, limits)
    except SluiceError as err:
        param = f"body.{err.param}" if err.param else "body"
        return LineError(number, err.code or "invalid_request", err.message, param)
    return Line(number, custom_id, data)
