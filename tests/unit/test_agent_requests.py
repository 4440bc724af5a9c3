"""The coding agents' own requests, as recorded, through the whole HTTP pipeline.

Each file of tests/agents/recorded/ is one request an agent sent to Sluice,
recorded by the loopback proxy of tests/agents/proxy.py (docs/coding-agents.md,
"The agents in the test suite", says how to record another): the
method, path, the headers that say which API and betas it speaks, and the body
as sent, untrimmed. Each was refused by Sluice before issue 26 (the refusal is
in each test's docstring); here each must stream to its end on a FakeEngine
with the demo tokenizer, whose byte-per-token prompts are longer than the real
ones, so the context is sized from the prompt the fake renders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from server.api.openai_chat.parse import parse_chat
from server.wire.request import Limits
from tests.agents import RECORDED
from tests.fakes import FakeEngine

pytestmark = pytest.mark.timeout(60)

MODEL = "sluice-demo"  # the name the agents were pointed at
BIG = 1 << 20  # positions: room for any recorded prompt at a byte per token


@pytest.fixture(scope="module")
def tok(demo_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


def recorded(name: str) -> dict[str, Any]:
    rec: dict[str, Any] = orjson.loads((RECORDED / name).read_bytes())
    assert rec["body"]["model"] == MODEL
    return rec


async def send(client: Any, rec: dict[str, Any]) -> tuple[int, str]:
    headers = {**rec["headers"], "authorization": "Bearer k", "x-api-key": "k"}
    resp = await client.request(rec["method"], rec["path"], json=rec["body"], headers=headers)
    return resp.status, await resp.text()


async def ignored(client: Any) -> dict[str, set[str]]:
    """``sluice_ignored_fields_total`` from /metrics: the fields counted per API."""
    text = await (await client.get("/metrics")).text()
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("sluice_ignored_fields_total{"):
            labels = dict(
                part.split("=", 1)
                for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            out.setdefault(labels["api"].strip('"'), set()).add(labels["field"].strip('"'))
    return out


CLAUDE_CODE_IGNORES = {
    "context_management",
    "output_config.effort",
    "thinking.display",
    "system[].cache_control",
    "messages[].content[].cache_control",
}


def sse_data(text: str) -> list[Any]:
    return [
        orjson.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


@pytest.mark.parametrize(
    "name", ["claude-code-2.1.332.json", "claude-code-2.1.332-tool-search.json"]
)
async def test_claude_code_opening_request(make_client: Any, tok: Any, name: str) -> None:
    """Claude Code 2.1.332's first request of `claude -p` (24 tools; with its
    tool-search beta, 12 of which one is `defer_loading`). Refused before: a
    `system` message inside `messages` (400 naming messages[1].role). Its
    `thinking: adaptive` keeps the server's default (off here): before, it
    turned thinking on."""
    engine = FakeEngine(max_model_len=BIG, script=("Four", "."), tokenizer=tok)
    client, _, _ = await make_client(engine, model_name=MODEL, default_thinking=False)
    status, text = await send(client, recorded(name))
    assert status == 200, text
    events = sse_data(text)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    said = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert said == "Four."
    messages, kwargs = engine.rendered[-1]
    assert kwargs["enable_thinking"] is False
    # The system message stays where Claude Code put it: after the user's turn.
    assert [m.role for m in messages] == ["system", "user", "system"]
    # Every field it sends has a decision: none is counted as "other".
    search = {"tools[].defer_loading"} if "tool-search" in name else set()
    assert await ignored(client) == {"messages": CLAUDE_CODE_IGNORES | search}


async def test_codex_opening_request(make_client: Any, tok: Any) -> None:
    """Codex CLI 0.171's first request of `codex exec`. Refused before: its
    `namespace` tool (multi-agent tools, on by default: 400 naming
    tools[4].type), and behind it the hosted `web_search` tool."""
    engine = FakeEngine(max_model_len=BIG, script=("Four", "."), tokenizer=tok)
    client, _, _ = await make_client(engine, model_name=MODEL)
    status, text = await send(client, recorded("codex-0.171.0.json"))
    assert status == 200, text
    events = sse_data(text)
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][-1]["content"][0]["text"] == "Four."
    # Its namespace tool's functions are offered; its hosted web_search is not.
    names = [t["function"]["name"] for t in engine.rendered[-1][1]["tools"]]
    assert "multi_agent_v1__spawn_agent" in names and "web_search" not in names
    assert await ignored(client) == {
        "responses": {
            "client_metadata",
            "include",
            "prompt_cache_key",
            "reasoning.summary",
            "tools[type=web_search]",
        }
    }


async def test_qwen_code_opening_request(make_client: Any, tok: Any) -> None:
    """Qwen Code 0.24.4's first request of `qwen -p`: `max_tokens` 32000 beside a
    prompt of 22.5k tokens (real tokenizer). Refused before on a 40,960-token
    context: a 400 `context_length_exceeded`, where vLLM lowers max_tokens to
    the room left. Here the context leaves 8 tokens after the prompt."""
    rec = recorded("qwen-code-0.24.4.json")
    assert rec["body"]["max_tokens"] == 32000
    req = parse_chat(orjson.dumps(rec["body"]), Limits())
    prompt = (await FakeEngine().tokenize_chat([(req.messages, req.template_kwargs())]))[0]
    engine = FakeEngine(max_model_len=len(prompt) + 8, tokenizer=tok)
    client, _, _ = await make_client(engine, model_name=MODEL)
    status, text = await send(client, rec)
    assert status == 200, text
    chunks = sse_data(text)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length"
    assert await ignored(client) == {}
