"""Mutated bodies of all five APIs never reach a 500 (issue 28; Ollama's, issue 31).

Hypothesis takes a valid, feature-rich body of each API (chat with tools and a
tool-call history, completions, Responses with function calls, Messages with
tool_use / tool_result and count_tokens) and mutates it: values replaced by
arbitrary JSON (wrong types, huge numbers, odd strings, deep values), keys
dropped or added (known field names among them), items duplicated, or the
bytes themselves broken. Each body goes through the real app (aiohttp test
client, the server options `sluice serve` uses) on the fake engine, which has
the demo model's tokenizer, so vLLM's own tool and reasoning parsers read its
output. Every answer must be a success or a refusal in the API's own error
shape, never a 500 (also not one hidden in a stream's error event: no error
is logged), and the server must answer the valid body afterwards.

One server serves every example of a test (hypothesis's function-scoped
fixture check is off for that reason): state left behind by one example is
exactly what the next must survive.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fakes import FakeEngine
from tests.support import ErrorRecords

pytestmark = pytest.mark.timeout(300)

EXAMPLES = 200  # per API: 48 s for the first five (17 s of CPU) on the shared 2-core machine

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
    "required": ["city"],
}
CALL = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
# What the fake engine says: a thought, text, then a tool call (parsed when tools are on).
SCRIPT = ("<think>", "hmm", "</think>", "Hi. ", CALL)

CHAT = {
    "model": "fake",
    "max_tokens": 8,
    "temperature": 0,
    "n": 1,
    "stream": False,
    "stop": ["\n\n"],
    "chat_template_kwargs": {"enable_thinking": True},
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}],
    "tool_choice": "auto",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Rome?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ],
}
COMPLETIONS = {
    "model": "fake",
    "prompt": ["The sea", "A cat"],
    "max_tokens": 6,
    "temperature": 0.5,
    "seed": 7,
    "logprobs": 2,
    "echo": False,
    "stream": False,
    "stop": "x",
    "response_format": {"type": "json_object"},
}
RESPONSES = {
    "model": "fake",
    "max_output_tokens": 8,
    "instructions": "Be brief.",
    "reasoning": {"effort": "low"},
    "store": True,
    "stream": False,
    "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
    "tool_choice": "auto",
    "text": {"format": {"type": "text"}},
    "metadata": {"k": "v"},
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Rome"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
    ],
}
MESSAGES = {
    "model": "fake",
    "max_tokens": 8,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "stream": False,
    "stop_sequences": ["END"],
    "tools": [{"name": "get_weather", "description": "Weather now.", "input_schema": PARAMS}],
    "tool_choice": {"type": "auto"},
    "metadata": {"user_id": "u1"},
    "messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": ""},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "21 C"}],
                }
            ],
        },
    ],
}
COUNT = {k: v for k, v in MESSAGES.items() if k not in ("max_tokens", "stream")}
OLLAMA_CHAT = {
    "model": "fake:latest",
    "stream": False,
    "think": True,
    "format": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
    "keep_alive": "5m",
    "options": {"num_predict": 8, "temperature": 0, "stop": ["\n\n"], "num_ctx": 2048},
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}],
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": "",
            "thinking": "Look it up.",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}],
        },
        {"role": "tool", "content": "21 C", "tool_name": "get_weather"},
    ],
}
OLLAMA_GENERATE = {
    "model": "fake",
    "prompt": "Weather in Rome?",
    "system": "Be brief.",
    "template": "{{ if .System }}{{ .System }} {{ end }}U: {{ .Prompt }} A: {{ .Response }}",
    "raw": False,
    "stream": False,
    "format": "json",
    "options": {"num_predict": 6, "seed": 7, "repeat_penalty": 1.1},
}

APIS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
    "/v1/messages/count_tokens": COUNT,
    "/api/chat": OLLAMA_CHAT,
    "/api/generate": OLLAMA_GENERATE,
}

# Field names the parsers know, so that an added key often means something.
FIELDS = sorted(
    {
        *(k for body in APIS.values() for k in body),
        "n", "best_of", "logit_bias", "max_completion_tokens", "response_format",
        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "top_k",
        "top_p", "min_p", "priority", "ignore_eos", "user", "previous_response_id",
        "parallel_tool_calls", "type", "role", "content", "text", "name", "input",
        "arguments", "id", "call_id", "output", "tool_use_id", "json_schema", "schema",
        "format", "effort", "enable_thinking", "include_usage", "background", "prompt",
        "think", "options", "num_predict", "num_ctx", "raw", "template", "images", "suffix",
        "context", "tool_name", "thinking",
    }
)  # fmt: skip

LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),  # orjson's range; larger: floats
    st.floats(allow_nan=False, allow_infinity=False),  # 1e308 too
    st.text(max_size=12),
    st.sampled_from(["", "fake", "auto", "none", "required", "function", "text", "user",
                     "assistant", "tool", "json_schema", "\x00", "x" * 300]),
)  # fmt: skip
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.one_of(st.sampled_from(FIELDS), st.text(max_size=6)), inner, max_size=3
        )
    ),
    max_leaves=10,
)


def _paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a body (the body itself is ())."""
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*path, i))


