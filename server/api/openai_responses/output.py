"""OpenAI's Responses API, pure: a chat choice as output items, the response object, events.

Why this module exists: the engine's output is read as chat reads it (a
``ChatChoice`` when whole, ``ParsedDelta``s when streamed); this writes it
the Responses way. A whole body and a stream give the same items with the
same ids (``output_items`` and ``ResponsesStream`` share the item builders,
and the unit tests hold them to that). The stream's events come in the order
the openai client's ``responses.stream()`` helper assembles: created,
in_progress; per item added, content part added, deltas, their done
events; then completed or incomplete.

Pure code: no aiohttp, no vLLM, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import orjson

from server.api.openai_responses.parse import ClientTool, ResponsesRequest, custom_input, flat_name
from server.errors import SluiceError
from server.wire.output import ChatChoice, ParsedDelta, ToolCallDelta, Usage
from server.wire.request import Message, ToolCall

__all__ = [
    "ResponsesStream",
    "Status",
    "conversation_after",
    "output_items",
    "response_object",
    "status_of",
]

Status = Literal["completed", "incomplete"]


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


_CALLS = ("function_call", "custom_tool_call")


def _call_item(
    item_id: str, call: ToolCall, status: str, back: ClientTool | None = None
) -> dict[str, Any]:
    """A call as its output item: a ``function_call``, or, for a namespace or
    custom tool, the item the client declared it for (``ClientTool``)."""
    if back is not None:
        return {"id": item_id, **back.call_item(call.id, call.arguments), "status": status}
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


def output_items(
    response_id: str, choice: ChatChoice, req: ResponsesRequest | None = None
) -> list[dict[str, Any]]:
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
        back = req.client_tool(call.name) if req is not None else None
        items.append(_call_item(_item_id(response_id, "fc", len(items)), call, "completed", back))
    return items


def _as_called(item: dict[str, Any]) -> ToolCall:
    """An output call item as the call the model wrote (the name it saw)."""
    if item["type"] == "custom_tool_call":
        args = orjson.dumps({"input": item["input"]}).decode()
        return ToolCall(item["call_id"], item["name"], args)
    return ToolCall(
        item["call_id"], flat_name(item.get("namespace"), item["name"]), item["arguments"]
    )


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
    service_tier: str = "default",
) -> dict[str, Any]:
    """The ``response`` object: its state, its output, and the echoed request;
    ``service_tier`` is the tier that serves it (batching/classes.py rule 3)."""
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
        "service_tier": service_tier,
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
    calls = tuple(_as_called(item) for item in output if item["type"] in _CALLS)
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

    __slots__ = ("_created", "_fast", "_id", "_open", "_parts", "_req", "_seq", "_tier", "output")

    def __init__(
        self, req: ResponsesRequest, response_id: str, created: int, service_tier: str = "default"
    ) -> None:
        self._req = req
        self._tier = service_tier
        self._id = response_id
        self._created = created
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._parts: list[str] = []  # its text (or arguments) so far
        self._fast: tuple[bytes, bytes, bytes] = (b"", b"", b"")  # its delta frame, in pieces
        self.output: list[dict[str, Any]] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return _frame(kind, payload)

    def _part_event(self, phase: str, item_id: str, index: int, part: dict[str, Any]) -> bytes:
        """An item's one content part added or done (items here have one part)."""
        return self._event(
            f"response.content_part.{phase}",
            item_id=item_id,
            output_index=index,
            content_index=0,
            part=part,
        )

    def _object(self, status: str, usage: Usage | None = None, reasoning_tokens: int = 0) -> Any:
        output = self.output if status != "in_progress" else []
        return response_object(
            self._req, self._id, self._created, status, output, usage, reasoning_tokens, self._tier
        )

    def head(self) -> bytes:
        snapshot = self._object("in_progress")
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def _start(self, item: dict[str, Any]) -> bytes:
        self._open, self._parts = item, []
        if item["type"] not in _CALLS:
            self._fast = self._fast_pieces()
        index = len(self.output)
        out = self._event("response.output_item.added", output_index=index, item=item)
        part: dict[str, Any] | None = None
        if item["type"] == "message":
            part = _text_part("")
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        if part is not None:
            out += self._part_event("added", item["id"], index, part)
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

    def delta_dict(self, text: str) -> dict[str, Any]:
        """The open text item's delta event as a dict (the reference for the fast frame)."""
        assert self._open is not None
        kind = self._open["type"]
        event = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        payload: dict[str, Any] = {
            "type": event,
            "sequence_number": self._seq,
            "item_id": self._open["id"],
            "output_index": len(self.output),
            "content_index": 0,
            "delta": text,
        }
        if kind == "message":
            payload["logprobs"] = []
        return payload

    def _fast_pieces(self) -> tuple[bytes, bytes, bytes]:
        """The open item's delta frame around its sequence number and its text.

        The per-token frame is the stream's hot path: rendered once per item
        here, then per token only the number and ``orjson.dumps(text)`` are
        spliced in (2.5 us a token against 6 us through a dict, measured with
        64-token streams); ``delta_dict`` is the reference the unit tests hold
        it to, byte for byte."""
        ref = orjson.dumps(self.delta_dict(""))
        head, rest = ref.split(b'"sequence_number":', 1)
        mid = rest[rest.index(b",") : rest.index(b'"delta":') + len(b'"delta":')]
        tail = rest[rest.index(b'"delta":""') + len(b'"delta":""') :]
        kind = self._open["type"] if self._open is not None else ""
        event = b"reasoning_text" if kind == "reasoning" else b"output_text"
        return (
            b"event: response." + event + b".delta\ndata: " + head + b'"sequence_number":',
            mid,
            tail + b"\n\n",
        )

    def _text_delta(self, kind: str, text: str) -> bytes:
        out = self._switch(kind)
        self._parts.append(text)
        head, mid, tail = self._fast
        seq = self._seq
        self._seq += 1
        return out + b"".join((head, str(seq).encode(), mid, orjson.dumps(text), tail))

    def _call_delta(self, call: ToolCallDelta) -> bytes:
        out = b""
        if call.id is not None or call.name is not None or self._open is None:
            out += self.close()
            index = len(self.output)
            fc = ToolCall(call.id or f"call_{self._id}_{index}", call.name or "", "")
            back = self._req.client_tool(fc.name)
            item = _call_item(_item_id(self._id, "fc", index), fc, "in_progress", back)
            out += self._start(item)
        elif self._open["type"] not in _CALLS:
            return out  # arguments without a call: nothing a client could place
        if not call.arguments:
            return out
        assert self._open is not None
        self._parts.append(call.arguments)
        if self._open["type"] == "custom_tool_call":
            # The model writes {"input": ...} as JSON: the input is known
            # whole at the end (its done event), not as deltas of that text.
            return out
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
        if kind == "custom_tool_call":
            done = {**item, "input": custom_input(text), "status": "completed"}
            out = self._event(
                "response.custom_tool_call_input.done",
                item_id=item["id"],
                output_index=index,
                input=done["input"],
            )
        elif kind == "function_call":
            done = {**item, "arguments": text, "status": "completed"}
            out = self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=text,
            )
        else:
            # A reasoning item and a message close alike: the text's done
            # event (a message's also carries logprobs), then its part's.
            extra: dict[str, Any]
            if kind == "reasoning":
                done = _reasoning_item(item["id"], text, "completed")
                event, extra = "response.reasoning_text.done", {}
            else:
                done = _message_item(item["id"], text, "completed")
                event, extra = "response.output_text.done", {"logprobs": []}
            part = done["content"][0]
            out = self._event(
                event, item_id=item["id"], output_index=index, content_index=0, text=text, **extra
            )
            out += self._part_event("done", item["id"], index, part)
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
