"""The Messages translation, pure: request bodies into ChatRequest (same
messages as the chat API's for the same conversation), refusals that name the
field, stop reasons, and stream events that the `anthropic` client's own
accumulator assembles into the body's content."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message as AnthropicMessage
from anthropic.types import RawMessageStreamEvent
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter

from server.api.anthropic_messages.output import (
    MessagesChoice,
    MessagesStream,
    cut_stop,
    event,
    message_body,
    stop_reason,
)
from server.api.anthropic_messages.parse import parse_messages
from server.api.openai_chat.parse import parse_chat
from server.errors import SluiceError
from server.wire.output import ToolCallDelta, Usage
from server.wire.request import Limits, Message, ToolCall, ToolChoice

LIMITS = Limits()
HI = [{"role": "user", "content": "hi"}]


def parse(**kw: Any) -> Any:
    return parse_messages(orjson.dumps({"model": "m", "max_tokens": 8, **kw}), LIMITS)


def refused(param: str, **kw: Any) -> SluiceError:
    with pytest.raises(SluiceError) as exc:
        parse(**kw)
    assert exc.value.status == 400
    assert exc.value.param == param, exc.value.message
    return exc.value


def test_a_conversation_is_the_chat_apis_conversation() -> None:
    """The same turns through Messages and chat give the same messages (and so
    the same prompt tokens, tested on the engine in tests/integration)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    chat = parse_chat(
        orjson.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "sys one"},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    },
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "42"},
                    {"role": "user", "content": "thanks"},
                ],
            }
        ),
        LIMITS,
    )
    msgs = parse(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1"},
            {"type": "text", "text": "sys ", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "one"},
        ],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "thanks"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "c1",
                        "content": [{"type": "text", "text": "42"}],
                    },
                ],
            },
        ],
    )
    assert msgs.messages == chat.messages
    assert msgs.sampling == dataclasses.replace(chat.sampling, max_tokens=8)


def test_thinking_blocks_are_the_turns_reasoning() -> None:
    req = parse(
        messages=[
            *HI,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "let me see", "signature": "abc"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "4"},
                ],
            },
            {"role": "user", "content": "and?"},
        ]
    )
    assert req.messages[1] == Message("assistant", "4", reasoning="let me see")
    assert req.messages[1].template_dict()["reasoning"] == "let me see"


def test_tools_tool_choice_and_thinking_map_to_the_chat_fields() -> None:
    tools = [
        {"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    ]
    req = parse(
        messages=HI, tools=tools, metadata={"user_id": "ann"}, thinking={"type": "disabled"}
    )
    assert req.tools[0].name == "f" and req.tools[0].parameters == '{"type":"object"}'
    assert req.tool_choice == ToolChoice("auto") and req.parallel_tool_calls
    assert req.user == "ann" and req.enable_thinking is False
    assert req.template_kwargs()["enable_thinking"] is False
    forced = parse(
        messages=HI,
        tools=tools,
        tool_choice={"type": "tool", "name": "f", "disable_parallel_tool_use": True},
    )
    assert forced.tool_choice == ToolChoice("function", "f") and not forced.parallel_tool_calls
    assert (
        parse(messages=HI, tools=tools, tool_choice={"type": "any"}).tool_choice.mode == "required"
    )
    assert parse(messages=HI, tools=tools, tool_choice={"type": "none"}).tool_choice.mode == "none"
    on = parse(messages=HI, thinking={"type": "enabled", "budget_tokens": 1024})
    assert on.enable_thinking is True
    assert parse(messages=HI).enable_thinking is LIMITS.default_enable_thinking


def test_sampling_and_stop_sequences() -> None:
    req = parse(messages=HI, temperature=0.5, top_p=0.9, top_k=5, stop_sequences=["END", "END"])
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.stop, s.max_tokens) == (0.5, 0.9, 5, ("END",), 8)
    # A whole body keeps the stop string in the engine's text to tell which one ended it.
    assert s.include_stop_str_in_output is True
    assert (
        parse(messages=HI, stop_sequences=["END"], stream=True).sampling.include_stop_str_in_output
        is False
    )


def test_ignore_eos_is_honoured_as_on_chat() -> None:
    # The benchmark point (bench/points/api_point.py) runs the three APIs to the same length.
    assert parse(messages=HI, ignore_eos=True).sampling.ignore_eos is True
    assert parse(messages=HI).sampling.ignore_eos is False


def test_count_tokens_needs_no_max_tokens() -> None:
    req = parse_messages(orjson.dumps({"model": "m", "messages": HI}), LIMITS, count_only=True)
    assert req.messages == (Message("user", "hi"),)


@pytest.mark.parametrize(
    ("param", "body"),
    [
        ("max_tokens", {"max_tokens": None, "messages": HI}),
        ("messages", {"messages": []}),
        ("messages[0].role", {"messages": [{"role": "robot", "content": "x"}]}),
        # A turn's blocks are all checked to be objects before any is read.
        (
            "messages[0].content[1]",
            {"messages": [{"role": "user", "content": [{"type": "image"}, 5]}]},
        ),
        (
            "messages[0].content[1].type",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a"},
                            {"type": "document", "source": {}},
                        ],
                    }
                ]
            },
        ),
        (
            "messages[0].content[0].type",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}
                ]
            },
        ),
        (
            "messages[0].content[0].tool_use_id",
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        ),
        (
            "messages[0].content[0].is_error",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "a", "is_error": "yes"}],
                    }
                ]
            },
        ),
        (
            # A server tool is dropped, unless tool_choice forces it.
            "tool_choice.name",
            {
                "messages": HI,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                "tool_choice": {"type": "tool", "name": "web_search"},
            },
        ),
        ("tools[0].input_schema", {"messages": HI, "tools": [{"name": "f"}]}),
        (
            "tool_choice.name",
            {
                "messages": HI,
                "tools": [{"name": "f", "input_schema": {}}],
                "tool_choice": {"type": "tool", "name": "g"},
            },
        ),
        ("tool_choice", {"messages": HI, "tool_choice": {"type": "any"}}),
        ("thinking.type", {"messages": HI, "thinking": {"type": "sometimes"}}),
        ("mcp_servers", {"messages": HI, "mcp_servers": [{"type": "url", "url": "http://x"}]}),
        ("stop_sequences", {"messages": HI, "stop_sequences": [""]}),
        ("temperature", {"messages": HI, "temperature": 3}),
    ],
)
def test_refusals_name_the_field(param: str, body: dict[str, Any]) -> None:
    refused(param, **body)


