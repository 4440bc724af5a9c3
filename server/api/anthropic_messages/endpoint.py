"""Anthropic's Messages API on the chat pipeline: /v1/messages and its count_tokens.

Why this module exists: the aiohttp-facing half of the Messages API, kept out
of server/api/openai_chat/endpoint.py. `prepare_messages` translates the body into the
internal ChatRequest (server/api/anthropic_messages/parse.py) and hands it to
`chat_job`, so callers, the queue, dedupe, tools, the thinking split, metrics
(endpoint label `messages`), drain and abort on disconnect are the chat
endpoint's own. `MessagesEncoder` reads the output as ChatEncoder does (vLLM's
parsers with tools, `server/engines/reasoning_split.py` without) and writes Anthropic's
bodies and events, with a `ping` after `PING_IDLE_S` of silence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import orjson
from aiohttp import web

from server.api.anthropic_messages.output import (
    PING,
    MessagesChoice,
    MessagesStream,
    StopReason,
    cut_stop,
    message_body,
    stop_reason,
)
from server.api.anthropic_messages.parse import parse_messages
from server.api.openai_chat.endpoint import chat_job, read_body
from server.engines.interface import ChatParser, ChoiceParser, CompletionDelta
from server.engines.reasoning_split import ReasoningSplitter, split_reasoning
from server.errors import SluiceError
from server.http.models import use_model
from server.http.pipeline import Encoder, Job, Trace, check_accepting, json_response
from server.state import RUNTIME
from server.wire.output import TokenLogprob, Usage
from server.wire.request import ChatRequest

__all__ = ["PING_IDLE_S", "MessagesEncoder", "count_tokens", "prepare_messages"]

# Seconds of silence after which a stream sends `ping`. Anthropic sends them
# at no documented rate; 5 s is well inside the idle timeouts of the clients
# and proxies in front of them (Claude Code waits minutes, nginx 60 s).
PING_IDLE_S: Final = 5.0


async def prepare_messages(request: web.Request, tr: Trace) -> tuple[Job, Encoder[MessagesChoice]]:
    req = parse_messages(await read_body(request), request.app[RUNTIME].limits)
    cj = await chat_job(request, req, "messages")
    return cj.job, MessagesEncoder(req, tr.rid, cj.parser, cj.prompt_ids)


async def count_tokens(request: web.Request) -> web.Response:
    """/v1/messages/count_tokens: the prompt's tokens through the same render
    path as /v1/messages (system, tools, thinking switch), nothing generated."""
    check_accepting(request)
    req = parse_messages(await read_body(request), request.app[RUNTIME].limits, count_only=True)
    entry, _ = await use_model(request, req.model)
    ids = (await entry.engine.tokenize_chat([(req.messages, req.template_kwargs())]))[0]
    return json_response(orjson.dumps({"input_tokens": len(ids)}))


class MessagesEncoder:
    """`message` bodies and Messages stream events for one request (one choice)."""

    def __init__(
        self,
        req: ChatRequest,
        rid: str,
        parser: ChatParser | None,
        prompt_ids: Sequence[int],
    ) -> None:
        self._req = req
        self._id = f"msg_{rid}"
        self._parser = parser
        self._prompt_ids = prompt_ids
        self._stream: ChoiceParser | None = None
        self._splitter = ReasoningSplitter() if req.enable_thinking and parser is None else None
        self._enc = MessagesStream(self._id, req.model)
        self._stop: tuple[StopReason, str | None] = ("end_turn", None)

    def choices(
        self,
        texts: Sequence[str],
        logprobs: Sequence[Sequence[TokenLogprob]],
        reasons: Sequence[str | None],
    ) -> tuple[MessagesChoice, ...]:
        out = []
        for whole, reason in zip(texts, reasons, strict=True):
            text, stop = cut_stop(whole, reason, self._req.sampling.stop)
            if self._parser is not None:
                parsed = self._parser.parse(text)
                reasoning, content, calls = parsed.reasoning, parsed.content, parsed.tool_calls
            else:
                reasoning, content = split_reasoning(text, thinking=self._req.enable_thinking)
                calls = ()
            why, sequence = stop_reason(reason, stop, bool(calls))
            out.append(MessagesChoice(reasoning, content, calls, why, sequence))
        return tuple(out)

    def body(self, choices: Sequence[MessagesChoice], usage: Usage) -> bytes:
        return message_body(self._id, self._req.model, choices[0], usage)

    def stream_head(self) -> bytes:
        return self._enc.start(len(self._prompt_ids))

    def stream_delta(self, choice: int, delta: CompletionDelta) -> bytes:
        enc = self._enc
        done = delta.finish_reason is not None
        parts: list[bytes] = []
        called = False
        if self._parser is not None:
            if self._stream is None:
                self._stream = self._parser.stream()
                self._stream.start(self._prompt_ids)
            d = self._stream.feed(delta.text, delta.token_ids, finished=done)
            parts += (enc.thinking(d.reasoning), enc.text(d.content), enc.tool_calls(d.tool_calls))
            called = self._stream.called
        elif self._splitter is not None:
            reasoning, content = self._splitter.feed(delta.text)
            if done:
                r2, c2 = self._splitter.finish()
                reasoning, content = reasoning + r2, content + c2
            parts += (enc.thinking(reasoning), enc.text(content))
        else:
            parts.append(enc.text(delta.text))
        if done:
            self._stop = stop_reason(delta.finish_reason, delta.stop_reason, called)
        return b"".join(parts)

    def stream_end(self, usage: Usage) -> bytes:
        return self._enc.finish(*self._stop, usage)

    def stream_error(self, err: SluiceError) -> bytes:
        return self._enc.error(err)

    def keepalive(self) -> tuple[float, bytes]:
        return PING_IDLE_S, PING
