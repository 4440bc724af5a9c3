"""Prompt logprobs on /v1/completions (issue 51), through the `openai` client
on the real engine: an echo with logprobs gives the prompt's tokens with
their logprobs (the first one's null) before the generated ones, as vLLM's
server does for lm-eval's loglikelihood requests; text and token-id prompts,
arrays, streaming and max_tokens 0 (the prompt alone). And /tokenizer_info,
which lm-eval's `auto` tokenizer backend probes."""

from __future__ import annotations

from collections.abc import Iterator

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
    for v, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert v is not None and v <= 0.0
        assert top is not None and len(top) == 1
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
        ((token, value),) = top.items()
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
            assert all(t is not None and len(t) <= 2 for t in c.logprobs.top_logprobs[1:])
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


@pytest.mark.parametrize("field", ["logprobs"])
def test_huge_logprobs_refused(client: openai.OpenAI, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, extra_body={field: 100_000}
        )
    assert err.value.body is not None and err.value.param == field  # type: ignore[attr-defined]


def test_tokenizer_info(sluice_server: SluiceProcess) -> None:
    r = httpx.get(sluice_server.base + "/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert "eos_token" in info and info["tokenizer_class"]
    assert "vocab_file" not in info
