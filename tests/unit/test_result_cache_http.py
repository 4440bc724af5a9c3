"""--result-cache-ttl: repeated deterministic requests are answered without the engine."""

from __future__ import annotations

from typing import Any


async def test_repeated_greedy_completion_hits_the_cache(make_client: Any) -> None:
    client, _, engine = await make_client(result_cache_ttl=60.0, warmup=False)
    body = {"model": "fake", "prompt": "same", "max_tokens": 4, "temperature": 0}
    first = await client.post("/v1/completions", json=body, headers={"x-request-id": "one"})
    second = await client.post("/v1/completions", json=body, headers={"x-request-id": "two"})
    a, b = await first.json(), await second.json()
    assert first.status == second.status == 200
    assert len(engine.added) == 1  # the second never reached the engine
    assert a["choices"] == b["choices"] and a["usage"] == b["usage"]
    assert (a["id"], b["id"]) == ("cmpl-one", "cmpl-two")


async def test_sampled_and_thinking_requests_are_not_cached(make_client: Any) -> None:
    client, _, engine = await make_client(result_cache_ttl=60.0, warmup=False)
    chat = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    for _ in range(2):
        assert (
            await client.post("/v1/chat/completions", json={**chat, "temperature": 0})
        ).status == 200
        assert (
            await client.post(
                "/v1/completions", json={"model": "fake", "prompt": "y", "max_tokens": 2}
            )
        ).status == 200
    # Greedy chat with thinking on (the default) and sampled completions: 4 generations.
    assert len(engine.added) == 4


async def test_cache_is_off_by_default(make_client: Any) -> None:
    client, _, engine = await make_client(warmup=False)
    body = {"model": "fake", "prompt": "same", "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        assert (await client.post("/v1/completions", json=body)).status == 200
    assert len(engine.added) == 2
