"""The memory watchdog on the real CPU engine: a preemption storm in a small KV cache.

A Sluice with a 4 MiB KV cache (4,096 tokens at 1 KiB/token for the demo
model) and a 1,024-token context is flooded with long generations that together
outgrow the cache, so vLLM preempts running requests to make room. With a
storm threshold of one preemption, new requests get 503 with Retry-After and
/ready is 503 while it lasts; every admitted request still completes; afterwards
Sluice is ready again by itself. Nothing hangs, nothing is lost. (A full cache without
preemptions does not shed: tests/unit/test_pressure.py.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import SluiceProcess

pytestmark = pytest.mark.engine

CONTEXT = 1024  # --max-model-len


@pytest.fixture(scope="module")
def small_kv_server(
    demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SluiceProcess]:
    with SluiceProcess(
        [
            "--kv-cache-memory-bytes",
            str(4 * 2**20),
            "--max-model-len",
            str(CONTEXT),
            "--kv-storm-usage",
            "0.5",
            "--kv-critical-usage",
            "1.0",
            "--preempt-window",
            "10",
            "--preempt-leave",
            "1",
            "--preempt-shed",
            "1",
            "--preempt-critical",
            "1000000",
            "--min-dwell",
            "3",
            "--watchdog-interval-ms",
            "100",
        ],
        cache_dir=demo_cache_root,
        log_path=tmp_path_factory.mktemp("shed") / "sluice.log",
    ).running() as proc:
        yield proc


FLOOD = 6
LONG = 900


def _long(i: int, max_tokens: int = LONG) -> dict[str, object]:
    # A token-id prompt: 100 tokens, 900 to generate: 1,000 KV slots each, so
    # six of them would need 6,000 of the 4,096-token cache: after about 580
    # tokens each the cache is full and vLLM preempts to go on.
    return {
        "model": "sluice-demo",
        "prompt": [(7 * i + k) % 1000 + 10 for k in range(100)],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


PROBE = {"model": "sluice-demo", "prompt": [11, 12, 13], "max_tokens": 1}


async def test_flood_sheds_and_recovers(small_kv_server: SluiceProcess) -> None:
    base = small_kv_server.base
    async with httpx.AsyncClient(timeout=120) as client:
        flood = [
            asyncio.create_task(client.post(base + "/v1/completions", json=_long(i)))
            for i in range(FLOOD)
        ]
        refused: list[httpx.Response] = []
        not_ready = False
        # Probe until both signs of shedding were seen. The state outlives the
        # flood by --min-dwell (3 s), so probing may go on for 2 s after the
        # flood ends: on these two cores a client's requests can lag the
        # server by seconds (bench/results/ANALYSIS.md).
        deadline = time.monotonic() + 60
        flood_done_at: float | None = None
        while time.monotonic() < deadline and not (refused and not_ready):
            probe = await client.post(base + "/v1/completions", json=PROBE)
            if probe.status_code == 503:
                refused.append(probe)
            else:
                assert probe.status_code == 200, probe.text
            not_ready = not_ready or (await client.get(base + "/ready")).status_code == 503
            if flood_done_at is None and all(t.done() for t in flood):
                flood_done_at = time.monotonic()
            if flood_done_at is not None and time.monotonic() - flood_done_at > 2.0:
                break
        results = await asyncio.wait_for(asyncio.gather(*flood), 120)

        assert refused, "the preemptions never shed"
        assert not_ready, "/ready stayed 200 while shedding"
        for r in refused:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "memory"
        # Admitted work is never lost: every flood request was admitted before
        # the shedding began and completes in full.
        for r in results:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == LONG

        # Recovery without a restart.
        deadline = time.monotonic() + 30
        while (await client.get(base + "/ready")).status_code != 200:
            assert time.monotonic() < deadline, "never became ready again"
            await asyncio.sleep(0.2)
        ok = await client.post(base + "/v1/completions", json=_long(1, max_tokens=16))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 16


def test_max_tokens_past_the_context_is_lowered_to_the_room_left(
    small_kv_server: SluiceProcess,
) -> None:
    """A prompt 5 tokens short of the context with max_tokens far above: the
    engine generates the 5 and ends with `length`, as vLLM lowers it (the
    400 for a prompt alone past the context: test_server.py)."""
    r = httpx.post(
        small_kv_server.base + "/v1/completions",
        json={"model": "sluice-demo", "prompt": [7] * (CONTEXT - 5), "max_tokens": 100_000},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 5
