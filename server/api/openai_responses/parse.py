"""OpenAI's Responses API (/v1/responses), pure: its body to the chat request it means.

Why this module exists: Responses is the chat API in other clothes, so a
body is translated into the chat body it means and parsed by
``parse_chat`` (one validation, one ``ChatRequest``, the same token ids as
/v1/chat/completions); what comes out of the engine is read as chat
choices and deltas and written back as Responses items and semantic events
(``server/api/openai_responses/output.py``).

Request: ``input`` (a string or items: messages with text parts,
``function_call`` (with its ``namespace``), ``function_call_output``,
``custom_tool_call``, ``custom_tool_call_output``, ``reasoning``),
``instructions`` (a system message first, not carried over by
``previous_response_id``, as in OpenAI's API), ``max_output_tokens``,
``temperature``, ``top_p``, ``tools`` (below), ``tool_choice``,
``parallel_tool_calls``, ``text.format``, ``reasoning.effort`` (the
thinking switch), ``stream``, ``user``, ``metadata``, ``store``,
``previous_response_id``. A ``function_call_output`` (or
``custom_tool_call_output``) whose ``call_id`` no earlier call of the input,
or of the stored conversation ``previous_response_id`` continues, carries
is a 400 naming it (``input[2].call_id``). Refused with a 400 naming the field, because
honouring them is impossible here and dropping them changes the answer:
``background: true``, ``conversation``, ``prompt`` (stored prompt
templates), ``top_logprobs``, a ``tool_choice`` that forces a tool this
server does not offer, non-text input parts, ``item_reference`` items.
Accepted and ignored under server/wire/ignored.py's rule (listed there
with why; docs/apis.md's "What the APIs accept" lists them): ``include``,
``prompt_cache_key``, ``text.verbosity``, ``reasoning.summary``, Codex's
``client_metadata``, the content of input ``reasoning`` items, and others.

Tools: ``function`` tools as chat's; a ``namespace`` tool's functions (Codex's
multi-agent tools) are offered to the model as ``NAMESPACE__NAME`` with the
namespace's description opening each one's (how Codex itself flattens them
for providers without namespaces), and a call comes back as a
``function_call`` item with the function's own ``name`` and its
``namespace``, which Codex reads. A ``custom`` tool (free-form input, such as
an ``apply_patch`` tool) is offered as a function of one string argument,
``input``, and its call comes back as a ``custom_tool_call`` item with that
string as ``input``; its grammar (``format``) is not enforced. Tools the
server cannot run or offer (``web_search``, ``file_search``,
``code_interpreter``, ``image_generation``, ``mcp``, ...) are dropped from
what the model sees.

Pure code: no aiohttp, no vLLM, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from server.api.openai_chat.parse import parse_chat
from server.wire.fields import (
    MISSING,
    bad,
    get,
    get_bool,
    get_int,
    get_model,
    get_role,
    get_str,
    get_text_parts,
    load_object,
    objects,
    show,
    type_name,
    unsupported,
)
from server.wire.ignored import Notes
from server.wire.request import ChatRequest, Limits, Message
from server.wire.tools import check_tool_results

__all__ = ["ClientTool", "ResponsesRequest", "custom_input", "flat_name", "parse_responses"]

# reasoning.effort values: "none" and "minimal" turn Qwen3's thinking off.
_EFFORT_OFF: Final = frozenset({"none", "minimal"})
_EFFORT_ON: Final = frozenset({"low", "medium", "high", "xhigh"})
_ROLES: Final = ("user", "system", "developer", "assistant")
_TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text"})
# Request fields echoed in the response object as given (OpenAI echoes them;
# the openai client's parse() and the Agents SDK read some back).
_ECHOED: Final = (
    "instructions",
    "max_output_tokens",
    "metadata",
    "parallel_tool_calls",
    "previous_response_id",
    "prompt_cache_key",
    "reasoning",
    "safety_identifier",
    "temperature",
    "tool_choice",
    "tools",
    "top_p",
    "truncation",
    "user",
)
_METADATA_KEYS: Final = 16  # OpenAI's documented bound on metadata pairs
# Top-level fields read here; any other is noted as ignored (rule 2).
_HONOURED: Final = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "reasoning",
        "stream",
        "user",
        "service_tier",
        "metadata",
        "store",
        "previous_response_id",
        "background",
        "conversation",
        "prompt",
        "top_logprobs",
    }
)
# Tool types this server offers to the model; the rest are dropped (rule 2),
# unless tool_choice forces one (a 400).
_CLIENT_TOOLS: Final = frozenset({"function", "namespace", "custom"})
# A flattened namespace function's name: NAMESPACE + _SEP + NAME.
_SEP: Final = "__"


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for a function (of a namespace, or not)."""
    return f"{namespace}{_SEP}{name}" if namespace else name


