"""Function calling and structured output in the protocol: parsing, refusals, values, bodies."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest

from server.api.openai_chat.output import chat_completion_body
from server.api.openai_chat.parse import parse_chat, parse_completion
from server.api.openai_chat.stream import ChatStream, sse
from server.errors import SluiceError
from server.wire.output import ChatChoice, ToolCallDelta, Usage
from server.wire.request import ChatRequest, Constraint, Limits, Message, Tool, ToolCall, ToolChoice

USER = [{"role": "user", "content": "hi"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS, "strict": True}},
    {"function": {"name": "noop", "description": "does nothing"}},
]


def chat(**fields: Any) -> ChatRequest:
    return parse_chat(orjson.dumps({"model": "m", "messages": USER, **fields}), Limits())


def refused(param: str, **fields: Any) -> SluiceError:
    with pytest.raises(SluiceError) as info:
        chat(**fields)
    err = info.value
    assert err.status == 400 and err.param == param, (err.param, err.message)
    assert err.body()["error"]["type"] == "invalid_request_error"
    return err


# -- tools and tool_choice ----------------------------------------------------------------


def test_tools_parse() -> None:
    req = chat(tools=TOOLS)
    assert req.tools == (
        Tool("get_weather", orjson.dumps(PARAMS).decode(), strict=True),
        Tool("noop", None, description="does nothing"),
    )
    assert req.tool_choice == ToolChoice("auto")  # OpenAI's default with tools
    assert req.parallel_tool_calls is True
    assert req.tools[0].as_dict() == {
        "type": "function",
        "function": {**TOOLS[0]["function"], "description": None},
    }
    assert req.tools[1].as_dict()["function"]["parameters"] is None
    assert req.template_kwargs()["tools"] == [t.as_dict() for t in req.tools]


def test_tool_choices() -> None:
    assert chat().tool_choice == ToolChoice("none")
    assert chat(tools=[], tool_choice="auto").tool_choice == ToolChoice("none")
    assert chat(tools=TOOLS, tool_choice="none").tool_choice == ToolChoice("none")
    assert chat(tools=TOOLS, tool_choice="required").tool_choice.forced
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "noop"}})
    assert named.tool_choice == ToolChoice("function", "noop") and named.tool_choice.forced
    assert chat(tools=TOOLS, parallel_tool_calls=False).parallel_tool_calls is False
    assert "tools" not in chat().template_kwargs()


def test_key_order_of_a_schema_is_kept() -> None:
    # The chat template renders the schema as given; property order steers generation.
    params = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    assert (
        chat(tools=tools).tools[0].parameters
        == '{"type":"object","properties":{"z":{"type":"string"},"a":{"type":"integer"}}}'
    )


TOOL_BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": ["f"]}, "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        "tools[0].function.parameters",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
        "tools[0].function.description",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
        "tools[0].function.strict",
    ),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "functions"),
]


@pytest.mark.parametrize(("fields", "param"), TOOL_BAD)
def test_tool_refusals(fields: dict[str, Any], param: str) -> None:
    refused(param, **fields)


def test_unknown_function_names_it() -> None:
    err = refused(
        "tool_choice",
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "nope"}},
    )
    assert '"nope"' in err.message


@pytest.mark.parametrize("key", ["tools", "tool_choice", "functions"])
def test_completions_refuse_tools(key: str) -> None:
    body = {"model": "m", "prompt": "x", key: TOOLS if key != "tool_choice" else "auto"}
    with pytest.raises(SluiceError) as info:
        parse_completion(orjson.dumps(body), Limits())
    assert info.value.param == key and info.value.code == "unsupported"


# -- tool calls and tool results in the history ----------------------------------------------

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
TURNS = [
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
]


def test_history_with_calls() -> None:
    req = chat(messages=TURNS, tools=TOOLS)
    assert req.messages[1] == Message(
        "assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Oslo"}'),)
    )
    assert req.messages[2] == Message("tool", "-3 C", tool_call_id="call_1")
    assert req.messages[1].template_dict() == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    }
    assert req.messages[2].template_dict() == {
        "role": "tool",
        "content": "-3 C",
        "tool_call_id": "call_1",
    }


@pytest.mark.parametrize(
    ("arguments", "text"),
    [
        ({"a": [1]}, '{"a":[1]}'),  # an object, as vLLM accepts
        ("", "{}"),
        (None, "{}"),
        ("not json", "not json"),  # kept; vLLM's renderer gives the template {}
        ("[1]", "[1]"),
    ],
)
def test_call_arguments(arguments: Any, text: str) -> None:
    fn = {"name": "f"} if arguments is None else {"name": "f", "arguments": arguments}
    msg = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": fn}]}
    req = chat(messages=[*USER, msg])
    assert req.messages[1].tool_calls == (ToolCall("c", "f", text),)
    assert req.messages[1].template_dict()["tool_calls"][0]["function"]["arguments"] == text


MESSAGE_BAD: list[tuple[dict[str, Any], str]] = [
    ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
    ({"role": "tool", "content": "x", "tool_call_id": 5}, "messages[1].tool_call_id"),
    ({"role": "tool", "tool_call_id": "c"}, "messages[1].content"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": {}}, "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": ["x"]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{**CALL, "id": None}]}, "messages[1].tool_calls[0].id"),
    (
        {"role": "assistant", "tool_calls": [{**CALL, "type": "x"}]},
        "messages[1].tool_calls[0].type",
    ),
    (
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]},
        "messages[1].tool_calls[0].function.name",
    ),
    (
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 3}}],
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize(("message", "param"), MESSAGE_BAD)
def test_malformed_tool_messages(message: dict[str, Any], param: str) -> None:
    refused(param, messages=[*USER, message])


def test_rendered_by_vllms_renderer(demo_model_dir: Path) -> None:
    """The tools and the exchange reach Qwen3's template through the renderer
    the engine uses (server/engines/vllm_adapter.py), as vLLM's server renders them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers import renderer_from_config
    from vllm.renderers.params import ChatParams

    config = EngineArgs(model=str(demo_model_dir), max_model_len=512).create_engine_config()
    renderer = renderer_from_config(config)
    bad = {"id": "c2", "function": {"name": "get_weather", "arguments": "not json"}}
    turns = [*TURNS[:2], {**TURNS[1], "tool_calls": [bad]}, TURNS[2]]
    req = chat(messages=turns, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    kwargs = {**req.template_kwargs(), "add_generation_prompt": True, "tokenize": False}
    _, prompt = renderer.render_messages(
        [m.template_dict() for m in req.messages], ChatParams(chat_template_kwargs=kwargs)
    )
    text = prompt["prompt"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    call = '<tool_call>\n{{"name": "get_weather", "arguments": {}}}\n</tool_call>'
    assert call.format('{"city": "Oslo"}') in text
    assert call.format("{}") in text  # not a JSON object: {} (vLLM's coercion)
    assert "<|im_start|>user\n<tool_response>\n-3 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# -- structured output ---------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.parametrize(
    ("fields", "constraint"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": SCHEMA, "strict": True},
                }
            },
            Constraint("json", orjson.dumps(SCHEMA).decode()),
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            Constraint("json", orjson.dumps(SCHEMA).decode()),
        ),
        (
            {"structured_outputs": {"json": orjson.dumps(SCHEMA).decode()}},
            Constraint("json", orjson.dumps(SCHEMA).decode()),
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, Constraint("regex", "[a-z]+")),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            Constraint("choice", choices=("yes", "no")),
        ),
        (
            {"structured_outputs": {"grammar": "root ::= 'x'"}},
            Constraint("grammar", "root ::= 'x'"),
        ),
        ({"structured_outputs": {"json_object": True}}, Constraint("json_object")),
        ({"structured_outputs": {"disable_any_whitespace": True}}, None),
        ({"guided_json": SCHEMA}, Constraint("json", orjson.dumps(SCHEMA).decode())),
        ({"guided_regex": "a|b"}, Constraint("regex", "a|b")),
        ({"guided_choice": ["a"]}, Constraint("choice", choices=("a",))),
        ({"guided_grammar": "root ::= 'x'"}, Constraint("grammar", "root ::= 'x'")),
    ],
)
def test_constraints(fields: dict[str, Any], constraint: Constraint | None) -> None:
    assert chat(**fields).sampling.constraint == constraint
    body = {"model": "m", "prompt": "x", **fields}
    raw = parse_completion(orjson.dumps(body), Limits()).sampling.constraint
    # A raw completion is constrained from its first token (no thinking to wait for).
    assert raw == (None if constraint is None else dataclasses.replace(constraint, from_start=True))


