"""/tokenize and /detokenize over HTTP on the real engine, as vLLM's server
serves them: `model` may be left out, a chat is tokenized exactly as the chat
endpoint counts its prompt, and ids decode back to the text."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support import SluiceProcess

pytestmark = pytest.mark.engine

MODEL = "sluice-demo"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _post(server: SluiceProcess, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.base + path, json=body, timeout=30)


@pytest.mark.parametrize("model", [{"model": MODEL}, {}], ids=["model", "no-model"])
def test_tokenize_prompt(sluice_server: SluiceProcess, model: dict[str, str]) -> None:
    r = _post(sluice_server, "/tokenize", {**model, "prompt": "Once upon a time"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == 40960
    # The completions endpoint counts the same prompt the same.
    c = _post(
        sluice_server,
        "/v1/completions",
        {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1},
    ).json()
    assert c["usage"]["prompt_tokens"] == body["count"]


@pytest.mark.parametrize("model", [{"model": MODEL}, {}], ids=["model", "no-model"])
def test_tokenize_messages(sluice_server: SluiceProcess, model: dict[str, str]) -> None:
    r = _post(sluice_server, "/tokenize", {**model, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    chat = _post(
        sluice_server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 1},
    ).json()
    assert chat["usage"]["prompt_tokens"] == len(tokens)
    # chat_template_kwargs reach the template: thinking off closes the thought
    # (off is also the demo model's default, which the two above used).
    on, off = (
        _post(
            sluice_server,
            "/tokenize",
            {**model, "messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": t}},
        ).json()["tokens"]
        for t in (True, False)
    )
    assert off == tokens
    assert off[: len(on)] == on and len(off) > len(on)


@pytest.mark.parametrize("model", [{"model": MODEL}, {}], ids=["model", "no-model"])
def test_detokenize_round_trip(sluice_server: SluiceProcess, model: dict[str, str]) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    tokens = _post(sluice_server, "/tokenize", {**model, "prompt": text}).json()["tokens"]
    r = _post(sluice_server, "/detokenize", {**model, "tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/detokenize", {"tokens": "1 2 3"}, "tokens"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ],
)
def test_bad_input(sluice_server: SluiceProcess, path: str, body: Any, param: str) -> None:
    r = _post(sluice_server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)