@dataclass(frozen=True, slots=True)
class ClientTool:
    """A client tool the model sees under another shape: how its calls go back.

    ``flat`` is the function name the model calls; ``name`` and ``namespace``
    are the client's (a namespace's function), ``custom`` marks a free-form
    tool whose call carries ``input`` text rather than JSON arguments.
    """

    flat: str
    name: str
    namespace: str | None = None
    custom: bool = False

    def call_item(self, call_id: str, arguments: str) -> dict[str, Any]:
        """The output item of a call, as the client reads it (no id or status)."""
        if self.custom:
            return {
                "type": "custom_tool_call",
                "call_id": call_id,
                "name": self.name,
                "input": custom_input(arguments),
            }
        return {
            "type": "function_call",
            "call_id": call_id,
            "name": self.name,
            "namespace": self.namespace,
            "arguments": arguments,
        }


def custom_input(arguments: str) -> str:
    """A custom tool call's input: the ``input`` string of the arguments the
    model wrote, or the text itself when it wrote no such object."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return str(value["input"])
    return arguments


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated /v1/responses request.

    ``chat`` is the chat request of this turn alone (instructions, then the
    input); ``with_history`` puts a stored conversation between the two.
    ``turn`` is this turn's input messages, kept with the output when the
    response is stored. ``echo`` holds the request fields the response object
    repeats, as given (JSON values, read only).
    """

    chat: ChatRequest
    turn: tuple[Message, ...]
    previous_response_id: str | None = None
    store: bool = True
    echo: tuple[tuple[str, Any], ...] = ()
    client_tools: tuple[ClientTool, ...] = ()

    def client_tool(self, flat: str) -> ClientTool | None:
        """The namespace or custom tool the model's call of ``flat`` names."""
        return next((t for t in self.client_tools if t.flat == flat), None)

    def with_history(self, history: Sequence[Message]) -> ChatRequest:
        """The chat request that continues ``history`` (a stored conversation),
        or a 400 where a tool result of the turn answers no call of the two
        (``check_tool_results``: a stored turn's own results were checked when
        it ran, so an error names this turn's ``input[i].call_id``)."""
        system = self.chat.messages[: len(self.chat.messages) - len(self.turn)]
        messages = (*system, *history, *self.turn)
        check_tool_results(messages, fallback="previous_response_id")
        return dataclasses.replace(self.chat, messages=messages) if history else self.chat


# ---------------------------------------------------------------------------
# Request: a Responses body to the chat body it means.


def _text_of(value: Any, param: str) -> str:
    """A text, or Responses' text parts (and refusals) joined as chat joins them."""
    return get_text_parts(value, param, _TEXT_PARTS, refusals=True)


