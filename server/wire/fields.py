"""Typed readers for the fields of a client's JSON object, and the refusal list.

Each reader names the field and its allowed range in the 400 it raises, so
every refusal reads the same way. JSON null counts as an absent field: OpenAI
clients send explicit nulls for unset options.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from typing import Any, Final

import orjson

from server.errors import SluiceError

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
MISSING: Final[Any] = object()

# ---------------------------------------------------------------------------
# Field readers. Each takes the body dict and a key; JSON null counts as absent.


def full_match(pattern: re.Pattern[str], value: object) -> re.Match[str] | None:
    """`value` matched by `pattern` as a whole, or None (also for a value that is
    not a string). Identifier patterns go through here: `re.match` with a
    trailing `$` also takes a value that ends in a newline (issue 50)."""
    return pattern.fullmatch(value) if isinstance(value, str) else None


def bad(param: str, message: str) -> SluiceError:
    return SluiceError(message, status=400, param=param, code="invalid_value")


def show(value: Any) -> str:
    """A short rendering of a client value for an error message."""
    if isinstance(value, float):
        text = repr(value)
    else:
        try:
            text = orjson.dumps(value).decode()
        except TypeError:  # what orjson does not encode: an integer past 64 bits
            text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def type_name(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def get(obj: dict[str, Any], key: str) -> Any:
    value = obj.get(key, MISSING)
    return MISSING if value is None else value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def get_int(
    obj: dict[str, Any],
    key: str,
    default: Any,
    *,
    lo: int = INT64_MIN,
    hi: int = INT64_MAX,
    param: str | None = None,
) -> Any:
    value = get(obj, key)
    if value is MISSING:
        return default
    param = param or key
    if not is_int(value) or not lo <= value <= hi:
        rng = f">= {lo}" if hi == INT64_MAX else f"in [{lo}, {hi}]"
        if lo == INT64_MIN:
            rng = "a 64-bit integer"
        raise bad(param, f"'{param}' must be an integer {rng}, got {show(value)}")
    return value


def get_float(
    obj: dict[str, Any],
    key: str,
    default: float,
    lo: float,
    hi: float,
    *,
    lo_open: bool = False,
) -> float:
    value = get(obj, key)
    if value is MISSING:
        return default
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (lo < value if lo_open else lo <= value)
        and value <= hi
    )
    if not ok:
        left = "(" if lo_open else "["
        rng = f"> {lo:g}" if hi == math.inf else f"in {left}{lo:g}, {hi:g}]"
        raise bad(key, f"'{key}' must be a number {rng}, got {show(value)}")
    return float(value)


def get_bool(obj: dict[str, Any], key: str, default: bool, param: str | None = None) -> bool:
    value = get(obj, key)
    if value is MISSING:
        return default
    if not isinstance(value, bool):
        param = param or key
        raise bad(param, f"'{param}' must be a boolean, got {type_name(value)}")
    return value


def get_str(obj: dict[str, Any], key: str, param: str | None = None) -> str | None:
    value = get(obj, key)
    if value is MISSING:
        return None
    if not isinstance(value, str):
        param = param or key
        raise bad(param, f"'{param}' must be a string, got {type_name(value)}")
    return value


def get_role(obj: dict[str, Any], roles: Sequence[str], where: str) -> str:
    """`obj["role"]`, one of `roles` (a 400 naming `where.role` and them otherwise;
    an object or array is refused too, not looked up)."""
    role = obj.get("role")
    if not isinstance(role, str) or role not in roles:
        raise bad(
            f"{where}.role",
            f"'{where}.role' must be one of {', '.join(roles)}; got {show(role)}",
        )
    return role


def objects(items: list[Any], param: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each item of the array ``param`` with its path (``param[i]``), refusing a
    non-object when it is reached: an earlier item's own errors come first."""
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"'{where}' must be an object")
        yield where, item


