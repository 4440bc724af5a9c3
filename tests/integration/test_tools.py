"""Tool calls and structured output against the real engine, with the official `openai` client.

The demo model has random weights, so these test what the server guarantees,
not what a model chooses: a forced call always comes back as a valid call,
a response_format always as valid JSON of its schema. Schemas are bounded
(enums, booleans): a random model loops inside a free string or number until
max_tokens. Thinking is off where a constraint must engage: the demo model
never writes </think>, and in thinking mode a constraint starts only after it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.support import SluiceProcess

pytestmark = pytest.mark.engine

MODEL = "sluice-demo"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Rome", "Lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "unit", "alerts"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def client(sluice_server: SluiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=sluice_server.base + "/v1", api_key="unused", max_retries=0)


def check_calls(calls: Any) -> list[tuple[str, dict[str, Any]]]:
    """Every call names a given tool and its arguments are valid JSON of its schema."""
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_required_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=3,
        seed=7,
        max_tokens=120,
        extra_body=NO_THINK,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(check_calls(choice.message.tool_calls)) == 1


def test_required_call_streamed(client: openai.OpenAI) -> None:
    """The stream the client's own helper assembles holds the same kind of valid call."""
    with client.chat.completions.stream(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=11,
        max_tokens=120,
        extra_body=NO_THINK,
    ) as stream:
        announced = []
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                announced.append(event.name)
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    ((name, _),) = check_calls(choice.message.tool_calls)
    assert announced and set(announced) == {name}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_call_cut_by_max_tokens_is_never_raw_json(
    client: openai.OpenAI, choice: Any
) -> None:
    """Four tokens cut any call here: finish_reason length, no content, and
    only calls that closed before the cut (none can in four tokens)."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=4,
        extra_body=NO_THINK,
    )
    (c,) = r.choices
    assert c.finish_reason == "length"
    assert c.message.content is None, c.message.content
    assert not c.message.tool_calls
    assert r.usage is not None and r.usage.completion_tokens == 4


@pytest.mark.parametrize("stream", [False, True])
def test_named_call(client: openai.OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "seed": 3,
        "max_tokens": 60,
        "extra_body": NO_THINK,
    }
    if not stream:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"  # a named call stops, as in OpenAI
        assert [n for n, _ in check_calls(r.choices[0].message.tool_calls)] == ["get_time"]
        return
    deltas = [
        tc
        for chunk in client.chat.completions.create(stream=True, **kw)
        for choice in chunk.choices
        for tc in choice.delta.tool_calls or ()
    ]
    first, *rest = deltas
    assert (first.index, first.type, first.function and first.function.name) == (
        0,
        "function",
        "get_time",
    )
    assert first.id and all(d.id is None and d.function and not d.function.name for d in rest)
    args = "".join(d.function.arguments or "" for d in deltas if d.function)
    jsonschema.validate(json.loads(args), TIME)


class Forecast(BaseModel):
    city: Literal["Oslo", "Rome", "Lima"]
    rain: bool
    unit: Literal["c", "f"]


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        response_format=Forecast,
        seed=5,
        max_tokens=60,
        extra_body=NO_THINK,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)


def test_two_turns_with_a_tool_result(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        seed=1,
        max_tokens=60,
        extra_body=NO_THINK,
    )
    message = first.choices[0].message
    ((_, args),) = check_calls(message.tool_calls)
    result = json.dumps({"city": args["city"], "temperature": -3, "sky": "snow"})
    history: list[Any] = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": result},  # type: ignore[index]
    ]
    second = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        seed=2,
        max_tokens=60,
        extra_body=NO_THINK,
    )
    assert [n for n, _ in check_calls(second.choices[0].message.tool_calls)] == ["get_time"]
    # The call and its result went into the prompt (the template renders both).
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20
    # auto: whatever the random model says comes back as text or as valid calls.
    third = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, seed=4, max_tokens=30, extra_body=NO_THINK
    )
    msg = third.choices[0].message
    assert msg.tool_calls is None or check_calls(msg.tool_calls)


def test_bad_constraints_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=5,
            extra_body={"structured_outputs": {"regex": "a(b"}},
        )
    assert info.value.body["param"] == "structured_outputs.regex"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=5,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_raw_completion_is_constrained_from_the_first_token(client: openai.OpenAI) -> None:
    """A raw prompt has no thought to wait for: the constraint holds at once,
    although the engine runs the qwen3 reasoning parser."""
    r = client.completions.create(
        model=MODEL,
        prompt="Is it raining? Answer:",
        max_tokens=20,
        seed=9,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(
        model=MODEL,
        prompt="The weather as JSON:",
        max_tokens=60,
        seed=9,
        extra_body={"guided_json": TIME},
    )
    jsonschema.validate(json.loads(r.choices[0].text), TIME)
