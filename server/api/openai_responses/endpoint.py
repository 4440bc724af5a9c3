"""/v1/responses on the one pipeline: prepare, the encoder, and the stored-response routes.

Why this module exists: OpenAI's Responses API is a chat request in other
clothes. ``prepare_responses`` parses the body into a ``ChatRequest``
(server/api/openai_responses/parse.py, output.py), puts a stored conversation in front when
``previous_response_id`` names one, and runs ``chat_job``: everything after
(callers, queue, dedupe, result cache, tools, thinking, metrics under the
``responses`` label, drain, abort on disconnect) is the pipeline's.
``ResponsesEncoder`` reads the output as chat does (``ChatEncoder.choices``
for whole bodies, ``ChoiceReader`` per delta) and writes Responses items and
events; a finished response goes to the ``ResponseStore`` unless the request
said ``store: false``. GET and DELETE /v1/responses/{id} read that store.
``StoredResponses`` is that store: the policy (store.py) in front of the state
database (server/operations/state_db.py). A write is queued at once and
awaited before POST /v1/responses returns (``post_responses``), so a
non-streamed response is on disk before its body goes out.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import orjson
from aiohttp import web

from server.api.openai_chat.endpoint import ChatEncoder, ChatJob, chat_job, read_body
from server.api.openai_responses.output import (
    ResponsesStream,
    conversation_after,
    output_items,
    response_object,
    status_of,
)
from server.api.openai_responses.parse import ResponsesRequest, parse_responses
from server.api.openai_responses.store import (
    ResponseStore,
    StoredResponse,
    decode_conversation,
    encode_conversation,
    size_of,
)
from server.engines.choice_reader import ChoiceReader
from server.engines.interface import CompletionDelta, Engine
from server.errors import SluiceError
from server.http.pipeline import Encoder, Job, Trace, generation_endpoint, json_response
from server.operations.state_db import ResponseRow, StateDB
from server.state import CALLER, RUNTIME
from server.wire.output import ChatChoice, TokenLogprob, Usage
from server.wire.request import ChatRequest, Message

__all__ = [
    "RESPONSES",
    "StoredResponses",
    "delete_response",
    "get_response",
    "post_responses",
    "prepare_responses",
]

log = logging.getLogger("sluice")


class StoredResponses:
    """The stored responses: ``policy`` decides, ``db`` keeps (the module's docstring)."""

    def __init__(self, db: StateDB, policy: ResponseStore) -> None:
        self.db = db
        self.policy = policy
        self._pending: set[asyncio.Future[None]] = set()

    async def open(self, now: float) -> None:
        """Open the database and read the index; delete what expired meanwhile."""
        await self.db.open()
        gone = self.policy.load(await self.db.responses_index(), now)
        await self.db.delete_responses(gone)

    async def close(self) -> None:
        await self.flush()
        await self.db.close()

    def put(
        self,
        response_id: str,
        owner: str | None,
        body: bytes,
        conversation: Sequence[Message],
        now: float,
    ) -> bool:
        """Keep a response (written on the database's thread); False when too big."""
        size = size_of(body, conversation)
        dropped = self.policy.admit(response_id, owner, size, now)
        if dropped is None:
            return False
        row = ResponseRow(response_id, owner, now, size, body, encode_conversation(conversation))
        fut = self.db.put_response(row, dropped)
        self._pending.add(fut)
        fut.add_done_callback(self._written)
        return True

    def _written(self, fut: asyncio.Future[None]) -> None:
        self._pending.discard(fut)
        if not fut.cancelled() and (exc := fut.exception()) is not None:
            log.error("a stored response was not written", extra={"fields": {"error": str(exc)}})

    async def flush(self) -> None:
        """Wait for the writes queued so far."""
        if self._pending:
            await asyncio.wait(set(self._pending))

    async def get(self, response_id: str, owner: str | None, now: float) -> StoredResponse | None:
        if not self.policy.visible(response_id, owner, now):
            return None
        row = await self.db.get_response(response_id)
        if row is None:  # its write failed
            return None
        return StoredResponse(row.owner, row.body, decode_conversation(row.conversation))

    async def delete(self, response_id: str, owner: str | None, now: float) -> bool:
        if not self.policy.visible(response_id, owner, now):
            return False
        self.policy.forget((response_id,))
        await self.db.delete_responses((response_id,))
        return True

    async def sweep(self, now: float) -> int:
        """Delete what is past its retention; how many."""
        gone = self.policy.expired(now)
        self.policy.forget(gone)
        await self.db.delete_responses(gone)
        return len(gone)


# The app's stored responses (server/app.py fills it): beside the one API that
# reads it, above the shell, so the app's state (server/state.py) imports no API.
RESPONSES = web.AppKey("responses", StoredResponses)  # /v1/responses' stored responses


def _not_found(response_id: str, param: str | None = None) -> SluiceError:
    what = "Previous response" if param else "Response"
    return SluiceError(
        f"{what} with id '{response_id}' not found.",
        status=404,
        param=param,
        code="previous_response_not_found" if param else "not_found",
    )


async def prepare_responses(request: web.Request, tr: Trace) -> tuple[Job, Encoder[ChatChoice]]:
    rreq = parse_responses(await read_body(request), request.app[RUNTIME].limits)
    store = request.app[RESPONSES]
    owner = request.get(CALLER)
    history: tuple[Message, ...] = ()
    if rreq.previous_response_id is not None:
        prev = await store.get(rreq.previous_response_id, owner, time.time())
        if prev is None:
            raise _not_found(rreq.previous_response_id, "previous_response_id")
        history = prev.conversation
    req = rreq.with_history(history)
    try:
        cj = await chat_job(request, req, "responses")
    except SluiceError as err:
        if err.param == "messages":  # the context check names chat's field
            err.param = "input"
        raise
    engine = cj.job.entry.engine
    return cj.job, ResponsesEncoder(rreq, req, history, cj, tr.rid, engine, store, owner)


class ResponsesEncoder:
    """``response`` bodies and Responses stream events for one request."""

    def __init__(
        self,
        rreq: ResponsesRequest,
        req: ChatRequest,
        history: tuple[Message, ...],
        cj: ChatJob,
        rid: str,
        engine: Engine,
        store: StoredResponses,
        owner: str | None,
    ) -> None:
        self._rreq = rreq
        self._history = history
        self._engine = engine
        self._store = store
        self._owner = owner
        self._id = f"resp_{uuid.uuid4().hex}"
        self._created = int(time.time())
        self._chat_args = (req, rid, engine.detokenize, cj.parser, cj.prompt_ids)
        self._reader = ChoiceReader(cj.parser, cj.prompt_ids, thinking=req.enable_thinking)
        self._tier = cj.job.request_class.service_tier
        self._stream = ResponsesStream(rreq, self._id, self._created, self._tier)
        self._reasoning: list[str] = []
        self._finish: str | None = None

    def choices(
        self,
        texts: Sequence[str],
        logprobs: Sequence[Sequence[TokenLogprob]],
        reasons: Sequence[str | None],
    ) -> tuple[ChatChoice, ...]:
        # Whole bodies are read as chat reads them (built here: a stream needs none).
        return ChatEncoder(*self._chat_args).choices(texts, logprobs, reasons)

    def body(self, choices: Sequence[ChatChoice], usage: Usage) -> bytes:
        choice = choices[0]
        output = output_items(self._id, choice, self._rreq)
        reasoning = self._engine.count_tokens(choice.reasoning or "")
        status = status_of(choice.finish_reason)
        obj = response_object(
            self._rreq, self._id, self._created, status, output, usage, reasoning, self._tier
        )
        return self._keep(obj)

    def _keep(self, obj: dict[str, Any]) -> bytes:
        body = orjson.dumps(obj)
        if self._rreq.store:
            conversation = conversation_after(self._history, self._rreq.turn, obj["output"])
            self._store.put(self._id, self._owner, body, conversation, time.time())
        return body

    def stream_head(self) -> bytes:
        return self._stream.head()

    def stream_delta(self, choice: int, delta: CompletionDelta) -> bytes:
        d = self._reader.feed(delta)
        if d.reasoning:
            self._reasoning.append(d.reasoning)
        if delta.finish_reason is not None:
            self._finish = delta.finish_reason
        return self._stream.feed(d)

    def stream_end(self, usage: Usage) -> bytes:
        reasoning = self._engine.count_tokens("".join(self._reasoning))
        frames, final = self._stream.end(status_of(self._finish), usage, reasoning)
        self._keep(final)
        return frames

    def stream_error(self, err: SluiceError) -> bytes:
        return self._stream.error(err)


_generate = generation_endpoint("responses", prepare_responses)


async def post_responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: the pipeline, then its stored response's write
    awaited, so that a body the client gets names a response on disk (a
    stream's last event goes out just before)."""
    resp = await _generate(request)
    await request.app[RESPONSES].flush()
    return resp


async def get_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    entry = await request.app[RESPONSES].get(response_id, request.get(CALLER), time.time())
    if entry is None:
        raise _not_found(response_id)
    return json_response(entry.body)


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not await request.app[RESPONSES].delete(response_id, request.get(CALLER), time.time()):
        raise _not_found(response_id)
    body = orjson.dumps({"id": response_id, "object": "response.deleted", "deleted": True})
    return json_response(body)
