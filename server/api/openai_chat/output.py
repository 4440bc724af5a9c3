"""OpenAI response bodies as bytes: chat, text completion, models list, errors.

Whole (non-streaming) bodies are built as dicts and serialised once with
orjson; their cost is paid once per request. The per-token stream chunk is
the hot path and lives in ``server/api/openai_chat/stream.py``; both share the
dict builders here (and the value types of server/wire/output.py) so the two
can never drift apart (the unit tests compare them byte for byte).

Field names follow OpenAI; the reasoning text of a thinking model goes in
``reasoning``, the name vLLM 0.32 uses in both ``message`` and ``delta``
(older vLLM and some gateways used ``reasoning_content``; pass
``reasoning_field="reasoning_content"`` to the builders for those clients).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, overload

import orjson

from server.wire.output import ChatChoice, CompletionChoice, PromptLogprob, TokenLogprob, Usage
from server.wire.request import ToolCall

__all__ = [
    "REASONING_FIELD",
    "chat_completion_body",
    "chat_logprobs",
    "completion_body",
    "completion_logprobs",
    "models_body",
]

REASONING_FIELD: Final = "reasoning"

# vLLM's stand-in for -inf: JSON has no infinity, and orjson would write null.
_LOGPROB_FLOOR: Final = -9999.0


def tool_call_dict(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@overload
def _lp(value: float) -> float: ...
@overload
def _lp(value: None) -> None: ...
def _lp(value: float | None) -> float | None:
    if value is None:  # a prompt's first token
        return None
    return value if value > _LOGPROB_FLOOR else _LOGPROB_FLOOR  # also maps NaN


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", "surrogatepass"))


def chat_logprobs(tokens: Iterable[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [...]}``."""
    return {
        "content": [
            {
                "token": t.token,
                "logprob": _lp(t.logprob),
                "bytes": _bytes(t.token),
                "top_logprobs": [
                    {"token": tok, "logprob": _lp(lp), "bytes": _bytes(tok)} for tok, lp in t.top
                ],
            }
            for t in tokens
        ]
    }


def completion_logprobs(tokens: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object, offsets counted from ``text_offset``."""
    offsets = []
    at = text_offset
    for t in tokens:
        offsets.append(at)
        at += len(t.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [_lp(t.logprob) for t in tokens],
        "top_logprobs": [
            None if t.logprob is None else {tok: _lp(lp) for tok, lp in t.top} for t in tokens
        ],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(
    entries: Sequence[PromptLogprob | None],
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` field: per prompt token null (the first) or
    ``{token id: {logprob, rank, decoded_token}}``."""
    return [
        None
        if e is None
        else {
            str(tid): {"logprob": lp, "rank": rank, "decoded_token": text}
            for tid, lp, rank, text in e.candidates
        }
        for e in entries
    ]


def chat_completion_body(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: Sequence[ChatChoice],
    usage: Usage,
    reasoning_field: str = REASONING_FIELD,
    service_tier: str = "default",
    prompt_logprobs: Sequence[PromptLogprob | None] | None = None,
) -> bytes:
    """A non-streaming ``chat.completion`` body; ``id`` is ``chatcmpl-<request_id>``;
    ``service_tier`` is the tier that served it (batching/classes.py rule 3);
    ``prompt_logprobs`` vLLM's extension, at the top as its server puts it."""
    out = []
    for c in choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.reasoning is not None:
            message[reasoning_field] = c.reasoning
        if c.tool_calls:
            message["tool_calls"] = [tool_call_dict(t) for t in c.tool_calls]
        out.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
        )
    body: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage.as_dict(),
        "service_tier": service_tier,
    }
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(prompt_logprobs)
    return orjson.dumps(body)


def _completion_choice(c: CompletionChoice) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": c.index,
        "text": c.text,
        "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs, c.text_offset),
        "finish_reason": c.finish_reason,
    }
    if c.prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_logprobs)
    return out


def completion_body(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: Sequence[CompletionChoice],
    usage: Usage,
) -> bytes:
    """A non-streaming ``text_completion`` body; ``id`` is ``cmpl-<request_id>``."""
    return orjson.dumps(
        {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [_completion_choice(c) for c in choices],
            "usage": usage.as_dict(),
        }
    )


def models_body(
    model_ids: Iterable[str],
    *,
    created: int,
    owned_by: str = "sluice",
    max_model_len: int | None = None,
    adapters: Iterable[tuple[str, str, str]] = (),
    cards: Mapping[str, Mapping[str, Any]] | None = None,
) -> bytes:
    """The ``/v1/models`` list. ``root`` and ``max_model_len`` as vLLM adds them.

    `adapters` are LoRA adapters as (name, path, parent): a card each, after
    the base models, as vLLM's server lists them (OpenAIServingModels
    .show_available_models): ``root`` the adapter's path, ``parent`` its base
    model, no ``max_model_len``. `cards`: fields of a model's own card, by its
    id (with several models: its state, kind, created and context)."""
    data = []
    for model_id in model_ids:
        entry: dict[str, Any] = {
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": owned_by,
            "root": model_id,
            "parent": None,
        }
        if max_model_len is not None:
            entry["max_model_len"] = max_model_len
        if cards is not None:
            entry.update(cards.get(model_id, {}))
        data.append(entry)
    for name, path, parent in adapters:
        data.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": owned_by,
                "root": path,
                "parent": parent,
            }
        )
    return orjson.dumps({"object": "list", "data": data})
