"""Capacity across data-parallel ranks, and one scheduler under TP/PP.

On replayed engine configurations (vLLM's own `create_engine_config` on the
flags, as tests/unit/test_engine_config.py does; no engine starts):

* `--data-parallel-size 2` feeds two engine cores from one AsyncLLM: Sluice
  counts 2 x max_num_seqs slots and 2 x the step budget, and splits the KV
  cache vLLM summed at the handshake back into one rank's.
* `--tensor-parallel-size 2` and `--pipeline-parallel-size 2` keep one
  scheduler: Sluice reads its numbers unchanged, the ones `vllm serve` gets.

And on the room (batching/room.py rule 6): a prompt needs KV on one rank,
not the sum; per-rank stats from vLLM's per-engine logger adapter are summed
where a sum is right; metrics carry each rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.metrics.loggers import PerEngineStatLoggerAdapter
from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

from batching import EngineCapacity
from batching.pressure import RankStats
from batching.room import EngineView, Room
from server.cli import parse_serve_args
from server.engines.interface import ModelInfo
from server.engines.vllm_adapter import (
    _stat_logger_factory,
    _StatsBox,
    dp_ranks,
    engine_config,
    names_ranks,
)
from server.operations.metrics import _rank_families
from server.settings import engine_capacity
from tests.unit.test_engine_config import _flags, _vllm_server

# (flags, data-parallel ranks fed by this process)
LAYOUTS = {
    "single": ([], 1),
    "dp2": (["--data-parallel-size", "2"], 2),
    "dp4-hybrid-2-local": (
        [
            "--data-parallel-size",
            "4",
            "--data-parallel-size-local",
            "2",
            "--data-parallel-hybrid-lb",
        ],
        2,
    ),
    "tp2": (["--tensor-parallel-size", "2"], 1),
    "pp2": (["--pipeline-parallel-size", "2"], 1),
}


def _room(cap: EngineCapacity, in_flight: int = 1, **kw: Any) -> Room:
    """A room beside an idle engine (no step reported, nothing running)."""
    args: dict[str, Any] = {
        "in_flight": in_flight,
        "unstarted_n": 0,
        "unstarted_tokens": 0,
        "unstarted_feed": 0,
        "view": EngineView.of(cap, [None] * cap.ranks, 0),
        "kv_usage": 0.0,
        "prefilled": 0,
        "reserve": 0.0,
        "short_prompt": 0,
        "feed_steps": 2.0,
        **kw,
    }
    return Room(cap, **args)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replayed_layouts(layout: str, demo_model_dir: Path) -> None:
    extra, ranks = LAYOUTS[layout]
    flags = _flags(demo_model_dir, *extra)
    config = engine_config(parse_serve_args(flags, {}).engine_args)
    assert dp_ranks(config) == ranks
    # Sluice names the rank of each request (room.py `place`) only where vLLM's
    # client balances every rank itself; a hybrid client's ranks are a slice.
    assert names_ranks(config) == (layout == "dp2")
    sched = config.scheduler_config
    # Each rank's (or the one scheduler's) numbers, as `vllm serve` resolves them.
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == _vllm_server(flags)
    blocks_per_rank = 1000
    info = ModelInfo(
        "m",
        8192,
        None,
        0,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        # vLLM sums num_gpu_blocks over the ranks (core_client.py, the handshake).
        kv_cache_tokens=ranks * blocks_per_rank * 16,
        dp_ranks=dp_ranks(config),
    )
    cap = engine_capacity(info)
    assert cap.ranks == ranks
    assert cap.kv_tokens == blocks_per_rank * 16
    room = _room(cap)
    # Room rule 2: every rank's free slots (an idle engine: all) and two steps of
    # its budget.
    assert room.feed_slots == ranks * sched.max_num_seqs
    assert room.feed_tokens == 2.0 * ranks * sched.max_num_batched_tokens
    assert room.kv_tokens == ranks * blocks_per_rank * 16


def test_the_feed_adds_up_over_ranks() -> None:
    """Room rule 2 on an idle engine, one step fed: each rank takes its own slots
    and budget."""
    one = EngineCapacity(max_seqs=128, step_tokens=2048, kv_tokens=100_000)
    two = EngineCapacity(max_seqs=128, step_tokens=2048, kv_tokens=100_000, ranks=2)
    kw: dict[str, Any] = {"in_flight": 200, "feed_steps": 1.0}
    assert not _room(one, unstarted_n=127, **kw).full and _room(one, unstarted_n=128, **kw).full
    assert _room(two, unstarted_n=200, **kw).fits(64)  # past one rank's 128
    assert not _room(two, unstarted_n=256, **kw).fits(64)
    # Budget: 2 ranks x 2,048 of unstarted prompt tokens.
    kw = {**kw, "unstarted_n": 10, "unstarted_tokens": 3000, "unstarted_feed": 3000}
    assert not _room(one, **kw).fits(64)
    assert _room(two, **kw).fits(64)
    assert not _room(two, **kw).fits(1200)


def test_a_prompt_needs_room_on_one_rank() -> None:
    two = EngineCapacity(max_seqs=128, step_tokens=2048, kv_tokens=10_000, ranks=2)
    # Both ranks 60% used: 8,000 tokens free in all, 4,000 on either rank.
    even = {"kv_usage": 0.6, "kv_usage_least": 0.6}
    assert _room(two, **even).fits(4000)
    assert not _room(two, **even).fits(5000)
    # Ranks at 20% and 100%: the free rank holds 8,000 tokens.
    skewed = {"kv_usage": 0.6, "kv_usage_least": 0.2}
    assert _room(two, **skewed).fits(7000)
    # One rank of the summed size takes the 5,000 the split ranks cannot.
    one = EngineCapacity(max_seqs=256, step_tokens=4096, kv_tokens=20_000)
    assert _room(one, kv_usage=0.6).fits(5000)


@given(
    ranks=st.integers(1, 4),
    seqs=st.integers(1, 300),
    kv=st.integers(0, 50_000),
    slack=st.integers(-3, 3),
    usage=st.floats(0.0, 1.0),
    spread=st.floats(0.0, 1.0),
    ptok=st.integers(0, 60_000),
)
def test_ranks_never_admit_more_than_one_summed_engine(
    ranks: int, seqs: int, kv: int, slack: int, usage: float, spread: float, ptok: int
) -> None:
    """Rule 6 only narrows: N ranks admit nothing one engine of N x the size would refuse,
    and with one rank the per-rank bound is absent."""
    least = usage * spread
    in_flight = max(1, seqs * ranks + slack)  # about the slot bound
    split = EngineCapacity(max_seqs=seqs, step_tokens=2048, kv_tokens=kv, ranks=ranks)
    summed = EngineCapacity(max_seqs=seqs * ranks, step_tokens=2048 * ranks, kv_tokens=kv * ranks)
    kw = {"in_flight": in_flight, "kv_usage": usage}
    if _room(split, kv_usage_least=least, **kw).fits(ptok):
        assert _room(summed, **kw).fits(ptok)
    if ranks == 1:
        assert _room(split, kv_usage_least=least, **kw).fits(ptok) == _room(summed, **kw).fits(ptok)


def _sched(running: int, waiting: int, kv: float) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        kv_cache_usage=kv,
        prefix_cache_stats=PrefixCacheStats(),
    )


def dp_stat_loggers() -> tuple[_StatsBox, PerEngineStatLoggerAdapter]:
    """vLLM's per-engine logger adapter as AsyncLLM builds it for
    --data-parallel-size 2, each rank's Sluice logger feeding one stats box."""
    box = _StatsBox()
    adapter = PerEngineStatLoggerAdapter(
        vllm_config=None,  # type: ignore[arg-type] - Sluice's logger reads none of it
        engine_indexes=[0, 1],
        per_engine_stat_logger_factory=_stat_logger_factory(box),
    )
    return box, adapter


