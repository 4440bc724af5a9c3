"""The one generation pipeline behind every generation route (chat, completions,
Responses, Messages, Ollama's chat and generate), and its pooling twin behind
/v1/embeddings and /v1/rerank.

Why this module exists: both endpoints do the same steps, and each step should
exist once. An endpoint (server/api/openai_chat/endpoint.py) parses its body and tokenizes
its prompts into a `Job` and supplies an `Encoder` for its wire format; this
module does everything else:

    trace (status, latency metrics, one access-log line, whatever happens)
    -> phase check -> prepare (endpoint: parse, tokenize, context check)
    -> result cache (deterministic, non-streaming results; --result-cache-ttl)
    -> Driver.submit per prompt (the core admits or refuses at once)
    -> await the tickets -> stream (SSE, or the encoder's own framing: Ollama's
       newline-delimited JSON) or collect one JSON body -> leave.

The `finally` around the tickets is what makes a vanished client cost
nothing: aiohttp cancels the handler (handler_cancellation=True) and
`Ticket.leave()` removes the request from the queue or aborts it in the
engine. Streaming writes one buffer per engine output per request: vLLM
merges the deltas a slow reader has not taken yet, so a lagging client gets
several tokens in one write rather than a backlog of small ones.

A pooling request (`pooling_endpoint`) takes the same road with one engine
request per input and no stream: each input is a core request with no tokens
to generate (batching/types.py), all admitted or none; a request whose inputs
could never be admitted together is a 413 at once (`Coalescer.most_at_once`),
not a 503 to retry; the body is built from every input's one output.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from aiohttp import web

from batching import (
    DEFAULT_CALLER,
    Charge,
    RequestClass,
    class_priority,
    group_key,
    queue_timeout,
    request_class,
)
from batching import Request as CoreRequest
from server.engines.driver import Driver, FirstTokens, Generation, Ticket
from server.engines.interface import (
    CompletionDelta,
    EngineOutput,
    EngineParams,
    Pooled,
    PoolingParamsLike,
)
from server.engines.lora import Adapter
from server.engines.registry import ModelEntry
from server.errors import SluiceError
from server.http.door import BATCH_LINE
from server.operations.tracing import TRACER, RequestSpan
from server.operations.usage import UsageEvent
from server.state import (
    ACCESS,
    BUDGETS,
    CALLER,
    CALLERS,
    METRICS,
    REQUEST_ID,
    RESULTS,
    RUNTIME,
    SETTINGS,
    USAGE,
    Phase,
)
from server.wire.output import PromptLogprob, TokenLogprob, Usage
from server.wire.request import Sampling

__all__ = [
    "Encoder",
    "Job",
    "KeepAlive",
    "PoolJob",
    "StreamHeaders",
    "Trace",
    "generation_endpoint",
    "json_response",
    "logprobs",
    "pooling_endpoint",
]

log = logging.getLogger("sluice")

_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}  # x-request-id is added to every response by server/http/middleware.py
_seq = itertools.count(1)
C = TypeVar("C")


def json_response(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


@dataclass(slots=True)
class Trace:
    """What the access-log line and the latency metrics need."""

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
    caller: str | None = None  # None until known (from the key, or after parsing)
    model: str | None = None  # the served model's name once resolved
    adapter: str | None = None  # the LoRA adapter's name once resolved (None: base)
    cached: dict[int, int] = field(default_factory=dict)  # prefix-cache hits per prompt
    finish_reasons: list[str] = field(default_factory=list)  # per choice, as they end
    # Interactive or background (batching/classes.py), once the body is read.
    request_class: RequestClass | None = None
    # The Usage API endpoint that counts it (server/operations/usage.py):
    # "completions" for generations, "embeddings" for pooling (rerank and score too).
    usage_kind: str = "completions"

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held, over its prompts."""
        return sum(self.cached.values())

    def first_token(self) -> None:
        if self.ttft is None:
            self.ttft = time.monotonic() - self.t0


