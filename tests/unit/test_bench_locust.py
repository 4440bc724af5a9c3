"""bench/locust_mix.py (issue 64): the Locust mix's long classes sized to the
served context, read from GET /v1/models; the chosen sizes fit on the demo
model's own tokenizer and chat template."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from bench.locust_mix import (
    ANALYSIS_LEAD,
    ANALYSIS_WORDS,
    SUMMARY_LEAD,
    SUMMARY_WORDS,
    Sizes,
    context_of,
    sizes_for,
    text,
    words_for_context,
)
from server.api.openai_chat.output import models_body


def test_the_seeds_sizes_where_the_context_allows() -> None:
    # The demo model's full context (40,960), and a common 32k.
    for context in (40_960, 32_768):
        assert words_for_context(context, 128, ANALYSIS_WORDS) == ANALYSIS_WORDS
        assert sizes_for(context, 128) == Sizes(SUMMARY_WORDS, ANALYSIS_WORDS)
    # At 1,024 only the analysis is shortened; below, the summary too.
    assert sizes_for(1024, 128) == Sizes(SUMMARY_WORDS, 307)
    assert sizes_for(512, 128).summary < SUMMARY_WORDS


def test_the_answer_takes_its_room() -> None:
    assert words_for_context(8192, 1024, ANALYSIS_WORDS) < words_for_context(
        8192, 128, ANALYSIS_WORDS
    )
    # No room at all: one word, for the server to refuse in the run's failures.
    assert words_for_context(200, 128, ANALYSIS_WORDS) == 1


def test_a_size_given_wins_even_too_long() -> None:
    assert sizes_for(1024, 128, analysis=12_000) == Sizes(SUMMARY_WORDS, 12_000)
    assert sizes_for(512, 128, summary=600, analysis=50) == Sizes(600, 50)
    # No context from the server: the seeds' sizes.
    assert sizes_for(None, 128) == Sizes(SUMMARY_WORDS, ANALYSIS_WORDS)


@pytest.mark.parametrize("context", [512, 1024, 2048, 8192])
@pytest.mark.parametrize("max_tokens", [16, 128])
def test_the_chosen_sizes_fit_the_demo_model(
    demo_model_dir: Path, context: int, max_tokens: int
) -> None:
    """Each long request at its chosen size, through the demo model's chat
    template, leaves the answer its max_tokens (the server's check: prompt +
    max_tokens within the context)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    sizes = sizes_for(context, max_tokens)
    rng = random.Random(context + max_tokens)
    for lead, words in ((SUMMARY_LEAD, sizes.summary), (ANALYSIS_LEAD, sizes.analysis)):
        for _ in range(5):
            messages = [{"role": "user", "content": lead + text(words, rng)}]
            prompt = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
            assert tokens + max_tokens <= context, (lead, words, tokens)


def test_the_context_from_sluice_and_vllm() -> None:
    # Sluice with one model (the card vLLM's server sends has the same field).
    one = orjson.loads(models_body(["m"], created=1, max_model_len=1024))
    assert context_of(one) == 1024
    assert context_of(one, "m") == 1024
    # Sluice with several models: each card its own; an adapter its base's.
    several = orjson.loads(
        models_body(
            ["a", "b"],
            created=1,
            adapters=[("b-lora", "/adapters/x", "b")],
            cards={"a": {"max_model_len": 4096}, "b": {"max_model_len": 2048}},
        )
    )
    assert context_of(several) == 4096
    assert context_of(several, "b") == 2048
    assert context_of(several, "b-lora") == 2048
    vllm = {
        "object": "list",
        "data": [{"id": "m", "object": "model", "max_model_len": 8192, "permission": []}],
    }
    assert context_of(vllm) == 8192


@pytest.mark.parametrize(
    "body",
    [
        {"object": "list", "data": [{"id": "m", "object": "model"}]},  # an older server
        {"object": "list", "data": []},
        {"error": {"message": "no"}},
        {"object": "list", "data": [{"id": "m", "max_model_len": True}]},
        {"object": "list", "data": [{"id": "m", "max_model_len": "1024"}]},
        [],
    ],
)
def test_no_context_said(body: object) -> None:
    assert context_of(body) is None
    assert context_of({"object": "list", "data": [{"id": "m", "max_model_len": 10}]}, "x") is None
