"""The two generation endpoints: what differs between chat and completions.

Why this module exists: the pipeline (server/http/pipeline.py) runs every
generation the same way; an endpoint only says how its body becomes token ids
(`prepare_*`: parse, check a structured-output constraint, tokenize, context
check) and how choices go back on the wire (its `Encoder`: whole bodies,
stream frames, the reasoning split, tool calls).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

from aiohttp import web

from server.api.openai_chat.output import chat_completion_body, completion_body
from server.api.openai_chat.parse import check_context, parse_chat, parse_completion
from server.api.openai_chat.stream import DONE, ChatStream, CompletionStream, sse
from server.engines.interface import ChatParser, ChoiceParser, CompletionDelta, EngineOutput
from server.engines.reasoning_split import ReasoningSplitter, split_reasoning
from server.errors import SluiceError
from server.http.models import use_model
from server.http.pipeline import (
    Encoder,
    Job,
    Trace,
    candidates,
    classify,
    logprobs,
    prompt_logprobs,
)
from server.state import METRICS, RUNTIME, SETTINGS
from server.wire.ignored import Api
from server.wire.output import (
    ChatChoice,
    CompletionChoice,
    FinishReason,
    PromptLogprob,
    TokenLogprob,
    Usage,
)
from server.wire.request import ChatRequest, CompletionRequest

T = TypeVar("T")

__all__ = [
    "REASONING_FIELD",
    "ChatJob",
    "chat_job",
    "openai_stream_error",
    "prepare_chat",
    "prepare_completion",
    "read_body",
]

# vLLM 0.32 names the thinking part "reasoning"; the OpenAI-compatible
# ecosystem (and the field our users' clients read) is "reasoning_content".
REASONING_FIELD: Final = "reasoning_content"

Detokenize = Callable[[Sequence[int]], str]


async def read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise SluiceError(
            f"request body exceeds {request.app[SETTINGS].max_body_bytes} bytes",
            status=413,
            code="body_too_large",
        ) from None


def _openai_stream_end(usage_frame: bytes) -> bytes:
    """An OpenAI stream's close: the usage chunk when asked for, then [DONE]."""
    return usage_frame + DONE


def openai_stream_error(err: SluiceError) -> bytes:
    """An OpenAI stream that failed after its headers: the error as an event, then [DONE]."""
    return sse(err.body()) + DONE


def _finish_reason(reason: str | None) -> FinishReason:
    return "length" if reason == "length" else "stop"


# ---------------------------------------------------------------------------
# Chat