@dataclass(frozen=True, slots=True)
class Job:
    """One generation request, parsed and tokenized: what the pipeline runs.

    `variant` is everything besides the prompt tokens and the sampling fields
    that shapes the generated text (chat: the thinking mode) or the response
    (completions: echo); it is part of the dedupe fingerprint and the result
    cache key. `cacheable` says whether the endpoint allows the result cache
    for this request at all.
    """

    model: str
    # The served model it runs on (server/engines/registry.py): its engine and
    # driver; the request holds it until it ends (server/http/models.py).
    entry: ModelEntry
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]  # per prompt, after the context check
    sampling: Sampling
    # The LoRA adapter it runs on (server/engines/lora.py), None for the base weights:
    # part of the group key, so of the dedupe key, and of the result cache key.
    adapter: Adapter | None = None
    priority: int = 0
    request_class: RequestClass = RequestClass.INTERACTIVE  # classify()'s answer
    stream: bool = False
    include_usage: bool = False
    user: str | None = None  # the OpenAI `user` field: names the caller without keys
    variant: Hashable = None
    cacheable: bool = True
    # Legacy completions: each token's top_logprobs holds the sampled token
    # too (OpenAI's rule for that API, as vLLM's server answers; `_top`).
    top_with_chosen: bool = False


@dataclass(frozen=True, slots=True)
class PoolJob:
    """One pooling request, tokenized: one engine request per input.

    `params` are each input's pooling parameters (a cross-encoder pair may
    carry its own); `variant` is what besides an input's tokens shapes its
    output (task, dimensions, activation): with the caller's cache salt, the
    dedupe fingerprint, so identical inputs waiting together share one engine
    request. `param` names the request's list of inputs in a 413.
    """

    model: str
    entry: ModelEntry  # the served model (server/engines/registry.py)
    inputs: tuple[tuple[int, ...], ...]
    params: tuple[PoolingParamsLike, ...]
    variant: Hashable
    param: str = "input"
    adapter: Adapter | None = None
    priority: int = 0
    user: str | None = None


class Encoder(Protocol[C]):
    """An endpoint's wire format: whole bodies and stream frames.

    Choice indexes are `prompt index x n + output index`. A stream encoder may
    keep per-choice state (the reasoning split); one encoder serves one request.
    A stream is `stream_head` (sent with the first output), a `stream_delta`
    per output, then either
    `stream_end` (the closing frames: usage, the API's end marker) or, when it
    fails after its headers went out, `stream_error` (the error in the API's
    own shape, then its end marker).
    """

    def choices(
        self,
        texts: Sequence[str],
        logprobs: Sequence[Sequence[TokenLogprob]],
        reasons: Sequence[str | None],
    ) -> tuple[C, ...]: ...
    def body(self, choices: Sequence[C], usage: Usage) -> bytes: ...
    def stream_head(self) -> bytes: ...
    def stream_delta(self, choice: int, delta: CompletionDelta) -> bytes: ...
    def stream_end(self, usage: Usage) -> bytes: ...
    def stream_error(self, err: SluiceError) -> bytes: ...


@runtime_checkable
class KeepAlive(Protocol):
    """An encoder whose API wants a frame while a stream is quiet (Anthropic's `ping`).

    `keepalive()` gives the idle seconds after which the frame goes out, and
    the frame. Encoders without it (OpenAI's) send nothing between tokens.
    """

    def keepalive(self) -> tuple[float, bytes]: ...


@runtime_checkable
class StreamHeaders(Protocol):
    """An encoder whose stream is not server-sent events (Ollama's
    newline-delimited JSON): the headers its stream goes out with."""

    def stream_headers(self) -> Mapping[str, str]: ...


@runtime_checkable
class ReadsPrompt(Protocol):
    """An encoder that reads each output of a prompt besides its choices'
    deltas: the echo of /v1/completions takes the prompt's logprobs from it
    (vLLM sends them once, with the output that ends the prefill). Called
    for every output, before that output's deltas, streamed or not."""

    def prompt_output(self, prompt: int, out: EngineOutput) -> None: ...


# An endpoint's own step: parse the body and tokenize, into a Job and its encoder.
Prepare = Callable[[web.Request, Trace], Awaitable[tuple[Job, Encoder[Any]]]]
# A pooling endpoint's: into a PoolJob and the body its outputs make, in input order.
PreparePool = Callable[
    [web.Request, Trace], Awaitable[tuple[PoolJob, Callable[[Sequence[Pooled]], bytes]]]
]


