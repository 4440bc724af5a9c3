"""Ollama's API on the one pipeline: /api/chat, /api/generate and the routes around them.

Why this module exists: the aiohttp half of Ollama's API, so that clients
that speak only Ollama (its Python and JavaScript libraries, LangChain's
ChatOllama, Open WebUI) point at Sluice unchanged. ``prepare_chat`` and
``prepare_generate`` translate the body (server/api/ollama/parse.py) and hand
it to ``chat_job``, so callers, the backlog, dedupe, tools, structured output,
the thinking split, metrics (endpoint labels ``ollama_chat`` and
``ollama_generate``), drain and abort on disconnect are the chat endpoint's
own; a raw or templated generate is tokenized as a completion's prompt. The
``OllamaEncoder`` reads the output as the other chat-shaped APIs do
(``ChatEncoder.choices`` for a whole body, ``ChoiceReader`` per delta) and
writes Ollama's bodies and newline-delimited lines (server/api/ollama/output.py).

The rest: /api/tags, /api/show and /api/ps describe what is served;
/api/version answers the version of Ollama's API these shapes follow; the
embedding routes refuse until an embedding model is served (issue 30's
pooling path: the translation is in parse.py and output.py already); the
model-management routes refuse, each saying what to do instead.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final

import orjson
from aiohttp import web

from server import __version__
from server.api.ollama.output import (
    NDJSON,
    CallAssembly,
    Clock,
    Metrics,
    ModelEntry,
    OllamaStream,
    answer_body,
    done_reason,
    embed_body,
    embeddings_body,
    load_body,
    ps_body,
    show_body,
    tags_body,
)
from server.api.ollama.parse import (
    EmbedRequest,
    OllamaRequest,
    check_num_ctx,
    parse_chat,
    parse_embed,
    parse_embeddings,
    parse_generate,
    parse_show,
    served_name,
)
from server.api.openai_chat.endpoint import ChatEncoder, Detokenize, chat_job, read_body
from server.api.openai_chat.parse import check_context
from server.api.pooling.endpoint import embed_job
from server.engines.choice_reader import ChoiceReader
from server.engines.interface import ChatParser, CompletionDelta, Pooled
from server.engines.registry import ModelEntry as Served
from server.engines.registry import State
from server.errors import SluiceError
from server.http.models import use_model
from server.http.pipeline import Encoder, Job, PoolJob, Trace, json_response, logprobs
from server.state import CALLER, CALLERS, METRICS, MODELS, RUNTIME
from server.wire.output import ChatChoice, TokenLogprob, Usage
from server.wire.request import ChatRequest, ToolCall

__all__ = [
    "MANAGEMENT",
    "OLLAMA_VERSION",
    "OllamaEncoder",
    "not_managed",
    "prepare_chat",
    "prepare_embed",
    "prepare_embeddings",
    "prepare_generate",
    "ps",
    "show",
    "tags",
    "version",
]

# The Ollama release whose API reference (docs/api.md, api/types.go) these
# shapes follow: what /api/version answers, since clients gate features on it.
OLLAMA_VERSION: Final = "0.32.15"

_STREAM_HEADERS: Final = {
    "Content-Type": NDJSON,
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def _served(request: web.Request, name: str) -> str:
    """The served name an Ollama client's model name stands for (parse.py rule 1)."""
    registry = request.app[MODELS]
    return served_name(name, lambda n: registry.find(n) is not None)


async def prepare_chat(request: web.Request, tr: Trace) -> tuple[Job, Encoder[ChatChoice]]:
    req = parse_chat(await read_body(request), request.app[RUNTIME].limits)
    return await _prepare(request, tr, req)


async def prepare_generate(request: web.Request, tr: Trace) -> tuple[Job, Encoder[ChatChoice]]:
    req = parse_generate(await read_body(request), request.app[RUNTIME].limits)
    return await _prepare(request, tr, req)


