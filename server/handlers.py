"""HTTP handlers: the OpenAI endpoints, probes and metrics.

A generation request goes: auth and phase checks -> read and parse the body
(server/protocol) -> tokenize on the engine's worker thread -> context check
-> `Driver.submit` (the core admits or refuses at once) -> await the ticket ->
stream or collect the engine's outputs -> one access-log line. The `finally`
around the ticket is what makes a vanished client cost nothing: aiohttp
cancels the handler (handler_cancellation=True) and `Ticket.leave()` removes
the request from the queue or aborts it in the engine.

Streaming writes one buffer per engine output per request: vLLM merges the
deltas a slow reader has not taken yet, so a lagging client gets several
tokens in one write rather than a backlog of small ones.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from batching import Request as CoreRequest
from batching import ResultCache, group_key
from server import logs
from server.app import DRIVER, ENGINE, METRICS, RESULTS, RUNTIME, SETTINGS, Phase
from server.driver import Generation, Ticket
from server.errors import SluiceError
from server.protocol import (
    DONE,
    ChatChoice,
    ChatRequest,
    ChatStream,
    CompletionChoice,
    CompletionRequest,
    CompletionStream,
    Limits,
    TokenLogprob,
    Usage,
    chat_completion_body,
    check_context,
    completion_body,
    models_body,
    parse_chat,
    parse_completion,
)
from server.reasoning import ReasoningSplitter, split_reasoning

log = logging.getLogger("sluice.http")

# vLLM 0.32 names the thinking part "reasoning"; the OpenAI-compatible
# ecosystem (and the field our users' clients read) is "reasoning_content".
REASONING_FIELD = "reasoning_content"
_JSON = "application/json"
_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
_seq = itertools.count(1)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _request_id(request: web.Request) -> str:
    rid = request.headers.get("x-request-id", "")
    if rid and len(rid) <= 128 and rid.isprintable():
        return rid
    return uuid.uuid4().hex


def _json(body: bytes, rid: str, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type=_JSON, headers={"x-request-id": rid})


def _check_auth(request: web.Request) -> None:
    key = request.app[SETTINGS].api_key
    if key is None:
        return
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    # Constant-time compare; the key itself never reaches a log line.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise SluiceError("invalid or missing API key", status=401, code="invalid_api_key")


def _check_accepting(request: web.Request) -> None:
    rt = request.app[RUNTIME]
    if rt.phase is Phase.READY:
        return
    request.app[METRICS].rejections.labels(rt.phase.value).inc()
    if rt.phase is Phase.STARTING:
        raise SluiceError(
            "the model is still loading", status=503, retry_after=5, code="warming_up"
        )
    if rt.phase is Phase.DRAINING:
        raise SluiceError(
            "server shutting down; retry elsewhere", status=503, retry_after=5, code="draining"
        )
    raise SluiceError("the engine is not running", status=503, retry_after=5, code="engine_dead")


def _check_model(request: web.Request, model: str) -> None:
    settings = request.app[SETTINGS]
    if model not in (settings.model_name, settings.model_path):
        raise SluiceError(
            f"The model `{model}` does not exist.",
            status=404,
            param="model",
            code="model_not_found",
        )


def limits(request: web.Request) -> Limits:
    return request.app[RUNTIME].limits


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise SluiceError(
            f"request body exceeds {request.app[SETTINGS].max_body_bytes} bytes",
            status=413,
            code="body_too_large",
        ) from None


@dataclass(slots=True)
class _Trace:
    """What the access log line and the latency metrics need."""

    rid: str
    endpoint: str
    t0: float
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    tickets: list[Ticket] = field(default_factory=list)
    stream: bool = False
    error: str | None = None


def _finish_trace(request: web.Request, tr: _Trace) -> None:
    metrics = request.app[METRICS]
    now = time.monotonic()
    metrics.requests.labels(tr.endpoint, str(tr.status)).inc()
    metrics.duration.observe(now - tr.t0)
    if tr.ttft is not None:
        metrics.ttft.observe(tr.ttft)
    metrics.generated_tokens.inc(tr.completion_tokens)
    request.app[RUNTIME].tokens_out += tr.completion_tokens
    t = tr.tickets[0] if tr.tickets else None
    fields: dict[str, Any] = {
        "request_id": tr.rid,
        "endpoint": tr.endpoint,
        "status": tr.status,
        "stream": tr.stream,
        "prompt_tokens": tr.prompt_tokens,
        "completion_tokens": tr.completion_tokens,
        "queue_wait_ms": round(t.queue_wait * 1000, 2) if t else None,
        "ttft_ms": round(tr.ttft * 1000, 2) if tr.ttft is not None else None,
        "total_ms": round((now - tr.t0) * 1000, 2),
        "batch_id": t.batch_id if t else None,
        "batch_size": t.batch_size if t else None,
        "deduped": t.joined if t else False,
    }
    if tr.error:
        fields["error"] = tr.error
    logs.access(fields)


# ---------------------------------------------------------------------------
# The result cache


def _results(request: web.Request) -> ResultCache[Any]:
    return request.app[RESULTS]


def _cache_key(
    request: web.Request,
    endpoint: str,
    prompts: Sequence[Sequence[int]],
    sampling: Any,
    extra: Any,
) -> Any:
    """Everything that makes a deterministic result what it is; None: not cacheable."""
    if not sampling.deterministic or not _results(request).enabled:
        return None
    return (endpoint, tuple(tuple(p) for p in prompts), sampling.fingerprint(), extra)


# ---------------------------------------------------------------------------
# Submitting work


def _fingerprint(sampling: Any, extra: Any) -> Any:
    # Only deterministic sampling can share a generation (greedy, or seeded).
    return (sampling.fingerprint(), extra) if sampling.deterministic else None


async def _submit(
    request: web.Request,
    tr: _Trace,
    prompts: Sequence[Sequence[int]],
    sampling: Any,
    priority: int,
    max_tokens: Sequence[int],
    fingerprint_extra: Any,
) -> list[Ticket]:
    driver = request.app[DRIVER]
    engine: Any = request.app[ENGINE]
    settings = request.app[SETTINGS]
    now = driver.now()
    key = group_key(settings.model_name)
    fp = _fingerprint(sampling, fingerprint_extra)
    base = f"{tr.rid}-{next(_seq)}"
    tickets = []
    try:
        for i, ids in enumerate(prompts):
            params = engine.sampling_params(sampling, max_tokens[i])
            core_req = CoreRequest(
                id=base if len(prompts) == 1 else f"{base}-{i}",
                key=key,
                prompt_tokens=tuple(ids),
                max_new_tokens=max_tokens[i] * sampling.n,
                arrival=now,
                priority=priority,
                deadline=now + settings.queue_timeout,
                fingerprint=fp,
            )
            tickets.append(driver.submit(core_req, params))
    except SluiceError:
        for t in tickets:
            t.leave()
        raise
    return tickets


async def _generations(tickets: Sequence[Ticket]) -> list[Generation]:
    return [await t.wait() for t in tickets]


async def _merged(
    gens: Sequence[Generation], tickets: Sequence[Ticket]
) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, output) from several generations, as they come."""
    if len(gens) == 1:
        async for out in gens[0].outputs(tickets[0].id):
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any] | BaseException | None] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in gens[i].outputs(tickets[i].id):
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    async with asyncio.TaskGroup() as tg:
        for i in range(len(gens)):
            tg.create_task(pump(i))
        remaining = len(gens)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item


