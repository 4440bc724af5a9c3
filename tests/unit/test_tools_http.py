"""Tool calls and structured output through the whole HTTP pipeline, on a scripted FakeEngine.

The fake says crafted Qwen3 text; vLLM's real parsers (on the demo
tokenizer) read it. Bodies are validated with the `openai` package's models,
and streams assembled with its own stream helper, as a client would.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from server.wire.request import Constraint
from tests.fakes import FakeEngine

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_time"}},
]
NO_THINK = {"enable_thinking": False}
AUTO_SCRIPT = (
    "Checking.",
    "<tool_call>",
    '\n{"name": "get_weather", ',
    '"arguments": {"city": "Os',
    'lo"}}\n',
    "</tool_call>",
    '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
)


@pytest.fixture(scope="module")
def tok(demo_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


def body(**kw: Any) -> dict[str, Any]:
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "weather?"}],
        "max_tokens": 40,
        "tools": TOOLS,
        "chat_template_kwargs": NO_THINK,
        **kw,
    }


async def post(client: Any, payload: dict[str, Any]) -> Any:
    resp = await client.post(CHAT, json=payload)
    assert resp.status == 200, await resp.text()
    return resp


async def streamed(client: Any, payload: dict[str, Any]) -> Any:
    """The stream as the openai client's ChatCompletionStreamState assembles it."""
    resp = await post(client, {**payload, "stream": True})
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for frame in (await resp.text()).split("\n\n"):
        if frame and frame != "data: [DONE]":
            chunk = orjson.loads(frame.removeprefix("data: "))
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion()