def test_anthropic_error_shape_names_the_field_and_maps_statuses() -> None:
    err = refused(
        "messages[0].content[0].type",
        messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
    )
    assert err.anthropic_body() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages[0].content[0].type: an image block on this text-only model"
            " is not supported by this server",
        },
    }
    busy = SluiceError("shutting down", status=503, retry_after=5)
    assert busy.anthropic_status == 529
    assert busy.anthropic_body()["error"]["type"] == "overloaded_error"
    assert SluiceError("over", status=429).anthropic_body()["error"]["type"] == "rate_limit_error"
    assert (
        SluiceError("key", status=401).anthropic_body()["error"]["type"] == "authentication_error"
    )


def test_stop_reasons() -> None:
    assert stop_reason("length", "END", True) == ("max_tokens", None)
    assert stop_reason("stop", "END", True) == ("stop_sequence", "END")
    assert stop_reason("stop", 151645, True) == ("tool_use", None)
    assert stop_reason("stop", None, False) == ("end_turn", None)
    assert cut_stop("abc END", "stop", ("X", "END", "D")) == ("abc ", "END")
    assert cut_stop("abc END", "length", ("END",)) == ("abc END", None)
    assert cut_stop("abc", "stop", ("END",)) == ("abc", None)


@given(st.text(), st.sampled_from(["text", "thinking"]), st.integers(0, 3))
def test_spliced_deltas_equal_the_general_event(text: str, kind: str, blocks: int) -> None:
    enc = MessagesStream("msg_1", "m")
    for _ in range(blocks):
        enc.tool_calls([ToolCallDelta(len(enc._calls), "i", "f")])
    frames = enc.text(text) if kind == "text" else enc.thinking(text)
    if text:
        delta = {"type": f"{kind}_delta", kind: text}
        want = event({"type": "content_block_delta", "index": blocks, "delta": delta})
        assert frames.endswith(want)
    else:
        assert frames == b""


def test_body_is_a_valid_anthropic_message() -> None:
    choice = MessagesChoice("think", "answer", (ToolCall("t1", "f", '{"x": [1]}'),), "tool_use")
    body = orjson.loads(message_body("msg_1", "m", choice, Usage(10, 3, cached_tokens=4)))
    msg = AnthropicMessage.model_validate(body)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[2].input == {"x": [1]}  # type: ignore[union-attr]
    assert body["usage"] == {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4}


_EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)

Piece = tuple[str, str]
pieces = st.lists(
    st.tuples(st.sampled_from(["thinking", "text", "call", "args"]), st.text(max_size=6)),
    max_size=12,
)


def _assembled(frames: bytes) -> Any:
    """The client's snapshot, after checking the order the API promises: one
    block open at a time, each started and stopped once, in index order, all
    closed before message_delta."""
    snapshot = None
    bufs: dict[int, bytes] = {}
    open_block: int | None = None
    started = 0
    for frame in frames.decode().split("\n\n"):
        if not frame:
            continue
        kind, data = frame.split("\n")
        payload = orjson.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        if payload["type"] == "content_block_start":
            assert open_block is None and payload["index"] == started
            open_block, started = started, started + 1
        elif payload["type"] == "content_block_delta":
            assert payload["index"] == open_block
        elif payload["type"] == "content_block_stop":
            assert payload["index"] == open_block
            open_block = None
        elif payload["type"] == "message_delta":
            assert open_block is None
        snapshot = accumulate_event(
            event=_EVENTS.validate_python(payload), current_snapshot=snapshot, json_bufs=bufs
        )
    return snapshot


