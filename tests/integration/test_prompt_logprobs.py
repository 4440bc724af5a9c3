"""Prompt logprobs on /v1/completions (issue 51), through the `openai` client
on the real engine: an echo with logprobs gives the prompt's tokens with
their logprobs (the first one's null) before the generated ones, as vLLM's
server does for lm-eval's loglikelihood requests; text and token-id prompts,
arrays, streaming and max_tokens 0 (the prompt alone); vLLM's own
`prompt_logprobs` extension on completions and chat; a huge k refused in each
API's shape. And /tokenizer_info, which lm-eval's `auto` tokenizer backend
probes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support import SluiceProcess

pytestmark = pytest.mark.engine

MODEL = "sluice-demo"
PROMPT = "Once upon a time there was a small house by the river"
# bf16 on the CPU: the same position computed in another batch shape differs
# in the last bits.
TOL = 2e-2


@pytest.fixture(scope="module")
def client(sluice_server: SluiceProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=sluice_server.base + "/v1", api_key="none") as c:
        yield c


def _ids(server: SluiceProcess, text: str) -> list[int]:
    r = httpx.post(server.base + "/tokenize", json={"prompt": text}, timeout=30)
    r.raise_for_status()
    ids: list[int] = r.json()["tokens"]
    return ids


def test_echo_logprobs_text_prompt(client: openai.OpenAI, sluice_server: SluiceProcess) -> None:
    ids = _ids(sluice_server, PROMPT)
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=1, echo=True, temperature=0
    )
    (choice,) = r.choices
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert r.usage is not None and r.usage.completion_tokens == 3
    assert len(lp.tokens) == len(ids) + 3
    assert choice.text.startswith(PROMPT)
    # Nothing comes before the first token: no logprob, no alternatives.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for tok, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert v is not None and v <= 0.0
        # The top 1 and, as OpenAI's legacy completions answer, the token itself.
        assert top is not None and 1 <= len(top) <= 2 and top[tok] == v
        assert v <= max(top.values()) + TOL
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)


def test_prompt_logprobs_are_the_model_s(
    client: openai.OpenAI, sluice_server: SluiceProcess
) -> None:
    """Position i's alternatives are the model's next token after the first i
    tokens: the greedy token generated from that prefix, with its logprob."""
    ids = _ids(sluice_server, PROMPT)
    echo = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, logprobs=1, echo=True, temperature=0
    )
    lp = echo.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None
    for i in (1, len(ids) // 2, len(ids) - 1):
        gen = client.completions.create(
            model=MODEL, prompt=ids[:i], max_tokens=1, logprobs=1, temperature=0
        )
        glp = gen.choices[0].logprobs
        assert glp is not None and glp.tokens and glp.token_logprobs
        top = lp.top_logprobs[i]
        assert top is not None
        token, value = max(top.items(), key=lambda kv: kv[1])  # the top 1
        assert token == glp.tokens[0]
        assert value == pytest.approx(glp.token_logprobs[0], abs=TOL)


def test_prompt_only_and_arrays(client: openai.OpenAI, sluice_server: SluiceProcess) -> None:
    texts = [PROMPT, "A second prompt, shorter"]
    ids = [_ids(sluice_server, t) for t in texts]
    for prompt in (texts, ids):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=0, logprobs=2, echo=True, temperature=0
        )
        assert [c.index for c in r.choices] == [0, 1]
        for c, want, text in zip(r.choices, ids, texts, strict=True):
            assert c.logprobs is not None and c.logprobs.tokens is not None
            assert len(c.logprobs.tokens) == len(want)  # the prompt alone
            assert c.text == text
            assert c.logprobs.top_logprobs is not None
            assert all(t is not None and len(t) <= 3 for t in c.logprobs.top_logprobs[1:])
    # An echo with max_tokens 0 and no logprobs: the prompt's text alone.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs is None


def test_echo_logprobs_streamed_match_whole(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, prompt=[PROMPT, "Short one"], max_tokens=4, logprobs=1, echo=True)
    whole = client.completions.create(temperature=0, **args)  # type: ignore[call-overload]
    tokens: dict[int, list[str]] = {0: [], 1: []}
    values: dict[int, list[float | None]] = {0: [], 1: []}
    texts: dict[int, str] = {0: "", 1: ""}
    with client.completions.create(temperature=0, stream=True, **args) as stream:  # type: ignore[call-overload]
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
                if c.logprobs is not None:
                    tokens[c.index] += c.logprobs.tokens or []
                    values[c.index] += c.logprobs.token_logprobs or []
    for c in whole.choices:
        assert c.logprobs is not None
        assert tokens[c.index] == c.logprobs.tokens
        assert texts[c.index] == c.text
        got, want = values[c.index], c.logprobs.token_logprobs or []
        assert got[0] is None and want[0] is None
        assert got[1:] == pytest.approx(want[1:], abs=TOL)


def _same_prompt(extension: Any, ids: list[int], echo: Any) -> None:
    """vLLM's prompt_logprobs: per prompt token null (the first) or the prompt's
    own token first, with its logprob and rank, then the top 2; the prompt's
    own values are the echo's."""
    assert isinstance(extension, list) and len(extension) == len(ids)
    assert extension[0] is None
    for tid, entry, want in zip(ids[1:], extension[1:], echo.token_logprobs[1:], strict=True):
        assert next(iter(entry)) == str(tid)  # the prompt's own token first
        assert 1 <= len(entry) <= 3
        own = entry[str(tid)]
        assert own["logprob"] == pytest.approx(want, abs=TOL)
        assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(tid))
        assert ranks in ([1, 2], [1], [2], [])  # the top 2 (the own token may be one)


