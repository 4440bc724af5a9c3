"""The Responses translation, pure: bodies to chat requests, outputs to items and events."""

from __future__ import annotations

import itertools
import json
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types.responses import Response

from server.api.openai_chat.parse import parse_chat
from server.api.openai_responses.output import (
    ResponsesStream,
    conversation_after,
    output_items,
    response_object,
)
from server.api.openai_responses.parse import parse_responses
from server.errors import SluiceError
from server.wire.output import ChatChoice, ParsedDelta, ToolCallDelta, Usage
from server.wire.request import Limits, Message, ToolCall

LIMITS = Limits(max_tokens_cap=4096)
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}


def parse(**kw: Any) -> Any:
    return parse_responses(orjson.dumps({"model": "m", "input": "hi", **kw}), LIMITS)


def refused(**kw: Any) -> SluiceError:
    with pytest.raises(SluiceError) as info:
        parse(**kw)
    assert info.value.status == 400
    return info.value


def test_a_conversation_is_the_chat_request_it_means() -> None:
    """The same conversation through chat and Responses parses to one ChatRequest's
    messages, tools, choice and thinking: the same token ids downstream."""
    call = {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city":"O"}'}
    r = parse(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            call,
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        tools=[{"type": "function", "name": "w", "parameters": PARAMS, "strict": True}],
        tool_choice={"type": "function", "name": "w"},
        reasoning={"effort": "none"},
        max_output_tokens=50,
        temperature=0.5,
    )
    chat = parse_chat(
        orjson.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "weather?"},
                    {
                        "role": "assistant",
                        "content": "Checking.",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "w", "arguments": '{"city":"O"}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                ],
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "w", "parameters": PARAMS, "strict": True},
                    }
                ],
                "tool_choice": {"type": "function", "function": {"name": "w"}},
                "chat_template_kwargs": {"enable_thinking": False},
                "max_completion_tokens": 50,
                "temperature": 0.5,
            }
        ),
        LIMITS,
    )
    assert r.chat == chat
    assert r.turn == chat.messages[1:]  # instructions are not part of what is stored


def test_thinking_switch_and_defaults() -> None:
    assert parse().chat.enable_thinking is True  # the server default (Limits)
    assert parse(reasoning={"effort": "minimal"}).chat.enable_thinking is False
    assert parse(reasoning={"effort": "high", "summary": "auto"}).chat.enable_thinking is True
    assert parse(reasoning={"summary": "auto"}).chat.enable_thinking is True
    assert parse().store is True and parse(store=False).store is False


def test_text_format_is_the_constraint() -> None:
    fmt = {"type": "json_schema", "name": "f", "schema": PARAMS, "strict": True}
    c = parse(text={"format": fmt}).chat.sampling.constraint
    assert c is not None and c.kind == "json" and json.loads(c.value) == PARAMS
    obj = parse(text={"format": {"type": "json_object"}}).chat.sampling.constraint
    assert obj is not None and obj.kind == "json_object"
    assert (
        parse(text={"format": {"type": "text"}, "verbosity": "low"}).chat.sampling.constraint
        is None
    )


def test_history_goes_between_instructions_and_the_turn() -> None:
    r = parse(instructions="sys", input="next")
    history = (Message("user", "first"), Message("assistant", "answer"))
    msgs = r.with_history(history).messages
    assert [(m.role, m.content) for m in msgs] == [
        ("system", "sys"),
        ("user", "first"),
        ("assistant", "answer"),
        ("user", "next"),
    ]