def calls(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


async def test_auto_calls_non_streaming_and_streaming(make_client: Any, tok: Any) -> None:
    engine = FakeEngine(script=AUTO_SCRIPT, tokenizer=tok)
    client, _, _ = await make_client(engine=engine, warmup=False)
    whole = ChatCompletion.model_validate(await (await post(client, body())).json())
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    want = [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert calls(choice.message) == want
    assert all(c.id.startswith("chatcmpl-tool-") for c in choice.message.tool_calls or ())
    final = await streamed(client, body())
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.content == "Checking."
    assert calls(final.choices[0].message) == want


async def test_text_without_calls_stops(make_client: Any, tok: Any) -> None:
    engine = FakeEngine(script=("Just ", "text."), tokenizer=tok)
    client, _, _ = await make_client(engine=engine, warmup=False)
    whole = ChatCompletion.model_validate(await (await post(client, body())).json())
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content == "Just text."
    assert not whole.choices[0].message.tool_calls


async def test_thinking_with_tools(make_client: Any, tok: Any) -> None:
    script = ("Let me", " see.", "</think>", "\n\n", *AUTO_SCRIPT[1:])
    client, _, _ = await make_client(engine=FakeEngine(script=script, tokenizer=tok), warmup=False)
    payload = body(chat_template_kwargs={"enable_thinking": True})
    whole = await (await post(client, payload)).json()
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me see."
    final = await streamed(client, payload)
    assert final.choices[0].message.reasoning_content == "Let me see."  # type: ignore[attr-defined]
    assert calls(final.choices[0].message) == calls(
        ChatCompletion.model_validate(whole).choices[0].message
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_named_call(make_client: Any, tok: Any, stream: bool) -> None:
    engine = FakeEngine(script=('{"city"', ':"Rome"}'), tokenizer=tok)
    client, _, _ = await make_client(engine=engine, warmup=False)
    payload = body(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        final = await streamed(client, payload)
    else:
        final = ChatCompletion.model_validate(await (await post(client, payload)).json())
    assert final.choices[0].finish_reason == "stop"  # a named call, as in OpenAI and vLLM
    assert calls(final.choices[0].message) == [("get_weather", {"city": "Rome"})]
    # The engine was held to the parameters schema, checked first.
    assert engine.constraints == [Constraint("json", orjson.dumps(PARAMS).decode())]


async def test_forced_required_replaces_response_format(make_client: Any, tok: Any) -> None:
    script = ('[{"name":"get_time",', '"parameters":{}}]')
    engine = FakeEngine(script=script, tokenizer=tok)
    client, _, _ = await make_client(engine=engine, warmup=False)
    payload = body(tool_choice="required", response_format={"type": "json_object"})
    final = await streamed(client, payload)
    assert final.choices[0].finish_reason == "tool_calls"
    assert calls(final.choices[0].message) == [("get_time", {})]
    (constraint,) = engine.constraints
    assert json.loads(constraint.value)["type"] == "array"


async def test_response_format_reaches_the_engine(make_client: Any) -> None:
    engine = FakeEngine(script=('{"ok":', "true}"))
    client, _, _ = await make_client(engine=engine, warmup=False)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    payload = {**body(response_format=rf), "tools": None}
    whole = ChatCompletion.model_validate(await (await post(client, payload)).json())
    assert whole.choices[0].message.content == '{"ok":true}'
    assert engine.constraints == [
        Constraint(
            "json", orjson.dumps(schema).decode(), param="response_format.json_schema.schema"
        )
    ]


async def test_bad_constraint_is_400_before_queueing(make_client: Any) -> None:
    engine = FakeEngine()
    client, _, _ = await make_client(engine=engine, warmup=False)
    for path, payload in [
        (CHAT, {**body(structured_outputs={"regex": "("}), "tools": None}),
        ("/v1/completions", {"model": "fake", "prompt": "x", "guided_regex": "("}),
    ]:
        resp = await client.post(path, json=payload)
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["param"] in ("structured_outputs.regex", "guided_regex")
    assert engine.added == []


async def test_tools_need_the_engines_parsers(make_client: Any) -> None:
    client, _, _ = await make_client(engine=FakeEngine(), warmup=False)
    resp = await client.post(CHAT, json=body())
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tools"


async def test_constraints_dedupe_apart_and_batch_together(
    make_client: Any, tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Greedy twins share one generation only when their constraints match, and
    requests with different constraints still go out in one batch."""
    engine = FakeEngine(script=("{}",), tokenizer=tok)
    client, _, _ = await make_client(
        engine=engine, window=0.05, adaptive=False, release_lone=False, warmup=False
    )
    plain = {**body(temperature=0), "tools": None}
    regex_a = {**plain, "structured_outputs": {"regex": "a"}}
    regex_b = {**plain, "structured_outputs": {"regex": "b"}}
    with caplog.at_level(logging.INFO, logger="sluice.access"):
        replies = await asyncio.gather(
            *(client.post(CHAT, json=p) for p in (plain, regex_a, regex_a, regex_b))
        )
    assert all(r.status == 200 for r in replies)
    assert len(engine.added) == 3  # the two regex-a requests shared a generation
    batches = {r.fields["batch_id"] for r in caplog.records if hasattr(r, "fields")}  # type: ignore[attr-defined]
    assert len(batches) == 1


async def test_another_reasoning_parser_splits_requests_without_tools(
    make_client: Any, tok: Any
) -> None:
    """--reasoning-parser granite (text markers, not Qwen3's tags): a plain
    request is split by vLLM's granite parser, streamed or not, not by Qwen3's."""
    script = ("Here is my thought process:", " weigh it ", "Here is my response:", " Sunny.")
    engine = FakeEngine(script=script, tokenizer=tok, reasoning_parser="granite")
    client, _, _ = await make_client(engine=engine, warmup=False)
    plain = body(chat_template_kwargs={"enable_thinking": True})
    del plain["tools"]
    whole = ChatCompletion.model_validate(await (await post(client, plain)).json())
    message: Any = whole.choices[0].message
    assert (message.reasoning_content.strip(), message.content.strip()) == ("weigh it", "Sunny.")
    final: Any = (await streamed(client, plain)).choices[0].message
    assert (final.reasoning_content.strip(), final.content.strip()) == ("weigh it", "Sunny.")
