"""Anthropic's Messages API, pure: a request body into the internal ChatRequest.

Why this module exists: /v1/messages runs on the one chat pipeline; only the
two translations differ, and they are kept here, free of aiohttp and vLLM,
so they are tested on their own (tests/unit/test_protocol_anthropic.py).

Request (shapes as the `anthropic` client's types and vLLM 0.32's
entrypoints/anthropic/serving.py read them, so a prompt renders to the same
tokens as through vLLM's server). What is accepted and ignored follows
server/wire/ignored.py's rule (listed there, and in docs/apis.md's "What
the APIs accept"):

1. ``system``: a string or text blocks, joined with "" as vLLM does; a block
   that is Claude Code's ``x-anthropic-billing-header`` is dropped, as vLLM
   does (it changes per request and would defeat the prefix cache).
2. ``messages``: user / assistant turns, and ``system`` messages anywhere
   (Claude Code sends its environment as one after the user's turn): each
   stays where it is, a system message for the chat template, which renders
   it in place (Qwen3's template does; for a template that refuses a system
   message after the first, the engine adapter merges them into the first,
   as vLLM does, see server/engines/vllm_adapter.py). Content a string or blocks. Text
   blocks of one turn are joined with "\\n" (vLLM's string content format); a
   user turn's ``tool_result`` blocks become tool messages, in order, before
   the turn's text (a ``tool_use_id`` that no earlier ``tool_use`` block
   carries is a 400 naming it, ``messages[2].content[0].tool_use_id``, as
   Anthropic's API refuses it); an assistant's ``tool_use`` blocks become its
   tool calls and its ``thinking`` blocks its reasoning; ``redacted_thinking`` is
   dropped. A system message's ``tool_addition`` / ``tool_removal`` blocks
   change ``tools`` as vLLM applies them: the tools in effect at the end of
   the conversation are offered. ``image``, ``document`` and any other
   block: a 400 naming it (dropping it would change the answer).
3. ``max_tokens`` is required (except for count_tokens), as in Anthropic's API,
   and is a ceiling: the server's cap and the context's room lower it
   (Claude Code sends 32000 whatever the model) instead of a 400.
4. ``thinking``: ``enabled`` turns Qwen3's thinking on, ``disabled`` off;
   ``adaptive`` (the model decides) and absent keep the server's default;
   ``budget_tokens`` and ``display`` are accepted and ignored (the template
   has a switch, not a budget; thinking goes back whole).
5. ``tool_choice``: auto, any (-> required), tool (-> that function), none;
   ``disable_parallel_tool_use`` -> parallel_tool_calls false. Tools of
   Anthropic's server types (``web_search_20250305``, ``bash_...``) are
   dropped from what the model sees, unless ``tool_choice`` names one: a 400.
6. ``metadata.user_id`` names the caller where OpenAI's ``user`` does.
7. ``mcp_servers`` and ``container`` ask for things Sluice does not run: 400.
8. ``ignore_eos``, vLLM's extension, is honoured as on chat and Responses (the
   benchmark point runs all three APIs to the same length with it; vLLM's own
   /v1/messages drops it).
9. ``output_config.format`` (a JSON schema) constrains the answer, as
   ``response_format`` does on chat; ``output_config.effort`` is ignored.

Bodies and stream events going back: server/api/anthropic_messages/output.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

import orjson

from server.api.openai_chat.parse import _sampling
from server.errors import SluiceError
from server.wire.fields import (
    MISSING,
    bad,
    get,
    get_bool,
    get_int,
    get_model,
    get_str,
    load_object,
    objects,
    show,
    type_name,
    unsupported,
)
from server.wire.ignored import Notes
from server.wire.request import (
    ChatRequest,
    Constraint,
    Limits,
    Message,
    Tool,
    ToolCall,
    ToolChoice,
)
from server.wire.structured import json_schema
from server.wire.tools import check_tool_results

__all__ = ["parse_messages"]

_BILLING: Final = "x-anthropic-billing-header"
# Fields whose meaning Sluice cannot honour (servers it would have to run).
_REFUSED: Final = ("mcp_servers", "container")
# Top-level fields read here; any other is noted as ignored (rule 2).
_HONOURED: Final = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "tools",
        "tool_choice",
        "thinking",
        "temperature",
        "top_p",
        "top_k",
        "ignore_eos",
        "stop_sequences",
        "stream",
        "metadata",
        "output_config",
        *_REFUSED,
    }
)
# Each block type's own keys; any other is noted as ignored.
_BLOCK_KEYS: Final = {
    "text": frozenset({"type", "text"}),
    "tool_use": frozenset({"type", "id", "name", "input"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
}
_TOOL_KEYS: Final = frozenset({"type", "name", "description", "input_schema"})


# ---------------------------------------------------------------------------
# Request.


def _blocks(value: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise bad(param, f"'{param}' must be a string or an array of content blocks")
    return [block for _, block in objects(value, param)]


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"{where}.text", f"'{where}.text' must be a string")
    return text


def _system_text(
    value: Any, param: str, label: str, notes: Notes, changes: list[tuple[str, Any, str]] | None
) -> str:
    """A system prompt's text blocks joined with "" (as vLLM joins them),
    without Claude Code's billing header. A system message's tool changes go
    to ``changes`` (None: the top-level ``system``, which takes none)."""
    parts = []
    for j, block in enumerate(_blocks(value, param)):
        where = f"{param}[{j}]"
        kind = block.get("type")
        if kind in ("tool_addition", "tool_removal") and changes is not None:
            changes.append((kind, block.get("tool"), where))
            continue
        if kind != "text":
            raise unsupported(f"{where}.type", f"system block type {show(kind)}")
        notes.extra_keys(block, _BLOCK_KEYS["text"], f"{label}.")
        text = _text(block, where)
        if not text.startswith(_BILLING):
            parts.append(text)
    return "".join(parts)


def _system(obj: dict[str, Any], notes: Notes) -> tuple[Message, ...]:
    value = get(obj, "system")
    if value is MISSING:
        return ()
    text = _system_text(value, "system", "system[]", notes, None)
    return (Message("system", text),) if text else ()


def _tool_result(block: dict[str, Any], where: str, notes: Notes) -> Message:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}.tool_use_id", f"'{where}.tool_use_id' must be a non-empty string")
    get_bool(block, "is_error", False, param=f"{where}.is_error")
    content = get(block, "content")
    texts: list[str] = []
    if content is not MISSING:
        for k, part in enumerate(_blocks(content, f"{where}.content")):
            at = f"{where}.content[{k}]"
            kind = part.get("type")
            if kind == "tool_reference":
                # A tool search's answer: the tool it names is already shown
                # to the model (defer_loading is ignored), so nothing to add.
                notes.note("tool_result.content[type=tool_reference]")
                continue
            if kind != "text":
                raise unsupported(f"{at}.type", f"tool_result content type {show(kind)}")
            notes.extra_keys(part, _BLOCK_KEYS["text"], "messages[].content[].")
            texts.append(_text(part, at))
    return Message("tool", "\n".join(texts), tool_call_id=call_id, param=f"{where}.tool_use_id")


def _tool_use(block: dict[str, Any], where: str) -> ToolCall:
    call_id = block.get("id")
    name = block.get("name")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}.id", f"'{where}.id' must be a non-empty string")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.name", f"'{where}.name' must be a non-empty string")
    args = get(block, "input")
    if args is MISSING:
        args = {}
    if not isinstance(args, dict):
        raise bad(f"{where}.input", f"'{where}.input' must be an object")
    return ToolCall(call_id, name, orjson.dumps(args).decode())


def _turn(msg: Any, where: str, notes: Notes, changes: list[tuple[str, Any, str]]) -> list[Message]:
    """One Anthropic turn as chat messages (a user turn may yield tool messages;
    a system message's tool changes go to ``changes``)."""
    if not isinstance(msg, dict):
        raise bad(where, f"'{where}' must be an object")
    role = msg.get("role")
    if role not in ("user", "assistant", "system"):
        raise bad(
            f"{where}.role",
            f"'{where}.role' must be user, assistant or system; got {show(role)}",
        )
    if "content" not in msg:
        raise bad(f"{where}.content", f"'{where}.content' is required")
    notes.extra_keys(msg, ("role", "content"), "messages[].")
    if role == "system":
        text = _system_text(
            msg["content"], f"{where}.content", "messages[].content[]", notes, changes
        )
        return [Message("system", text)] if text else []
    out: list[Message] = []
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(_blocks(msg["content"], f"{where}.content")):
        at = f"{where}.content[{j}]"
        kind = block.get("type")
        if isinstance(kind, str) and kind in _BLOCK_KEYS:
            notes.extra_keys(block, _BLOCK_KEYS[kind], "messages[].content[].")
        if kind == "text":
            if text := _text(block, at):
                texts.append(text)
        elif kind == "tool_result" and role == "user":
            out.append(_tool_result(block, at, notes))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "thinking" and role == "assistant":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise bad(f"{at}.thinking", f"'{at}.thinking' must be a string")
            thoughts.append(thinking)
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # opaque to Sluice, as to vLLM: dropped
        elif kind in ("image", "document"):
            raise unsupported(f"{at}.type", f"an {kind} block on this text-only model")
        else:
            raise unsupported(f"{at}.type", f"content block type {show(kind)} in a {role} turn")
    if role == "assistant":
        out.append(
            Message(
                "assistant",
                "\n".join(texts),
                tool_calls=tuple(calls),
                reasoning="".join(thoughts) if thoughts else None,
            )
        )
    elif texts or not out:
        out.append(Message("user", "\n".join(texts)))
    return out


def _messages(
    obj: dict[str, Any], notes: Notes, changes: list[tuple[str, Any, str]]
) -> tuple[Message, ...]:
    value = get(obj, "messages")
    if not isinstance(value, list) or not value:
        raise bad("messages", "'messages' is required and must be a non-empty array")
    out = list(_system(obj, notes))
    for i, msg in enumerate(value):
        out.extend(_turn(msg, f"messages[{i}]", notes, changes))
    check_tool_results(out)
    return tuple(out)


def _tool(item: dict[str, Any], where: str, notes: Notes) -> Tool:
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.name", f"'{where}.name' must be a non-empty string")
    schema = item.get("input_schema")
    if not isinstance(schema, dict):
        raise bad(f"{where}.input_schema", f"'{where}.input_schema' must be a JSON schema object")
    notes.extra_keys(item, _TOOL_KEYS, "tools[].")
    description = get_str(item, "description", param=f"{where}.description")
    return Tool(name, orjson.dumps(schema).decode(), description)


def _server_tool(kind: str) -> str:
    """An Anthropic server tool's type without its version date:
    ``web_search_20250305`` -> ``web_search``."""
    head, _, date = kind.rpartition("_")
    return head if head and date.isdigit() else kind


def _tools(obj: dict[str, Any], notes: Notes) -> tuple[tuple[Tool, ...], set[str]]:
    """The client's tools, and the names of the server tools left out."""
    value = get(obj, "tools")
    if value is MISSING:
        return (), set()
    if not isinstance(value, list):
        raise bad("tools", f"'tools' must be an array, got {type_name(value)}")
    tools: list[Tool] = []
    seen: set[str] = set()
    dropped: set[str] = set()
    for where, item in objects(value, "tools"):
        kind = item.get("type", "custom")
        if kind not in ("custom", None):
            # Anthropic's server tools (web_search_..., bash_..., code_execution_...):
            # run by Anthropic or shaped by its training, not offered here.
            if not isinstance(kind, str):
                raise bad(f"{where}.type", f"'{where}.type' must be a string")
            notes.note(f"tools[type={_server_tool(kind)}]")
            if isinstance(item.get("name"), str):
                dropped.add(item["name"])
            continue
        tool = _tool(item, where, notes)
        if tool.name in seen:
            raise bad(f"{where}.name", f"'tools' names tool {show(tool.name)} twice")
        seen.add(tool.name)
        tools.append(tool)
    return tuple(tools), dropped


def _tool_changes(
    tools: tuple[Tool, ...], changes: list[tuple[str, Any, str]], notes: Notes
) -> tuple[Tool, ...]:
    """``tools`` after the system messages' tool_addition / tool_removal blocks,
    in order, as vLLM applies them (its ``_resolve_tools``): a tool given by
    definition is declared, one given by reference must be in ``tools``, a
    removed one is left out."""
    if not changes:
        return tools
    by_name = {t.name: t for t in tools}
    removed: set[str] = set()
    for kind, change, where in changes:
        if not isinstance(change, dict):
            raise bad(f"{where}.tool", f"'{where}.tool' must be an object")
        if change.get("type") == "tool_reference":
            name = change.get("name") or change.get("tool_name")
            if name not in by_name:
                raise bad(
                    f"{where}.tool.name",
                    f"'{where}.tool' names tool {show(name)}, which is not in 'tools'",
                )
        else:
            definition = change.get("definition", change)
            if not isinstance(definition, dict):
                raise bad(
                    f"{where}.tool.definition", f"'{where}.tool.definition' must be an object"
                )
            tool = _tool(definition, f"{where}.tool.definition", notes)
            name = tool.name
            by_name[name] = tool
        if kind == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return tuple(t for n, t in by_name.items() if n not in removed)


def _tool_choice(
    obj: dict[str, Any], tools: Sequence[Tool], dropped: set[str]
) -> tuple[ToolChoice, bool]:
    value = get(obj, "tool_choice")
    if value is MISSING:
        return ToolChoice("auto" if tools else "none"), True
    if not isinstance(value, dict):
        raise bad("tool_choice", f"'tool_choice' must be an object, got {type_name(value)}")
    parallel = not get_bool(
        value, "disable_parallel_tool_use", False, param="tool_choice.disable_parallel_tool_use"
    )
    kind = value.get("type")
    name = value.get("name")
    if kind == "tool" and isinstance(name, str) and name in dropped:
        raise unsupported("tool_choice.name", f"forcing the server tool {show(name)}")
    if kind == "none" or (kind == "auto" and not tools):
        return ToolChoice("none"), parallel
    if kind == "auto":
        return ToolChoice("auto"), parallel
    if not tools:
        raise bad("tool_choice", f"'tool_choice' {show(kind)} needs a non-empty 'tools'")
    if kind == "any":
        return ToolChoice("required"), parallel
    if kind == "tool":
        if name not in {t.name for t in tools}:
            raise bad("tool_choice.name", f"'tool_choice.name' {show(name)} is not in 'tools'")
        return ToolChoice("function", name), parallel
    raise bad(
        "tool_choice.type", f"'tool_choice.type' must be auto, any, tool or none; got {show(kind)}"
    )


def _thinking(obj: dict[str, Any], default: bool, notes: Notes) -> bool:
    value = get(obj, "thinking")
    if value is MISSING:
        return default
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(value, dict) and value.get("display") is not None:
        notes.note("thinking.display")
    if kind in ("enabled", "adaptive"):
        get_int(value, "budget_tokens", None, lo=0)  # checked, then ignored
        # adaptive: "the model decides" -- here the server's default decides.
        return True if kind == "enabled" else default
    if kind == "disabled":
        return False
    raise bad(
        "thinking.type", f"'thinking.type' must be enabled, adaptive or disabled; got {show(kind)}"
    )


def _stop_sequences(obj: dict[str, Any], limits: Limits) -> tuple[str, ...]:
    value = get(obj, "stop_sequences")
    if value is MISSING:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad("stop_sequences", "'stop_sequences' must be an array of non-empty strings")
    if len(value) > limits.max_stop:
        raise bad(
            "stop_sequences",
            f"'stop_sequences' allows at most {limits.max_stop} sequences, got {len(value)}",
        )
    return tuple(dict.fromkeys(value))


def _max_tokens(obj: dict[str, Any], limits: Limits, required: bool) -> int | None:
    """A ceiling, not a demand: above the server's cap it is the cap (and the
    context's room lowers it further, see `chat_job(fit_context=True)`)."""
    value = get_int(obj, "max_tokens", MISSING, lo=1)
    if value is not MISSING:
        return min(int(value), limits.max_tokens_cap or int(value))
    if required:
        raise SluiceError(
            "'max_tokens' is required",
            param="max_tokens",
            code="missing_required_parameter",
        )
    return limits.default_max_tokens


def _output_config(obj: dict[str, Any], notes: Notes) -> Constraint | None:
    """``output_config.format`` as a JSON schema constraint; ``effort`` ignored."""
    value = get(obj, "output_config")
    if value is MISSING:
        return None
    if not isinstance(value, dict):
        raise bad("output_config", f"'output_config' must be an object, got {type_name(value)}")
    notes.extra_keys(value, ("format",), "output_config.")
    fmt = get(value, "format")
    if fmt is MISSING:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad("output_config.format", "'output_config.format' must be a json_schema format")
    return json_schema(fmt.get("schema"), "output_config.format.schema")


def _user(obj: dict[str, Any]) -> str | None:
    meta = get(obj, "metadata")
    if meta is MISSING:
        return None
    if not isinstance(meta, dict):
        raise bad("metadata", f"'metadata' must be an object, got {type_name(meta)}")
    return get_str(meta, "user_id", param="metadata.user_id")


def parse_messages(body: bytes, limits: Limits, *, count_only: bool = False) -> ChatRequest:
    """A /v1/messages body (``count_only``: /v1/messages/count_tokens) as the
    internal chat request, or a 400 SluiceError naming the field."""
    obj = load_object(body)
    model = get_model(obj)
    limits = limits.for_model(model)  # its own defaults, with several models
    for key in _REFUSED:
        if get(obj, key) is not MISSING:
            raise unsupported(key, f"'{key}'")
    notes = Notes("messages")
    notes.extra_keys(obj, _HONOURED)
    changes: list[tuple[str, Any, str]] = []
    messages = _messages(obj, notes, changes)
    tools, dropped = _tools(obj, notes)
    tools = _tool_changes(tools, changes, notes)
    tool_choice, parallel = _tool_choice(obj, tools, dropped)
    thinking = _thinking(obj, limits.default_enable_thinking, notes)
    constraint = _output_config(obj, notes)
    max_tokens = _max_tokens(obj, limits, required=not count_only)
    # OpenAI's sampling reader on the fields both APIs share (same names and
    # ranges; Anthropic's temperature stops at 1, Sluice accepts vLLM's 2),
    # plus vLLM's ignore_eos (rule 8).
    shared: dict[str, Any] = {
        k: obj[k] for k in ("temperature", "top_p", "top_k", "ignore_eos") if k in obj
    }
    stop = _stop_sequences(obj, limits)
    stream = get_bool(obj, "stream", False)
    # Which stop string ended the answer: a stream reads it from the last
    # output (vLLM's stop_reason); a whole body only sees finish reasons, so
    # the engine keeps the string in the text and `cut_stop` takes it off.
    sampling = dataclasses.replace(
        _sampling(shared, limits, max_tokens, None),
        stop=stop,
        include_stop_str_in_output=bool(stop) and not stream,
        constraint=constraint,
    )
    return ChatRequest(
        model=model,
        messages=messages,
        sampling=sampling,
        stream=stream,
        user=_user(obj),
        enable_thinking=thinking,
        chat_template_kwargs=(("enable_thinking", thinking),),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        ignored=notes.done(),
    )
