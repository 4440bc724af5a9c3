"""Ollama's API against the real engine, with Ollama's own clients unchanged.

The `ollama` Python client (chat plain, streamed, with tools and a tool result
turn, with `format` from a pydantic model; generate; list, show, ps),
LangChain's `ChatOllama` (invoke, stream, bind_tools, with_structured_output)
and the JavaScript `ollama` client from npm (a streamed chat, installed once
into the suite's npm cache as the coding agents are: tests/agents/install.py).

The demo model has random weights: thinking is off where a constraint must
engage (it never writes </think>), schemas are bounded (enums, booleans),
answers greedy and short. It never chooses a tool call by itself and Ollama's
API cannot force one, so the tool tests check that the tools reach the prompt
and that a call and its result go back as a turn; the calls themselves, in
Ollama's shape, are read with vLLM's real parsers in
tests/unit/test_ollama_http.py. The embedding routes wait for an embedding
model (issue 30); here they refuse in Ollama's shape.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import ollama
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_ollama import ChatOllama
from pydantic import BaseModel

from tests.agents.install import cache_dir, install_package
from tests.integration.test_tools import MODEL
from tests.support import SluiceProcess

pytestmark = pytest.mark.engine

# The JavaScript client, pinned (bump by hand: `npm view ollama version`).
OLLAMA_JS = ("ollama", "0.6.4")
GREEDY: Any = {"temperature": 0, "num_predict": 12}
ASK: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
            "required": ["city"],
        },
    },
}


class Weather(BaseModel):
    """Bounded, so that the random model closes it."""

    city: Literal["Oslo", "Rome", "Lima"]
    rain: bool


@pytest.fixture(scope="module")
def oc(sluice_server: SluiceProcess) -> Any:
    with ollama.Client(host=sluice_server.base) as client:
        yield client


def test_chat_whole_and_streamed_agree(oc: ollama.Client) -> None:
    whole = oc.chat(model=f"{MODEL}:latest", messages=ASK, think=False, options=GREEDY)
    assert whole.model == f"{MODEL}:latest" and whole.done
    assert whole.done_reason in ("stop", "length") and 0 < (whole.eval_count or 0) <= 12
    assert (whole.total_duration or 0) > (whole.eval_duration or 0) > 0
    assert whole.message.role == "assistant" and whole.message.thinking is None
    parts = list(oc.chat(model=MODEL, messages=ASK, think=False, options=GREEDY, stream=True))
    assert len(parts) > 2 and parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_thinking_comes_back_as_thinking(oc: ollama.Client) -> None:
    r = oc.chat(model=MODEL, messages=ASK, think=True, options=GREEDY)
    # The demo model never closes its thought: all of it is thinking.
    assert r.message.thinking and not r.message.content


def test_tools_reach_the_prompt_and_a_tool_turn_is_answered(oc: ollama.Client) -> None:
    plain = oc.chat(model=MODEL, messages=ASK, think=False, options=GREEDY)
    with_tool = oc.chat(model=MODEL, messages=ASK, tools=[TOOL], think=False, options=GREEDY)
    assert (with_tool.prompt_eval_count or 0) > (plain.prompt_eval_count or 0) + 20
    call = {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    turn = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "4 C, rain", "tool_name": "get_weather"},
    ]
    parts = list(
        oc.chat(model=MODEL, messages=turn, tools=[TOOL], think=False, options=GREEDY, stream=True)
    )
    assert parts[-1].done and (parts[-1].prompt_eval_count or 0) > with_tool.prompt_eval_count


def test_format_from_a_pydantic_model(oc: ollama.Client) -> None:
    r = oc.chat(
        model=MODEL,
        messages=ASK,
        format=Weather.model_json_schema(),
        think=False,
        options={"temperature": 0, "num_predict": 60},
    )
    assert Weather.model_validate_json(r.message.content or "")
    j = oc.generate(model=MODEL, prompt="Weather?", format="json", think=False, options=GREEDY)
    assert r.done and j.done


def test_generate_whole_streamed_and_raw(oc: ollama.Client) -> None:
    whole = oc.generate(
        model=MODEL, prompt="Once upon", system="Be brief.", think=False, options=GREEDY
    )
    parts = list(
        oc.generate(
            model=MODEL,
            prompt="Once upon",
            system="Be brief.",
            think=False,
            options=GREEDY,
            stream=True,
        )
    )
    assert "".join(p.response or "" for p in parts) == whole.response
    assert parts[-1].done and parts[-1].eval_count == whole.eval_count
    # Raw: the prompt as sent, without the chat template's tokens around it.
    templated = oc.generate(model=MODEL, prompt="Once upon", think=False, options=GREEDY)
    raw = oc.generate(model=MODEL, prompt="Once upon", raw=True, options=GREEDY)
    assert raw.done and 0 < (raw.prompt_eval_count or 0) < (templated.prompt_eval_count or 0)


def test_list_show_ps(oc: ollama.Client) -> None:
    assert [m.model for m in oc.list().models] == [f"{MODEL}:latest"]
    shown = oc.show(MODEL)
    assert shown.capabilities == ["completion", "tools", "thinking"]
    assert (shown.modelinfo or {})["sluice.context_length"] >= 4096
    running = oc.ps().models
    assert [m.model for m in running] == [f"{MODEL}:latest"] and running[0].context_length


def test_refusals(oc: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as nf:
        oc.chat(model=f"{MODEL}:7b", messages=ASK)
    assert nf.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as emb:
        oc.embed(model=MODEL, input="x")
    assert emb.value.status_code == 400 and "embedding" in emb.value.error


# -- LangChain -------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_ollama(sluice_server: SluiceProcess) -> Iterator[Callable[[int], ChatOllama]]:
    """chat_ollama(num_predict): a greedy ChatOllama on the server; its
    connection (an `ollama.Client` LangChain keeps and never closes) closed
    after the module."""
    made: list[ChatOllama] = []

    def make(num_predict: int) -> ChatOllama:
        made.append(
            ChatOllama(
                model=MODEL,
                base_url=sluice_server.base,
                reasoning=False,
                temperature=0,
                num_predict=num_predict,
            )
        )
        return made[-1]

    yield make
    for lc in made:
        lc._client.close()


@pytest.fixture(scope="module")
def lc(chat_ollama: Callable[[int], ChatOllama]) -> ChatOllama:
    return chat_ollama(12)


def test_langchain_invoke_and_stream(lc: ChatOllama, oc: ollama.Client) -> None:
    whole = lc.invoke([HumanMessage("What is the weather in Oslo?")])
    assert isinstance(whole, AIMessage) and whole.usage_metadata
    assert whole.response_metadata["done_reason"] in ("stop", "length")
    chunks = list(lc.stream([HumanMessage("What is the weather in Oslo?")]))
    assert all(isinstance(c, AIMessageChunk) for c in chunks) and len(chunks) > 2
    assert "".join(str(c.content) for c in chunks) == whole.content
    # ChatOllama streams under invoke too: the same answer, asked whole.
    asked = oc.chat(model=MODEL, messages=ASK, think=False, options=GREEDY, stream=False)
    assert whole.content == asked.message.content


def test_langchain_bind_tools_and_a_tool_result(lc: ChatOllama) -> None:
    @tool
    def get_weather(city: Literal["Oslo", "Rome"]) -> str:
        """Weather now."""
        return "4 C"

    bound = lc.bind_tools([get_weather])
    first = bound.invoke([HumanMessage("What is the weather in Oslo?")])
    assert isinstance(first, AIMessage)
    call = {"name": "get_weather", "args": {"city": "Oslo"}, "id": "call_1"}
    history = [
        HumanMessage("What is the weather in Oslo?"),
        AIMessage("", tool_calls=[call]),
        ToolMessage("4 C, rain", tool_call_id="call_1"),
    ]
    answer = bound.invoke(history)
    assert isinstance(answer, AIMessage) and answer.response_metadata["done"]


def test_langchain_structured_output(chat_ollama: Callable[[int], ChatOllama]) -> None:
    got = chat_ollama(60).with_structured_output(Weather).invoke("What is the weather in Oslo?")
    assert isinstance(got, Weather)


# -- the JavaScript client ---------------------------------------------------------

_JS = """
const { Ollama } = require(process.env.OLLAMA_JS);
(async () => {
  const client = new Ollama({ host: process.env.OLLAMA_HOST });
  const ask = { model: process.env.MODEL, messages: [{ role: "user", content: "Hi" }],
                think: false, options: { temperature: 0, num_predict: 12 } };
  const parts = [];
  for await (const part of await client.chat({ ...ask, stream: true })) parts.push(part);
  const whole = await client.chat({ ...ask, stream: false });
  console.log(JSON.stringify({ parts, whole }));
})().catch((err) => { console.error(err); process.exit(1); });
"""


@pytest.fixture(scope="module")
def ollama_js() -> Path:
    if shutil.which("npm") is None:
        if os.environ.get("CI"):
            pytest.fail("npm is missing: .ci/run installs Node.js and npm on a fresh machine")
        pytest.skip("npm is not installed: the JavaScript client's test needs Node.js and npm")
    package, version = OLLAMA_JS
    home = install_package(
        package, version, cache_dir(os.environ), expect=Path("node_modules", package)
    )
    return home / "node_modules" / package


def test_javascript_client_streams_a_chat(
    sluice_server: SluiceProcess, ollama_js: Path, tmp_path: Path
) -> None:
    script = tmp_path / "chat.cjs"
    script.write_text(_JS)
    env = {
        **os.environ,
        "OLLAMA_JS": str(ollama_js),
        "OLLAMA_HOST": sluice_server.base,
        "MODEL": MODEL,
    }
    out = subprocess.run(
        ["node", str(script)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    parts, whole = got["parts"], got["whole"]
    assert len(parts) > 2 and parts[-1]["done"] and not any(p["done"] for p in parts[:-1])
    assert "".join(p["message"]["content"] for p in parts) == whole["message"]["content"]
    assert parts[-1]["eval_count"] == whole["eval_count"] > 0
