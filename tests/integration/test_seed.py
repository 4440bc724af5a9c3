"""`seed` end to end on the real engine: the same seed at temperature 1 gives
the same tokens, different seeds (almost always) different ones.

Each generation is a separate one in the engine: the requests go one after
another (nothing to share in Sluice's queue), the result cache is off by
default, and the dedupe counter is checked to stay put. The longer run with
the same seed differs in `max_tokens` (so could share nothing even in
principle) and must start with the shorter run's tokens: the seeded sampler
reproduces the same draws step by step.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support import SluiceProcess, metric

pytestmark = pytest.mark.engine

MODEL = "sluice-demo"


def _tokens(server: SluiceProcess, seed: int, max_tokens: int) -> list[str]:
    r = httpx.post(
        server.base + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "seed": seed,
            "ignore_eos": True,
            "logprobs": 1,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    tokens: list[str] = r.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == max_tokens
    return tokens


def test_seed_reproduces_and_different_seeds_differ(sluice_server: SluiceProcess) -> None:
    dedupe_before = metric(sluice_server.base, "sluice_dedupe_hits_total")
    first = _tokens(sluice_server, 7, 16)
    assert _tokens(sluice_server, 7, 16) == first
    assert _tokens(sluice_server, 7, 24)[:16] == first
    others = [_tokens(sluice_server, seed, 16) for seed in (8, 9, 10)]
    assert sum(o != first for o in others) >= 2, others
    assert len({tuple(o) for o in others}) >= 2, others
    assert metric(sluice_server.base, "sluice_dedupe_hits_total") == dedupe_before