def test_vllms_prompt_logprobs_extension(
    client: openai.OpenAI, sluice_server: SluiceProcess
) -> None:
    """vLLM's `prompt_logprobs` on completions (on each choice) and chat (at
    the top), as vLLM's server answers it, through the `openai` client's
    extra fields."""
    ids = _ids(sluice_server, PROMPT)
    echo = (
        client.completions.create(
            model=MODEL, prompt=ids, max_tokens=0, logprobs=0, echo=True, temperature=0
        )
        .choices[0]
        .logprobs
    )
    assert echo is not None
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    (choice,) = r.choices
    assert choice.logprobs is None and not choice.text.startswith(PROMPT)  # no echo
    assert choice.model_extra is not None
    _same_prompt(choice.model_extra["prompt_logprobs"], ids, echo)

    messages: Any = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    assert chat.usage is not None and chat.model_extra is not None
    extension = chat.model_extra["prompt_logprobs"]
    assert len(extension) == chat.usage.prompt_tokens and extension[0] is None
    assert all(1 <= len(e) <= 3 for e in extension[1:])
    # Not asked: not there, as before.
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert "prompt_logprobs" not in (plain.model_extra or {})
    # With a stream, vLLM's server refuses it (there is no frame for it).
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert err.value.param == "prompt_logprobs"  # type: ignore[attr-defined]


HUGE = 100_000


@pytest.mark.parametrize(
    ("api", "field"),
    [
        ("completions", "logprobs"),
        ("completions", "prompt_logprobs"),
        ("chat", "prompt_logprobs"),
        ("chat", "top_logprobs"),
        ("ollama", "top_logprobs"),
    ],
)
def test_huge_logprobs_refused(
    client: openai.OpenAI, sluice_server: SluiceProcess, api: str, field: str
) -> None:
    """A huge k is a 400 in the API's own shape, bounded by --max-logprobs,
    before the engine: never a 500."""
    messages: Any = [{"role": "user", "content": PROMPT}]
    if api == "ollama":
        r = httpx.post(
            sluice_server.base + "/api/chat",
            json={"model": MODEL, "messages": messages, "stream": False, field: HUGE},
            timeout=30,
        )
        assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text
        assert field in r.json()["error"]
        return
    with pytest.raises(openai.BadRequestError) as err:
        if api == "completions":
            client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, extra_body={field: HUGE}
            )
        else:
            client.chat.completions.create(
                model=MODEL, messages=messages, logprobs=True, extra_body={field: HUGE}
            )
    assert err.value.body is not None and err.value.param == field  # type: ignore[attr-defined]
    assert "20" in err.value.message  # the bound it is held to


def test_tokenizer_info(sluice_server: SluiceProcess) -> None:
    r = httpx.get(sluice_server.base + "/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert "eos_token" in info and info["tokenizer_class"]
    assert "vocab_file" not in info
