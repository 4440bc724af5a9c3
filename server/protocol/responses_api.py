"""OpenAI's Responses API (/v1/responses), pure: its body to a chat request, its output back.

Why this module exists: Responses is the chat API in other clothes, so a
body is translated into the chat body it means and parsed by
``parse_chat`` (one validation, one ``ChatRequest``, the same token ids as
/v1/chat/completions); what comes out of the engine is read as chat
choices and deltas and written back as Responses items and semantic events.

Request: ``input`` (a string or items: messages with text parts,
``function_call``, ``function_call_output``, ``reasoning``),
``instructions`` (a system message first, not carried over by
``previous_response_id``, as in OpenAI's API), ``max_output_tokens``,
``temperature``, ``top_p``, function ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``text.format``, ``reasoning.effort`` (the
thinking switch), ``stream``, ``user``, ``metadata``, ``store``,
``previous_response_id``. Refused with a 400 naming the field, because
honouring them is impossible here and dropping them changes the answer:
``background: true``, ``conversation``, ``prompt`` (stored prompt
templates), ``top_logprobs``, built-in tools, non-text input parts,
``item_reference`` items. Accepted and ignored (they do not change the
tokens): ``include``, ``prompt_cache_key``, ``prompt_cache_retention``,
``safety_identifier``, ``service_tier``, ``truncation``, ``max_tool_calls``,
``stream_options``, ``text.verbosity``, ``reasoning.summary``, and the
content of input ``reasoning`` items (a past turn's thinking is not
rendered: ``Message`` has no reasoning field, so chat cannot carry it
either, and Qwen3's template drops it before the last user turn anyway).

Pure code: no aiohttp, no vLLM, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from server.errors import SluiceError
from server.protocol.fields import (
    MISSING,
    bad,
    get,
    get_bool,
    get_int,
    get_model,
    get_str,
    load_object,
    show,
    type_name,
    unsupported,
)
from server.protocol.requests import parse_chat
from server.protocol.responses import ChatChoice, ParsedDelta, ToolCallDelta, Usage
from server.protocol.types import ChatRequest, Limits, Message, ToolCall

__all__ = [
    "ResponsesRequest",
    "ResponsesStream",
    "Status",
    "conversation_after",
    "output_items",
    "parse_responses",
    "response_object",
    "status_of",
]

Status = Literal["completed", "incomplete"]

# reasoning.effort values: "none" and "minimal" turn Qwen3's thinking off.
_EFFORT_OFF: Final = frozenset({"none", "minimal"})
_EFFORT_ON: Final = frozenset({"low", "medium", "high", "xhigh"})
_ROLES: Final = frozenset({"user", "system", "developer", "assistant"})
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

    def with_history(self, history: Sequence[Message]) -> ChatRequest:
        """The chat request that continues ``history`` (a stored conversation)."""
        if not history:
            return self.chat
        system = self.chat.messages[: len(self.chat.messages) - len(self.turn)]
        return dataclasses.replace(self.chat, messages=(*system, *history, *self.turn))


# ---------------------------------------------------------------------------
# Request: a Responses body to the chat body it means.


def _text_of(value: Any, param: str) -> str:
    """A text, or a list of text parts joined by newlines (as chat joins them)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(param, f"'{param}' must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(value):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise bad(where, f"'{where}' must be an object")
        kind = part.get("type")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in _TEXT_PARTS:
            raise unsupported(f"{where}.type", f"content part type {show(kind)} (only text)")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{where}.text", f"'{where}.text' must be a string")
        texts.append(text)
    return "\n".join(texts)


def _required_str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad(f"{where}.{key}", f"'{where}.{key}' must be a non-empty string")
    return value


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    args = get(item, "arguments")
    if args is MISSING:
        args = "{}"
    if not isinstance(args, str):
        raise bad(f"{where}.arguments", f"'{where}.arguments' must be JSON text")
    return {
        "id": _required_str(item, "call_id", where),
        "type": "function",
        "function": {"name": _required_str(item, "name", where), "arguments": args},
    }


def _input(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages (dicts in the chat API's shape)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", "'input' is required: a string or a non-empty array of input items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"'{where}' must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad(
                    f"{where}.role",
                    f"'{where}.role' must be one of user, system, developer, assistant;"
                    f" got {show(role)}",
                )
            out.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = _call(item, where)
            last = out[-1] if out else None
            # Calls right after an assistant message (or each other) are that
            # turn's calls: one assistant message, as the model produced them.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _required_str(item, "call_id", where),
                    "content": _text_of(output, f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            continue  # accepted; a past turn's thinking is not rendered (see the docstring)
        else:
            raise unsupported(f"{where}.type", f"input item type {show(kind)}")
    if not out:
        raise bad("input", "'input' holds no message, function_call or function_call_output")
    return out


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad("tools", f"'tools' must be an array, got {type_name(value)}")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(where, f"'{where}' must be an object")
        kind = tool.get("type")
        if kind != "function":
            raise unsupported(f"{where}.type", f"tool type {show(kind)} (only function tools)")
        fn: dict[str, Any] = {"name": _required_str(tool, "name", where)}
        for key in ("description", "parameters", "strict"):
            if get(tool, key) is not MISSING:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise bad("tool_choice.name", "'tool_choice.name' must be a non-empty string")
        return {"type": "function", "function": {"name": name}}
    if isinstance(value, dict):
        raise unsupported("tool_choice.type", f"tool_choice type {show(value.get('type'))}")
    raise bad("tool_choice", "'tool_choice' must be none, auto, required or a function object")


def _text_format(value: Any) -> dict[str, Any] | None:
    """``text.format`` as the chat API's ``response_format``."""
    if not isinstance(value, dict):
        raise bad("text", f"'text' must be an object, got {type_name(value)}")
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


def _thinking(value: Any) -> bool | None:
    """``reasoning.effort``: None keeps the server's default."""
    if not isinstance(value, dict):
        raise bad("reasoning", f"'reasoning' must be an object, got {type_name(value)}")
    effort = get(value, "effort")
    if effort is MISSING:
        return None
    if effort in _EFFORT_OFF:
        return False
    if effort in _EFFORT_ON:
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
    _refuse(obj)
    turn = _input(get(obj, "input"))
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
    for key in ("temperature", "top_p", "parallel_tool_calls", "stream", "user"):
        if get(obj, key) is not MISSING:
            chat[key] = obj[key]
    if get(obj, "tools") is not MISSING:
        chat["tools"] = _tools(obj["tools"])
    if get(obj, "tool_choice") is not MISSING:
        chat["tool_choice"] = _tool_choice(obj["tool_choice"])
    if get(obj, "text") is not MISSING and (fmt := _text_format(obj["text"])) is not None:
        chat["response_format"] = fmt
    if get(obj, "reasoning") is not MISSING and (think := _thinking(obj["reasoning"])) is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": think}
    _metadata(obj)
    req = parse_chat(orjson.dumps(chat), limits)
    echo = tuple((k, obj[k]) for k in _ECHOED if obj.get(k) is not None)
    if get(obj, "text") is not MISSING:
        echo += (("text", obj["text"]),)
    return ResponsesRequest(
        chat=req,
        turn=req.messages[len(req.messages) - len(turn) :],
        previous_response_id=get_str(obj, "previous_response_id"),
        store=get_bool(obj, "store", True),
        echo=echo,
    )


# ---------------------------------------------------------------------------
# Output: items, the response object, and what a stored response continues.


def status_of(finish_reason: str | None) -> Status:
    return "incomplete" if finish_reason == "length" else "completed"


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": None,
        "status": status,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [_text_part(text)],
    }


def _call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def _item_id(response_id: str, prefix: str, index: int) -> str:
    """Output item ids derived from the response's (unique with it, and pure)."""
    return f"{prefix}_{response_id.removeprefix('resp_')}_{index}"


def output_items(response_id: str, choice: ChatChoice) -> list[dict[str, Any]]:
    """A finished choice as output items: reasoning, the message, then the calls.

    The message is there when the model wrote text, or when nothing else came
    out (so ``output_text`` reads "" rather than failing)."""
    items: list[dict[str, Any]] = []
    if choice.reasoning:
        items.append(_reasoning_item(_item_id(response_id, "rs", 0), choice.reasoning, "completed"))
    if choice.content or not (choice.reasoning or choice.tool_calls):
        items.append(
            _message_item(
                _item_id(response_id, "msg", len(items)), choice.content or "", "completed"
            )
        )
    for call in choice.tool_calls:
        items.append(_call_item(_item_id(response_id, "fc", len(items)), call, "completed"))
    return items


def _usage(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_object(
    req: ResponsesRequest,
    response_id: str,
    created: int,
    status: str,
    output: Sequence[dict[str, Any]],
    usage: Usage | None = None,
    reasoning_tokens: int = 0,
) -> dict[str, Any]:
    """The ``response`` object: its state, its output, and the echoed request."""
    chat = req.chat
    obj: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,
        "max_output_tokens": None,
        "metadata": {},
        "model": chat.model,
        "output": list(output),
        "parallel_tool_calls": chat.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": None,
        "store": req.store,
        "temperature": chat.sampling.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto" if chat.tools else "none",
        "tools": [],
        "top_p": chat.sampling.top_p,
        "truncation": "disabled",
        "usage": None if usage is None else _usage(usage, reasoning_tokens),
        "user": None,
    }
    obj.update(req.echo)
    return obj


def conversation_after(
    history: Sequence[Message], turn: Sequence[Message], output: Sequence[dict[str, Any]]
) -> tuple[Message, ...]:
    """What a later ``previous_response_id`` continues: the history, this turn's
    input, and the output as one assistant message (text and calls)."""
    text = "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    calls = tuple(
        ToolCall(item["call_id"], item["name"], item["arguments"])
        for item in output
        if item["type"] == "function_call"
    )
    return (*history, *turn, Message(role="assistant", content=text, tool_calls=calls))


# ---------------------------------------------------------------------------
# Stream: semantic events, in the order the openai client's stream helper
# assembles (created, in_progress, per item: added, part added, deltas, done
# events; then completed or incomplete).


def _frame(kind: str, payload: dict[str, Any]) -> bytes:
    """One SSE frame: OpenAI names the event on its own line as well as in ``type``."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class ResponsesStream:
    """The event frames of one streamed response; ``output`` holds its finished items.

    Feed it each ``ParsedDelta`` of the one choice; an item opens when its kind
    of text first appears and closes when another kind starts or at the end.
    """

    __slots__ = ("_created", "_id", "_open", "_parts", "_req", "_seq", "output")

    def __init__(self, req: ResponsesRequest, response_id: str, created: int) -> None:
        self._req = req
        self._id = response_id
        self._created = created
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._parts: list[str] = []  # its text (or arguments) so far
        self.output: list[dict[str, Any]] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return _frame(kind, payload)

    def _object(self, status: str, usage: Usage | None = None, reasoning_tokens: int = 0) -> Any:
        output = self.output if status != "in_progress" else []
        return response_object(
            self._req, self._id, self._created, status, output, usage, reasoning_tokens
        )

    def head(self) -> bytes:
        snapshot = self._object("in_progress")
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def _start(self, item: dict[str, Any]) -> bytes:
        self._open, self._parts = item, []
        index = len(self.output)
        out = self._event("response.output_item.added", output_index=index, item=item)
        part: dict[str, Any] | None = None
        if item["type"] == "message":
            part = _text_part("")
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        if part is not None:
            out += self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        return out

    def _switch(self, kind: str) -> bytes:
        """Frames that make ``kind`` the open item (closing another one)."""
        if self._open is not None and self._open["type"] == kind:
            return b""
        out = self.close()
        index = len(self.output)
        if kind == "reasoning":
            return out + self._start(
                _reasoning_item(_item_id(self._id, "rs", index), "", "in_progress")
            )
        return out + self._start(
            _message_item(_item_id(self._id, "msg", index), None, "in_progress")
        )

    def _text_delta(self, kind: str, text: str) -> bytes:
        out = self._switch(kind)
        assert self._open is not None
        self._parts.append(text)
        event = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        return out + self._event(
            event,
            item_id=self._open["id"],
            output_index=len(self.output),
            content_index=0,
            delta=text,
            **extra,
        )

    def _call_delta(self, call: ToolCallDelta) -> bytes:
        out = b""
        if call.id is not None or call.name is not None or self._open is None:
            out += self.close()
            index = len(self.output)
            fc = ToolCall(call.id or f"call_{self._id}_{index}", call.name or "", "")
            out += self._start(_call_item(_item_id(self._id, "fc", index), fc, "in_progress"))
        elif self._open["type"] != "function_call":
            return out  # arguments without a call: nothing a client could place
        if not call.arguments:
            return out
        assert self._open is not None
        self._parts.append(call.arguments)
        return out + self._event(
            "response.function_call_arguments.delta",
            item_id=self._open["id"],
            output_index=len(self.output),
            delta=call.arguments,
        )

    def feed(self, delta: ParsedDelta) -> bytes:
        out = b""
        if delta.reasoning:
            out += self._text_delta("reasoning", delta.reasoning)
        if delta.content:
            out += self._text_delta("message", delta.content)
        for call in delta.tool_calls:
            out += self._call_delta(call)
        return out

    def close(self) -> bytes:
        """Frames that finish the open item (b"" when none is open)."""
        item = self._open
        if item is None:
            return b""
        self._open = None
        text = "".join(self._parts)
        index = len(self.output)
        kind = item["type"]
        if kind == "function_call":
            done = {**item, "arguments": text, "status": "completed"}
            out = self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=text,
            )
        else:
            if kind == "reasoning":
                done = _reasoning_item(item["id"], text, "completed")
                part = done["content"][0]
                out = self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            else:
                done = _message_item(item["id"], text, "completed")
                part = done["content"][0]
                out = self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            out += self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        self.output.append(done)
        return out + self._event("response.output_item.done", output_index=index, item=done)

    def end(self, status: Status, usage: Usage, reasoning_tokens: int) -> tuple[bytes, Any]:
        """The closing frames, and the final response object (for the store)."""
        out = self.close()
        if not self.output:  # nothing came out: an empty message, as in the body
            out += self._switch("message") + self.close()
        final = self._object(status, usage, reasoning_tokens)
        return out + self._event(f"response.{status}", response=final), final

    def error(self, err: SluiceError) -> bytes:
        """A stream that failed after its headers: OpenAI's error event, then failed."""
        failed = self._object("failed")
        failed["error"] = {"code": err.code or err.error_type, "message": err.message}
        return self._event(
            "error", code=err.code or err.error_type, message=err.message, param=err.param
        ) + self._event("response.failed", response=failed)