@given(pieces)
def test_stream_events_assemble_to_the_pieces(seq: list[Piece]) -> None:
    """Any interleaving of thinking, text and tool-call pieces: the client's
    accumulator builds one block per run of a kind (per call), in order."""
    enc = MessagesStream("msg_1", "m")
    frames = [enc.start(7)]
    want: list[dict[str, Any]] = []
    calls = 0
    for kind, text in seq:
        if kind == "thinking" and text:
            frames.append(enc.thinking(text))
            if want and want[-1]["type"] == "thinking":
                want[-1]["thinking"] += text
            else:
                want.append({"type": "thinking", "thinking": text, "signature": ""})
        elif kind == "text" and text:
            frames.append(enc.text(text))
            if want and want[-1]["type"] == "text":
                want[-1]["text"] += text
            else:
                want.append({"type": "text", "text": text})
        elif kind == "call":
            frames.append(enc.tool_calls([ToolCallDelta(calls, f"id{calls}", "f", '{"k": "')]))
            want.append({"type": "tool_use", "id": f"id{calls}", "name": "f"})
            calls += 1
        elif kind == "args" and want and want[-1]["type"] == "tool_use":
            escaped = orjson.dumps(text).decode()[1:-1]  # inside the open string
            frames.append(enc.tool_calls([ToolCallDelta(calls - 1, arguments=escaped)]))
    frames.append(enc.finish("end_turn", None, Usage(7, 2)))
    msg = _assembled(b"".join(frames))
    got = [b.model_dump(exclude_none=True) for b in msg.content]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert {k: g[k] for k in w} == w
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens == 2


# -- issue 26: what Claude Code sends today --------------------------------------


def _fields(req: Any) -> list[tuple[str, str]]:
    return [(i.field, i.name) for i in req.ignored]


def test_a_system_message_in_messages_stays_where_it_is() -> None:
    """Claude Code sends its environment as a system message after the user's
    turn; it is a system message in place (Qwen3's template renders it so)."""
    env = {
        "role": "system",
        "content": [{"type": "text", "text": "# Environment", "cache_control": {"type": "x"}}],
    }
    req = parse(system="Be brief.", messages=[*HI, env, {"role": "assistant", "content": "ok"}])
    assert req.messages == (
        Message("system", "Be brief."),
        Message("user", "hi"),
        Message("system", "# Environment"),
        Message("assistant", "ok"),
    )
    assert ("messages[].content[].cache_control", "messages[].content[].cache_control") in (
        _fields(req)
    )


@pytest.mark.parametrize("default", [True, False])
def test_thinking_adaptive_keeps_the_servers_default(default: bool) -> None:
    limits = Limits(default_enable_thinking=default)
    body = {"model": "m", "max_tokens": 8, "messages": HI}

    def thinking(value: Any) -> bool:
        return parse_messages(orjson.dumps({**body, "thinking": value}), limits).enable_thinking

    assert thinking({"type": "adaptive", "display": "omitted"}) is default
    assert thinking(None) is default
    assert thinking({"type": "enabled", "budget_tokens": 1024}) is True
    assert thinking({"type": "disabled"}) is False


def test_claude_codes_new_fields_are_noted_under_their_names() -> None:
    req = parse(
        messages=HI,
        system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
        tools=[{"name": "f", "input_schema": {}, "defer_loading": True, "kind": "new"}],
        thinking={"type": "adaptive", "display": "omitted"},
        context_management={"edits": []},
        output_config={"effort": "high"},
        brand_new={"a": 1},
    )
    assert sorted(_fields(req)) == sorted(
        [
            ("other", "brand_new"),
            ("context_management", "context_management"),
            ("output_config.effort", "output_config.effort"),
            ("system[].cache_control", "system[].cache_control"),
            ("tools[].defer_loading", "tools[].defer_loading"),
            ("other", "tools[].kind"),
            ("thinking.display", "thinking.display"),
        ]
    )


def test_a_server_tool_is_dropped_and_tool_changes_apply() -> None:
    f = {"name": "f", "input_schema": {}}
    g = {"name": "g", "input_schema": {"type": "object"}}
    change = {
        "role": "system",
        "content": [
            {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": g}},
            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "f"}},
        ],
    }
    req = parse(
        messages=[*HI, change],
        tools=[f, {"type": "web_search_20250305", "name": "web_search"}],
    )
    assert [t.name for t in req.tools] == ["g"]
    assert req.messages == (Message("user", "hi"),)
    assert ("tools[type=web_search]", "tools[type=web_search]") in _fields(req)
    bad = {
        "role": "system",
        "content": [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "nope"}}],
    }
    with pytest.raises(SluiceError) as info:
        parse(messages=[*HI, bad], tools=[f])
    assert info.value.param == "messages[1].content[0].tool.name"
