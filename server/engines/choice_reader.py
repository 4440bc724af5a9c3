"""One streamed chat choice read into reasoning, content and tool-call deltas.

Why this module exists: the chat encoder writes each delta as it reads it,
but the APIs with typed output items (Responses, Messages) need the parts
first: which text is thinking, which is the answer, which is a call. With
tools, vLLM's parsers read the output (``ChatParser.stream``); without, the
reasoning split of server/engines/reasoning_split.py (a hundredth of the cost per delta,
see server/api/openai_chat/endpoint.py). Either way the result is one ``ParsedDelta``.
"""

from __future__ import annotations

from collections.abc import Sequence

from server.engines.interface import ChatParser, ChoiceParser, CompletionDelta
from server.engines.reasoning_split import ReasoningSplitter
from server.wire.output import ParsedDelta

__all__ = ["ChoiceReader"]


class ChoiceReader:
    """Feed each engine delta of one choice; get what it releases."""

    __slots__ = ("_parser", "_splitter", "_stream")

    def __init__(
        self, parser: ChatParser | None, prompt_ids: Sequence[int], *, thinking: bool
    ) -> None:
        self._parser = parser
        self._stream: ChoiceParser | None = None
        if parser is not None:
            self._stream = parser.stream()
            self._stream.start(prompt_ids)
        self._splitter = ReasoningSplitter() if thinking and parser is None else None

    @property
    def called(self) -> bool:
        """Whether a tool call was announced (for the finish reason)."""
        return self._stream is not None and self._stream.called

    def feed(self, delta: CompletionDelta) -> ParsedDelta:
        done = delta.finish_reason is not None
        if self._stream is not None:
            return self._stream.feed(delta.text, delta.token_ids, finished=done)
        if self._splitter is None:
            return ParsedDelta(content=delta.text)
        reasoning, content = self._splitter.feed(delta.text)
        if done:
            r, c = self._splitter.finish()
            reasoning, content = reasoning + r, content + c
        return ParsedDelta(reasoning, content)
