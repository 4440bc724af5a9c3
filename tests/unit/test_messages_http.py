"""/v1/messages through the whole HTTP pipeline on the fake engine, spoken to by
the official `anthropic` client over a real loopback socket: bodies, the
stream helper's assembly, tool_use with vLLM's real parsers (demo tokenizer),
count_tokens, pings, auth by x-api-key, and errors in Anthropic's shape and
statuses (the client raises the right exception class)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anthropic
import orjson
import pytest

from server.api.anthropic_messages import endpoint as messages
from server.callers import parse_callers
from server.state import RUNTIME, Phase
from tests.fakes import FakeEngine
from tests.unit.test_tools_http import AUTO_SCRIPT, PARAMS

pytestmark = pytest.mark.timeout(60)

HI = [{"role": "user", "content": "hi"}]


def client_for(client: Any, key: str = "none") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=str(client.make_url("")).rstrip("/"), api_key=key, max_retries=0
    )


@pytest.fixture(scope="module")
def tok(demo_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


async def test_create_splits_thinking_from_text(make_client: Any) -> None:
    engine = FakeEngine(script=("<think>", "hmm", "</think>", "Hello", " world"))
    client, _, _ = await make_client(engine)
    async with client_for(client) as ac:
        msg = await ac.messages.create(model="fake", max_tokens=20, messages=HI)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == "fake"
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "hmm"  # type: ignore[union-attr]
    assert msg.content[0].signature == ""  # type: ignore[union-attr]
    assert msg.content[1].text == "Hello world"  # type: ignore[union-attr]
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 5 and msg.usage.input_tokens > 0


async def test_max_tokens_is_stop_reason_max_tokens(make_client: Any) -> None:
    client, _, _ = await make_client()
    async with client_for(client) as ac:
        msg = await ac.messages.create(
            model="fake", max_tokens=4, messages=HI, thinking={"type": "disabled"}
        )
    assert msg.stop_reason == "max_tokens"
    assert [b.type for b in msg.content] == ["text"]  # thinking off: all text


async def test_stream_helper_assembles_the_same_message(make_client: Any) -> None:
    engine = FakeEngine(script=("<think>", "hm", "m", "</think>", "Hel", "lo"))
    client, _, _ = await make_client(engine)
    async with client_for(client) as ac:
        whole = await ac.messages.create(model="fake", max_tokens=20, messages=HI)
        async with ac.messages.stream(model="fake", max_tokens=20, messages=HI) as stream:
            kinds = [e.type async for e in stream]
            final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_use_blocks_with_input_objects(make_client: Any, tok: Any, stream: bool) -> None:
    engine = FakeEngine(script=AUTO_SCRIPT, tokenizer=tok)
    client, _, _ = await make_client(engine)
    kw: dict[str, Any] = {
        "model": "fake",
        "max_tokens": 40,
        "messages": HI,
        "thinking": {"type": "disabled"},
        "tools": [
            {"name": "get_weather", "input_schema": PARAMS},
            {"name": "get_time", "input_schema": {"type": "object"}},
        ],
    }
    async with client_for(client) as ac:
        if stream:
            async with ac.messages.stream(**kw) as s:
                msg = await s.get_final_message()
        else:
            msg = await ac.messages.create(**kw)
    uses = [(b.name, b.input) for b in msg.content if b.type == "tool_use"]
    assert uses == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert msg.stop_reason == "tool_use"


async def test_count_tokens_counts_what_create_sends(make_client: Any) -> None:
    client, _, _ = await make_client()
    async with client_for(client) as ac:
        counted = await ac.messages.count_tokens(model="fake", messages=HI, system="be brief")
        msg = await ac.messages.create(model="fake", max_tokens=3, messages=HI, system="be brief")
    assert counted.input_tokens == msg.usage.input_tokens > 0


async def test_quiet_stream_gets_pings(make_client: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(messages, "PING_IDLE_S", 0.05)
    client, _, _ = await make_client(FakeEngine(step=0.3, script=("a", "b")))
    resp = await client.post(
        "/v1/messages", json={"model": "fake", "max_tokens": 5, "messages": HI, "stream": True}
    )
    text = await resp.text()
    events = [f.split("\n")[0] for f in text.split("\n\n") if f]
    assert "event: ping" in events
    assert events[-1] == "event: message_stop"  # nothing after the closing frames


async def test_errors_are_anthropic_exceptions(make_client: Any) -> None:
    client, app, _ = await make_client()
    async with client_for(client) as ac:
        with pytest.raises(anthropic.NotFoundError) as nf:
            await ac.messages.create(model="claude-x", max_tokens=5, messages=HI)
        assert nf.value.body == {
            "type": "error",
            "error": {
                "type": "not_found_error",
                "message": "model: The model `claude-x` does not exist.",
            },
        }
        with pytest.raises(anthropic.BadRequestError) as br:
            await ac.messages.create(
                model="fake",
                max_tokens=5,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
                        ],
                    }
                ],
            )
        assert br.value.body["error"]["message"].startswith(  # type: ignore[index]
            "messages[0].content[0].type: an image block"
        )
        app[RUNTIME].phase = Phase.DRAINING
        with pytest.raises(anthropic.InternalServerError) as ov:
            await ac.messages.create(model="fake", max_tokens=5, messages=HI)
        assert ov.value.status_code == 529
        assert ov.value.response.headers["Retry-After"] == "5"
        assert ov.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    # The chat API keeps OpenAI's shape and status on the same refusal.
    chat = await client.post(
        "/v1/chat/completions", json={"model": "fake", "messages": HI, "max_tokens": 2}
    )
    assert chat.status == 503
    assert set(orjson.loads(await chat.text())) == {"error"}


async def test_missing_max_tokens_is_400(make_client: Any) -> None:
    client, _, _ = await make_client()
    resp = await client.post("/v1/messages", json={"model": "fake", "messages": HI})
    assert resp.status == 400
    body = orjson.loads(await resp.text())
    assert body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "max_tokens: 'max_tokens' is required",
        },
    }


async def test_x_api_key_and_bearer_name_the_same_caller(make_client: Any) -> None:
    table = parse_callers('[callers.team]\nkey = "sk-team"\n')
    client, _, _ = await make_client(caller_table=table, callers=table.policies)
    async with client_for(client, "sk-team") as ac:  # sends x-api-key
        msg = await ac.messages.create(model="fake", max_tokens=2, messages=HI)
        assert msg.stop_reason == "max_tokens"
    async with client_for(client, "wrong") as ac:
        with pytest.raises(anthropic.AuthenticationError) as ae:
            await ac.messages.create(model="fake", max_tokens=2, messages=HI)
        assert ae.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    bearer = await client.post(
        "/v1/messages",
        json={"model": "fake", "max_tokens": 2, "messages": HI},
        headers={"Authorization": "Bearer sk-team", "anthropic-version": "2023-06-01"},
    )
    assert bearer.status == 200, await bearer.text()
    # x-api-key works on the OpenAI paths too; a wrong key there is OpenAI's 401.
    models = await client.get("/v1/models", headers={"x-api-key": "sk-team"})
    assert models.status == 200
    bad = await client.get("/v1/models", headers={"x-api-key": "nope"})
    assert bad.status == 401 and "error" in orjson.loads(await bad.text())


async def test_stream_cut_by_disconnect_aborts_in_engine(make_client: Any) -> None:
    engine = FakeEngine(step=0.05)
    client, _, _ = await make_client(engine)
    resp = await client.post(
        "/v1/messages",
        json={"model": "fake", "max_tokens": 200, "messages": HI, "stream": True},
    )
    await resp.content.readline()
    resp.close()
    for _ in range(200):
        if [a for a in engine.aborted if not a.startswith("warmup-")]:
            break
        await asyncio.sleep(0.02)
    assert [a for a in engine.aborted if not a.startswith("warmup-")]


async def test_max_tokens_above_the_room_left_is_lowered_to_it(make_client: Any) -> None:
    client, _, engine = await make_client()  # 256 positions
    async with client_for(client) as ac:
        msg = await ac.messages.create(model="fake", max_tokens=9000, messages=HI)
        counted = await ac.messages.count_tokens(model="fake", messages=HI)
    assert msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == engine.max_model_len - counted.input_tokens


async def test_engine_death_mid_stream_is_an_error_event(make_client: Any) -> None:
    client, _, engine = await make_client(engine=FakeEngine(step=0.02), warmup=False)
    resp = await client.post(
        "/v1/messages",
        json={"model": "fake", "max_tokens": 200, "messages": HI, "stream": True},
    )
    assert resp.status == 200
    head = await resp.content.readline()  # message_start is out: headers are gone
    for _ in range(250):
        if [r for r in engine._producers if not r.startswith("warmup-")]:
            break
        await asyncio.sleep(0.02)
    engine.kill()
    frames = [f for f in (head + await resp.content.read()).decode().split("\n\n") if f]
    kind, data = frames[-1].split("\n")
    assert kind == "event: error"
    err = orjson.loads(data.removeprefix("data: "))
    assert err["type"] == "error" and err["error"]["type"] == "overloaded_error"
    assert "died" in err["error"]["message"]


async def test_stop_sequence_is_named_and_cut_from_the_text(make_client: Any) -> None:
    # As vLLM with include_stop_str_in_output: the text ends with the stop string
    # (the fake says at most three pieces when a request has stop strings).
    client, _, _ = await make_client(FakeEngine(script=("Hello wor", "ld", " END")))
    async with client_for(client) as ac:
        msg = await ac.messages.create(
            model="fake",
            max_tokens=20,
            messages=HI,
            stop_sequences=["END", "ld END"],
            thinking={"type": "disabled"},
        )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "ld END"
    assert msg.content[0].text == "Hello wor"  # type: ignore[union-attr]


async def test_claude_codes_preconnect_is_answered(make_client: Any) -> None:
    """Claude Code 2.1.332 sends HEAD /api/hello to its base URL as it starts."""
    client, _, _ = await make_client()
    assert (await client.head("/api/hello")).status == 200
    assert (await client.get("/api/hello")).status == 200
