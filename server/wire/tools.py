"""Function calling in a chat request: ``tools``, ``tool_choice``, and the tool parts of messages.

Split out of the chat parser (``server/api/openai_chat/parse.py``) to keep each module small. Shapes
follow OpenAI's chat API, with vLLM 0.32's leniency where a drop-in for its server
needs it: a tool call's ``arguments`` may be an object as well as JSON text,
and text that is no JSON object is kept (the chat template gets ``{}``, see
``Message.template_dict``). Everything that would make the answer ambiguous
is a 400 naming the field: an unknown function in ``tool_choice``, two tools
of one name, a tool message without its ``tool_call_id``, a call without a
name. ``check_tool_results`` holds the one rule on a whole conversation that
every chat-shaped API shares: a tool result answers a call made earlier.

Pure code: no aiohttp, no vLLM, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import orjson

from server.wire.fields import (
    MISSING,
    bad,
    get,
    get_bool,
    objects,
    show,
    type_name,
    unsupported,
)
from server.wire.request import Message, Tool, ToolCall, ToolChoice

__all__ = [
    "arguments_object",
    "check_tool_results",
    "function_of",
    "parse_tool_calls",
    "parse_tools",
    "tool_call_id",
]

# How much of a client's id an error repeats: real ids are 20 to 50
# characters (call_..., toolu_..., a UUID), shown whole; a longer one is cut.
_SHOWN_ID: Final = 128


def _schema_text(value: Any, param: str) -> str:
    if not isinstance(value, dict):
        raise bad(param, f"'{param}' must be a JSON schema object, got {type_name(value)}")
    return orjson.dumps(value).decode()


def function_of(obj: dict[str, Any], where: str) -> tuple[dict[str, Any], str]:
    """``where.function``, an object, and its non-empty ``name``: a tool's and a
    tool call's alike."""
    fn = obj.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function", f"'{where}.function' must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.function.name", f"'{where}.function.name' must be a non-empty string")
    return fn, name


def _tool(value: Any, where: str) -> Tool:
    if not isinstance(value, dict):
        raise bad(where, f"'{where}' must be an object")
    kind = value.get("type", "function")
    if kind != "function":
        raise unsupported(f"{where}.type", f"tool type {show(kind)} (only function)")
    fn, name = function_of(value, where)
    description = get(fn, "description")
    if description is not MISSING and not isinstance(description, str):
        param = f"{where}.function.description"
        raise bad(param, f"'{param}' must be a string")
    parameters = get(fn, "parameters")
    strict = get(fn, "strict")
    if strict is not MISSING and not isinstance(strict, bool):
        raise bad(f"{where}.function.strict", f"'{where}.function.strict' must be a boolean")
    return Tool(
        name=name,
        parameters=None
        if parameters is MISSING
        else _schema_text(parameters, f"{where}.function.parameters"),
        description=None if description is MISSING else description,
        strict=None if strict is MISSING else strict,
    )


def _tool_choice(value: Any, names: set[str]) -> ToolChoice:
    if value is MISSING:
        return ToolChoice("auto" if names else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad(
                "tool_choice",
                "'tool_choice' must be none, auto, required or a function object;"
                f" got {show(value)}",
            )
        if value == "required" and not names:
            raise bad("tool_choice", "'tool_choice' required needs a non-empty 'tools'")
        # auto with no tools is none: there is nothing to call (vLLM's reading).
        return ToolChoice(value if names else "none")  # type: ignore[arg-type]
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(value, dict) or value.get("type", "function") != "function" or not name:
        raise bad(
            "tool_choice",
            '\'tool_choice\' as an object must be {"type": "function", "function": {"name": ...}}',
        )
    if name not in names:
        raise bad("tool_choice", f"'tool_choice' names function {show(name)}, not in 'tools'")
    return ToolChoice("function", name)


def parse_tools(obj: dict[str, Any]) -> tuple[tuple[Tool, ...], ToolChoice, bool]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body."""
    if get(obj, "functions") is not MISSING or get(obj, "function_call") is not MISSING:
        raise unsupported("functions", "'functions' and 'function_call' (use 'tools')")
    value = get(obj, "tools")
    tools: list[Tool] = []
    if value is not MISSING:
        if not isinstance(value, list):
            raise bad("tools", f"'tools' must be an array, got {type_name(value)}")
        seen: set[str] = set()
        for i, item in enumerate(value):
            tool = _tool(item, f"tools[{i}]")
            if tool.name in seen:
                raise bad(
                    f"tools[{i}].function.name",
                    f"'tools' names function {show(tool.name)} twice",
                )
            seen.add(tool.name)
            tools.append(tool)
    choice = _tool_choice(get(obj, "tool_choice"), {t.name for t in tools})
    parallel = get_bool(obj, "parallel_tool_calls", True)
    return tuple(tools), choice, parallel


def parse_tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (``where``: the field's path)."""
    if not isinstance(value, list):
        raise bad(where, f"'{where}' must be an array")
    calls = []
    for at, call in objects(value, where):
        if call.get("type", "function") != "function":
            raise unsupported(f"{at}.type", f"tool call type {show(call.get('type'))}")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise bad(f"{at}.id", f"'{at}.id' must be a non-empty string")
        fn, name = function_of(call, at)
        args = get(fn, "arguments")
        if args is MISSING or args == "":
            text = "{}"
        elif isinstance(args, str):
            text = args
        elif isinstance(args, dict):
            text = orjson.dumps(args).decode()
        else:
            raise bad(
                f"{at}.function.arguments",
                f"'{at}.function.arguments' must be JSON text or an object",
            )
        calls.append(ToolCall(call_id, name, text))
    return tuple(calls)


def tool_call_id(msg: dict[str, Any], where: str) -> str:
    """A ``tool`` message's ``tool_call_id``: required, as in OpenAI's API."""
    value = msg.get("tool_call_id")
    if not isinstance(value, str) or not value:
        raise bad(
            f"{where}.tool_call_id",
            f"'{where}.tool_call_id' is required for role tool and must be a non-empty string",
        )
    return value


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as the object Anthropic's ``input`` and
    Ollama's ``arguments`` are: {} when the text is not a JSON object."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def check_tool_results(messages: Sequence[Message], fallback: str = "messages") -> None:
    """Every tool message answers a call made earlier in the conversation: a
    400 naming the first that does not, with its id and the field it came
    from (``Message.param``; ``fallback`` where a message has none, such as a
    stored turn).

    OpenAI's chat and Responses APIs and Anthropic's Messages API refuse such
    a result with a 400 naming the id; all three run this rule once they
    hold the whole conversation (Responses: after a stored
    ``previous_response_id`` is joined). What they accept is accepted:
    several results in one turn, in any order. Theirs is stricter in two
    ways this rule leaves alone: the call must be in the message right
    before the results, and (Anthropic) each call must be answered. A call
    answered twice is accepted too (lenient: neither API documents a refusal
    of it, and the template renders both results). Ollama's API does not run
    it: its tool messages may carry only ``tool_name``, and Ollama's own
    server checks no ids.
    """
    made: set[str] = set()
    for m in messages:
        if m.tool_calls:
            made.update([c.id for c in m.tool_calls])
        elif m.tool_call_id is not None and m.role == "tool" and m.tool_call_id not in made:
            param = m.param or fallback
            shown = m.tool_call_id
            if len(shown) > _SHOWN_ID:
                shown = shown[: _SHOWN_ID - 3] + "..."
            raise bad(
                param,
                f"'{param}' is {orjson.dumps(shown).decode()}, but no tool call earlier"
                " in the conversation has this id",
            )
