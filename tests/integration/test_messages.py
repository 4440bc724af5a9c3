"""Anthropic Messages against the real engine, with the official `anthropic` client.

The demo model has random weights: thinking is off where structure must hold
(it never writes </think>), tool input is forced and bounded by enums, and
answers are short. What is tested is what the server guarantees: the
client's types parse every body, its stream helper assembles the same
message as the whole body (greedy), a forced tool_use is valid input of its
schema and a tool_result turn is accepted, count_tokens counts what the
engine is given (the chat API's count for the same conversation), prefix
cache hits are reported, and refusals are the client's exception classes.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import jsonschema
import orjson
import pytest

from tests.agents import RECORDED
from tests.integration.test_tools import MODEL, WEATHER
from tests.support import SluiceProcess

pytestmark = pytest.mark.engine

OFF: Any = {"type": "disabled"}
ASK: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
TOOL: Any = {"name": "get_weather", "description": "Weather now.", "input_schema": WEATHER}


@pytest.fixture(scope="module")
def ac(sluice_server: SluiceProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=sluice_server.base, api_key="unused", max_retries=0)


def test_create_and_stream_agree(ac: anthropic.Anthropic) -> None:
    kw: Any = {
        "model": MODEL,
        "max_tokens": 12,
        "messages": ASK,
        "thinking": OFF,
        "extra_body": {"temperature": 0},
    }
    msg = ac.messages.create(**kw)
    assert msg.id.startswith("msg_") and msg.model == MODEL and msg.role == "assistant"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason in ("max_tokens", "end_turn")
    assert msg.usage.output_tokens <= 12
    with ac.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    assert final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens


def test_forced_tool_use_then_tool_result(ac: anthropic.Anthropic) -> None:
    kw: Any = {
        "model": MODEL,
        "max_tokens": 80,
        "thinking": OFF,
        "tools": [TOOL],
        "extra_body": {"temperature": 0},
    }
    msg = ac.messages.create(
        messages=ASK, tool_choice={"type": "tool", "name": "get_weather"}, **kw
    )
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    assert msg.stop_reason == "tool_use"
    with ac.messages.stream(
        messages=ASK, tool_choice={"type": "tool", "name": "get_weather"}, **kw
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.input) for b in streamed.content] == [("tool_use", uses[0].input)]  # type: ignore[union-attr]

    turn: Any = [
        *ASK,
        {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "4 C, rain"},
                {"type": "text", "text": "Summarise."},
            ],
        },
    ]
    answer = ac.messages.create(messages=turn, max_tokens=8, model=MODEL, thinking=OFF)
    assert answer.content and answer.content[0].type == "text"


def test_count_tokens_is_the_chat_apis_prompt(
    ac: anthropic.Anthropic, sluice_server: SluiceProcess
) -> None:
    """The three APIs agree: the same conversation renders to the same tokens
    through Messages (count_tokens) and chat (/tokenize with messages)."""
    counted = ac.messages.count_tokens(
        model=MODEL,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "c1",
                        "name": "get_weather",
                        "input": {"city": "Oslo", "unit": "c", "alerts": False},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "4 C"}],
            },
        ],
        tools=[TOOL],
        thinking=OFF,
    )
    call = {
        "id": "c1",
        "type": "function",
        "function": {
            "name": "get_weather",
            "arguments": '{"city": "Oslo", "unit": "c", "alerts": false}',
        },
    }
    chat = httpx.post(
        sluice_server.base + "/tokenize",
        json={
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "Be brief."},
                *ASK,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "4 C"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "Weather now.",
                        "parameters": WEATHER,
                    },
                }
            ],
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert chat.status_code == 200, chat.text
    assert counted.input_tokens == chat.json()["count"]


def test_prefix_cache_hits_are_cache_read_input_tokens(ac: anthropic.Anthropic) -> None:
    system = "You answer questions about the weather. " * 40
    kw: Any = {"model": MODEL, "max_tokens": 2, "system": system, "messages": ASK, "thinking": OFF}
    first = ac.messages.create(**kw)
    again = ac.messages.create(**kw)
    total = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert again.usage.cache_read_input_tokens and again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total


def test_unknown_model_is_not_found(ac: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as exc:
        ac.messages.create(model="claude-opus-4-6", max_tokens=4, messages=ASK)
    assert exc.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {"type": "text", "media_type": "text/plain", "data": "x"},
                        }
                    ],
                }
            ],
        )


def test_claude_codes_own_model_name_is_a_404_naming_it(sluice_server: SluiceProcess) -> None:
    """Claude Code's recorded opening request (tests/agents/recorded/) with its
    own model name, as when ANTHROPIC_MODEL is not set: a 404 that says which
    model is missing. The whole turn runs in test_coding_agents.py."""
    rec = orjson.loads((RECORDED / "claude-code-2.1.332.json").read_bytes())
    unset = httpx.post(
        sluice_server.base + rec["path"],
        json={**rec["body"], "model": "claude-opus-4-6"},
        headers={**rec["headers"], "x-api-key": "unused"},
        timeout=30,
    )
    assert unset.status_code == 404
    assert unset.json()["error"]["message"].startswith("model: The model `claude-opus-4-6`")
