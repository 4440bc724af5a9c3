"""Parse and validate /v1/embeddings and /v1/rerank bodies into frozen values.

Why this module exists: the pooling endpoints' front door, bytes in, an
`EmbeddingsRequest` or a `RerankRequest` out, or a 400 naming the field. The
shapes are OpenAI's embeddings API (`input` a string, an array of strings, an
array of token ids or an array of such arrays; `encoding_format` float or
base64; `dimensions`; `user`) with the fields vLLM's server adds
(`truncate_prompt_tokens`, `truncation_side`, `add_special_tokens`,
`use_activation`, `priority`), and vLLM's rerank API (Jina's and Cohere's:
`query`, `documents` as strings or `{"text": ...}` objects, `top_n`,
`return_documents`).

What is refused rather than dropped, because dropping it would change the
answer: an empty input list or an empty string (nothing to embed), chat
`messages` as input, `encoding_format` bytes, an `embed_dtype` other than
float32, big-endian output, `padding` to a length, vLLM's removed `normalize`,
per-query and per-document token limits, multimodal documents. What is
accepted and ignored is noted under server/wire/ignored.py's rule.

Pure code: no aiohttp, no vLLM, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from server.errors import SluiceError
from server.wire.fields import (
    INT64_MAX,
    MISSING,
    bad,
    get,
    get_bool,
    get_int,
    get_str,
    is_int,
    load_object,
    show,
    type_name,
    unsupported,
)
from server.wire.ignored import Ignored, Notes

__all__ = ["EmbeddingsRequest", "RerankRequest", "Truncation", "parse_embeddings", "parse_rerank"]

Side = Literal["left", "right"]
EncodingFormat = Literal["float", "base64"]

# The fields each endpoint honours (or refuses by name); others are noted as ignored.
_COMMON: Final = frozenset(
    {
        "model",
        "user",
        "priority",
        "truncate_prompt_tokens",
        "truncation_side",
        "use_activation",
        "normalize",
        "padding",
    }
)
_EMBEDDINGS: Final = _COMMON | {
    "input",
    "encoding_format",
    "dimensions",
    "add_special_tokens",
    "embed_dtype",
    "endianness",
    "messages",
}
_RERANK: Final = _COMMON | {
    "query",
    "documents",
    "top_n",
    "return_documents",
    "max_tokens_per_query",
    "max_tokens_per_doc",
}


@dataclass(frozen=True, slots=True)
class Truncation:
    """vLLM's truncate_prompt_tokens (None: never; -1: to the context) and side."""

    tokens: int | None = None
    side: Side | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str | None  # None: the served model (vLLM's server takes an absent model so)
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None
    truncation: Truncation = Truncation()
    add_special_tokens: bool = True
    use_activation: bool | None = None
    priority: int = 0
    user: str | None = None
    ignored: tuple[Ignored, ...] = ()


@dataclass(frozen=True, slots=True)
class RerankRequest:
    model: str | None
    query: str
    documents: tuple[str, ...]
    top_n: int = 0  # 0: every document, as vLLM's server
    return_documents: bool = True
    truncation: Truncation = Truncation()
    use_activation: bool | None = None
    priority: int = 0
    user: str | None = None
    ignored: tuple[Ignored, ...] = ()


def _model(obj: dict[str, Any]) -> str | None:
    model = get_str(obj, "model")
    if model == "":
        raise bad("model", "'model' must be a non-empty string")
    return model


def _token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    if not value:
        raise bad(param, f"'{param}' must not be empty: there is nothing to embed")
    if not all(is_int(t) and 0 <= t <= INT64_MAX for t in value):
        raise bad(param, f"'{param}' token ids must be integers >= 0")
    return tuple(value)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise bad(param, f"'{param}' must be a string, got {type_name(value)}")
    if not value:
        raise bad(param, f"'{param}' must not be empty: there is nothing to embed")
    return value


def _inputs(obj: dict[str, Any]) -> tuple[str | tuple[int, ...], ...]:
    shape = "a string, an array of strings, an array of token ids or an array of such arrays"
    if get(obj, "messages") is not MISSING:
        raise unsupported("messages", "chat messages as embedding input")
    value = get(obj, "input")
    if value is MISSING:
        raise SluiceError(
            f"'input' is required: {shape}",
            param="input",
            code="missing_required_parameter",
        )
    if isinstance(value, str):
        return (_text(value, "input"),)
    if not isinstance(value, list):
        raise bad("input", f"'input' must be {shape}, got {type_name(value)}")
    if not value:
        raise bad("input", "'input' must not be an empty array: there is nothing to embed")
    if all(is_int(t) for t in value):
        return (_token_ids(value, "input"),)
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if isinstance(item, list):
            out.append(_token_ids(item, where))
        elif isinstance(item, dict) and isinstance(item.get("role"), str):
            raise unsupported(where, "chat messages as embedding input")
        else:
            out.append(_text(item, where))
    return tuple(out)


