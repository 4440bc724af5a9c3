"""Parse and validate OpenAI request bodies into frozen value types.

This is the front door for every generation request: raw ``bytes`` from the
socket in, a ``ChatRequest`` or ``CompletionRequest`` out, or a 400
``SluiceError`` naming the offending field and its allowed range. Nothing past
this module re-checks a field, so ranges follow vLLM 0.32's own
``SamplingParams`` checks (a body vLLM's server accepts, we accept) with
OpenAI's documented limits where the two agree.

Unknown fields are accepted and ignored, and noted under
server/wire/ignored.py's rule (logged once, counted): OpenAI clients send
fields we have no use for (``store``, ``metadata``, ``prompt_cache_key``). A
``max_tokens`` above what the context leaves is lowered to it
(``check_context``), as vLLM does. Fields whose *meaning* we
cannot honour are refused with a clear 400 instead of being silently
dropped, because dropping them changes the answer (see
``fields.refuse_unsupported``): ``logit_bias``, ``suffix``, ``best_of``
beyond ``n``, non-text content parts and audio, the
chat-template switches ``continue_final_message`` /
``add_generation_prompt: false``, and tools on /v1/completions. Function
calling (``server/wire/tools.py``) and structured output
(``server/wire/structured.py``) have their own modules.

Pure code: no aiohttp, no vLLM, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Final, cast

from server.errors import SluiceError
from server.wire.fields import (
    INT64_MAX,
    MISSING,
    bad,
    get,
    get_bool,
    get_float,
    get_int,
    get_model,
    get_prompt_logprobs,
    get_role,
    get_str,
    get_text_parts,
    is_int,
    load_object,
    objects,
    refuse_unsupported,
    type_name,
    unsupported,
)
from server.wire.ignored import Notes
from server.wire.request import (
    DEFAULTABLE,
    ChatRequest,
    CompletionRequest,
    Limits,
    Message,
    Role,
    Sampling,
)
from server.wire.structured import parse_constraint
from server.wire.tools import check_tool_results, parse_tool_calls, parse_tools, tool_call_id

__all__ = [
    "COMPLETION_DEFAULT_MAX_TOKENS",
    "ChatRequest",
    "CompletionRequest",
    "Limits",
    "Message",
    "Sampling",
    "check_context",
    "parse_chat",
    "parse_completion",
]

# OpenAI's documented default for /v1/completions (vLLM uses the same).
COMPLETION_DEFAULT_MAX_TOKENS: Final = 16

_ROLES: Final = ("system", "user", "assistant", "tool", "developer")
# Fields both parsers read (sampling, streaming, priority, refusals checked);
# each adds its own. Any other is noted as ignored (rule 2).
_SHARED: Final = frozenset(
    {
        "model",
        "n",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "ignore_eos",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "logprobs",
        "stream",
        "stream_options",
        "priority",
        "service_tier",
        "user",
        "prompt_logprobs",
        # Checked by refuse_unsupported: honoured in their neutral values.
        "audio",
        "logit_bias",
        "suffix",
        "modalities",
        "best_of",
        "continue_final_message",
        "add_generation_prompt",
    }
)
_CHAT: Final = _SHARED | {
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "max_completion_tokens",
    "top_logprobs",
    "chat_template_kwargs",
}
_COMPLETIONS: Final = _SHARED | {"prompt", "echo", "tools", "functions", "tool_choice"}


# ---------------------------------------------------------------------------
# Shared sampling fields.


def _stop(obj: dict[str, Any], limits: Limits) -> tuple[str, ...]:
    value = get(obj, "stop")
    if value is MISSING:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad("stop", "'stop' must be a non-empty string or an array of non-empty strings")
    if len(items) > limits.max_stop:
        raise bad("stop", f"'stop' allows at most {limits.max_stop} sequences, got {len(items)}")
    return tuple(dict.fromkeys(items))


def _stop_token_ids(obj: dict[str, Any]) -> tuple[int, ...]:
    value = get(obj, "stop_token_ids")
    if value is MISSING:
        return ()
    if not isinstance(value, list) or not all(is_int(t) and 0 <= t <= INT64_MAX for t in value):
        raise bad(
            "stop_token_ids", "'stop_token_ids' must be an array of token ids (integers >= 0)"
        )
    return tuple(dict.fromkeys(value))


def _max_tokens(obj: dict[str, Any], key: str, default: int | None, limits: Limits) -> int | None:
    value = get_int(obj, key, MISSING, lo=1)
    if value is MISSING:
        return default
    if limits.max_tokens_cap is not None and value > limits.max_tokens_cap:
        raise bad(
            key,
            f"'{key}' must be an integer in [1, {limits.max_tokens_cap}], got {value}",
        )
    return int(value)


def _sampling(
    obj: dict[str, Any], limits: Limits, max_tokens: int | None, logprobs: int | None
) -> Sampling:
    defaults = {**DEFAULTABLE, **dict(limits.sampling_defaults)}
    temperature = get_float(obj, "temperature", float(defaults["temperature"]), 0.0, 2.0)
    top_p = get_float(obj, "top_p", float(defaults["top_p"]), 0.0, 1.0, lo_open=True)
    top_k = int(get_int(obj, "top_k", int(defaults["top_k"]), lo=-1))
    if top_k == -1:
        top_k = 0
    min_p = get_float(obj, "min_p", float(defaults["min_p"]), 0.0, 1.0)
    if temperature == 0:
        top_p, top_k, min_p = 1.0, 0, 0.0
    seed = get_int(obj, "seed", None)
    if seed == -1:  # vLLM reads -1 as "no seed"
        seed = None
    min_tokens = int(get_int(obj, "min_tokens", 0, lo=0))
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad(
            "min_tokens",
            f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})",
        )
    return Sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        n=int(get_int(obj, "n", 1, lo=1, hi=limits.max_n)),
        stop=_stop(obj, limits),
        stop_token_ids=_stop_token_ids(obj),
        seed=seed,
        presence_penalty=get_float(
            obj, "presence_penalty", float(defaults["presence_penalty"]), -2.0, 2.0
        ),
        frequency_penalty=get_float(
            obj, "frequency_penalty", float(defaults["frequency_penalty"]), -2.0, 2.0
        ),
        repetition_penalty=get_float(
            obj,
            "repetition_penalty",
            float(defaults["repetition_penalty"]),
            0.0,
            math.inf,
            lo_open=True,
        ),
        logprobs=logprobs,
        ignore_eos=get_bool(obj, "ignore_eos", False),
        min_tokens=min_tokens,
        skip_special_tokens=get_bool(obj, "skip_special_tokens", True),
        include_stop_str_in_output=get_bool(obj, "include_stop_str_in_output", False),
        constraint=parse_constraint(obj),
    )


def _stream(obj: dict[str, Any]) -> tuple[bool, bool]:
    stream = get_bool(obj, "stream", False)
    options = get(obj, "stream_options")
    if options is MISSING:
        return stream, False
    if not stream:
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    if not isinstance(options, dict):
        raise bad("stream_options", f"'stream_options' must be an object, got {type_name(options)}")
    return stream, get_bool(options, "include_usage", False, param="stream_options.include_usage")


def _priority(obj: dict[str, Any]) -> int:
    return int(get_int(obj, "priority", 0))


# ---------------------------------------------------------------------------
# Chat.


def _messages(obj: dict[str, Any]) -> tuple[Message, ...]:
    value = get(obj, "messages")
    if not isinstance(value, list) or not value:
        raise bad("messages", "'messages' is required and must be a non-empty array")
    out = []
    for where, msg in objects(value, "messages"):
        role = get_role(msg, _ROLES, where)
        calls = get(msg, "tool_calls")
        if calls is not MISSING and role != "assistant":
            raise bad(f"{where}.tool_calls", f"'{where}.tool_calls' is only allowed for assistant")
        raw = msg.get("content")
        if raw is None:
            if role != "assistant":
                raise bad(f"{where}.content", f"'{where}.content' is required for role {role}")
            content = ""
        else:
            content = get_text_parts(raw, f"{where}.content")
        name = get_str(msg, "name", param=f"{where}.name")
        out.append(
            Message(
                role=cast(Role, role),  # one of _ROLES, checked above
                content=content,
                name=name,
                tool_calls=()
                if calls is MISSING
                else parse_tool_calls(calls, f"{where}.tool_calls"),
                tool_call_id=tool_call_id(msg, where) if role == "tool" else None,
                param=f"{where}.tool_call_id" if role == "tool" else None,
            )
        )
    return tuple(out)


def _template_kwargs(
    obj: dict[str, Any], limits: Limits
) -> tuple[bool, tuple[tuple[str, Any], ...]]:
    value = get(obj, "chat_template_kwargs")
    if value is MISSING:
        value = {}
    if not isinstance(value, dict):
        raise bad(
            "chat_template_kwargs",
            f"'chat_template_kwargs' must be an object, got {type_name(value)}",
        )
    thinking = get_bool(
        value,
        "enable_thinking",
        limits.default_enable_thinking,
        param="chat_template_kwargs.enable_thinking",
    )
    items = {**value, "enable_thinking": thinking}
    return thinking, tuple(sorted(items.items()))


def parse_chat(body: bytes, limits: Limits, *, whole: bool = True) -> ChatRequest:
    """Parse a /v1/chat/completions body, or raise SluiceError(400).

    ``whole``: the messages are the whole conversation, so each tool message
    must answer a call among them (``check_tool_results``); Responses parses
    a turn that a stored conversation may precede, and checks after the join.
    """
    obj = load_object(body)
    model = get_model(obj)
    limits = limits.for_model(model)  # its own defaults, with several models
    messages = _messages(obj)
    if whole:
        check_tool_results(messages)
    n = int(get_int(obj, "n", 1, lo=1, hi=limits.max_n))
    refuse_unsupported(obj, n)
    tools, tool_choice, parallel = parse_tools(obj)

    # max_completion_tokens is OpenAI's newer name; like vLLM, it wins.
    max_tokens = _max_tokens(obj, "max_tokens", limits.default_max_tokens, limits)
    max_tokens = _max_tokens(obj, "max_completion_tokens", max_tokens, limits)

    want_logprobs = get_bool(obj, "logprobs", False)
    top = int(get_int(obj, "top_logprobs", 0, lo=0, hi=limits.max_logprobs))
    if top and not want_logprobs:
        raise bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    logprobs = top if want_logprobs else None

    stream, include_usage = _stream(obj)
    prompt_k = get_prompt_logprobs(obj, stream, limits.max_logprobs)
    sampling = _sampling(obj, limits, max_tokens, logprobs)
    if prompt_k is not None:
        sampling = dataclasses.replace(sampling, prompt_logprobs=prompt_k)
    thinking, kwargs = _template_kwargs(obj, limits)
    notes = Notes("chat")
    notes.extra_keys(obj, _CHAT)
    return ChatRequest(
        model=model,
        messages=messages,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        prompt_logprobs=prompt_k,
        priority=_priority(obj),
        service_tier=get_str(obj, "service_tier"),
        user=get_str(obj, "user"),
        enable_thinking=thinking,
        chat_template_kwargs=kwargs,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        ignored=notes.done(),
    )


# ---------------------------------------------------------------------------
# Completions.


def _token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    if not value:
        raise bad(param, f"'{param}' must not be empty")
    if not all(is_int(t) and 0 <= t <= INT64_MAX for t in value):
        raise bad(param, f"'{param}' token ids must be integers >= 0")
    return tuple(value)


def _prompts(obj: dict[str, Any], limits: Limits) -> tuple[str | tuple[int, ...], ...]:
    value = get(obj, "prompt")
    shape = "a string, an array of strings, an array of token ids or an array of such arrays"
    if value is MISSING:
        raise SluiceError(
            f"'prompt' is required: {shape}",
            status=400,
            param="prompt",
            code="missing_required_parameter",
        )
    if isinstance(value, str):
        if not value:
            raise bad("prompt", "'prompt' must not be empty")
        return (value,)
    if not isinstance(value, list) or not value:
        raise bad("prompt", f"'prompt' must be {shape}, non-empty")
    if all(is_int(t) for t in value):
        return (_token_ids(value, "prompt"),)
    if len(value) > limits.max_prompts:
        raise bad(
            "prompt", f"'prompt' allows at most {limits.max_prompts} prompts, got {len(value)}"
        )
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(value):
        where = f"prompt[{i}]"
        if isinstance(item, str) and item:
            out.append(item)
        elif isinstance(item, list):
            out.append(_token_ids(item, where))
        else:
            raise bad(where, f"'{where}' must be a non-empty string or an array of token ids")
    return tuple(out)


def parse_completion(body: bytes, limits: Limits) -> CompletionRequest:
    """Parse a /v1/completions body, or raise SluiceError(400)."""
    obj = load_object(body)
    model = get_model(obj)
    limits = limits.for_model(model)  # its own defaults, with several models
    prompts = _prompts(obj, limits)
    n = int(get_int(obj, "n", 1, lo=1, hi=limits.max_n))
    refuse_unsupported(obj, n)
    for key in ("tools", "functions", "tool_choice"):
        if get(obj, key) is not MISSING and obj[key] not in ([], "none"):
            raise unsupported(key, f"'{key}' on /v1/completions (use /v1/chat/completions)")

    echo = get_bool(obj, "echo", False)
    raw_max = obj.get("max_tokens", MISSING)
    # An echo with max_tokens 0 answers the prompt alone (lm-eval's rolling
    # loglikelihood); the engine still runs one step, as vLLM's server does,
    # and that token is left out of the answer.
    prompt_only = echo and raw_max == 0 and type(raw_max) is int
    # Absent: OpenAI's 16. Explicit null: vLLM's "rest of the context".
    if prompt_only:
        max_tokens: int | None = 1
    elif raw_max is None:
        max_tokens = limits.default_max_tokens
    else:
        max_tokens = _max_tokens(obj, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, limits)
        if limits.max_tokens_cap is not None and max_tokens is not None:
            max_tokens = min(max_tokens, limits.max_tokens_cap)

    logprobs = get_int(obj, "logprobs", None, lo=0, hi=limits.max_logprobs)
    stream, include_usage = _stream(obj)
    prompt_k = get_prompt_logprobs(obj, stream, limits.max_logprobs)
    sampling = _sampling(obj, limits, max_tokens, logprobs)
    # The echoed prompt's tokens carry their logprobs too (vLLM's
    # prompt_logprobs, as its server sets them for an echo): computed by the
    # engine over the prompt, bounded by --max-logprobs like logprobs. The
    # engine's k serves both the echo and the extension's own field.
    echo_k = logprobs if echo else None
    engine_k = max((k for k in (echo_k, prompt_k) if k is not None), default=None)
    if engine_k is not None:
        sampling = dataclasses.replace(sampling, prompt_logprobs=engine_k)
    notes = Notes("completions")
    notes.extra_keys(obj, _COMPLETIONS)
    if sampling.constraint is not None:
        # A raw prompt has no chat template opening a thought: constrain at once.
        constraint = dataclasses.replace(sampling.constraint, from_start=True)
        sampling = dataclasses.replace(sampling, constraint=constraint)
    return CompletionRequest(
        model=model,
        prompts=prompts,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        priority=_priority(obj),
        service_tier=get_str(obj, "service_tier"),
        user=get_str(obj, "user"),
        echo=echo,
        prompt_only=prompt_only,
        prompt_logprobs=prompt_k,
        ignored=notes.done(),
    )


# ---------------------------------------------------------------------------
# Context check, after tokenizing.


def check_context(
    prompt_len: int, max_tokens: int | None, max_model_len: int, *, where: str = "messages"
) -> int:
    """The max_tokens a prompt of ``prompt_len`` tokens runs with: what the
    request asked for (``None``: the rest of the context), lowered to the room
    the context leaves, as vLLM's ``get_max_tokens`` does. The answer then
    ends with finish reason ``length`` when it fills that room. Every API's
    context check is this one call.

    A prompt that leaves no room is a 400 with vLLM's wording; ``where``
    names the prompt in the message ("messages", "prompt" or "input").
    """
    room = max_model_len - prompt_len
    if room <= 0:
        raise SluiceError(
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, your request has {prompt_len} input tokens, which leaves no "
            f"room for a completion. Please reduce the length of the {where}.",
            status=400,
            param=where,
            code="context_length_exceeded",
        )
    return room if max_tokens is None else min(max_tokens, room)
