"""Server-sent-event frames for streamed chat and text completions.

The per-token chunk is Sluice's hottest serialisation: a profile of a naive
front put about a fifth of its CPU in per-token socket writes and JSON
(DESIGN.md). Every chunk of one request repeats the same id, object, created
and model, so a stream encoder renders that once, keeps the bytes before and
after the token text per choice index, and per token splices in only
``orjson.dumps(text)`` — the JSON-escaped string. ``contents()`` / ``texts()``
join many choices' (or a lagging client's several tokens') frames into one
buffer, so the server can flush one write per request per engine step.

The fast frames equal ``sse(encoder.chunk_dict(...))`` byte for byte; the unit
tests hold them to that. Anything unusual (logprobs, several fields at once)
goes through the general ``chunk()`` path, which is that reference itself.
Frame: ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

import orjson

from server.api.openai_chat.output import REASONING_FIELD, chat_logprobs, completion_logprobs
from server.wire.output import FinishReason, TokenLogprob, ToolCallDelta, Usage

__all__ = ["DONE", "ChatStream", "CompletionStream", "sse"]

DONE: Final = b"data: [DONE]\n\n"

_dumps = orjson.dumps


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE frame holding ``payload`` as JSON."""
    return b"data: " + _dumps(payload) + b"\n\n"


class _Stream:
    """Shared head (id, object, created, model) and per-index prefix cache."""

    __slots__ = ("_base", "_head", "_prefixes")

    _ID_PREFIX: str = ""
    _OBJECT: str = ""

    def __init__(
        self, request_id: str, created: int, model: str, n: int, service_tier: str | None = None
    ) -> None:
        self._base: dict[str, Any] = {
            "id": f"{self._ID_PREFIX}{request_id}",
            "object": self._OBJECT,
            "created": created,
            "model": model,
        }
        if service_tier is not None:  # chat chunks name it, as OpenAI's do
            self._base["service_tier"] = service_tier
        # `data: {"id":...,"model":...,` — the dict's JSON without its closing brace.
        self._head = b"data: " + _dumps(self._base)[:-1] + b","
        self._prefixes: list[dict[str, bytes]] = [self._make_prefixes(i) for i in range(n)]

    def _make_prefixes(self, index: int) -> dict[str, bytes]:
        raise NotImplementedError

    def _prefix(self, index: int, kind: str) -> bytes:
        prefixes = self._prefixes
        while index >= len(prefixes):
            prefixes.append(self._make_prefixes(len(prefixes)))
        return prefixes[index][kind]

    def usage(self, usage: Usage) -> bytes:
        """The final usage frame (``choices: []``), sent when include_usage is set."""
        return sse({**self._base, "choices": [], "usage": usage.as_dict()})


