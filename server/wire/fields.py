"""Typed readers for the fields of a client's JSON object, and the refusal list.

Each reader names the field and its allowed range in the 400 it raises, so
every refusal reads the same way. JSON null counts as an absent field: OpenAI
clients send explicit nulls for unset options.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Final

import orjson

from server.errors import SluiceError

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
MISSING: Final[Any] = object()

# ---------------------------------------------------------------------------
# Field readers. Each takes the body dict and a key; JSON null counts as absent.


def bad(param: str, message: str) -> SluiceError:
    return SluiceError(message, status=400, param=param, code="invalid_value")


def show(value: Any) -> str:
    """A short rendering of a client value for an error message."""
    text = orjson.dumps(value).decode() if not isinstance(value, float) else repr(value)
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
        if kind not in kinds:
            raise unsupported(f"{where}.type", f"content part type {show(kind)} (only text)")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{where}.text", f"'{where}.text' must be a string")
        texts.append(text)
    return "\n".join(texts)


def load_object(body: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson reports invalid UTF-8 and bad JSON alike; its text says which.
        raise SluiceError(
            f"Request body is not valid JSON: {exc}", status=400, code="invalid_json"
        ) from None
    if not isinstance(obj, dict):
        raise SluiceError(
            f"Request body must be a JSON object, got {type_name(obj)}",
            status=400,
            code="invalid_json",
        )
    return obj


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


def refuse_unsupported(obj: dict[str, Any], n: int) -> None:
    for key in ("prompt_logprobs", "audio"):
        if obj.get(key) is not None:
            raise unsupported(key, f"'{key}'")
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