def test_text_parts_and_refusals_join_with_a_newline() -> None:
    """Input, output and plain text parts, and a refusal part's text, are one
    message's content joined with "\\n", as chat joins its text parts."""
    parts = [
        {"type": "output_text", "text": "a"},
        {"type": "refusal", "refusal": "b"},
        {"type": "text", "text": "c"},
    ]
    r = parse(input=[{"role": "assistant", "content": parts}, {"role": "user", "content": "q"}])
    assert [(m.role, m.content) for m in r.chat.messages] == [
        ("assistant", "a\nb\nc"),
        ("user", "q"),
    ]


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"top_logprobs": 3}, "top_logprobs"),
        # Hosted tools are dropped (rule 2), unless tool_choice forces one.
        (
            {
                "tools": [{"type": "web_search_preview"}],
                "tool_choice": {"type": "web_search_preview"},
            },
            "tool_choice.type",
        ),
        (
            {"tools": [{"type": "mcp", "server_label": "x"}], "tool_choice": {"type": "mcp"}},
            "tool_choice.type",
        ),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
        ({"tools": [{"type": 7}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": {"a": 1}, "content": "x"}]}, "input[0].role"),  # unhashable
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call", "name": "w"}]}, "input[0].call_id"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),
        ({"reasoning": {"effort": "max"}}, "reasoning.effort"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ],
)
def test_refusals_name_the_field(kw: dict[str, Any], param: str) -> None:
    err = refused(**kw)
    assert err.param == param
    if param == "tool_choice.type":
        assert kw["tool_choice"]["type"] in err.message


def test_background_false_and_ignored_fields_are_accepted() -> None:
    r = parse(
        background=False,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="k",
        safety_identifier="u",
        service_tier="auto",
        truncation="auto",
        max_tool_calls=3,
        stream_options={"include_obfuscation": False},
    )
    assert r.chat.messages == (Message("user", "hi"),)


CALL = ToolCall("call_1", "w", '{"city":"Oslo"}')


def test_body_items_and_the_openai_model() -> None:
    r = parse(metadata={"a": "b"}, tools=[{"type": "function", "name": "w"}])
    choice = ChatChoice(0, "Oslo.", "tool_calls", reasoning="hmm", tool_calls=(CALL,))
    items = output_items("resp_1", choice)
    obj = response_object(r, "resp_1", 0, "completed", items, Usage(3, 4), 2)
    resp = Response.model_validate(obj)
    assert [o.type for o in resp.output] == ["reasoning", "message", "function_call"]
    assert resp.output_text == "Oslo." and resp.metadata == {"a": "b"}
    assert resp.tools[0].name == "w"  # type: ignore[union-attr]
    assert resp.usage is not None and resp.usage.output_tokens_details.reasoning_tokens == 2
    convo = conversation_after((), r.turn, items)
    assert convo[-1] == Message("assistant", "Oslo.", tool_calls=(CALL,))


def chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points) if b > a]


@given(
    reasoning=st.text(max_size=20),
    content=st.text(max_size=20),
    calls=st.lists(st.sampled_from(["", '{"a":1}', "{}"]), max_size=2),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_a_stream_assembles_the_body(
    reasoning: str, content: str, calls: list[str], cuts: list[int]
) -> None:
    """However the text is cut into deltas, the stream's items are the body's."""
    r = parse()
    deltas = [ParsedDelta(reasoning=t) for t in chunks(reasoning, cuts)]
    deltas += [ParsedDelta(content=t) for t in chunks(content, cuts)]
    tool_calls = []
    for i, args in enumerate(calls):
        call = ToolCall(f"call_{i}", f"f{i}", args)
        tool_calls.append(call)
        deltas.append(ParsedDelta(tool_calls=(ToolCallDelta(i, call.id, call.name),)))
        deltas += [
            ParsedDelta(tool_calls=(ToolCallDelta(i, arguments=t),)) for t in chunks(args, cuts)
        ]
    stream = ResponsesStream(r, "resp_x", 0)
    frames = stream.head() + b"".join(stream.feed(d) for d in deltas)
    end, final = stream.end("completed", Usage(1, 1), 0)
    choice = ChatChoice(
        0, content or None, "stop", reasoning=reasoning or None, tool_calls=tuple(tool_calls)
    )
    assert final["output"] == output_items("resp_x", choice)
    events = [orjson.loads(f.split(b"\ndata: ")[1]) for f in (frames + end).split(b"\n\n") if f]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    Response.model_validate(final)


def test_a_closing_text_item_sends_its_done_events() -> None:
    """Reasoning and a message close with their text's done event (the message's
    with logprobs, as OpenAI sends it), then the content part's."""
    stream = ResponsesStream(parse(), "resp_x", 0)
    stream.head()
    frames = stream.feed(ParsedDelta(reasoning="hm")) + stream.feed(ParsedDelta(content="ok"))
    frames += stream.end("completed", Usage(1, 1), 0)[0]
    events = [orjson.loads(f.split(b"\ndata: ")[1]) for f in frames.split(b"\n\n") if f]
    done = [
        {k: v for k, v in e.items() if k not in ("sequence_number", "item_id", "part")}
        for e in events
        if e["type"].endswith((".reasoning_text.done", ".output_text.done", ".content_part.done"))
    ]
    assert done == [
        {
            "type": "response.reasoning_text.done",
            "output_index": 0,
            "content_index": 0,
            "text": "hm",
        },
        {"type": "response.content_part.done", "output_index": 0, "content_index": 0},
        {
            "type": "response.output_text.done",
            "output_index": 1,
            "content_index": 0,
            "text": "ok",
            "logprobs": [],
        },
        {"type": "response.content_part.done", "output_index": 1, "content_index": 0},
    ]
    parts = [e["part"] for e in events if e["type"] == "response.content_part.done"]
    assert [p["type"] for p in parts] == ["reasoning_text", "output_text"]
    added = [
        (e["item_id"], e["output_index"], e["content_index"], e["part"]["type"])
        for e in events
        if e["type"] == "response.content_part.added"
    ]
    items = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [(items[0], 0, 0, "reasoning_text"), (items[1], 1, 0, "output_text")]


def test_stream_error_is_an_error_event_then_failed() -> None:
    stream = ResponsesStream(parse(), "resp_x", 0)
    stream.head()
    frames = stream.error(SluiceError("engine died", status=503, code="engine_dead"))
    kinds = [f.split(b"\n")[0] for f in frames.split(b"\n\n") if f]
    assert kinds == [b"event: error", b"event: response.failed"]


@pytest.mark.parametrize("kind", ["reasoning", "content"])
@given(text=st.text(min_size=1, max_size=12))
def test_the_fast_delta_frame_is_the_reference(kind: str, text: str) -> None:
    stream = ResponsesStream(parse(), "resp_x", 0)
    stream.head()
    stream.feed(ParsedDelta(**{kind: "open"}))  # the item opens
    want = stream.delta_dict(text)
    frame = stream.feed(ParsedDelta(**{kind: text}))
    assert frame == b"event: " + want["type"].encode() + b"\ndata: " + orjson.dumps(want) + b"\n\n"


# -- issue 26: what Codex sends today ----------------------------------------------


NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "description": "Close one.",
            "parameters": PARAMS,
        }
    ],
}
CUSTOM = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}


