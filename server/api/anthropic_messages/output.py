"""Anthropic's Messages API, pure: a generated answer back into a ``message``
body and the stream's events.

Why this module exists: the other half of server/api/anthropic_messages/parse.py (which
parses requests), kept apart so each stays small. Shapes as the `anthropic`
client's types read them and its stream helper assembles them.

Response: ``msg_<request id>``; content blocks thinking (``signature`` ""),
text, tool_use (``input`` an object); stop_reason max_tokens > stop_sequence
> tool_use > end_turn (vLLM's precedence); usage input_tokens excludes the
prefix-cache hits, which are ``cache_read_input_tokens`` (Anthropic's and
vLLM's accounting). The per-token delta frame is spliced from prebuilt bytes,
as server/api/openai_chat/stream.py does for chat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from server.errors import SluiceError
from server.wire.output import ToolCallDelta, Usage
from server.wire.request import ToolCall
from server.wire.tools import arguments_object

__all__ = [
    "PING",
    "MessagesChoice",
    "MessagesStream",
    "StopReason",
    "cut_stop",
    "event",
    "message_body",
    "stop_reason",
    "usage_dict",
]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


@dataclass(frozen=True, slots=True)
class MessagesChoice:
    """One finished answer, read: thinking, text, tool calls, why it stopped."""

    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...]
    stop_reason: StopReason
    stop_sequence: str | None = None


def stop_reason(
    engine_reason: str | None, stop: int | str | None, called: bool
) -> tuple[StopReason, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for the engine's finish: a cut
    by max_tokens wins, then a matched stop string (vLLM's ``stop_reason`` is
    the string), then a tool call, else the model ended its turn."""
    if engine_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("tool_use" if called else "end_turn"), None


def cut_stop(text: str, engine_reason: str | None, stops: Sequence[str]) -> tuple[str, str | None]:
    """A whole answer without the stop string the engine left at its end
    (``include_stop_str_in_output``), and that string; (text, None) if none ended it."""
    if engine_reason == "stop":
        for s in sorted(stops, key=len, reverse=True):
            if text.endswith(s):
                return text[: -len(s)], s
    return text, None


def usage_dict(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": max(0, usage.prompt_tokens - usage.cached_tokens),
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def _head(message_id: str, model: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model}


def message_body(message_id: str, model: str, choice: MessagesChoice, usage: Usage) -> bytes:
    """A non-streamed ``message`` body."""
    content: list[dict[str, Any]] = []
    if choice.reasoning:
        content.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
    if choice.content:
        content.append({"type": "text", "text": choice.content})
    content.extend(
        {"type": "tool_use", "id": c.id, "name": c.name, "input": arguments_object(c.arguments)}
        for c in choice.tool_calls
    )
    return orjson.dumps(
        {
            **_head(message_id, model),
            "content": content,
            "stop_reason": choice.stop_reason,
            "stop_sequence": choice.stop_sequence,
            "usage": usage_dict(usage),
        }
    )


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event as Anthropic frames it: the ``event:`` line names its type."""
    kind: str = payload["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


PING: Final = event({"type": "ping"})

BlockKind = Literal["thinking", "text", "tool_use"]


class MessagesStream:
    """The event sequence of one streamed message, which the ``anthropic``
    client's stream helper assembles: message_start; per block
    content_block_start, its deltas, content_block_stop; message_delta
    (stop_reason, usage); message_stop. A block closes when output of another
    kind (or another tool call) begins."""

    __slots__ = ("_calls", "_index", "_kind", "_message_id", "_model")

    def __init__(self, message_id: str, model: str) -> None:
        self._message_id = message_id
        self._model = model
        self._index = -1  # the open block's index; -1 before the first
        self._kind: BlockKind | None = None  # the open block's kind; None: closed
        self._calls: dict[int, int] = {}  # the parser's tool index -> block index

    def start(self, input_tokens: int) -> bytes:
        message = {
            **_head(self._message_id, self._model),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        return event({"type": "message_start", "message": message})

    def _open(self, block: dict[str, Any]) -> bytes:
        closing = self._close()
        self._index += 1
        self._kind = block["type"]
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return closing + event(start)

    def _close(self) -> bytes:
        if self._kind is None:
            return b""
        self._kind = None
        return event({"type": "content_block_stop", "index": self._index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event({"type": "content_block_delta", "index": self._index, "delta": delta})

    def thinking(self, text: str) -> bytes:
        if not text:
            return b""
        head = (
            b""
            if self._kind == "thinking"
            else self._open({"type": "thinking", "thinking": "", "signature": ""})
        )
        return head + self._delta({"type": "thinking_delta", "thinking": text})

    def text(self, text: str) -> bytes:
        if not text:
            return b""
        head = b"" if self._kind == "text" else self._open({"type": "text", "text": ""})
        return head + self._delta({"type": "text_delta", "text": text})

    def tool_calls(self, deltas: Sequence[ToolCallDelta]) -> bytes:
        parts = []
        for d in deltas:
            if d.index not in self._calls:
                block = {"type": "tool_use", "id": d.id or "", "name": d.name or "", "input": {}}
                parts.append(self._open(block))
                self._calls[d.index] = self._index
            if d.arguments and self._calls[d.index] == self._index:
                parts.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments}))
        return b"".join(parts)

    def finish(self, reason: StopReason, sequence: str | None, usage: Usage) -> bytes:
        end = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage_dict(usage),
        }
        return self._close() + event(end) + event({"type": "message_stop"})

    @staticmethod
    def error(err: SluiceError) -> bytes:
        return event(err.anthropic_body())
