"""Room rule 2 on the real engine: a chat turn goes into the step beside an unstarted long prompt.

The demo engine batches 256 tokens a step (`--max-num-batched-tokens 256`), so
Sluice caps each prompt's prefill chunk at 64 (server/engines/step_flags.py) and a
7,000-token prompt needs over 27 steps before its first token. A 32-token chat
turn sent while that prompt is released and unstarted finds the engine's queue
holding what its next two steps prefill of it (2 x 64 + 32 <= 2 x 256), not its
whole prompt (7,000 + 32 > 256, which held the chat turn until the long
prompt's first token in issue 11's room): so the chat turn's first token comes
first. The check is on order only, not on time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import SluiceProcess, metric, until

pytestmark = pytest.mark.engine

MODEL = "sluice-demo"
LONG = 7000
CHAT = 32


@pytest.fixture(scope="module")
def small_step(
    demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SluiceProcess]:
    tmp = tmp_path_factory.mktemp("step")
    with SluiceProcess(
        ["--max-num-batched-tokens", "256", "--log-format", "plain"],
        cache_dir=demo_cache_root,
        log_path=tmp / "sluice.log",
    ).running() as proc:
        yield proc


async def _first_token(
    client: httpx.AsyncClient, base: str, prompt: list[int], name: str, order: list[str]
) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True, "stream": True}
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()
        async for line in lines:
            if line.startswith("data: {"):
                order.append(name)
                break
        async for _ in lines:  # read to the end: no abort
            pass


async def test_a_chat_turn_starts_beside_an_unstarted_long_prompt(
    small_step: SluiceProcess,
) -> None:
    base = small_step.base
    order: list[str] = []
    async with httpx.AsyncClient(timeout=120) as client:
        long_prompt = [11 + i % 900 for i in range(LONG)]
        long = asyncio.create_task(_first_token(client, base, long_prompt, "long", order))
        # Released by Sluice, not started by the engine (a blocking poll: the
        # long stream has nothing to read until its first token).
        await until(lambda: metric(base, "sluice_engine_unstarted") >= 1, 30, "its release")
        assert not order, "the long prompt started before the chat turn was sent"
        chat = [7 + i for i in range(CHAT)]
        await asyncio.wait_for(
            asyncio.gather(long, _first_token(client, base, chat, "chat", order)), 120
        )
    assert order == ["chat", "long"]


def _engine_seconds(base: str, since: int) -> dict[str, float]:
    """Engine seconds per caller from the Usage API (open mode: every caller's)."""
    r = httpx.get(
        base + "/v1/organization/usage/completions",
        params={"start_time": since, "bucket_width": "1d", "group_by": "api_key_id"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    seconds: dict[str, float] = {}
    for bucket in r.json()["data"]:
        for res in bucket["results"]:
            key = res["api_key_id"]
            seconds[key] = seconds.get(key, 0.0) + res["engine_seconds"]
    return seconds


async def _complete(
    client: httpx.AsyncClient, base: str, prompt: list[int], user: str, n: int
) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "ignore_eos": True, "user": user}
    r = await client.post(base + "/v1/completions", json=body)
    assert r.status_code == 200, r.text


async def test_each_callers_engine_seconds_add_up_to_the_engines_busy_time(
    small_step: SluiceProcess,
) -> None:
    """Issue 52, item 1, on the real engine with 256-token steps (a long prompt
    takes many steps of chunks beside the chat turns' decodes): the Usage API's
    engine seconds per caller add up to the engine's step time over the same
    requests, within 2 %, and the caller of the long prompts is charged more."""
    base = small_step.base
    since = int(time.time()) - 60
    busy0 = metric(base, "sluice_engine_step_seconds_total")
    async with httpx.AsyncClient(timeout=240) as client:
        # Alone: one request is charged every step it ran in.
        await _complete(client, base, [11 + i % 900 for i in range(1500)], "u-alone", 4)
        alone = _engine_seconds(base, since)["u-alone"]
        busy1 = metric(base, "sluice_engine_step_seconds_total")
        assert alone == pytest.approx(busy1 - busy0, rel=0.02)
        # Beside each other: long prompts and short chat turns.
        jobs = [
            _complete(client, base, [13 + (i + k) % 900 for i in range(2500)], "u-long", 4)
            for k in range(3)
        ] + [
            _complete(client, base, [7 + k + i for i in range(CHAT)], "u-chat", 24)
            for k in range(12)
        ]
        await asyncio.wait_for(asyncio.gather(*jobs), 240)
    busy2 = metric(base, "sluice_engine_step_seconds_total")
    used = _engine_seconds(base, since)
    assert used["u-long"] + used["u-chat"] == pytest.approx(busy2 - busy1, rel=0.02)
    assert used["u-long"] > used["u-chat"] > 0