def test_namespace_and_custom_tools_are_offered_and_come_back_as_declared() -> None:
    r = parse(tools=[NAMESPACE, CUSTOM, {"type": "web_search", "external_web_access": False}])
    seen = {t.name: t for t in r.chat.tools}
    assert list(seen) == ["multi_agent_v1__close_agent", "apply_patch"]
    assert seen["multi_agent_v1__close_agent"].description == "Tools for sub-agents.\n\nClose one."
    assert json.loads(seen["apply_patch"].parameters or "")["required"] == ["input"]
    assert [(i.field, i.name) for i in r.chat.ignored] == [
        ("tools[].format", "tools[].format"),
        ("tools[type=web_search]", "tools[type=web_search]"),
    ]
    calls = (
        ToolCall("c1", "multi_agent_v1__close_agent", '{"city":"Oslo"}'),
        ToolCall("c2", "apply_patch", '{"input":"*** Begin Patch"}'),
    )
    choice = ChatChoice(0, None, "tool_calls", tool_calls=calls)
    items = output_items("resp_1", choice, r)
    assert [{k: v for k, v in i.items() if k not in ("id", "status")} for i in items] == [
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "close_agent",
            "namespace": "multi_agent_v1",
            "arguments": '{"city":"Oslo"}',
        },
        {
            "type": "custom_tool_call",
            "call_id": "c2",
            "name": "apply_patch",
            "input": "*** Begin Patch",
        },
    ]
    Response.model_validate(response_object(r, "resp_1", 0, "completed", items))
    # Sent back as input, they render as the calls the model made.
    back = [
        {**items[0], "type": "function_call"},
        {"type": "function_call_output", "call_id": "c1", "output": "closed"},
        {k: v for k, v in items[1].items() if k != "status"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
    ]
    again = parse(tools=[NAMESPACE, CUSTOM], input=back)
    assert again.chat.messages[0].tool_calls[0] == calls[0]
    assert again.chat.messages[2].tool_calls[0] == calls[1]
    assert conversation_after((), (), items)[-1].tool_calls == calls


def test_a_streamed_custom_call_ends_with_its_input() -> None:
    r = parse(tools=[CUSTOM], stream=True)
    stream = ResponsesStream(r, "resp_1", 0)
    out = stream.head()
    out += stream.feed(ParsedDelta(tool_calls=(ToolCallDelta(0, "c2", "apply_patch", '{"in'),)))
    out += stream.feed(ParsedDelta(tool_calls=(ToolCallDelta(0, None, None, 'put":"x"}'),)))
    frames, final = stream.end("completed", Usage(1, 1), 0)
    kinds = [json.loads(f.split(b"data: ")[1])["type"] for f in (out + frames).split(b"\n\n") if f]
    assert "response.custom_tool_call_input.done" in kinds
    assert final["output"][-1]["type"] == "custom_tool_call"
    assert final["output"][-1]["input"] == "x"
