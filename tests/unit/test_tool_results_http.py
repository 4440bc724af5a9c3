"""A tool result for a call never made, through the official clients (issue 64).

Each API runs a real tool loop on the fake engine (vLLM's real parsers on the
demo tokenizer read its two parallel calls): the results of the calls the
server made, sent back in reverse order, are served; a result whose id no
call carries is a 400 in the API's own error shape, which the `openai` and
`anthropic` packages raise as BadRequestError, naming the id and its field.
The rule itself: tests/unit/test_tool_results.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.fakes import FakeEngine
from tests.unit.test_tools_http import AUTO_SCRIPT, NO_THINK, PARAMS, TOOLS

pytestmark = pytest.mark.timeout(60)

ASK = {"role": "user", "content": "weather?"}
NEVER = "call_never_made"


@pytest.fixture(scope="module")
def tok(demo_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


async def serve(make_client: Any, tok: Any) -> str:
    """A server whose model calls get_weather and get_time at once; its URL."""
    client, _, _ = await make_client(FakeEngine(script=AUTO_SCRIPT, tokenizer=tok))
    return str(client.make_url("")).rstrip("/")


async def test_chat_completions(make_client: Any, tok: Any) -> None:
    url = await serve(make_client, tok)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oc:
        kw: dict[str, Any] = {
            "model": "fake",
            "max_tokens": 40,
            "tools": TOOLS,
            "extra_body": {"chat_template_kwargs": NO_THINK},
        }
        first = await oc.chat.completions.create(messages=[ASK], **kw)
        said = first.choices[0].message
        ids = [c.id for c in said.tool_calls or ()]
        assert len(ids) == 2
        turn = [ASK, said.model_dump(exclude_none=True)]
        results = [{"role": "tool", "tool_call_id": i, "content": "ok"} for i in reversed(ids)]
        await oc.chat.completions.create(messages=[*turn, *results], **kw)
        results[1]["tool_call_id"] = NEVER
        with pytest.raises(openai.BadRequestError) as err:
            await oc.chat.completions.create(messages=[*turn, *results], **kw)
    assert err.value.status_code == 400
    assert err.value.param == "messages[3].tool_call_id"
    assert err.value.type == "invalid_request_error"
    assert NEVER in err.value.message


async def test_responses(make_client: Any, tok: Any) -> None:
    url = await serve(make_client, tok)
    tools: Any = [{"type": "function", "name": t["function"]["name"]} for t in TOOLS]
    tools[0]["parameters"] = PARAMS
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oc:
        kw: dict[str, Any] = {
            "model": "fake",
            "max_output_tokens": 40,
            "tools": tools,
            "reasoning": {"effort": "none"},
        }
        first = await oc.responses.create(input="weather?", **kw)
        ids = [o.call_id for o in first.output if o.type == "function_call"]
        assert len(ids) == 2
        results: list[Any] = [
            {"type": "function_call_output", "call_id": i, "output": "ok"} for i in reversed(ids)
        ]
        # The calls of the stored response answered, and the same with the
        # whole history sent again.
        await oc.responses.create(previous_response_id=first.id, input=results, **kw)
        made = [o.model_dump(exclude_none=True) for o in first.output]
        await oc.responses.create(input=[ASK, *made, *results], **kw)
        results[1] = {**results[1], "call_id": NEVER}
        for more in (
            {"previous_response_id": first.id, "input": results},
            {"input": [ASK, *made, *results]},
        ):
            with pytest.raises(openai.BadRequestError) as err:
                await oc.responses.create(**more, **kw)
            at = 1 if "previous_response_id" in more else 1 + len(made) + 1
            assert err.value.status_code == 400
            assert err.value.param == f"input[{at}].call_id"
            assert NEVER in err.value.message


async def test_anthropic_messages(make_client: Any, tok: Any) -> None:
    url = await serve(make_client, tok)
    async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as ac:
        kw: dict[str, Any] = {
            "model": "fake",
            "max_tokens": 40,
            "thinking": {"type": "disabled"},
            "tools": [
                {"name": "get_weather", "input_schema": PARAMS},
                {"name": "get_time", "input_schema": {"type": "object"}},
            ],
        }
        first = await ac.messages.create(messages=[ASK], **kw)
        ids = [b.id for b in first.content if b.type == "tool_use"]
        assert len(ids) == 2
        turn: list[Any] = [ASK, {"role": "assistant", "content": first.model_dump()["content"]}]
        results: list[Any] = [
            {"type": "tool_result", "tool_use_id": i, "content": "ok"} for i in reversed(ids)
        ]
        await ac.messages.create(messages=[*turn, {"role": "user", "content": results}], **kw)
        results[1] = {**results[1], "tool_use_id": NEVER}
        bad = [*turn, {"role": "user", "content": results}]
        with pytest.raises(anthropic.BadRequestError) as err:
            await ac.messages.create(messages=bad, **kw)
        with pytest.raises(anthropic.BadRequestError) as counted:
            await ac.messages.count_tokens(model="fake", messages=bad)
    for e in (err, counted):
        assert e.value.status_code == 400
        body: Any = e.value.body
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith("messages[2].content[1].tool_use_id: ")
        assert NEVER in body["error"]["message"]