def test_constraint_names_its_field() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    for fields, param in [
        ({"response_format": rf}, "response_format.json_schema.schema"),
        ({"guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice"),
    ]:
        constraint = chat(**fields).sampling.constraint
        assert constraint is not None and constraint.param == param


CONSTRAINT_BAD: list[tuple[dict[str, Any], str]] = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": [1]}}},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": 1, "schema": SCHEMA}}},
        "response_format.json_schema.name",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": SCHEMA, "strict": 1},
            }
        },
        "response_format.json_schema.strict",
    ),
    ({"structured_outputs": []}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": [1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a\x00"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
    ),
]


@pytest.mark.parametrize(("fields", "param"), CONSTRAINT_BAD)
def test_constraint_refusals(fields: dict[str, Any], param: str) -> None:
    refused(param, **fields)


# -- fingerprints (dedupe and the result cache) -----------------------------------------------


def test_fingerprint_covers_tools_and_constraint() -> None:
    base = chat(temperature=0)
    variants = [
        chat(temperature=0, tools=TOOLS),
        chat(temperature=0, tools=TOOLS[:1]),
        chat(temperature=0, tools=TOOLS, tool_choice="required"),
        chat(temperature=0, tools=TOOLS, tool_choice="none"),
        chat(temperature=0, tools=TOOLS, parallel_tool_calls=False),
        chat(temperature=0, response_format={"type": "json_object"}),
        chat(temperature=0, structured_outputs={"regex": "a"}),
        chat(temperature=0, structured_outputs={"regex": "b"}),
        chat(temperature=0, chat_template_kwargs={"enable_thinking": False}),
    ]

    def fingerprint(r: ChatRequest) -> Any:
        return (r.sampling.fingerprint(), r.variant())

    prints = [fingerprint(r) for r in [base, *variants]]
    assert len(set(prints)) == len(prints)
    hash(tuple(prints))  # hashable, for the core's dedupe index
    # The same constraint from another field is the same answer.
    assert fingerprint(chat(temperature=0, guided_regex="a")) == fingerprint(variants[6])
    assert fingerprint(chat(temperature=0, tools=TOOLS)) == fingerprint(variants[0])