def test_stats_from_every_rank() -> None:
    """Through vLLM's own per-engine adapter, as AsyncLLM builds it for DP=2."""
    box, adapter = dp_stat_loggers()
    adapter.record(_sched(100, 3, 0.5), None, engine_idx=0)
    adapter.record(_sched(120, 1, 0.3), None, engine_idx=1)
    adapter.record(_sched(110, 2, 0.7), None, engine_idx=0)  # rank 0 again: its latest
    s = box.get()
    assert (s.running, s.waiting) == (230, 3)
    assert s.kv_cache_usage == pytest.approx(0.5)
    assert s.ranks == (RankStats(0.7, 110, 2), RankStats(0.3, 120, 1))
    assert s.kv_usage_least == pytest.approx(0.3)


def test_preemptions_are_counted_per_rank() -> None:
    """Each rank's preemptions stay its own (the watchdog's storm is per rank);
    the engine-wide counter is their sum."""
    box, adapter = dp_stat_loggers()
    for rank, preempted in ((0, 5), (1, 0), (0, 3), (1, 2)):
        it = IterationStats()
        it.num_preempted_reqs = preempted
        adapter.record(_sched(100, 0, 0.9), it, engine_idx=rank)
    s = box.get()
    assert [r.preemptions_total for r in s.ranks] == [8, 2]
    assert s.preemptions_total == 10


def test_one_rank_has_no_rank_series() -> None:
    box = _StatsBox()
    _stat_logger_factory(box)(None, 0).record(_sched(5, 1, 0.25), None)
    s = box.get()
    assert (s.running, s.waiting, s.kv_cache_usage, s.ranks) == (5, 1, 0.25, ())
    assert s.kv_usage_least is None
    assert list(_rank_families(s.ranks)) == []


def test_rank_metrics() -> None:
    ranks = (RankStats(0.7, 110, 2, 0, 64, 48), RankStats(0.3, 120, 1))
    samples = {
        (f.name, s.labels["rank"]): s.value for f in _rank_families(ranks) for s in f.samples
    }
    assert samples == {
        ("sluice_engine_rank_requests_running", "0"): 110,
        ("sluice_engine_rank_requests_running", "1"): 120,
        ("sluice_engine_rank_requests_waiting", "0"): 2,
        ("sluice_engine_rank_requests_waiting", "1"): 1,
        ("sluice_engine_rank_kv_cache_usage", "0"): 0.7,
        ("sluice_engine_rank_kv_cache_usage", "1"): 0.3,
        # Counters: the families' names, without the exposition's _total.
        ("sluice_engine_rank_prefix_cache_queries", "0"): 64,
        ("sluice_engine_rank_prefix_cache_queries", "1"): 0,
        ("sluice_engine_rank_prefix_cache_hits", "0"): 48,
        ("sluice_engine_rank_prefix_cache_hits", "1"): 0,
    }