def _top(entry: Any, tok_id: int, k: int, with_chosen: bool) -> tuple[tuple[str, float], ...]:
    """One position's alternatives: the top ``k`` by rank, and with
    ``with_chosen`` the token that was there first (legacy completions: OpenAI
    "always returns the logprob of the sampled token, so there may be up to
    logprobs+1 elements", as vLLM's server answers)."""
    ranked = [
        lp
        for lp in sorted(entry.values(), key=lambda lp: lp.rank or 0)
        if lp.rank is not None and 1 <= lp.rank <= k
    ]
    chosen = entry.get(tok_id)
    if with_chosen and chosen is not None and chosen not in ranked:
        ranked.insert(0, chosen)
    return tuple((lp.decoded_token or "", lp.logprob) for lp in ranked)


def logprobs(
    detokenize: Callable[[Sequence[int]], str],
    delta: CompletionDelta,
    k: int,
    *,
    with_chosen: bool = False,
) -> list[TokenLogprob]:
    """vLLM's per-token {token_id: Logprob} dicts to our TokenLogprob values.

    vLLM returns the top `k` tokens plus the sampled one when it ranks below
    them; chat's `top_logprobs` (OpenAI's, Ollama's) is exactly the top `k`
    (rank 1..k), legacy completions' has the sampled one too (`_top`).
    """
    out = []
    lps = delta.logprobs or []
    for tok_id, entry in zip(delta.token_ids, lps, strict=False):
        chosen = entry.get(tok_id)
        token = chosen.decoded_token if chosen is not None else detokenize([tok_id])
        top = _top(entry, tok_id, k, with_chosen)
        out.append(TokenLogprob(token or "", chosen.logprob if chosen else 0.0, top))
    return out


def prompt_logprobs(
    detokenize: Callable[[Sequence[int]], str],
    prompt: Sequence[int],
    entries: Sequence[Any],
    k: int,
) -> list[TokenLogprob]:
    """A prompt's tokens with vLLM's prompt logprobs (one {token_id: Logprob}
    per token, None for the first, which nothing comes before): the same
    values as a generated token's in a legacy completion (the prompt's own
    token among the alternatives, `_top`), the first without any."""
    out = []
    for tok_id, entry in zip(prompt, entries, strict=False):
        if entry is None:
            out.append(TokenLogprob(detokenize([tok_id]), None))
            continue
        chosen = entry.get(tok_id)
        token = chosen.decoded_token if chosen is not None else None
        top = _top(entry, tok_id, k, with_chosen=True)
        out.append(
            TokenLogprob(token or detokenize([tok_id]), chosen.logprob if chosen else 0.0, top)
        )
    return out


def candidates(
    detokenize: Callable[[Sequence[int]], str], entries: Sequence[Any]
) -> tuple[PromptLogprob | None, ...]:
    """vLLM's prompt logprobs (one {token_id: Logprob} per prompt token, None
    for the first) as its ``prompt_logprobs`` extension answers them: each
    candidate in the engine's order, the prompt's own token first; -inf
    becomes -9999.0, as vLLM's server clamps it (JSON has no infinity)."""
    return tuple(
        None
        if entry is None
        else PromptLogprob(
            tuple(
                (
                    tid,
                    max(lp.logprob, -9999.0),
                    lp.rank,
                    lp.decoded_token if lp.decoded_token is not None else detokenize([tid]),
                )
                for tid, lp in entry.items()
            )
        )
        for entry in entries
    )


def check_accepting(request: web.Request) -> None:
    """503 unless the app is serving (starting, draining and dead refuse)."""
    rt = request.app[RUNTIME]
    if rt.phase is Phase.READY:
        return
    if rt.phase is Phase.STARTING and request.app[SETTINGS].several:
        # The port opens before the engines start: a models file's request waits
        # for its model's load as for an on-demand one (server/http/models.py).
        # (With --model, the request's limits come from its engine: 503 until then.)
        return
    request.app[METRICS].reject(rt.phase.value)
    if rt.phase is Phase.STARTING:
        raise SluiceError(
            "the model is still loading", status=503, retry_after=5, code="warming_up"
        )
    if rt.phase is Phase.DRAINING:
        raise SluiceError(
            "server shutting down; retry elsewhere", status=503, retry_after=5, code="draining"
        )
    raise SluiceError("the engine is not running", status=503, retry_after=5, code="engine_dead")


