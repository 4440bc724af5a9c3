"""The four chat-shaped APIs agree: one conversation, sent through OpenAI chat,
Anthropic Messages, OpenAI Responses and Ollama's chat, reaches the engine's
renderer as the same messages and template arguments, so the real engine sees
the same token ids (its chat template is a pure function of those two). The
fake engine records what each request asked it to render."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fakes import FakeEngine

pytestmark = pytest.mark.timeout(60)

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}}}
SYSTEM = "Be brief."
ASK = "Weather in Rome?"
# Messages carries a call's input as an object, sent on as compact JSON text.
ARGS = '{"city":"Rome"}'
RESULT = '{"temp": 21}'

CHAT = {
    "model": "fake",
    "max_tokens": 8,
    "chat_template_kwargs": {"enable_thinking": False},
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}],
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ARGS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ],
}
MESSAGES = {
    "model": "fake",
    "max_tokens": 8,
    "thinking": {"type": "disabled"},
    "system": SYSTEM,
    "tools": [{"name": "get_weather", "input_schema": PARAMS}],
    "messages": [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "call_1",
                    "name": "get_weather",
                    "input": {"city": "Rome"},
                }
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": RESULT}],
        },
    ],
}
RESPONSES = {
    "model": "fake",
    "max_output_tokens": 8,
    "reasoning": {"effort": "none"},
    "instructions": SYSTEM,
    "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
    "input": [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ARGS},
        {"type": "function_call_output", "call_id": "call_1", "output": RESULT},
    ],
}

OLLAMA = {
    "model": "fake:latest",
    "stream": False,
    "think": False,
    "options": {"num_predict": 8},
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}],
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": "",
            # Ollama carries a call's arguments as an object, as Messages does.
            "tool_calls": [
                {"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
            ],
        },
        {"role": "tool", "content": RESULT, "tool_call_id": "call_1"},
    ],
}


def _comparable(rendered: tuple[Any, dict[str, Any]]) -> Any:
    """What the chat template reads: each message's template dict, and the kwargs."""
    messages, kwargs = rendered
    return [m.template_dict() for m in messages], kwargs


async def test_one_conversation_renders_the_same_through_all_four(
    make_client: Any, tok: Any
) -> None:
    engine = FakeEngine(tokenizer=tok)
    client, _app, engine = await make_client(engine=engine, warmup=False)
    for path, payload in (
        ("/v1/chat/completions", CHAT),
        ("/v1/messages", MESSAGES),
        ("/v1/responses", RESPONSES),
        ("/api/chat", OLLAMA),
    ):
        resp = await client.post(path, json=payload)
        assert resp.status == 200, (path, await resp.text())
    chat, messages, responses, ollama = (_comparable(r) for r in engine.rendered[-4:])
    assert chat[0][-1]["role"] == "tool" and chat[1]["tools"]  # the whole turn, tools included
    assert messages == chat
    assert responses == chat
    assert ollama == chat


@pytest.fixture(scope="module")
def tok(demo_model_dir: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)
