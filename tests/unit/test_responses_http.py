"""/v1/responses through the whole HTTP pipeline, on a scripted FakeEngine.

Bodies are validated with the `openai` package's `Response` model and streams
assembled by its own `ResponseStreamState`, as the client's `responses.stream()`
does; vLLM's real parsers (on the demo tokenizer) read the tool calls.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from server.callers import parse_callers
from tests.fakes import FakeEngine

pytestmark = pytest.mark.timeout(60)

PATH = "/v1/responses"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}}}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
NO_THINK = {"effort": "none"}
EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def tok(demo_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "fake", "input": "weather?", "max_output_tokens": 40, **kw}


async def create(client: Any, payload: dict[str, Any], **headers: str) -> Response:
    resp = await client.post(PATH, json=payload, headers=headers)
    assert resp.status == 200, await resp.text()
    return Response.model_validate(await resp.json())


def events(text: str) -> list[dict[str, Any]]:
    """The stream's events, each frame's `event:` line checked against its type."""
    out = []
    for frame in text.split("\n\n"):
        if not frame:
            continue
        head, data = frame.split("\n")
        event = orjson.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


async def streamed(client: Any, payload: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """The raw events, and the final response as the openai stream helper assembles it."""
    resp = await client.post(PATH, json={**payload, "stream": True})
    assert resp.status == 200, await resp.text()
    raw = events(await resp.text())
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=TOOLS, text_format=omit)  # type: ignore[arg-type]
    final = None
    for event in raw:
        for out in state.handle_event(EVENT.validate_python(event)):
            if out.type == "response.completed":
                final = out.response
    return raw, final


async def test_text_body_and_stream_agree(make_client: Any) -> None:
    engine = FakeEngine(script=("Just ", "text."))
    client, _, _ = await make_client(engine=engine, warmup=False)
    whole = await create(client, body(reasoning=NO_THINK, metadata={"k": "v"}))
    assert whole.id.startswith("resp_") and whole.status == "completed"
    assert whole.output_text == "Just text."
    assert whole.metadata == {"k": "v"} and whole.max_output_tokens == 40
    assert whole.usage is not None and whole.usage.output_tokens == 2
    raw, final = await streamed(client, body(reasoning=NO_THINK))
    kinds = [e["type"] for e in raw]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.output_text == "Just text." and final.status == "completed"


async def test_thinking_is_a_reasoning_item(make_client: Any) -> None:
    script = ("Let me", " see.", "</think>", "Oslo.")
    client, _, _ = await make_client(engine=FakeEngine(script=script), warmup=False)
    for reasoning in (None, {"effort": "high"}):
        payload = body() if reasoning is None else body(reasoning=reasoning)
        whole = await create(client, payload)
        assert [o.type for o in whole.output] == ["reasoning", "message"]
        assert whole.output[0].content[0].text == "Let me see."  # type: ignore[union-attr,index]
        assert whole.output_text == "Oslo."
        assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens > 0
        raw, final = await streamed(client, payload)
        assert "response.reasoning_text.delta" in [e["type"] for e in raw]
        assert [o.type for o in final.output] == ["reasoning", "message"]
        assert final.output_text == "Oslo."


async def test_length_is_incomplete(make_client: Any) -> None:
    client, _, _ = await make_client(engine=FakeEngine(), warmup=False)
    whole = await create(client, body(max_output_tokens=5))
    assert whole.status == "incomplete"
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    resp = await client.post(PATH, json={**body(max_output_tokens=5), "stream": True})
    raw = events(await resp.text())
    assert raw[-1]["type"] == "response.incomplete"
    assert raw[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_call_then_its_output(make_client: Any, tok: Any, stream: bool) -> None:
    engine = FakeEngine(script=('{"city"', ':"Rome"}'), tokenizer=tok)
    client, _, _ = await make_client(engine=engine, warmup=False)
    payload = body(tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        _, first = await streamed(client, {**payload, "reasoning": NO_THINK})
    else:
        first = await create(client, {**payload, "reasoning": NO_THINK})
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Rome"}
    follow = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": '{"temp": 21}',
    }
    # Continued from the stored response, and with the whole history sent again.
    by_id = body(previous_response_id=first.id, input=[follow], reasoning=NO_THINK)
    history = [{"role": "user", "content": "weather?"}, call.model_dump(), follow]
    whole = body(input=history, reasoning=NO_THINK)
    assert (await create(client, by_id)).status == "completed"
    assert (await create(client, whole)).status == "completed"
    # Both rendered the same conversation: the same token ids on a real engine.
    by_id_prompt, whole_prompt = engine.rendered[-2:]
    assert by_id_prompt == whole_prompt
    assert [m.role for m in whole_prompt[0]] == ["user", "assistant", "tool"]
    assert whole_prompt[0][1].tool_calls[0].id == call.call_id


async def test_store_get_delete_and_owner(make_client: Any) -> None:
    table = parse_callers('[callers.alice]\nkey = "ka"\n[callers.bob]\nkey = "kb"\n')
    client, _, _ = await make_client(
        engine=FakeEngine(script=("hi",)), warmup=False, caller_table=table, callers=table.policies
    )
    alice = {"Authorization": "Bearer ka"}
    bob = {"Authorization": "Bearer kb"}
    r = await create(client, body(), **alice)
    got = await client.get(f"{PATH}/{r.id}", headers=alice)
    assert got.status == 200 and Response.model_validate(await got.json()).id == r.id
    for method in (client.get, client.delete):
        other = await method(f"{PATH}/{r.id}", headers=bob)
        assert other.status == 404
        assert (await other.json())["error"]["type"] == "not_found_error"
    cont = await client.post(PATH, json=body(previous_response_id=r.id), headers=bob)
    assert cont.status == 404 and (await cont.json())["error"]["param"] == "previous_response_id"
    deleted = await client.delete(f"{PATH}/{r.id}", headers=alice)
    assert (await deleted.json()) == {"id": r.id, "object": "response.deleted", "deleted": True}
    assert (await client.get(f"{PATH}/{r.id}", headers=alice)).status == 404
    unstored = await create(client, body(store=False), **alice)
    assert (await client.get(f"{PATH}/{unstored.id}", headers=alice)).status == 404


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        (
            {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
            "tool_choice.type",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, None),
        ({"previous_response_id": "resp_gone"}, "previous_response_id"),
        ({"input": "x" * 400}, "input"),  # over the fake's 256-token context
    ],
)
async def test_refusals_name_the_field(
    make_client: Any, extra: dict[str, Any], param: str | None
) -> None:
    engine = FakeEngine()
    client, _, _ = await make_client(engine=engine, warmup=False)
    resp = await client.post(PATH, json=body(**extra))
    error = (await resp.json())["error"]
    if param == "previous_response_id":
        assert resp.status == 404
    else:
        assert resp.status == 400
    assert error["param"] == (param or "input[0].content[0].type")
    if param and param.startswith("tools"):
        assert extra["tools"][0]["type"] in error["message"]
    assert engine.added == []