# -- response bodies and stream frames -------------------------------------------------------


def test_body_with_tool_calls() -> None:
    choice = ChatChoice(
        index=0,
        content=None,
        finish_reason="tool_calls",
        tool_calls=(ToolCall("call_9", "get_weather", '{"city":"Rome"}'),),
    )
    body = orjson.loads(
        chat_completion_body(
            request_id="r", created=1, model="m", choices=[choice], usage=Usage(3, 4)
        )
    )
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_9",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
            }
        ],
    }
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    plain = ChatChoice(index=0, content="x", finish_reason="stop")
    body = orjson.loads(
        chat_completion_body(
            request_id="r", created=1, model="m", choices=[plain], usage=Usage(1, 1)
        )
    )
    assert "tool_calls" not in body["choices"][0]["message"]


def test_tool_call_frames() -> None:
    enc = ChatStream(request_id="r", created=1, model="m", n=2)
    first = ToolCallDelta(index=0, id="call_1", name="f", arguments="")
    more = ToolCallDelta(index=0, arguments='{"a"')
    frame = enc.tool_calls(1, [first, more])
    assert frame == sse(enc.chunk_dict(1, tool_calls=[first, more]))
    delta = orjson.loads(frame.removeprefix(b"data: "))["choices"][0]["delta"]
    assert delta == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            },
            {"index": 0, "function": {"arguments": '{"a"'}},
        ]
    }