def check_budget(request: web.Request, caller: str | None) -> None:
    """429 `insufficient_quota` for a caller that has spent a budget
    (batching/budgets.py), before its request costs anything; Retry-After is
    the budget's reset. Requests already admitted finish."""
    if caller is None:  # open mode: named by the body's `user`, never budgeted
        return
    overdraft = request.app[BUDGETS].over(caller, time.time())
    if overdraft is None:
        return
    resets = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(overdraft.resets_at))
    raise SluiceError(
        f"caller {caller!r} has used its budget: {overdraft.limit} is {overdraft.allowed:g} "
        f"and {overdraft.used:g} is spent; it resets at {resets}",
        status=429,
        code="insufficient_quota",
        error_type="insufficient_quota",
        retry_after=overdraft.retry_after,
    )


def classify(request: web.Request, service_tier: str | None) -> RequestClass:
    """A request's class (batching/classes.py rule 1): a batch line (the door),
    its body's `service_tier`, or its caller's policy in the callers file as it
    stands now (SIGHUP swaps it)."""
    return request_class(
        batch_line=BATCH_LINE in request,
        service_tier=service_tier,
        caller=request.app[CALLERS].policy(request.get(CALLER)),
    )


def generation_endpoint(
    endpoint: str, prepare: Prepare
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler running `prepare` and then the pipeline, traced."""

    async def run(request: web.Request, tr: Trace) -> web.StreamResponse:
        job, enc = await prepare(request, tr)
        if tr.caller is None:
            tr.caller = request.app[CALLERS].from_user(job.user)
        tr.request_class = job.request_class
        tr.stream = job.stream
        tr.model = job.entry.name
        tr.adapter = job.adapter.name if job.adapter is not None else None
        tr.prompt_tokens = sum(map(len, job.prompts))
        return await _run(request, tr, job, enc)

    return _traced(endpoint, run)


def pooling_endpoint(
    endpoint: str, prepare: PreparePool
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler running a pooling endpoint's `prepare`, then its
    inputs through the core and the engine, traced (the module docstring)."""

    async def run(request: web.Request, tr: Trace) -> web.StreamResponse:
        job, body = await prepare(request, tr)
        if tr.caller is None:
            tr.caller = request.app[CALLERS].from_user(job.user)
        tr.request_class = classify(request, None)
        tr.usage_kind = "embeddings"
        tr.model = job.entry.name
        tr.adapter = job.adapter.name if job.adapter is not None else None
        tr.prompt_tokens = sum(map(len, job.inputs))
        _check_at_once(request, tr, job)
        salt = request.app[CALLERS].cache_salt(tr.caller)
        tr.tickets = _submit_pooled(request, tr, job, salt)
        try:
            outs = [await _pooled(t) for t in tr.tickets]
            return json_response(body(outs))
        finally:
            for t in tr.tickets:
                t.leave()

    return _traced(endpoint, run)


def _traced(
    endpoint: str, run: Callable[[web.Request, Trace], Awaitable[web.StreamResponse]]
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler around an endpoint's run: the phase check first, the trace's
    status whatever happens, and its access line and metrics at the end."""

    async def handler(request: web.Request) -> web.StreamResponse:
        tr = Trace(request[REQUEST_ID], endpoint, time.monotonic(), caller=request.get(CALLER))
        try:
            check_accepting(request)
            check_budget(request, tr.caller)
            return await run(request, tr)
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


async def _run(request: web.Request, tr: Trace, job: Job, enc: Encoder[Any]) -> web.StreamResponse:
    results = request.app[RESULTS]
    # The caller's prefix-cache salt (None: shared): the engine's cache, dedupe
    # and the result cache share work only within it (server/callers.py).
    salt = request.app[CALLERS].cache_salt(tr.caller)
    key: Hashable = None
    if job.cacheable and not job.stream and job.sampling.deterministic and results.enabled:
        key = (
            tr.endpoint,
            tr.adapter,
            salt,
            job.prompts,
            job.max_tokens,
            job.sampling.fingerprint(),
            job.variant,
        )
        if hit := results.get(key, time.monotonic()):
            choices, tr.completion_tokens = hit
            tr.first_token()
            return json_response(enc.body(choices, _usage(tr)))
    tr.tickets = _submit(request, tr, job, salt)
    try:
        gens = [await t.wait() for t in tr.tickets]
        if job.stream:
            return await _stream(request, tr, job, enc, gens)
        detokenize = job.entry.engine.detokenize
        reader = enc if isinstance(enc, ReadsPrompt) else None
        choices = enc.choices(*await _gather(tr, job, detokenize, gens, reader))
        if key is not None:
            results.put(key, (choices, tr.completion_tokens), time.monotonic())
        return json_response(enc.body(choices, _usage(tr)))
    finally:
        for t in tr.tickets:
            t.leave()


def _usage(tr: Trace) -> Usage:
    return Usage(tr.prompt_tokens, tr.completion_tokens, tr.cached_tokens)


def _note_cached(tr: Trace, prompt: int, out: EngineOutput) -> None:
    """Keep the engine's prefix-cache hits of a prompt (every output repeats them)."""
    if out.num_cached_tokens:
        tr.cached[prompt] = out.num_cached_tokens


def _submit(request: web.Request, tr: Trace, job: Job, salt: str | None) -> list[Ticket]:
    """Admit one core request per prompt to its model's core; all or none (a
    refusal leaves the rest)."""
    driver = job.entry.driver
    engine = job.entry.engine
    settings = request.app[SETTINGS]
    now = driver.now()
    # Every generation's key carries its adapter (None: the base weights): the
    # core batches, dedupes and releases by it (batching/keys.py).
    key = group_key(job.entry.name, tr.adapter)
    sampling = job.sampling
    # Only deterministic sampling can share a generation (greedy, or seeded),
    # and only within one prefix-cache salt: another caller's would tell it
    # what this one sent (its answer comes at once, as a result).
    fp = (sampling.fingerprint(), job.variant, salt) if sampling.deterministic else None
    base = f"{tr.rid}-{next(_seq)}"
    single = len(job.prompts) == 1
    waits = queue_timeout(
        job.request_class, settings.queue_timeout, settings.background_queue_timeout
    )
    return _admit(
        driver,
        (
            (
                CoreRequest(
                    id=base if single else f"{base}-{i}",
                    key=key,
                    prompt_tokens=ids,
                    max_new_tokens=job.max_tokens[i] * sampling.n,
                    arrival=now,
                    priority=class_priority(job.priority, job.request_class),
                    deadline=now + waits,
                    fingerprint=fp,
                    caller=tr.caller or DEFAULT_CALLER,
                    # No max_tokens: admission charges an estimate, not the context's room.
                    open_ended=sampling.max_tokens is None,
                    prefix=driver.prefix(ids, salt, job.adapter),
                ),
                engine.sampling_params(sampling, job.max_tokens[i]),
            )
            for i, ids in enumerate(job.prompts)
        ),
        job.adapter,
        salt,
    )


def _admit(
    driver: Driver,
    requests: Iterable[tuple[CoreRequest, EngineParams]],
    adapter: Adapter | None,
    salt: str | None,
) -> list[Ticket]:
    """Submit each core request to the model's driver; all or none (a refusal
    leaves the ones admitted before it and is raised)."""
    tickets: list[Ticket] = []
    try:
        for core_req, params in requests:
            tickets.append(driver.submit(core_req, params, adapter, salt))
    except SluiceError:
        for t in tickets:
            t.leave()
        raise
    return tickets


def _check_at_once(request: web.Request, tr: Trace, job: PoolJob) -> None:
    """A 413 for a pooling request whose inputs could never be admitted together
    (batching/coalescer.py `most_at_once`): retrying it would never help."""
    core = job.entry.driver.core
    most, tokens = core.most_at_once(tr.caller or DEFAULT_CALLER)
    n = len(job.inputs)
    if n > most:
        raise SluiceError(
            f"'{job.param}' holds {n:,} items; this server admits at most {most:,} "
            "at once (--max-pending-requests, or the caller's max_queued + max_concurrency): "
            "send them in smaller requests",
            status=413,
            param=job.param,
            code="too_many_inputs",
        )
    if tr.prompt_tokens > tokens:
        raise SluiceError(
            f"'{job.param}' holds {tr.prompt_tokens:,} tokens; this server admits at most "
            f"{tokens:,} at once (--max-pending-tokens, or the caller's tokens_per_minute): "
            "send them in smaller requests",
            status=413,
            param=job.param,
            code="too_many_tokens",
        )


def _submit_pooled(request: web.Request, tr: Trace, job: PoolJob, salt: str | None) -> list[Ticket]:
    """One core request per input, with no tokens to generate (batching/types.py)."""
    settings = request.app[SETTINGS]
    driver = job.entry.driver
    now = driver.now()
    key = group_key(job.entry.name, tr.adapter)
    # Pooling is deterministic: identical inputs of one salt may share an engine request.
    fp = (job.variant, salt)
    base = f"{tr.rid}-{next(_seq)}"
    cls = tr.request_class or classify(request, None)
    waits = queue_timeout(cls, settings.queue_timeout, settings.background_queue_timeout)
    return _admit(
        driver,
        (
            (
                CoreRequest(
                    id=f"{base}-{i}",
                    key=key,
                    prompt_tokens=ids,
                    max_new_tokens=0,
                    arrival=now,
                    priority=class_priority(job.priority, cls),
                    deadline=now + waits,
                    fingerprint=fp,
                    caller=tr.caller or DEFAULT_CALLER,
                ),
                job.params[i],
            )
            for i, ids in enumerate(job.inputs)
        ),
        job.adapter,
        salt,
    )


async def _pooled(ticket: Ticket) -> Pooled:
    """A pooling request's one output."""
    gen = await ticket.wait()
    async with contextlib.aclosing(gen.outputs(ticket.id)) as outs:
        async for out in outs:
            if isinstance(out, Pooled):
                return out
    raise SluiceError("the engine gave no output for an input", status=500)


async def _each_output(
    gens: Sequence[Generation],
    tickets: Sequence[Ticket],
    handle: Callable[[int, EngineOutput], Awaitable[None]],
) -> None:
    """`handle(prompt index, output)` for every output of several generations,
    in the order they come.

    A function, not an async generator: the pumps of a multi-prompt request
    live in a task group that this call enters and leaves, so they end before
    it returns, whatever `handle` does (an async generator that yields inside
    a task group leaves the group's exit to whoever closes it, or to the
    garbage collector). A failure leaves the group first and is raised as
    itself, not wrapped in an ExceptionGroup.
    """
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0].outputs(tickets[0].id)) as outs:
            async for out in outs:
                await handle(0, out)
        return
    queue: asyncio.Queue[tuple[int, EngineOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async with contextlib.aclosing(gens[i].outputs(tickets[i].id)) as outs:
                async for out in outs:
                    queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    failure: Exception | None = None
    async with asyncio.TaskGroup() as tg:
        pumps = [tg.create_task(pump(i), name=f"prompt-{i}") for i in range(len(gens))]
        remaining = len(gens)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    await handle(*item)
        except Exception as exc:
            failure = exc
            for p in pumps:
                p.cancel()
    if failure is not None:
        raise failure


async def _gather(
    tr: Trace,
    job: Job,
    detokenize: Callable[[Sequence[int]], str],
    gens: Sequence[Generation],
    reader: ReadsPrompt | None,
) -> tuple[list[str], list[list[TokenLogprob]], list[str | None]]:
    """Read every generation to its end: per choice the text, the logprobs
    (empty when off) and the finish reason; `reader` sees each output first."""
    n = job.sampling.n
    k = job.sampling.logprobs
    total = len(gens) * n
    texts: list[list[str]] = [[] for _ in range(total)]
    lps: list[list[TokenLogprob]] = [[] for _ in range(total)]
    reasons: list[str | None] = [None] * total

    async def take(pi: int, out: EngineOutput) -> None:
        tr.first_token()
        _note_cached(tr, pi, out)
        if reader is not None:
            reader.prompt_output(pi, out)
        for c in out.outputs:
            idx = pi * n + c.index
            texts[idx].append(c.text)
            tr.completion_tokens += len(c.token_ids)
            if k is not None:
                lps[idx].extend(logprobs(detokenize, c, k, with_chosen=job.top_with_chosen))
            if c.finish_reason is not None:
                reasons[idx] = c.finish_reason
                tr.finish_reasons.append(c.finish_reason)

    await _each_output(gens, tr.tickets, take)
    return ["".join(t) for t in texts], lps, reasons


async def _stream(
    request: web.Request, tr: Trace, job: Job, enc: Encoder[Any], gens: Sequence[Generation]
) -> web.StreamResponse:
    n = job.sampling.n
    headers = enc.stream_headers() if isinstance(enc, StreamHeaders) else _SSE_HEADERS
    resp = web.StreamResponse(headers=headers)
    # The head (chat's role frame, an echo, Messages' message_start) goes out
    # with the first output, as vLLM's server sends it: a client that times
    # its first frame (vllm bench serve does) then times the first token, not
    # the headers. A keepalive (Anthropic's ping) before it carries it along.
    head: bytes | None = enc.stream_head()

    def take_head() -> bytes:
        nonlocal head
        out, head = head or b"", None
        return out

    keepalive = enc.keepalive() if isinstance(enc, KeepAlive) else None
    beat = None if keepalive is None else (keepalive[0], lambda: take_head() + keepalive[1])
    wrote: Callable[[], None] = lambda: None  # noqa: E731 (replaced by the beat's)

    reader = enc if isinstance(enc, ReadsPrompt) else None
    first = FirstTokens(gens)  # each prompt's first token still due (step_share rule 2)

    async def send(pi: int, out: EngineOutput) -> None:
        tr.first_token()
        _note_cached(tr, pi, out)
        if reader is not None:
            reader.prompt_output(pi, out)
        parts = [take_head()]
        for c in out.outputs:
            tr.completion_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                tr.finish_reasons.append(c.finish_reason)
            if frame := enc.stream_delta(pi * n + c.index, c):
                parts.append(frame)
                first.shown(pi)
        if data := b"".join(parts):
            await resp.write(data)
            wrote()

    try:
        # Inside the guard: a client that left before the headers went out
        # (before aiohttp cancelled this handler) is a 499 too, not a 500.
        await resp.prepare(request)
        async with _keepalive(resp, beat) as wrote:
            await _each_output(gens, tr.tickets, send)
        # After the beat stopped: nothing may follow the closing frames.
        await resp.write(take_head() + enc.stream_end(_usage(tr)))
    except ConnectionResetError:
        tr.status, tr.error = 499, "client went away"  # mid-write: nobody to tell
    except Exception as exc:
        # Headers are gone: the error travels as the stream's last frames, in
        # the API's shape; the HTTP status stays 200, the trace says what it was.
        err = exc if isinstance(exc, SluiceError) else None
        if err is None:
            log.exception("stream failed after its headers went out: %s", tr.rid)
            err = SluiceError("internal server error", status=500)
        tr.status, tr.error = err.status, err.code or err.message[:80]
        with contextlib.suppress(ConnectionResetError):
            await resp.write(take_head() + enc.stream_error(err))
    finally:
        first.close()
    return resp


@contextlib.asynccontextmanager
async def _keepalive(
    resp: web.StreamResponse, keepalive: tuple[float, Callable[[], bytes]] | None
) -> AsyncIterator[Callable[[], None]]:
    """Write the keepalive frame (made when due) whenever the stream has been
    quiet for its idle time, until the block ends; the block calls the yielded
    function after each write of its own. The beat task is owned here: cancelled and
    awaited on the way out (not a TaskGroup, which would wrap the block's
    SluiceError in an ExceptionGroup)."""
    if keepalive is None:
        yield lambda: None
        return
    idle, frame = keepalive
    last = time.monotonic()

    def wrote() -> None:
        nonlocal last
        last = time.monotonic()

    async def beat() -> None:
        while True:
            wait = last + idle - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            await resp.write(frame())
            wrote()

    task = asyncio.create_task(beat())
    try:
        yield wrote
    finally:
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # a failed write: the block's own write reports it


def _finish_trace(request: web.Request, tr: Trace) -> None:
    metrics = request.app[METRICS]
    now = time.monotonic()
    m = metrics.model(tr.model)
    metrics.requests.labels(tr.endpoint, str(tr.status), tr.adapter or "", *m).inc()
    if tr.caller is not None:
        metrics.caller_requests.labels(metrics.caller_label(tr.caller), str(tr.status), *m).inc()
    metrics.of(metrics.duration, tr.model).observe(now - tr.t0)
    if tr.ttft is not None:
        metrics.observe_ttft(tr.ttft, tr.model)
    if tr.status == 200:
        metrics.of(metrics.prompt_tokens, tr.model).inc(tr.prompt_tokens)
    metrics.of(metrics.generated_tokens, tr.model).inc(tr.completion_tokens)
    # A request that failed before its body was read: classed by what is known.
    cls = tr.request_class or classify(request, None)
    metrics.class_requests.labels(cls.value, str(tr.status), *m).inc()
    if BATCH_LINE in request:  # a batch line (server/http/door.py)
        metrics.batch_tokens.inc(tr.prompt_tokens * (tr.status == 200) + tr.completion_tokens)
    request.app[RUNTIME].tokens_out += tr.completion_tokens
    t = tr.tickets[0] if tr.tickets else None
    charge = engine_charge(tr.tickets)
    _account(request, tr, cls, charge)
    fields: dict[str, Any] = {
        "request_id": tr.rid,
        "caller": tr.caller,
        "model": tr.model,
        "adapter": tr.adapter,
        "endpoint": tr.endpoint,
        "class": cls.value,
        "status": tr.status,
        "stream": tr.stream,
        "prompt_tokens": tr.prompt_tokens,
        "completion_tokens": tr.completion_tokens,
        "queue_wait_ms": round(t.queue_wait * 1000, 2) if t else None,
        "ttft_ms": round(tr.ttft * 1000, 2) if tr.ttft is not None else None,
        "total_ms": round((now - tr.t0) * 1000, 2),
        "batch_id": t.batch_id if t else None,
        "batch_size": t.batch_size if t else None,
        "release": t.release if t else None,
        "deduped": t.joined if t else False,
        "engine_ms": round(charge.engine_seconds * 1000, 3),
    }
    if tr.error:
        fields["error"] = tr.error
    request[ACCESS].fields = fields  # the request middleware writes the line
    if (tracer := request.app.get(TRACER)) is not None:
        tracer.record(_span(request, tr, t, now, cls))


def _account(request: web.Request, tr: Trace, cls: RequestClass, charge: Charge) -> None:
    """The request's usage (server/operations/usage.py) and its caller's budget
    spend (batching/budgets.py). What a request is charged: its engine time; its
    prompt tokens if it was answered or reached the engine (a refused request
    counts nothing); what it generated, answered or not."""
    ran = tr.status == 200 or charge.engine_seconds > 0 or tr.completion_tokens > 0
    if tr.caller is None or tr.model is None or not ran:
        return
    at = time.time()
    request.app[USAGE].record(
        UsageEvent(
            at=at,
            caller=tr.caller,
            model=tr.model,
            adapter=tr.adapter,
            kind=tr.usage_kind,
            request_class=cls.value,
            batch_id=request.get(BATCH_LINE) or None,
            prompt_tokens=tr.prompt_tokens,
            cached_tokens=tr.cached_tokens,
            completion_tokens=tr.completion_tokens,
            engine_seconds=charge.engine_seconds,
            block_seconds=charge.block_seconds,
            api=tr.endpoint,
        )
    )
    request.app[BUDGETS].spend(
        tr.caller, tr.prompt_tokens + tr.completion_tokens, charge.engine_seconds, at
    )


def engine_charge(tickets: Sequence[Ticket]) -> Charge:
    """The request's share of the engine's steps: its own generations' (one that
    joined another's, deduplicated, costs nothing: the first caller paid)."""
    total = Charge()
    for t in tickets:
        if t.generation is not None and not t.joined:
            total += t.generation.charge
    return total


def _span(
    request: web.Request, tr: Trace, t: Ticket | None, now: float, cls: RequestClass
) -> RequestSpan:
    """The request's span (server/operations/tracing.py), from the trace's times."""
    return RequestSpan(
        endpoint=tr.endpoint,
        method=request.method,
        path=request.path,
        headers=request.headers,
        request_id=tr.rid,
        status=tr.status,
        t0=tr.t0,
        end=now,
        model=tr.model,
        adapter=tr.adapter,
        caller=tr.caller,
        request_class=cls.value,
        stream=tr.stream,
        prompt_tokens=tr.prompt_tokens,
        completion_tokens=tr.completion_tokens,
        finish_reasons=tuple(tr.finish_reasons),
        ttft=tr.ttft,
        arrival=t.arrival if t and t.release else None,
        queue_wait=t.queue_wait if t and t.release else None,
        window=request.app[SETTINGS].core.window,
        release=t.release if t else None,
        batch_id=t.batch_id if t else None,
        batch_size=t.batch_size if t else None,
        deduped=t.joined if t else False,
        error=tr.error,
    )
