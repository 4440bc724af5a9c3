"""The output values every API and the engines share: a finished choice, a streamed delta, usage.

Why this module exists: the engine side (server/engines/) produces these and
every API's output module reads them; kept in the chat API they made the
engines and the other APIs import from one API's package. Pure values: no
I/O, no wire format beyond ``ToolCallDelta.as_dict`` (OpenAI's tool-call delta,
the one shape two APIs stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from server.wire.request import ToolCall

__all__ = [
    "ChatChoice",
    "CompletionChoice",
    "FinishReason",
    "Parsed",
    "ParsedDelta",
    "PromptLogprob",
    "TokenLogprob",
    "ToolCallDelta",
    "Usage",
]

FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's logprob and its top alternatives (token, logprob). A
    prompt's first token has none (``None``): nothing comes before it."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """One prompt token's candidates as vLLM's ``prompt_logprobs`` extension
    answers them: (token id, logprob, rank, decoded text), the prompt's own
    token first, then the top k. A prompt's first token has none (None in
    its place): nothing comes before it."""

    candidates: tuple[tuple[int, float, int | None, str], ...]


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One streamed piece of a tool call: the first carries ``id`` and ``name``
    (and ``type: function`` on the wire), later ones argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_dict(self) -> dict[str, Any]:
        function: dict[str, Any] = {}
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        out["function"] = function
        return out


@dataclass(frozen=True, slots=True)
class Parsed:
    """A finished chat choice's text, split: reasoning, answer, tool calls."""

    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class ParsedDelta:
    """What one text delta of a streamed chat choice releases ("" / (): nothing)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request. ``cached_tokens``: prompt tokens the
    engine's prefix cache already held (vLLM's ``num_cached_tokens``)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass(frozen=True, slots=True)
class ChatChoice:
    """One finished chat choice. ``reasoning`` None: no thinking output (key omitted);
    ``tool_calls`` empty: no calls (key omitted)."""

    index: int
    content: str | None
    finish_reason: FinishReason
    reasoning: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class CompletionChoice:
    """One finished text completion choice.

    ``text_offset`` is the character offset of the first logprob'd token in
    ``text`` (non-zero when the prompt was echoed in front of it).
    """

    index: int
    text: str
    finish_reason: FinishReason
    logprobs: tuple[TokenLogprob, ...] | None = None
    text_offset: int = 0
    # vLLM's prompt_logprobs extension, when asked: one entry per prompt token.
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None