async def _prepare(
    request: web.Request, tr: Trace, req: OllamaRequest
) -> tuple[Job, Encoder[ChatChoice]]:
    chat = dataclasses.replace(req.chat, model=_served(request, req.name))
    # The model, loaded (an on-demand one loads here); chat_job's own check
    # finds it held.
    entry, adapter = await use_model(request, chat.model)
    if req.keep_alive is not None:  # the model's idle time from now on (registry.py rule 7)
        entry.keep_alive = req.keep_alive
    engine = entry.engine
    check_num_ctx(req.num_ctx, engine.info.max_model_len)
    if not req.load and req.text is None:
        cj = await chat_job(request, chat, "ollama")
        return cj.job, OllamaEncoder(req, chat, tr, engine.detokenize, cj.parser, cj.prompt_ids)
    request.app[METRICS].ignored.record("ollama", chat.ignored)
    job = Job(
        model=chat.model,
        entry=entry,
        adapter=adapter,
        prompts=(),
        max_tokens=(),
        sampling=chat.sampling,
        cacheable=False,
    )
    if req.load:
        # Nothing to generate (parse.py rule 9): the pipeline runs no prompt
        # and the encoder answers Ollama's "loaded".
        return job, OllamaEncoder(req, chat, tr, engine.detokenize)
    assert req.text is not None
    # A raw or templated prompt: the engine gets it as it is, like a completion's.
    sampling = chat.sampling
    if sampling.constraint is not None:
        await engine.check_constraint(sampling.constraint)
    ids = tuple((await engine.tokenize_prompts([req.text]))[0])
    room = check_context(len(ids), sampling.max_tokens, engine.info.max_model_len, where="prompt")
    job = dataclasses.replace(
        job, prompts=(ids,), max_tokens=(room,), stream=chat.stream, variant=False, cacheable=True
    )
    return job, OllamaEncoder(req, chat, tr, engine.detokenize)