class ChatStream(_Stream):
    """Frames of one streamed ``chat.completion.chunk`` response.

    Per choice: ``first(i)`` (role), then ``content(i, text)`` /
    ``reasoning(i, text)`` / ``tool_calls(i, deltas)`` per delta, then
    ``finish(i, reason)``; after all choices, ``usage(...)`` if asked for,
    then ``DONE``.
    """

    __slots__ = ("_reasoning_field",)

    _ID_PREFIX = "chatcmpl-"
    _OBJECT = "chat.completion.chunk"
    _TAIL: Final = b'},"logprobs":null,"finish_reason":null}]}\n\n'

    def __init__(
        self,
        *,
        request_id: str,
        created: int,
        model: str,
        n: int = 1,
        reasoning_field: str = REASONING_FIELD,
        service_tier: str = "default",
    ) -> None:
        self._reasoning_field = reasoning_field
        super().__init__(request_id, created, model, n, service_tier)

    def _make_prefixes(self, index: int) -> dict[str, bytes]:
        start = self._head + b'"choices":[{"index":' + str(index).encode() + b',"delta":{'
        return {
            "content": start + b'"content":',
            "reasoning": start + _dumps(self._reasoning_field) + b":",
            "first": self.chunk(index, role="assistant", content=""),
        }

    def chunk_dict(
        self,
        index: int,
        *,
        role: str | None = None,
        content: str | None = None,
        reasoning: str | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
        finish_reason: FinishReason | None = None,
        tool_calls: Sequence[ToolCallDelta] = (),
    ) -> dict[str, Any]:
        """The chunk as a dict: the reference every fast frame must equal."""
        delta: dict[str, Any] = {}
        if role is not None:
            delta["role"] = role
        if content is not None:
            delta["content"] = content
        if reasoning is not None:
            delta[self._reasoning_field] = reasoning
        if tool_calls:
            delta["tool_calls"] = [t.as_dict() for t in tool_calls]
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": None if logprobs is None else chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        return {**self._base, "choices": [choice]}

    def chunk(
        self,
        index: int,
        *,
        role: str | None = None,
        content: str | None = None,
        reasoning: str | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
        finish_reason: FinishReason | None = None,
        tool_calls: Sequence[ToolCallDelta] = (),
    ) -> bytes:
        """General (slow) path: any combination of delta fields, logprobs, finish."""
        return sse(
            self.chunk_dict(
                index,
                role=role,
                content=content,
                reasoning=reasoning,
                logprobs=logprobs,
                finish_reason=finish_reason,
                tool_calls=tool_calls,
            )
        )

    def tool_calls(self, index: int, deltas: Sequence[ToolCallDelta]) -> bytes:
        """A frame with ``delta: {"tool_calls": [...]}`` (not per token: calls are rare)."""
        return self.chunk(index, tool_calls=deltas)

    def first(self, index: int) -> bytes:
        """The opening frame of a choice: ``delta: {"role": "assistant", "content": ""}``."""
        return self._prefix(index, "first")

    def content(self, index: int, text: str) -> bytes:
        """Fast frame with ``delta: {"content": text}``."""
        return b"".join((self._prefix(index, "content"), _dumps(text), self._TAIL))

    def reasoning(self, index: int, text: str) -> bytes:
        """Fast frame with ``delta: {<reasoning_field>: text}``."""
        return b"".join((self._prefix(index, "reasoning"), _dumps(text), self._TAIL))

    def contents(self, items: Iterable[tuple[int, str]]) -> bytes:
        """Content frames of several choices (or several tokens) for one write."""
        tail = self._TAIL
        parts: list[bytes] = []
        for index, text in items:
            parts += (self._prefix(index, "content"), _dumps(text), tail)
        return b"".join(parts)

    def splits(self, items: Iterable[tuple[int, str, str]]) -> bytes:
        """Frames for ``(index, reasoning, content)`` deltas of a thinking model.

        Empty parts are skipped; a delta holding both (the ``</think>`` step)
        becomes a reasoning frame then a content frame, in generation order.
        """
        tail = self._TAIL
        parts: list[bytes] = []
        for index, reasoning, content in items:
            if reasoning:
                parts += (self._prefix(index, "reasoning"), _dumps(reasoning), tail)
            if content:
                parts += (self._prefix(index, "content"), _dumps(content), tail)
        return b"".join(parts)

    def finish(self, index: int, finish_reason: FinishReason) -> bytes:
        """The closing frame of a choice: empty delta plus ``finish_reason``."""
        return self.chunk(index, finish_reason=finish_reason)


class CompletionStream(_Stream):
    """Frames of one streamed ``text_completion`` response.

    Tracks each choice's emitted text length so that streamed logprobs carry
    the same ``text_offset`` values a non-streaming body would.
    """

    __slots__ = ("_offsets",)

    _ID_PREFIX = "cmpl-"
    _OBJECT = "text_completion"
    _TAIL: Final = b',"logprobs":null,"finish_reason":null}]}\n\n'

    def __init__(self, *, request_id: str, created: int, model: str, n: int = 1) -> None:
        self._offsets: dict[int, int] = {}
        super().__init__(request_id, created, model, n)

    def _make_prefixes(self, index: int) -> dict[str, bytes]:
        return {"text": self._head + b'"choices":[{"index":' + str(index).encode() + b',"text":'}

    def chunk_dict(
        self,
        index: int,
        text: str,
        *,
        logprobs: Sequence[TokenLogprob] | None = None,
        finish_reason: FinishReason | None = None,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """The chunk as a dict: the reference every fast frame must equal."""
        choice = {
            "index": index,
            "text": text,
            "logprobs": None if logprobs is None else completion_logprobs(logprobs, text_offset),
            "finish_reason": finish_reason,
        }
        return {**self._base, "choices": [choice]}

    def chunk(
        self,
        index: int,
        text: str,
        *,
        logprobs: Sequence[TokenLogprob] | None = None,
        finish_reason: FinishReason | None = None,
    ) -> bytes:
        """General path: text with logprobs and/or a finish reason."""
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(text)
        return sse(
            self.chunk_dict(
                index, text, logprobs=logprobs, finish_reason=finish_reason, text_offset=offset
            )
        )

    def text(self, index: int, text: str) -> bytes:
        """Fast frame with only ``text``."""
        offsets = self._offsets
        offsets[index] = offsets.get(index, 0) + len(text)
        return b"".join((self._prefix(index, "text"), _dumps(text), self._TAIL))

    def texts(self, items: Iterable[tuple[int, str]]) -> bytes:
        """Text frames of several choices (or several tokens) for one write."""
        offsets = self._offsets
        tail = self._TAIL
        parts: list[bytes] = []
        for index, text in items:
            offsets[index] = offsets.get(index, 0) + len(text)
            parts += (self._prefix(index, "text"), _dumps(text), tail)
        return b"".join(parts)

    def finish(self, index: int, finish_reason: FinishReason) -> bytes:
        """The closing frame of a choice: empty text plus ``finish_reason``."""
        return self.chunk(index, "", finish_reason=finish_reason)