def _truncation(obj: dict[str, Any]) -> Truncation:
    tokens = get_int(obj, "truncate_prompt_tokens", None, lo=-1)
    side = get(obj, "truncation_side")
    if side is not MISSING and side not in ("left", "right"):
        raise bad("truncation_side", f"'truncation_side' must be left or right, got {show(side)}")
    return Truncation(tokens, None if side is MISSING else side)


def _use_activation(obj: dict[str, Any]) -> bool | None:
    if get(obj, "normalize") is not MISSING:
        # vLLM 0.32 removed it (a 400 there too): activation is `use_activation`.
        raise unsupported("normalize", "'normalize' (removed in vLLM; use 'use_activation')")
    value = get(obj, "use_activation")
    return None if value is MISSING else get_bool(obj, "use_activation", True)


def _refuse_padding(obj: dict[str, Any]) -> None:
    padding = get(obj, "padding")
    if padding is not MISSING and padding != "do_not_pad":
        raise unsupported("padding", f"'padding' {show(padding)}")


def parse_embeddings(body: bytes) -> EmbeddingsRequest:
    """A /v1/embeddings body, or a SluiceError (400)."""
    obj = load_object(body)
    model = _model(obj)
    inputs = _inputs(obj)
    fmt = get(obj, "encoding_format")
    if fmt is MISSING:
        fmt = "float"
    elif fmt in ("bytes", "bytes_only"):
        raise unsupported("encoding_format", f"'encoding_format' {fmt}")
    elif fmt not in ("float", "base64"):
        raise bad("encoding_format", f"'encoding_format' must be float or base64, got {show(fmt)}")
    embed_dtype = get(obj, "embed_dtype")
    if embed_dtype is not MISSING and embed_dtype != "float32":
        raise unsupported("embed_dtype", f"'embed_dtype' {show(embed_dtype)} (only float32)")
    endianness = get(obj, "endianness")
    if endianness is not MISSING and endianness not in ("native", "little"):
        raise unsupported("endianness", f"'endianness' {show(endianness)} (only little-endian)")
    _refuse_padding(obj)
    notes = Notes("embeddings")
    notes.extra_keys(obj, _EMBEDDINGS)
    return EmbeddingsRequest(
        model=model,
        inputs=inputs,
        encoding_format=fmt,
        dimensions=get_int(obj, "dimensions", None, lo=1),
        truncation=_truncation(obj),
        add_special_tokens=get_bool(obj, "add_special_tokens", True),
        use_activation=_use_activation(obj),
        priority=int(get_int(obj, "priority", 0)),
        user=get_str(obj, "user"),
        ignored=notes.done(),
    )


def _document(value: Any, param: str) -> str:
    """A document: a string, or an object with a string `text` (Jina's and Cohere
    v1's form); vLLM's multimodal `content` form is refused (text models)."""
    if isinstance(value, dict):
        if "content" in value:
            raise unsupported(f"{param}.content", "multimodal documents")
        return _text(value.get("text"), f"{param}.text")
    return _text(value, param)


def parse_rerank(body: bytes) -> RerankRequest:
    """A /v1/rerank (or /rerank) body, or a SluiceError (400)."""
    obj = load_object(body)
    model = _model(obj)
    query = get(obj, "query")
    if query is MISSING:
        raise SluiceError("'query' is required", param="query", code="missing_required_parameter")
    query = _document(query, "query")
    docs = get(obj, "documents")
    if docs is MISSING:
        raise SluiceError(
            "'documents' is required", param="documents", code="missing_required_parameter"
        )
    if isinstance(docs, str):
        docs = [docs]  # vLLM's server takes one document as is
    if not isinstance(docs, list):
        raise bad("documents", f"'documents' must be an array, got {type_name(docs)}")
    if not docs:
        raise bad("documents", "'documents' must not be empty: there is nothing to rank")
    documents = tuple(_document(d, f"documents[{i}]") for i, d in enumerate(docs))
    for key in ("max_tokens_per_query", "max_tokens_per_doc"):
        if get_int(obj, key, 0, lo=0):
            raise unsupported(key, f"'{key}'")
    _refuse_padding(obj)
    notes = Notes("rerank")
    notes.extra_keys(obj, _RERANK)
    return RerankRequest(
        model=model,
        query=query,
        documents=documents,
        top_n=int(get_int(obj, "top_n", 0, lo=0)),
        return_documents=get_bool(obj, "return_documents", True),
        truncation=_truncation(obj),
        use_activation=_use_activation(obj),
        priority=int(get_int(obj, "priority", 0)),
        user=get_str(obj, "user"),
        ignored=notes.done(),
    )
