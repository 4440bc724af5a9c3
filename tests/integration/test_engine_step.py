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