async def prepare_chat(request: web.Request, tr: Trace) -> tuple[Job, Encoder[ChatChoice]]:
    req = parse_chat(await read_body(request), request.app[RUNTIME].limits)
    cj = await chat_job(request, req, "chat")
    return cj.job, ChatEncoder(
        req,
        tr.rid,
        cj.job.entry.engine.detokenize,
        cj.parser,
        cj.prompt_ids,
        cj.job.request_class.service_tier,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ChatJob:
    """A chat request made ready to run: what every chat-shaped API's encoder needs.

    `parser` is vLLM's tool-call and reasoning parsing for a request with tools
    (None without tools); `prompt_ids` tell it where thinking stands at the start.
    """

    job: Job
    parser: ChatParser | None
    prompt_ids: tuple[int, ...]


async def chat_job(request: web.Request, req: ChatRequest, api: Api) -> ChatJob:
    """The steps every chat-shaped API shares once its body is a ChatRequest:
    what its parser ignored recorded (server/operations/ignored_log.py), the model
    check (and its load, for an on-demand model: server/http/models.py), the
    tool parser, the constraint check, rendering and tokenizing through the
    model's engine's chat template, and the context check, which lowers
    max_tokens to the room the prompt leaves (check_context). OpenAI chat,
    Anthropic Messages and OpenAI Responses all come through here."""
    request.app[METRICS].ignored.record(api, req.ignored)
    entry, adapter = await use_model(request, req.model)
    engine = entry.engine
    # With tools, vLLM's parsers read the output (calls and the thinking
    # split); without, server/engines/reasoning_split.py splits it (a hundredth of the cost
    # per delta, measured: 0.1 us against 10 us) when it is the same split:
    # another --reasoning-parser reads every request through vLLM's.
    parser = engine.chat_parser(req) if req.tools or not engine.info.qwen3_split else None
    sampling = req.sampling
    if parser is not None and parser.constraint is not None:
        # A forced call: its schema replaces any response_format, as in vLLM.
        sampling = dataclasses.replace(sampling, constraint=parser.constraint)
    if sampling.constraint is not None:
        await engine.check_constraint(sampling.constraint)
    ids = (await engine.tokenize_chat([(req.messages, req.template_kwargs())]))[0]
    max_tokens = check_context(len(ids), sampling.max_tokens, engine.info.max_model_len)
    job = Job(
        model=req.model,
        entry=entry,
        adapter=adapter,
        prompts=(tuple(ids),),
        max_tokens=(max_tokens,),
        sampling=sampling,
        priority=req.priority,
        request_class=classify(request, req.service_tier),
        stream=req.stream,
        include_usage=req.include_usage,
        user=req.user,
        variant=req.variant(),
        # Thinking output is not kept by the result cache (--result-cache-ttl).
        cacheable=not req.enable_thinking,
    )
    return ChatJob(job, parser, tuple(ids))


class ChatEncoder:
    """chat.completion bodies and chat.completion.chunk frames for one request.

    With a ``parser`` (a request with tools, or any request under a
    ``--reasoning-parser`` other than qwen3), each choice's text goes through
    vLLM's parsers: reasoning, content and tool calls; the prompt's token ids
    tell them where thinking stands when generation starts.
    """

    def __init__(
        self,
        req: ChatRequest,
        rid: str,
        detokenize: Detokenize,
        parser: ChatParser | None = None,
        prompt_ids: Sequence[int] = (),
        service_tier: str = "default",
    ) -> None:
        self._req = req
        self._rid = rid
        self._tier = service_tier  # the tier that serves it (batching/classes.py rule 3)
        self._created = int(time.time())
        self._detokenize = detokenize
        self._parser = parser
        self._prompt_ids = prompt_ids
        self._prompt_lps: tuple[PromptLogprob | None, ...] | None = None
        self._streams: dict[int, ChoiceParser] = {}
        n = req.sampling.n
        self._splitters = (
            [ReasoningSplitter() for _ in range(n)]
            if req.enable_thinking and parser is None
            else None
        )
        self._enc = ChatStream(
            request_id=rid,
            created=self._created,
            model=req.model,
            n=n,
            reasoning_field=REASONING_FIELD,
            service_tier=service_tier,
        )

    def prompt_output(self, prompt: int, out: EngineOutput) -> None:
        """vLLM's prompt_logprobs extension: kept from the output that has them."""
        if self._req.prompt_logprobs is None or self._prompt_lps is not None:
            return
        if out.prompt_logprobs:
            self._prompt_lps = candidates(self._detokenize, out.prompt_logprobs)

    def choices(
        self,
        texts: Sequence[str],
        logprobs: Sequence[Sequence[TokenLogprob]],
        reasons: Sequence[str | None],
    ) -> tuple[ChatChoice, ...]:
        req = self._req
        out = []
        for i, text in enumerate(texts):
            if self._parser is not None:
                parsed = self._parser.parse(text)
                out.append(
                    ChatChoice(
                        index=i,
                        content=parsed.content,
                        reasoning=parsed.reasoning,
                        finish_reason=self._parser.finish_reason(
                            reasons[i], bool(parsed.tool_calls)
                        ),
                        logprobs=tuple(logprobs[i]) if req.logprobs else None,
                        tool_calls=parsed.tool_calls,
                    )
                )
                continue
            reasoning, content = split_reasoning(text) if req.enable_thinking else (None, text)
            out.append(
                ChatChoice(
                    index=i,
                    content=content,
                    reasoning=reasoning,
                    finish_reason=_finish_reason(reasons[i]),
                    logprobs=tuple(logprobs[i]) if req.logprobs else None,
                )
            )
        return tuple(out)

    def body(self, choices: Sequence[ChatChoice], usage: Usage) -> bytes:
        return chat_completion_body(
            request_id=self._rid,
            created=self._created,
            model=self._req.model,
            choices=choices,
            usage=usage,
            reasoning_field=REASONING_FIELD,
            service_tier=self._tier,
            prompt_logprobs=self._asked_prompt_logprobs(),
        )

    def _asked_prompt_logprobs(self) -> tuple[PromptLogprob | None, ...] | None:
        if self._req.prompt_logprobs is None:
            return None
        if self._prompt_lps is None:
            raise SluiceError("the engine gave no prompt logprobs", status=500)
        return self._prompt_lps

    def stream_head(self) -> bytes:
        return b"".join(self._enc.first(i) for i in range(self._req.sampling.n))

    def stream_delta(self, choice: int, delta: CompletionDelta) -> bytes:
        if self._parser is not None:
            return self._parsed_delta(self._parser, choice, delta)
        enc = self._enc
        splitter = self._splitters[choice] if self._splitters is not None else None
        parts: list[bytes] = []
        if self._req.logprobs:
            text = delta.text
            if splitter is not None:
                r, text = splitter.feed(text)
                if r:
                    parts.append(enc.chunk(choice, reasoning=r))
            lps = logprobs(self._detokenize, delta, self._req.top_logprobs)
            parts.append(enc.chunk(choice, content=text, logprobs=lps))
        elif splitter is not None:
            r, t = splitter.feed(delta.text)
            parts.append(enc.splits(((choice, r, t),)))
        elif delta.text:
            parts.append(enc.content(choice, delta.text))
        if delta.finish_reason is not None:
            if splitter is not None:
                r, t = splitter.finish()
                parts.append(enc.splits(((choice, r, t),)))
            parts.append(enc.finish(choice, _finish_reason(delta.finish_reason)))
        return b"".join(parts)

    def _parsed_delta(self, parser: ChatParser, choice: int, delta: CompletionDelta) -> bytes:
        """Frames of one delta through vLLM's parsers: reasoning, content, calls."""
        enc = self._enc
        stream = self._streams.get(choice)
        if stream is None:
            stream = self._streams[choice] = parser.stream()
            stream.start(self._prompt_ids)
        done = delta.finish_reason is not None
        d = stream.feed(delta.text, delta.token_ids, finished=done)
        parts: list[bytes] = []
        if d.reasoning:
            parts.append(enc.reasoning(choice, d.reasoning))
        if self._req.logprobs:
            lps = logprobs(self._detokenize, delta, self._req.top_logprobs)
            parts.append(enc.chunk(choice, content=d.content, logprobs=lps))
        elif d.content:
            parts.append(enc.content(choice, d.content))
        if d.tool_calls:
            parts.append(enc.tool_calls(choice, d.tool_calls))
        if done:
            parts.append(
                enc.finish(choice, parser.finish_reason(delta.finish_reason, stream.called))
            )
        return b"".join(parts)

    def stream_end(self, usage: Usage) -> bytes:
        return _openai_stream_end(self._enc.usage(usage) if self._req.include_usage else b"")

    def stream_error(self, err: SluiceError) -> bytes:
        return openai_stream_error(err)


# ---------------------------------------------------------------------------
# Completions


async def prepare_completion(
    request: web.Request, tr: Trace
) -> tuple[Job, Encoder[CompletionChoice]]:
    req = parse_completion(await read_body(request), request.app[RUNTIME].limits)
    request.app[METRICS].ignored.record("completions", req.ignored)
    entry, adapter = await use_model(request, req.model)
    engine = entry.engine
    if req.sampling.constraint is not None:
        await engine.check_constraint(req.sampling.constraint)
    texts = [p for p in req.prompts if isinstance(p, str)]
    encoded = iter(await engine.tokenize_prompts(texts)) if texts else iter(())
    prompts = tuple(tuple(next(encoded)) if isinstance(p, str) else p for p in req.prompts)
    max_len = engine.info.max_model_len
    job = Job(
        model=req.model,
        entry=entry,
        adapter=adapter,
        prompts=prompts,
        max_tokens=tuple(
            check_context(len(ids), req.sampling.max_tokens, max_len, where="prompt")
            for ids in prompts
        ),
        sampling=req.sampling,
        priority=req.priority,
        request_class=classify(request, req.service_tier),
        stream=req.stream,
        include_usage=req.include_usage,
        user=req.user,
        variant=(req.echo, req.prompt_only, req.prompt_logprobs),
        top_with_chosen=True,
    )
    return job, CompletionEncoder(req, prompts, tr.rid, engine.detokenize)


def _given(per_prompt: dict[int, T], prompt: int) -> T:
    """A prompt's converted prompt logprobs, which the engine must have sent."""
    if prompt not in per_prompt:
        raise SluiceError("the engine gave no prompt logprobs", status=500)
    return per_prompt[prompt]


class CompletionEncoder:
    """text_completion bodies and stream frames for one request (echo included).

    An echo with logprobs carries the prompt's tokens with their logprobs
    in front of the generated ones (the first token's is null), as vLLM's
    server answers lm-eval's loglikelihood requests; offsets count from the
    prompt's start. Streamed, that echo goes with each choice's first output
    (its logprobs come with the output that ends the prefill), where an echo
    without logprobs goes out at once. With max_tokens 0 only the prompt is
    answered.
    """

    def __init__(
        self,
        req: CompletionRequest,
        prompts: Sequence[Sequence[int]],
        rid: str,
        detokenize: Detokenize,
    ) -> None:
        self._req = req
        self._prompts = prompts
        self._rid = rid
        self._created = int(time.time())
        self._detokenize = detokenize
        self._enc = CompletionStream(
            request_id=rid, created=self._created, model=req.model, n=len(prompts) * req.sampling.n
        )
        # The echo waits for the first output: it carries the prompt's logprobs,
        # or (prompt only) it is all the choice says.
        self._late_echo = req.echo and (req.sampling.prompt_logprobs is not None or req.prompt_only)
        self._echoed: set[int] = set()
        # Per prompt, converted once from the output that carries them: the
        # echo's tokens (with the request's own logprobs k) and vLLM's extension.
        self._echo_lps: dict[int, list[TokenLogprob]] = {}
        self._asked_lps: dict[int, tuple[PromptLogprob | None, ...]] = {}

    def _echo(self, choice: int) -> str:
        if not self._req.echo:
            return ""
        pi = choice // self._req.sampling.n
        p = self._req.prompts[pi]
        return p if isinstance(p, str) else self._detokenize(self._prompts[pi])

    def prompt_output(self, prompt: int, out: EngineOutput) -> None:
        entries = out.prompt_logprobs
        if not entries or prompt in self._echo_lps or prompt in self._asked_lps:
            return
        k = self._req.sampling.logprobs
        if self._req.echo and k is not None:
            ids = self._prompts[prompt]
            self._echo_lps[prompt] = prompt_logprobs(self._detokenize, ids, entries, k)
        if self._req.prompt_logprobs is not None:
            self._asked_lps[prompt] = candidates(self._detokenize, entries)

    def _echo_logprobs(self, choice: int) -> list[TokenLogprob]:
        """The echo's prompt tokens with the request's own ``logprobs`` k."""
        if self._req.sampling.logprobs is None:
            return []
        return _given(self._echo_lps, choice // self._req.sampling.n)

    def _asked_prompt_logprobs(self, choice: int) -> tuple[PromptLogprob | None, ...] | None:
        """vLLM's prompt_logprobs extension, on the choice as its server puts it."""
        if self._req.prompt_logprobs is None:
            return None
        return _given(self._asked_lps, choice // self._req.sampling.n)

    def choices(
        self,
        texts: Sequence[str],
        logprobs: Sequence[Sequence[TokenLogprob]],
        reasons: Sequence[str | None],
    ) -> tuple[CompletionChoice, ...]:
        want = self._req.sampling.logprobs is not None
        only = self._req.prompt_only
        out = []
        for idx, text in enumerate(texts):
            prefix = self._echo(idx)
            lps = [] if only else list(logprobs[idx])
            offset = len(prefix)
            if want and self._req.echo:
                lps = self._echo_logprobs(idx) + lps
                offset = 0
            out.append(
                CompletionChoice(
                    index=idx,
                    text=prefix if only else prefix + text,
                    finish_reason=_finish_reason(reasons[idx]),
                    logprobs=tuple(lps) if want else None,
                    text_offset=offset,
                    prompt_logprobs=self._asked_prompt_logprobs(idx),
                )
            )
        return tuple(out)

    def body(self, choices: Sequence[CompletionChoice], usage: Usage) -> bytes:
        return completion_body(
            request_id=self._rid,
            created=self._created,
            model=self._req.model,
            choices=choices,
            usage=usage,
        )

    def stream_head(self) -> bytes:
        if not self._req.echo or self._late_echo:
            return b""
        total = len(self._prompts) * self._req.sampling.n
        return self._enc.texts((i, self._echo(i)) for i in range(total))

    def stream_delta(self, choice: int, delta: CompletionDelta) -> bytes:
        enc = self._enc
        k = self._req.sampling.logprobs
        only = self._req.prompt_only
        text = "" if only else delta.text
        lps = [] if only or k is None else logprobs(self._detokenize, delta, k, with_chosen=True)
        if self._late_echo and choice not in self._echoed:
            self._echoed.add(choice)
            text = self._echo(choice) + text
            lps = self._echo_logprobs(choice) + lps
        parts: list[bytes] = []
        if k is not None:
            parts.append(enc.chunk(choice, text, logprobs=lps))
        elif text:
            parts.append(enc.text(choice, text))
        if delta.finish_reason is not None:
            parts.append(enc.finish(choice, _finish_reason(delta.finish_reason)))
        return b"".join(parts)

    def stream_end(self, usage: Usage) -> bytes:
        return _openai_stream_end(self._enc.usage(usage) if self._req.include_usage else b"")

    def stream_error(self, err: SluiceError) -> bytes:
        return openai_stream_error(err)