def _at(body: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        body = body[step]
    return body


@st.composite
def mutated(draw: st.DrawFn, body: dict[str, Any]) -> bytes:
    """A valid body with one to three mutations, or broken bytes."""
    doc = copy.deepcopy(body)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(doc))))
        op = draw(st.sampled_from(["replace", "drop", "add", "duplicate"]))
        if op == "replace":
            if not path:
                doc = draw(VALUES)
                break
            _at(doc, path[:-1])[path[-1]] = draw(VALUES)
        elif op == "drop" and path:
            parent = _at(doc, path[:-1])
            del parent[path[-1]]
        else:
            node = _at(doc, path)
            if isinstance(node, dict):
                key = draw(st.one_of(st.sampled_from(FIELDS), st.text(max_size=6)))
                node[key] = draw(VALUES)
            elif isinstance(node, list):
                node.append(copy.deepcopy(node[0]) if node and op == "duplicate" else draw(VALUES))
    raw = orjson.dumps(doc)
    cut = draw(st.sampled_from(["none"] * 12 + ["truncate", "flip"]))
    if cut == "truncate":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif cut == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + 1 :]
    return raw


@pytest.fixture(scope="module")
def tok(demo_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture
async def fuzz_client(make_client: Any, tok: Any) -> Any:
    engine = FakeEngine(max_model_len=4096, step=0, script=SCRIPT, tokenizer=tok)
    client, _, _ = await make_client(engine=engine, warmup=False)
    errors = ErrorRecords()
    logging.getLogger("sluice").addHandler(errors)
    try:
        yield client, errors
    finally:
        logging.getLogger("sluice").removeHandler(errors)


def _check_shape(path: str, status: int, body: bytes, content_type: str) -> None:
    assert status != 500 and status < 600, (status, body[:300])
    if status == 200:
        if content_type == "text/event-stream":
            assert body.endswith(b"\n\n"), body[-200:]
        elif content_type == "application/x-ndjson":
            lines = [orjson.loads(line) for line in body.splitlines()]
            assert lines[-1].get("done") is True, lines[-1]
        else:
            orjson.loads(body)
        return
    doc = orjson.loads(body)
    if path.startswith("/api/"):
        assert set(doc) == {"error"}, doc
        assert isinstance(doc["error"], str) and doc["error"]
    elif path.startswith("/v1/messages"):
        assert set(doc) == {"type", "error"} and doc["type"] == "error", doc
        assert set(doc["error"]) == {"type", "message"}, doc
        assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    else:
        assert set(doc) == {"error"}, doc
        assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
        assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]


async def _fuzz(client: Any, errors: ErrorRecords, path: str, raw: bytes) -> None:
    errors.records.clear()  # each example on its own (one failure, one report)
    headers = {"Content-Type": "application/json"}
    resp = await client.post(path, data=raw, headers=headers)
    body = await resp.read()
    _check_shape(path, resp.status, body, resp.content_type)
    assert not errors.records, [r.getMessage() for r in errors.records]
    ok = await client.post(path, json=APIS[path], headers=headers)
    assert ok.status == 200, await ok.text()


def _test(path: str) -> Any:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )
    @given(raw=mutated(APIS[path]))
    async def test(fuzz_client: Any, raw: bytes) -> None:
        await _fuzz(*fuzz_client, path, raw)

    return test


test_chat_completions = _test("/v1/chat/completions")
test_completions = _test("/v1/completions")
test_responses = _test("/v1/responses")
test_messages = _test("/v1/messages")
test_count_tokens = _test("/v1/messages/count_tokens")
test_ollama_chat = _test("/api/chat")
test_ollama_generate = _test("/api/generate")

# What the fuzzing found, kept as plain cases (each was a 500).
FOUND = [
    # A chat content part whose type is an array: unhashable in the type lookup.
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": [], "text": "hi"}]}]},
    ),
    # A Responses reasoning.effort that is an object or an array: the same.
    ("/v1/responses", {**RESPONSES, "reasoning": {"effort": {}}}),
    ("/v1/responses", {**RESPONSES, "reasoning": {"effort": []}}),
    # An Ollama option past 64 bits (2**64 as a float): rendering the value for the
    # error message raised.
    ("/api/generate", {**OLLAMA_GENERATE, "options": {"num_predict": 1.8446744073709552e19}}),
    # An echo with logprobs in completions: the fake engine gave no prompt logprobs
    # (vLLM does), so the echo found none (the fake's gap, mended there).
    ("/v1/completions", {**COMPLETIONS, "echo": True}),
]


@pytest.mark.parametrize(("path", "body"), FOUND)
async def test_what_the_fuzzing_found(fuzz_client: Any, path: str, body: Any) -> None:
    await _fuzz(*fuzz_client, path, orjson.dumps(body))


async def test_the_seed_bodies_are_valid(fuzz_client: Any) -> None:
    client, errors = fuzz_client
    for path, body in APIS.items():
        for stream in (False, True):
            if path.endswith("count_tokens") and stream:
                continue
            resp = await client.post(path, json={**body, "stream": stream})
            assert resp.status == 200, (path, await resp.text())
            await resp.read()
    assert not errors.records