def _required_str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad(f"{where}.{key}", f"'{where}.{key}' must be a non-empty string")
    return value


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` or ``custom_tool_call`` item as the chat tool call
    the model made (under the name it saw, with the arguments it wrote)."""
    name = _required_str(item, "name", where)
    if item.get("type") == "custom_tool_call":
        text = get_str(item, "input", param=f"{where}.input") or ""
        args = orjson.dumps({"input": text}).decode()
    else:
        args = get(item, "arguments")
        if args is MISSING:
            args = "{}"
        if not isinstance(args, str):
            raise bad(f"{where}.arguments", f"'{where}.arguments' must be JSON text")
        name = flat_name(get_str(item, "namespace", param=f"{where}.namespace"), name)
    return {
        "id": _required_str(item, "call_id", where),
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def _input(value: Any, notes: Notes) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """``input`` as chat messages (dicts in the chat API's shape), and the
    field each tool result's ``call_id`` came from, by its message's index."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], {}
    if not isinstance(value, list) or not value:
        raise bad("input", "'input' is required: a string or a non-empty array of input items")
    out: list[dict[str, Any]] = []
    results: dict[int, str] = {}
    for where, item in objects(value, "input"):
        kind = item.get("type", "message")
        if kind == "message":
            role = get_role(item, _ROLES, where)
            out.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind in ("function_call", "custom_tool_call"):
            call = _call(item, where)
            last = out[-1] if out else None
            # Calls right after an assistant message (or each other) are that
            # turn's calls: one assistant message, as the model produced them.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            results[len(out)] = f"{where}.call_id"
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _required_str(item, "call_id", where),
                    "content": _text_of(output, f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            notes.note("input[type=reasoning]")  # a past turn's thinking is not rendered
        else:
            raise unsupported(f"{where}.type", f"input item type {show(kind)}")
    if not out:
        raise bad("input", "'input' holds no message, function_call or function_call_output")
    return out, results


def _function(
    tool: dict[str, Any], where: str, notes: Notes, namespace: dict[str, Any] | None = None
) -> tuple[dict[str, Any], ClientTool | None]:
    """A function or custom tool (of a namespace, or not) as the chat tool the
    model sees, and how its calls go back when that is not as they came."""
    name = _required_str(tool, "name", where)
    if get(tool, "defer_loading") is not MISSING:
        notes.note("tools[].defer_loading")
    fn: dict[str, Any] = {"name": name}
    for key in ("description", "parameters", "strict"):
        if get(tool, key) is not MISSING:
            fn[key] = tool[key]
    back = None
    if tool.get("type") == "custom":
        if get(tool, "format") is not MISSING:
            notes.note("tools[].format")
        fn.pop("strict", None)
        fn["parameters"] = {
            "type": "object",
            "properties": {"input": {"type": "string", "description": "The tool's input."}},
            "required": ["input"],
        }
        back = ClientTool(name, name, custom=True)
    if namespace is not None:
        ns = namespace["name"]
        fn["name"] = flat_name(ns, name)
        described = [d for d in (namespace.get("description"), fn.get("description")) if d]
        if described:
            fn["description"] = "\n\n".join(described)
        back = ClientTool(fn["name"], name, ns, custom=back is not None)
    return {"type": "function", "function": fn}, back


def _tools(value: Any, notes: Notes) -> tuple[list[dict[str, Any]], list[ClientTool], set[str]]:
    """The tools as chat tools, the namespace and custom ones' way back, and
    the types of the tools left out (rule 2)."""
    if not isinstance(value, list):
        raise bad("tools", f"'tools' must be an array, got {type_name(value)}")
    out: list[dict[str, Any]] = []
    back: list[ClientTool] = []
    dropped: set[str] = set()
    for where, tool in objects(value, "tools"):
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise bad(f"{where}.type", f"'{where}.type' must be a string")
        if kind not in _CLIENT_TOOLS:
            notes.note(f"tools[type={kind}]")
            dropped.add(kind)
            continue
        if kind == "namespace":
            _required_str(tool, "name", where)
            inner = get(tool, "tools")
            if not isinstance(inner, list):
                raise bad(f"{where}.tools", f"'{where}.tools' must be an array")
            members = [(at, t) for at, t in objects(inner, f"{where}.tools")]
        else:
            members = [(where, tool)]
        for at, member in members:
            if kind == "namespace" and member.get("type") not in ("function", "custom"):
                raise bad(f"{at}.type", f"'{at}.type' must be function or custom")
            chat_tool, way_back = _function(
                member, at, notes, tool if kind == "namespace" else None
            )
            out.append(chat_tool)
            if way_back is not None:
                back.append(way_back)
    return out, back, dropped


def _tool_choice(value: Any, dropped: set[str]) -> Any:
    if isinstance(value, str):
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(value, dict) and kind in ("function", "custom"):
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise bad("tool_choice.name", "'tool_choice.name' must be a non-empty string")
        name = flat_name(get_str(value, "namespace", param="tool_choice.namespace"), name)
        return {"type": "function", "function": {"name": name}}
    if isinstance(value, dict) and kind in dropped:
        raise unsupported("tool_choice.type", f"forcing the {show(kind)} tool")
    if isinstance(value, dict):
        raise unsupported("tool_choice.type", f"tool_choice type {show(kind)}")
    raise bad("tool_choice", "'tool_choice' must be none, auto, required or a function object")


def _text_format(value: Any, notes: Notes) -> dict[str, Any] | None:
    """``text.format`` as the chat API's ``response_format``."""
    if not isinstance(value, dict):
        raise bad("text", f"'text' must be an object, got {type_name(value)}")
    notes.extra_keys(value, ("format",), "text.")
    fmt = get(value, "format")
    if fmt is MISSING:
        return None
    if not isinstance(fmt, dict):
        raise bad("text.format", f"'text.format' must be an object, got {type_name(fmt)}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = get(fmt, "schema")
        if not isinstance(schema, dict):
            raise bad("text.format.schema", "'text.format.schema' must be a JSON schema object")
        spec: dict[str, Any] = {"name": get_str(fmt, "name", "text.format.name"), "schema": schema}
        if get(fmt, "strict") is not MISSING:
            spec["strict"] = get_bool(fmt, "strict", True, param="text.format.strict")
        return {"type": "json_schema", "json_schema": spec}
    raise bad(
        "text.format.type",
        f"'text.format.type' must be text, json_object or json_schema; got {show(kind)}",
    )


def _thinking(value: Any, notes: Notes) -> bool | None:
    """``reasoning.effort``: None keeps the server's default."""
    if not isinstance(value, dict):
        raise bad("reasoning", f"'reasoning' must be an object, got {type_name(value)}")
    notes.extra_keys(value, ("effort",), "reasoning.")
    effort = get(value, "effort")
    if effort is MISSING:
        return None
    # (an array or an object is no key of the sets: the type first)
    if isinstance(effort, str) and effort in _EFFORT_OFF:
        return False
    if isinstance(effort, str) and effort in _EFFORT_ON:
        return True
    raise bad(
        "reasoning.effort",
        f"'reasoning.effort' must be none, minimal, low, medium, high or xhigh; got {show(effort)}",
    )


def _metadata(obj: dict[str, Any]) -> None:
    value = get(obj, "metadata")
    if value is MISSING:
        return
    ok = (
        isinstance(value, dict)
        and len(value) <= _METADATA_KEYS
        and all(isinstance(v, str) for v in value.values())
    )
    if not ok:
        raise bad(
            "metadata",
            f"'metadata' must be an object of at most {_METADATA_KEYS} string values",
        )


def _refuse(obj: dict[str, Any]) -> None:
    """Fields whose meaning Sluice cannot honour: a 400 naming the field."""
    if get_bool(obj, "background", False):
        raise unsupported("background", "'background: true' (responses run in the request)")
    if get(obj, "conversation") is not MISSING:
        raise unsupported("conversation", "'conversation' (use previous_response_id)")
    if get(obj, "prompt") is not MISSING:
        raise unsupported("prompt", "'prompt' (stored prompt templates)")
    if get_int(obj, "top_logprobs", 0, lo=0, hi=20):
        raise unsupported("top_logprobs", "'top_logprobs'")


def parse_responses(body: bytes, limits: Limits) -> ResponsesRequest:
    """Parse a /v1/responses body, or raise SluiceError(400)."""
    obj = load_object(body)
    model = get_model(obj)
    limits = limits.for_model(model)  # its own defaults, with several models
    _refuse(obj)
    notes = Notes("responses")
    notes.extra_keys(obj, _HONOURED)
    turn, results = _input(get(obj, "input"), notes)
    messages = list(turn)
    instructions = get_str(obj, "instructions")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {"model": model, "messages": messages}
    max_output = get_int(obj, "max_output_tokens", MISSING, lo=1)
    if max_output is not MISSING:
        if limits.max_tokens_cap is not None and max_output > limits.max_tokens_cap:
            raise bad(
                "max_output_tokens",
                f"'max_output_tokens' must be an integer in [1, {limits.max_tokens_cap}],"
                f" got {max_output}",
            )
        chat["max_completion_tokens"] = max_output
    for key in ("temperature", "top_p", "parallel_tool_calls", "stream", "user", "service_tier"):
        if get(obj, key) is not MISSING:
            chat[key] = obj[key]
    back: list[ClientTool] = []
    dropped: set[str] = set()
    if get(obj, "tools") is not MISSING:
        chat["tools"], back, dropped = _tools(obj["tools"], notes)
    if get(obj, "tool_choice") is not MISSING:
        chat["tool_choice"] = _tool_choice(obj["tool_choice"], dropped)
    if get(obj, "text") is not MISSING and (fmt := _text_format(obj["text"], notes)) is not None:
        chat["response_format"] = fmt
    reasoning = get(obj, "reasoning")
    if reasoning is not MISSING and (think := _thinking(reasoning, notes)) is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": think}
    _metadata(obj)
    # The turn alone: a previous response's calls join it in with_history.
    req = parse_chat(orjson.dumps(chat), limits, whole=False)
    head = len(req.messages) - len(turn)
    # Each tool result names its field in Responses' terms: input[i].call_id.
    named = tuple(
        dataclasses.replace(m, param=results[i]) if i in results else m
        for i, m in enumerate(req.messages[head:])
    )
    req = dataclasses.replace(req, messages=(*req.messages[:head], *named), ignored=notes.done())
    previous = get_str(obj, "previous_response_id")
    if previous is None:
        check_tool_results(req.messages)
    echo = tuple((k, obj[k]) for k in _ECHOED if obj.get(k) is not None)
    if get(obj, "text") is not MISSING:
        echo += (("text", obj["text"]),)
    return ResponsesRequest(
        chat=req,
        turn=named,
        previous_response_id=previous,
        store=get_bool(obj, "store", True),
        echo=echo,
        client_tools=tuple(back),
    )
