"""Structured output in a request: ``response_format``, and vLLM's own constraint fields.

One ``Constraint`` (or none) per request, from any of: OpenAI's
``response_format`` (``text``, ``json_object``, ``json_schema``); vLLM's
``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``); and the older top-level ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``. Two at once are a 400, since vLLM
could honour only one. The shapes are checked here; whether the engine's
backend can compile a schema, regex or grammar is checked against the engine
(``server/vllm_parsers.structured_outputs``) before the request is queued.

``json_schema.strict`` is accepted and does not change anything: the
schema is always enforced by the engine (as in vLLM).

Pure code: no aiohttp, no vLLM, no I/O.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from server.wire.fields import MISSING, bad, get, show, type_name, unsupported
from server.wire.request import Constraint

__all__ = ["json_schema", "parse_constraint"]

_GUIDED: Final = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# structured_outputs fields that change the answer and that Sluice does not pass on.
_REFUSED: Final = ("structural_tag", "whitespace_pattern")


def _schema(value: Any, param: str) -> str:
    """A JSON schema given as an object, or as JSON text of one (vLLM takes both)."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            raise bad(param, f"'{param}' is not valid JSON") from None
    if not isinstance(value, dict):
        raise bad(param, f"'{param}' must be a JSON schema object, got {type_name(value)}")
    return orjson.dumps(value).decode()


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise bad(param, f"'{param}' must be a non-empty string")
    if "\x00" in value:
        raise bad(param, f"'{param}' must not contain a NUL character")
    return value


def _of_kind(kind: str, value: Any, param: str) -> Constraint:
    if kind == "json":
        return Constraint("json", _schema(value, param), param=param)
    if kind == "json_object":
        if value is not True:
            raise bad(param, f"'{param}' must be true when given")
        return Constraint("json_object", param=param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad(param, f"'{param}' must be a non-empty array of strings")
        return Constraint("choice", choices=tuple(value), param=param)
    return Constraint(kind, _text(value, param), param=param)  # type: ignore[arg-type]


def json_schema(value: Any, param: str) -> Constraint:
    """A JSON schema constraint from another API's field (Anthropic's
    ``output_config.format.schema``), checked as ``response_format``'s is."""
    return _of_kind("json", value, param)


def _response_format(value: Any) -> Constraint | None:
    if not isinstance(value, dict):
        raise bad("response_format", f"'response_format' must be an object, got {type_name(value)}")
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint("json_object", param="response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad(
                "response_format.json_schema",
                "'response_format.json_schema' must be an object with 'name' and 'schema'",
            )
        name = get(spec, "name")
        if name is not MISSING and not isinstance(name, str):
            raise bad(
                "response_format.json_schema.name",
                "'response_format.json_schema.name' must be a string",
            )
        strict = get(spec, "strict")
        if strict is not MISSING and not isinstance(strict, bool):
            raise bad(
                "response_format.json_schema.strict",
                "'response_format.json_schema.strict' must be a boolean",
            )
        schema = get(spec, "schema")
        if schema is MISSING:
            raise bad(
                "response_format.json_schema.schema",
                "'response_format.json_schema.schema' is required",
            )
        param = "response_format.json_schema.schema"
        return Constraint("json", _schema(schema, param), param=param)
    if kind == "structural_tag":
        raise unsupported("response_format.type", "'response_format' of type structural_tag")
    raise bad(
        "response_format.type",
        f"'response_format.type' must be text, json_object or json_schema; got {show(kind)}",
    )


def _structured_outputs(value: Any) -> Constraint | None:
    if not isinstance(value, dict):
        raise bad(
            "structured_outputs", f"'structured_outputs' must be an object, got {type_name(value)}"
        )
    for key in _REFUSED:
        if get(value, key) is not MISSING:
            raise unsupported(f"structured_outputs.{key}", f"'structured_outputs.{key}'")
    found = [
        (kind, get(value, kind))
        for kind in ("json", "regex", "choice", "grammar", "json_object")
        if get(value, kind) is not MISSING
    ]
    if len(found) > 1:
        raise bad(
            f"structured_outputs.{found[1][0]}",
            "'structured_outputs' takes one of json, regex, choice, grammar, json_object;"
            f" got {', '.join(k for k, _ in found)}",
        )
    if not found:
        return None
    kind, raw = found[0]
    return _of_kind(kind, raw, f"structured_outputs.{kind}")


def parse_constraint(obj: dict[str, Any]) -> Constraint | None:
    """The request's structured-output constraint, or None (plain text)."""
    found: list[Constraint] = []
    value = get(obj, "response_format")
    if value is not MISSING and (c := _response_format(value)) is not None:
        found.append(c)
    value = get(obj, "structured_outputs")
    if value is not MISSING and (c := _structured_outputs(value)) is not None:
        found.append(c)
    for key, kind in _GUIDED.items():
        value = get(obj, key)
        if value is not MISSING:
            found.append(_of_kind(kind, value, key))
    if len(found) > 1:
        first, second = found[0].param.split(".")[0], found[1].param.split(".")[0]
        raise bad(second, f"'{second}' and '{first}' both constrain the output; give one")
    return found[0] if found else None