class OllamaEncoder:
    """Ollama's bodies and stream lines for one chat or generate request."""

    def __init__(
        self,
        req: OllamaRequest,
        chat: ChatRequest,
        tr: Trace,
        detokenize: Detokenize,
        parser: ChatParser | None = None,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._req = req
        self._chat = chat
        self._tr = tr
        self._detokenize = detokenize
        self._parser = parser
        self._prompt_ids = prompt_ids
        self._reader = ChoiceReader(parser, prompt_ids, thinking=chat.enable_thinking)
        self._stream = OllamaStream(req.name, generate=req.generate)
        self._calls = CallAssembly()
        self._clock = Clock()
        self._first = True
        self._reason = "stop"

    def _metrics(self, usage: Usage) -> Metrics:
        tr = self._tr
        queued = tr.tickets[0].queue_wait if tr.tickets else 0.0
        total = time.monotonic() - tr.t0
        return Metrics.of(total, queued, tr.ttft, usage.prompt_tokens, usage.completion_tokens)

    def choices(
        self,
        texts: Sequence[str],
        logprobs: Sequence[Sequence[TokenLogprob]],
        reasons: Sequence[str | None],
    ) -> tuple[ChatChoice, ...]:
        # Read as chat reads a whole answer (the thinking split, vLLM's parsers).
        chat = ChatEncoder(
            self._chat, self._tr.rid, self._detokenize, self._parser, self._prompt_ids
        )
        return chat.choices(texts, logprobs, reasons)

    def body(self, choices: Sequence[ChatChoice], usage: Usage) -> bytes:
        created = self._clock(time.time())
        if not choices:
            return load_body(self._req.name, created, generate=self._req.generate)
        c = choices[0]
        return answer_body(
            self._req.name,
            created,
            generate=self._req.generate,
            content=c.content or "",
            thinking=c.reasoning,
            calls=c.tool_calls,
            reason=done_reason(c.finish_reason),
            metrics=self._metrics(usage),
            logprobs=c.logprobs,
        )

    def stream_headers(self) -> Mapping[str, str]:
        return _STREAM_HEADERS

    def stream_head(self) -> bytes:
        return b""  # the first line is the first output's (output.py rule 1)

    def stream_delta(self, choice: int, delta: CompletionDelta) -> bytes:
        d = self._reader.feed(delta)
        if d.tool_calls:
            self._calls.add(d.tool_calls)
        calls: tuple[ToolCall, ...] = ()
        if delta.finish_reason is not None:
            self._reason = done_reason(delta.finish_reason)
            calls = self._calls.finish()
        k = self._chat.sampling.logprobs
        lps = None if k is None else logprobs(self._detokenize, delta, k)
        if not (self._first or d.content or d.reasoning or calls or lps):
            return b""
        self._first = False
        return self._stream.line(time.time(), d.content, d.reasoning, calls, lps)

    def stream_end(self, usage: Usage) -> bytes:
        return self._stream.done(time.time(), self._reason, self._metrics(usage))

    def stream_error(self, err: SluiceError) -> bytes:
        return self._stream.error(err)


# ---------------------------------------------------------------------------
# The models: what is served, as Ollama lists it.


def _entries(request: web.Request, *, loaded: bool = False) -> list[ModelEntry]:
    """The models this caller may see, each followed by its adapters it may use
    (its /v1/models); `loaded`: only the models whose engine is up (/api/ps)."""
    access = request.app[CALLERS].access(request.get(CALLER))
    out: list[ModelEntry] = []
    for e in request.app[MODELS].visible(access):
        if loaded and e.state is not State.LOADED:
            continue
        info = e.engine.info
        created, context = info.created, info.max_model_len or e.spec.max_model_len
        out.append(ModelEntry(e.name, e.spec.path, created, context))
        out += [
            ModelEntry(a.name, a.path, created, context, a.parent)
            for a in e.adapters.visible(access)
        ]
    return out


def _model(request: web.Request, served: str) -> Served:
    """The served model a caller's name stands for (no load): the 404 of an
    unknown name or one outside its `models`, the 403 of a base model outside
    its `adapters` (server/engines/registry.py rule 2)."""
    access = request.app[CALLERS].access(request.get(CALLER))
    entry, _ = request.app[MODELS].resolve(served, access)
    return entry


async def tags(request: web.Request) -> web.Response:
    return json_response(tags_body(_entries(request)))


async def ps(request: web.Request) -> web.Response:
    return json_response(ps_body(_entries(request, loaded=True), time.time()))


async def show(request: web.Request) -> web.Response:
    name = parse_show(await read_body(request))
    served = _served(request, name)
    model = _model(request, served)  # the 404 / 403 of an unknown or forbidden name
    entries = _entries(request)
    entry = next((e for e in entries if e.served == served), None)
    if entry is None:  # a model named by its path
        entry = next(e for e in entries if e.served == model.name)
    return json_response(show_body(entry))


async def version(request: web.Request) -> web.Response:
    return json_response(orjson.dumps({"version": OLLAMA_VERSION, "sluice": __version__}))


# ---------------------------------------------------------------------------
# Embeddings: on the pooling pipeline (server/http/pipeline.py `pooling_endpoint`),
# on a model that embeds (docs/pooling.md); any other is the 400 naming it.

PoolBody = Callable[[Sequence[Pooled]], bytes]


async def prepare_embed(request: web.Request, tr: Trace) -> tuple[PoolJob, PoolBody]:
    req = parse_embed(await read_body(request))

    def body(outs: Sequence[Pooled], metrics: Metrics) -> bytes:
        return embed_body(req.name, [o.data.tolist() for o in outs], metrics)

    return await _embed_job(request, tr, req, body)


async def prepare_embeddings(request: web.Request, tr: Trace) -> tuple[PoolJob, PoolBody]:
    """The older /api/embeddings: one ``prompt``, one ``embedding``."""
    req = parse_embeddings(await read_body(request))

    def body(outs: Sequence[Pooled], metrics: Metrics) -> bytes:
        return embeddings_body(outs[0].data.tolist() if outs else [])

    return await _embed_job(request, tr, req, body)


async def _embed_job(
    request: web.Request,
    tr: Trace,
    req: EmbedRequest,
    answer: Callable[[Sequence[Pooled], Metrics], bytes],
) -> tuple[PoolJob, PoolBody]:
    """The pooling job of an embed request: its inputs tokenized by the model's
    engine (``truncate``, Ollama's default, cuts each to the context, as vLLM's
    ``truncate_prompt_tokens`` -1 does; off, an input past it is a 400)."""
    request.app[METRICS].ignored.record("ollama", req.ignored)
    job = await embed_job(
        request,
        _served(request, req.name),
        req.inputs,
        dimensions=req.dimensions,
        truncate_prompt_tokens=-1 if req.truncate else None,
    )

    def body(outs: Sequence[Pooled]) -> bytes:
        total = time.monotonic() - tr.t0
        queued = tr.tickets[0].queue_wait if tr.tickets else 0.0
        return answer(outs, Metrics.of(total, queued, None, tr.prompt_tokens, 0))

    return job, body


# ---------------------------------------------------------------------------
# Model management: not Sluice's job; each refusal says what to do instead.

_SERVE: Final = "sluice serve --model NAME_OR_PATH"
MANAGEMENT: Final = {
    "/api/pull": f"Sluice serves the model it was started with and pulls none: start it "
    f"with the model ({_SERVE}); GET /api/tags lists what it serves",
    "/api/push": "Sluice does not push models: push from where the model was made",
    "/api/create": f"Sluice does not create models from a Modelfile: serve a model "
    f"directory ({_SERVE}), or a LoRA adapter on it (--lora-modules NAME=PATH)",
    "/api/blobs/{digest}": "Sluice takes no model blobs (they are for /api/create, "
    f"which it does not do): serve a model directory ({_SERVE})",
    "/api/copy": "Sluice does not copy models: serve the model under another name "
    "(--served-model-name NAME)",
    "/api/delete": "Sluice does not delete models: stop the server, or unload a LoRA "
    "adapter (POST /v1/unload_lora_adapter, with --allow-runtime-lora)",
}


def not_managed(advice: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The handler of one model-management route: a 501 with ``advice``. The
    route is known and deliberately not implemented: not a 404 (the client
    reached the right server), not a 400 (no body would do)."""

    async def handler(request: web.Request) -> web.Response:
        raise SluiceError(advice, status=501, code="not_implemented")

    return handler
