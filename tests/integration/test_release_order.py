"""The release key on the real engine: short-first, but a long prompt is never
passed by work that arrived more than `--short-first-max-delay` after it.

The demo engine gets one running slot (`--max-num-seqs 1`), so Sluice releases
one generation at a time and the order in which requests finish is the order of
release. A blocker holds the slot while a long prompt and then a short request
every 0.25 s arrive; closing the blocker's stream aborts it, and the backlog
drains in key order. With 100 tokens per second of exchange rate and a 2 s
ceiling, a 16-token class costs 0.16 s and the 400-token prompt 2 s: the short
requests sent in the first ~1.8 s after it go first, every one sent more than
2 s after it goes after it (order.py rule 3). No timing bound on the engine is
assumed: the checks are on order only.

The same server checks the prefix-warm order (batching/warm.py) past a small KV
cache: 6 MiB, 6,144 tokens at the demo's 1 KiB a token (384 blocks). Five system
prompts of 1,600 tokens (100 blocks each, 500 together) are each the start of
three requests, sent interleaved (A B C D E A B C D E ...) while a blocker holds
the slot. Released in that order, each prompt's blocks are evicted by the other
four's before its next request (4 x 102 blocks > 384 with the cache's LRU): the
engine finds almost nothing cached (checked once with --no-prefix-order: 0
tokens hit). Released warm, a prompt's three requests go together and the second
and third find its 1,600 tokens cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import SluiceProcess, metric

pytestmark = pytest.mark.engine

MODEL = "sluice-demo"
KV_BYTES = 6 * 2**20  # 6,144 tokens
CONTEXT = 4096  # vLLM wants the KV cache to hold one whole context
GROUPS = 5
PER_GROUP = 3
SYSTEM = 1600  # tokens: 100 blocks of 16
MAX_DELAY = 2.0
SHORTS = 16
GAP = 0.25  # seconds between short requests
SLACK = 0.3  # around the bound: client and server clocks differ by a hop


@pytest.fixture(scope="module")
def one_slot(
    demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SluiceProcess]:
    tmp = tmp_path_factory.mktemp("order")
    with SluiceProcess(
        [
            "--max-num-seqs",
            "1",
            "--prefix-order",
            "--short-first-rate",
            "100",
            "--short-first-max-delay",
            str(MAX_DELAY),
            "--kv-cache-memory-bytes",
            str(KV_BYTES),
            "--max-model-len",
            str(CONTEXT),
            "--log-format",
            "plain",
        ],
        cache_dir=demo_cache_root,
        log_path=tmp / "sluice.log",
    ).running() as proc:
        yield proc


async def _one(
    client: httpx.AsyncClient, base: str, prompt: int, finished: list[str], name: str
) -> None:
    body = {"model": MODEL, "prompt": [11 + i % 900 for i in range(prompt)], "max_tokens": 1}
    r = await client.post(base + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    finished.append(name)


@contextlib.asynccontextmanager
async def _holding_the_slot(
    client: httpx.AsyncClient, base: str, max_tokens: int
) -> AsyncIterator[None]:
    """A blocker stream that holds the engine's one slot, once its first token
    came, for the block; leaving the block closes it, which aborts it. Its line
    iterator is kept open across the block: a dropped one is finalized, which
    closes the stream, so Sluice aborts the blocker and frees the slot early."""
    body = {
        "model": MODEL,
        "prompt": [5, 6, 7],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", base + "/v1/completions", json=body) as blocker:
        assert blocker.status_code == 200
        lines = blocker.aiter_lines()
        async for line in lines:  # it runs: the one slot is taken
            if line.startswith("data: {"):
                break
        yield


async def test_a_long_prompt_is_passed_only_within_the_max_delay(one_slot: SluiceProcess) -> None:
    base = one_slot.base
    finished: list[str] = []
    sent: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=120) as client:
        async with _holding_the_slot(client, base, 4000):
            tasks = []
            sent["long"] = time.monotonic()
            tasks.append(asyncio.create_task(_one(client, base, 400, finished, "long")))
            for i in range(SHORTS):
                # Wait on the clock, not a fixed sleep for sequencing: each short
                # request goes at its own offset from the long one.
                due = sent["long"] + (i + 1) * GAP
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                sent[f"s{i}"] = time.monotonic()
                tasks.append(asyncio.create_task(_one(client, base, 8, finished, f"s{i}")))
            held = await asyncio.to_thread(metric, base, "sluice_backlog_generations")
            assert not finished, "the blocker did not hold the slot"
        # Leaving the stream aborts the blocker; the backlog drains in key order.
        await asyncio.wait_for(asyncio.gather(*tasks), 120)

    at = finished.index("long")
    before = [n for n in finished[:at] if n != "long"]
    after = finished[at + 1 :]
    offset = {n: sent[n] - sent["long"] for n in sent}
    print(
        f"backlog held {held:.0f}; finished before the long prompt: "
        f"{[f'{offset[n]:.2f}' for n in before]}; after: {[f'{offset[n]:.2f}' for n in after]}"
    )
    assert held >= SHORTS  # they all waited in Sluice's backlog
    # Short-first: those sent soon after the long prompt went ahead of it ...
    assert any(offset[n] > 0 for n in before), finished
    # ... but none sent more than the bound after it did.
    assert all(offset[n] <= MAX_DELAY + SLACK for n in before), (before, offset)
    assert all(n in after for n in offset if offset[n] > MAX_DELAY + SLACK), (after, offset)


def _system(group: int) -> list[int]:
    return [11 + (group * 97 + i * 31) % 900 for i in range(SYSTEM)]


async def test_prefix_groups_run_together_and_hit_the_cache(one_slot: SluiceProcess) -> None:
    base = one_slot.base
    names = [f"{'ABCDE'[i % GROUPS]}{i // GROUPS}" for i in range(GROUPS * PER_GROUP)]
    finished: list[str] = []
    hits0 = await asyncio.to_thread(metric, base, "sluice_engine_prefix_cache_hits_total")
    warm0 = await asyncio.to_thread(metric, base, "sluice_prefix_order_releases_total")

    async def one(client: httpx.AsyncClient, n: int) -> None:
        own = [11 + (n * 53 + j * 7) % 900 for j in range(32)]
        body = {"model": MODEL, "prompt": _system(n % GROUPS) + own, "max_tokens": 1}
        r = await client.post(base + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        finished.append(names[n])

    async with httpx.AsyncClient(timeout=120) as client:
        async with _holding_the_slot(client, base, 2000):
            tasks = [asyncio.create_task(one(client, n)) for n in range(len(names))]
            deadline = time.monotonic() + 30
            while (
                await asyncio.to_thread(metric, base, "sluice_backlog_generations") < len(names) - 1
            ):
                assert time.monotonic() < deadline, "the requests did not reach the backlog"
                await asyncio.sleep(0.05)
            assert not finished, "the blocker did not hold the slot"
        # Leaving the stream aborts the blocker; the backlog drains.
        await asyncio.wait_for(asyncio.gather(*tasks), 120)

    hits = await asyncio.to_thread(metric, base, "sluice_engine_prefix_cache_hits_total") - hits0
    warm = await asyncio.to_thread(metric, base, "sluice_prefix_order_releases_total") - warm0
    switches = sum(1 for a, b in itertools.pairwise(finished) if a[0] != b[0])
    text = await asyncio.to_thread(lambda: httpx.get(base + "/metrics", timeout=5).text)
    record = [
        ln for ln in text.splitlines() if ln.startswith("sluice_prefix_order_record_tokens_total{")
    ]
    print(f"finished {finished}; {switches} switches; hits {hits:.0f} tokens; warm {warm:.0f}")
    print("the record against the engine:", record)
    assert sorted(finished) == sorted(names)  # every request answered, once
    # Grouped: at most one switch per system prompt and one for a request that
    # reached the engine's queue before the order could choose (14 in arrival order).
    assert switches <= GROUPS, finished
    assert warm >= 2 * (GROUPS - 2), warm
    # The second and third of each group hit its system prompt: 10 x 1,600 tokens
    # of the 15 requests' prompts; 8 of them, at least.
    assert hits >= 8 * SYSTEM, hits