def _logprobs(engine: Any, completion: Any, k: int) -> list[TokenLogprob]:
    """vLLM's per-token {token_id: Logprob} dicts to our TokenLogprob values.

    vLLM returns the top `k` tokens plus the sampled one when it ranks below
    them; OpenAI's `top_logprobs` is exactly the top `k` (rank 1..k).
    """
    out = []
    lps = completion.logprobs or []
    for tok_id, entry in zip(completion.token_ids, lps, strict=False):
        chosen = entry.get(tok_id)
        token = chosen.decoded_token if chosen is not None else engine.detokenize([tok_id])
        top = tuple(
            (lp.decoded_token or "", lp.logprob)
            for lp in sorted(entry.values(), key=lambda lp: lp.rank or 0)
            if lp.rank is not None and 1 <= lp.rank <= k
        )
        out.append(TokenLogprob(token or "", chosen.logprob if chosen else 0.0, top))
    return out


def _finish_reason(reason: str | None) -> Any:
    return "length" if reason == "length" else "stop"


# ---------------------------------------------------------------------------
# Endpoints


def _traced(
    endpoint: str,
) -> Callable[[Callable[[web.Request, _Trace], Awaitable[web.StreamResponse]]], Handler]:
    """Give a generation endpoint its auth and phase checks and its trace:
    status, latency metrics, access log."""

    def wrap(fn: Callable[[web.Request, _Trace], Awaitable[web.StreamResponse]]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            tr = _Trace(_request_id(request), endpoint, time.monotonic())
            try:
                _check_auth(request)
                _check_accepting(request)
                return await fn(request, tr)
            except SluiceError as err:
                tr.status, tr.error = err.status, err.code or err.message[:80]
                raise
            except asyncio.CancelledError:
                tr.status, tr.error = 499, "client went away"
                raise
            except Exception:
                tr.status = 500
                raise
            finally:
                _finish_trace(request, tr)

        return handler

    return wrap


@_traced("chat")
async def chat_completions(request: web.Request, tr: _Trace) -> web.StreamResponse:
    body = await _read_body(request)
    req = parse_chat(body, limits(request))
    _check_model(request, req.model)
    engine: Any = request.app[ENGINE]
    ids = (await engine.tokenize_chat([(req.messages, req.template_kwargs())]))[0]
    tr.prompt_tokens = len(ids)
    max_tokens = check_context(len(ids), req.sampling.max_tokens, engine.info.max_model_len)
    tr.stream = req.stream
    # Repeated deterministic non-thinking requests may be answered from
    # the result cache (--result-cache-ttl; off by default).
    key = None
    if not req.stream and not req.enable_thinking:
        key = _cache_key(request, "chat", [ids], req.sampling, max_tokens)
        if key is not None and (hit := _results(request).get(key, time.monotonic())):
            choices, tr.completion_tokens = hit
            tr.ttft = time.monotonic() - tr.t0
            return _json(_chat_body(tr, req, choices), tr.rid)
    tr.tickets = await _submit(
        request, tr, [ids], req.sampling, req.priority, [max_tokens], req.enable_thinking
    )
    try:
        gens = await _generations(tr.tickets)
        if req.stream:
            return await _stream_chat(request, tr, req, gens)
        return await _collect_chat(request, tr, req, gens, key)
    finally:
        for t in tr.tickets:
            t.leave()


async def _gather(
    request: web.Request, tr: _Trace, gens: list[Generation], n: int, logprobs: int | None
) -> tuple[list[str], list[list[TokenLogprob]], list[str | None]]:
    """Read every generation to its end: per choice (prompt index * n + output
    index) the text, the logprobs (top `logprobs`; None: off) and the finish
    reason."""
    engine: Any = request.app[ENGINE]
    total = len(gens) * n
    texts: list[list[str]] = [[] for _ in range(total)]
    lps: list[list[TokenLogprob]] = [[] for _ in range(total)]
    reasons: list[str | None] = [None] * total
    async for pi, out in _merged(gens, tr.tickets):
        if tr.ttft is None:
            tr.ttft = time.monotonic() - tr.t0
        for c in out.outputs:
            idx = pi * n + c.index
            texts[idx].append(c.text)
            tr.completion_tokens += len(c.token_ids)
            if logprobs is not None:
                lps[idx].extend(_logprobs(engine, c, logprobs))
            if c.finish_reason is not None:
                reasons[idx] = c.finish_reason
    return ["".join(t) for t in texts], lps, reasons


async def _collect_chat(
    request: web.Request, tr: _Trace, req: ChatRequest, gens: list[Generation], key: Any
) -> web.Response:
    n = req.sampling.n
    texts, lps, reasons = await _gather(request, tr, gens, n, req.sampling.logprobs)
    choices = []
    for i in range(n):
        text = texts[i]
        reasoning, content = split_reasoning(text) if req.enable_thinking else (None, text)
        choices.append(
            ChatChoice(
                index=i,
                content=content,
                reasoning=reasoning,
                finish_reason=_finish_reason(reasons[i]),
                logprobs=tuple(lps[i]) if req.logprobs else None,
            )
        )
    if key is not None:
        _results(request).put(key, (tuple(choices), tr.completion_tokens), time.monotonic())
    return _json(_chat_body(tr, req, choices), tr.rid)


def _chat_body(tr: _Trace, req: ChatRequest, choices: Sequence[ChatChoice]) -> bytes:
    return chat_completion_body(
        request_id=tr.rid,
        created=int(time.time()),
        model=req.model,
        choices=choices,
        usage=Usage(tr.prompt_tokens, tr.completion_tokens),
        reasoning_field=REASONING_FIELD,
    )


async def _stream_error(resp: web.StreamResponse, tr: _Trace, err: SluiceError) -> None:
    """Headers are gone: the error travels as a final SSE event, then [DONE]."""
    tr.status, tr.error = err.status, err.code or err.message[:80]
    await resp.write(b"data: " + orjson.dumps(err.body()) + b"\n\n" + DONE)


async def _start_stream(request: web.Request, tr: _Trace) -> web.StreamResponse:
    resp = web.StreamResponse(headers={**_SSE_HEADERS, "x-request-id": tr.rid})
    await resp.prepare(request)
    return resp


async def _stream_chat(
    request: web.Request, tr: _Trace, req: ChatRequest, gens: list[Generation]
) -> web.StreamResponse:
    engine: Any = request.app[ENGINE]
    n = req.sampling.n
    enc = ChatStream(
        request_id=tr.rid,
        created=int(time.time()),
        model=req.model,
        n=n,
        reasoning_field=REASONING_FIELD,
    )
    splitters = [ReasoningSplitter() for _ in range(n)] if req.enable_thinking else None
    resp = await _start_stream(request, tr)
    await resp.write(b"".join(enc.first(i) for i in range(n)))
    try:
        async for _, out in _merged(gens, tr.tickets):
            if tr.ttft is None:
                tr.ttft = time.monotonic() - tr.t0
            parts: list[bytes] = []
            for c in out.outputs:
                tr.completion_tokens += len(c.token_ids)
                if req.logprobs:
                    if splitters is not None:
                        r, t = splitters[c.index].feed(c.text)
                        if r:
                            parts.append(enc.chunk(c.index, reasoning=r))
                        text = t
                    else:
                        text = c.text
                    parts.append(
                        enc.chunk(
                            c.index, content=text, logprobs=_logprobs(engine, c, req.top_logprobs)
                        )
                    )
                elif splitters is not None:
                    r, t = splitters[c.index].feed(c.text)
                    parts.append(enc.splits(((c.index, r, t),)))
                elif c.text:
                    parts.append(enc.content(c.index, c.text))
                if c.finish_reason is not None:
                    if splitters is not None:
                        r, t = splitters[c.index].finish()
                        parts.append(enc.splits(((c.index, r, t),)))
                    parts.append(enc.finish(c.index, _finish_reason(c.finish_reason)))
            if parts:
                await resp.write(b"".join(parts))
        if req.include_usage:
            await resp.write(enc.usage(Usage(tr.prompt_tokens, tr.completion_tokens)))
        await resp.write(DONE)
    except SluiceError as err:
        await _stream_error(resp, tr, err)
    return resp


@_traced("completions")
async def completions(request: web.Request, tr: _Trace) -> web.StreamResponse:
    body = await _read_body(request)
    req = parse_completion(body, limits(request))
    _check_model(request, req.model)
    engine: Any = request.app[ENGINE]
    texts = [p for p in req.prompts if isinstance(p, str)]
    encoded = iter(await engine.tokenize_prompts(texts)) if texts else iter(())
    prompts = [list(next(encoded)) if isinstance(p, str) else list(p) for p in req.prompts]
    max_len = engine.info.max_model_len
    max_tokens = [
        check_context(len(ids), req.sampling.max_tokens, max_len, where="prompt") for ids in prompts
    ]
    tr.prompt_tokens = sum(len(ids) for ids in prompts)
    tr.stream = req.stream
    key = None
    if not req.stream:
        key = _cache_key(
            request, "completions", prompts, req.sampling, (tuple(max_tokens), req.echo)
        )
        if key is not None and (hit := _results(request).get(key, time.monotonic())):
            choices, tr.completion_tokens = hit
            tr.ttft = time.monotonic() - tr.t0
            return _json(_completion_body(tr, req, choices), tr.rid)
    tr.tickets = await _submit(request, tr, prompts, req.sampling, req.priority, max_tokens, None)
    try:
        gens = await _generations(tr.tickets)
        if req.stream:
            return await _stream_completion(request, tr, req, gens, prompts)
        return await _collect_completion(request, tr, req, gens, prompts, key)
    finally:
        for t in tr.tickets:
            t.leave()


def _echo_text(engine: Any, req: CompletionRequest, i: int, ids: Sequence[int]) -> str:
    p = req.prompts[i]
    return p if isinstance(p, str) else engine.detokenize(ids)


async def _collect_completion(
    request: web.Request,
    tr: _Trace,
    req: CompletionRequest,
    gens: list[Generation],
    prompts: list[list[int]],
    key: Any,
) -> web.Response:
    engine: Any = request.app[ENGINE]
    n = req.sampling.n
    total = len(prompts) * n
    texts, lps, reasons = await _gather(request, tr, gens, n, req.sampling.logprobs)
    choices = []
    for idx in range(total):
        prefix = _echo_text(engine, req, idx // n, prompts[idx // n]) if req.echo else ""
        choices.append(
            CompletionChoice(
                index=idx,
                text=prefix + texts[idx],
                finish_reason=_finish_reason(reasons[idx]),
                logprobs=tuple(lps[idx]) if req.sampling.logprobs is not None else None,
                text_offset=len(prefix),
            )
        )
    if key is not None:
        _results(request).put(key, (tuple(choices), tr.completion_tokens), time.monotonic())
    return _json(_completion_body(tr, req, choices), tr.rid)


def _completion_body(
    tr: _Trace, req: CompletionRequest, choices: Sequence[CompletionChoice]
) -> bytes:
    return completion_body(
        request_id=tr.rid,
        created=int(time.time()),
        model=req.model,
        choices=choices,
        usage=Usage(tr.prompt_tokens, tr.completion_tokens),
    )


async def _stream_completion(
    request: web.Request,
    tr: _Trace,
    req: CompletionRequest,
    gens: list[Generation],
    prompts: list[list[int]],
) -> web.StreamResponse:
    engine: Any = request.app[ENGINE]
    n = req.sampling.n
    enc = CompletionStream(
        request_id=tr.rid, created=int(time.time()), model=req.model, n=len(prompts) * n
    )
    resp = await _start_stream(request, tr)
    try:
        if req.echo:
            await resp.write(
                enc.texts(
                    (pi * n + j, _echo_text(engine, req, pi, ids))
                    for pi, ids in enumerate(prompts)
                    for j in range(n)
                )
            )
        async for pi, out in _merged(gens, tr.tickets):
            if tr.ttft is None:
                tr.ttft = time.monotonic() - tr.t0
            parts: list[bytes] = []
            for c in out.outputs:
                idx = pi * n + c.index
                tr.completion_tokens += len(c.token_ids)
                if req.sampling.logprobs is not None:
                    parts.append(
                        enc.chunk(idx, c.text, logprobs=_logprobs(engine, c, req.sampling.logprobs))
                    )
                elif c.text:
                    parts.append(enc.text(idx, c.text))
                if c.finish_reason is not None:
                    parts.append(enc.finish(idx, _finish_reason(c.finish_reason)))
            if parts:
                await resp.write(b"".join(parts))
        if req.include_usage:
            await resp.write(enc.usage(Usage(tr.prompt_tokens, tr.completion_tokens)))
        await resp.write(DONE)
    except SluiceError as err:
        await _stream_error(resp, tr, err)
    return resp


async def models(request: web.Request) -> web.Response:
    _check_auth(request)
    engine: Any = request.app[ENGINE]
    s = request.app[SETTINGS]
    body = models_body(
        [s.model_name], created=engine.info.created, max_model_len=engine.info.max_model_len or None
    )
    return _json(body, _request_id(request))


async def health(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    engine: Any = request.app[ENGINE]
    if rt.phase is Phase.DEAD or engine.errored:
        raise SluiceError(
            f"engine dead: {rt.engine_error or 'errored'}",
            status=503,
            retry_after=5,
            code="engine_dead",
        )
    return _json(orjson.dumps({"status": "ok", "phase": rt.phase.value}), _request_id(request))


async def ready(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    if not rt.ready:
        why = rt.phase.value if rt.phase is not Phase.READY else rt.admission.name.lower()
        raise SluiceError(f"not ready: {why}", status=503, retry_after=5, code="not_ready")
    return _json(orjson.dumps({"status": "ready"}), _request_id(request))


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[METRICS].render(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def tokenize(request: web.Request) -> web.Response:
    """vLLM-compatible /tokenize ({"model", "prompt"} or {"model", "messages"})."""
    _check_auth(request)
    _check_accepting(request)
    rid = _request_id(request)
    obj = _object(await _read_body(request))
    engine: Any = request.app[ENGINE]
    if "messages" in obj:
        # `model` is optional here, as in vLLM's server: the served model.
        model = obj.get("model") or request.app[SETTINGS].model_name
        req = parse_chat(orjson.dumps({**obj, "model": model}), limits(request))
        ids = (await engine.tokenize_chat([(req.messages, req.template_kwargs())]))[0]
    else:
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise SluiceError("'prompt' must be a string", param="prompt")
        ids = (await engine.tokenize_prompts([prompt]))[0]
    body = orjson.dumps(
        {"count": len(ids), "max_model_len": engine.info.max_model_len, "tokens": ids}
    )
    return _json(body, rid)


async def detokenize(request: web.Request) -> web.Response:
    _check_auth(request)
    _check_accepting(request)
    obj = _object(await _read_body(request))
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise SluiceError("'tokens' must be a list of token ids", param="tokens")
    engine: Any = request.app[ENGINE]
    return _json(orjson.dumps({"prompt": engine.detokenize(tokens)}), _request_id(request))


def _object(body: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise SluiceError(f"malformed JSON: {exc}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise SluiceError("the request body must be a JSON object", code="invalid_json")
    return obj


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