def get_text_parts(
    value: Any,
    param: str,
    kinds: frozenset[str] = frozenset({"text"}),
    *,
    refusals: bool = False,
) -> str:
    """A content field that is a string or an array of text parts, as one text.

    ``kinds``: the part types that carry ``text`` (chat: ``text``; Responses
    also ``input_text`` and ``output_text``); ``refusals``: a ``refusal`` part
    with a string ``refusal`` counts as text too (Responses' assistant
    items). Parts are joined with a newline, as vLLM's "string" content
    format joins them, so chat and Responses render the same tokens.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(param, f"'{param}' must be a string or an array of content parts")
    texts = []
    for where, part in objects(value, param):
        kind = part.get("type")
        if refusals and kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if not isinstance(kind, str) or kind not in kinds:  # a list is no key of `kinds`
            raise unsupported(f"{where}.type", f"content part type {show(kind)} (only text)")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{where}.text", f"'{where}.text' must be a string")
        texts.append(text)
    return "\n".join(texts)


# How deep a request body may nest objects and arrays (the body itself is level
# 1). orjson refuses to encode past 254 levels and the parsers re-encode what
# they accept (tool parameters, a Messages call's input, a Responses body as
# chat), each inside a few levels of wrapping; Python's json (chat templates'
# `tojson`) and xgrammar recurse per level too. Real clients stay far below:
# Claude Code's opening request nests 10 levels, Codex's 9.
MAX_DEPTH: Final = 64
# Path segments an error names before "..." (the field, not 64 levels of it).
_PATH_SEGMENTS = 6


def load_object(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object within MAX_DEPTH; a 400 otherwise.

    Every route's body is parsed here, so the bound holds for all APIs
    before any field reader (or re-encode) sees the object."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson reports invalid UTF-8 and bad JSON alike (and nesting past
        # its own 1,024 levels); its text says which.
        raise SluiceError(
            f"Request body is not valid JSON: {exc}", status=400, code="invalid_json"
        ) from None
    if not isinstance(obj, dict):
        raise SluiceError(
            f"Request body must be a JSON object, got {type_name(obj)}",
            status=400,
            code="invalid_json",
        )
    # A body with fewer brackets than the bound cannot nest past it (brackets
    # inside strings only overcount): most chat turns skip the walk.
    if body.count(b"{") + body.count(b"[") > MAX_DEPTH:
        check_depth(obj)
    return obj


def check_depth(obj: dict[str, Any], limit: int = MAX_DEPTH) -> None:
    """A 400 naming the first field that nests past `limit` levels (`obj` is level 1).

    Recursive, but at most `limit` calls deep: the walk stops where the bound
    is passed. About 30 us for Claude Code's opening request (271 containers),
    as long as parsing it."""
    if _fits(obj, limit - 1):
        return
    path = _too_deep(obj, limit - 1) or []
    shown = "".join(path[:_PATH_SEGMENTS]).lstrip(".")
    param = shown + ("..." if len(path) > _PATH_SEGMENTS else "")
    raise SluiceError(
        f"'{param}' nests objects and arrays deeper than {limit} levels "
        f"(the limit of a request body)",
        status=400,
        param=param,
        code="too_deep",
    )


def _fits(node: dict[str, Any] | list[Any], room: int) -> bool:
    for v in node.values() if type(node) is dict else node:
        if (type(v) is dict or type(v) is list) and (room == 0 or not _fits(v, room - 1)):
            return False
    return True


def _too_deep(node: dict[str, Any] | list[Any], room: int) -> list[str] | None:
    """The path (".key" and "[i]" segments) to the first container past the
    bound, in one walk (only after `_fits` said no); None where it fits."""
    items = node.items() if type(node) is dict else enumerate(node)
    for k, v in items:
        if type(v) is dict or type(v) is list:
            step = f"[{k}]" if type(node) is list else "." + _key(str(k))
            if room == 0:
                return [step]
            if (below := _too_deep(v, room - 1)) is not None:
                return [step, *below]
    return None


def _key(key: str) -> str:
    return key if len(key) <= 24 else key[:21] + "..."


def get_model(obj: dict[str, Any]) -> str:
    model = get_str(obj, "model")
    if not model:
        raise SluiceError(
            "'model' is required and must be a non-empty string",
            status=400,
            param="model",
            code="missing_required_parameter" if model is None else "invalid_value",
        )
    return model


# ---------------------------------------------------------------------------
# Refusals: fields we recognise but cannot honour.


def unsupported(param: str, what: str) -> SluiceError:
    return SluiceError(
        f"{what} is not supported by this server", status=400, param=param, code="unsupported"
    )


def get_prompt_logprobs(obj: dict[str, Any], stream: bool, max_logprobs: int) -> int | None:
    """vLLM's ``prompt_logprobs`` extension (chat and completions): the prompt's
    tokens' logprobs with the top k besides, in the body; as vLLM's server, not
    with a stream (a positive k is refused there, 0 is accepted and unused).
    Bounded by --max-logprobs; vLLM's -1 (the whole vocabulary) is refused."""
    k = get_int(obj, "prompt_logprobs", None, lo=0, hi=max_logprobs)
    if k and stream:
        raise bad("prompt_logprobs", "'prompt_logprobs' is not available when 'stream' is true")
    return None if k is None or stream else int(k)


def refuse_unsupported(obj: dict[str, Any], n: int) -> None:
    if obj.get("audio") is not None:
        raise unsupported("audio", "'audio'")
    if obj.get("logit_bias"):
        raise unsupported("logit_bias", "'logit_bias'")
    if obj.get("suffix"):
        raise unsupported("suffix", "'suffix'")
    modalities = obj.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise unsupported("modalities", "output modalities other than text")
    best_of = obj.get("best_of")
    if (best_of is not None and best_of not in (1, n)) or isinstance(best_of, bool):
        raise unsupported("best_of", "'best_of' other than n")
    if obj.get("continue_final_message") is True:
        raise unsupported("continue_final_message", "'continue_final_message'")
    if obj.get("add_generation_prompt") is False:
        raise unsupported("add_generation_prompt", "'add_generation_prompt: false'")
