"""The pressure policy, replayed with hand-made readings and timestamps."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batching.pressure import (
    MIB,
    EngineStats,
    GpuMemory,
    HostMemory,
    PressureConfig,
    PressurePolicy,
    RankStats,
    Readings,
    State,
    Unknown,
)

GIB = 1024 * MIB
HOST_OK = HostMemory(available=32 * GIB, total=64 * GIB)


def gpu(*free_mib: float) -> Readings:
    gpus = tuple(
        GpuMemory(i, int(f * MIB), int(24 * GIB - f * MIB), 24 * GIB)
        for i, f in enumerate(free_mib)
    )
    return Readings(gpus=gpus, host=HOST_OK, engine=engine())


def engine(usage: float = 0.1, preemptions: int = 0) -> EngineStats:
    return EngineStats(kv_cache_usage=usage, running=4, waiting=0, preemptions_total=preemptions)


def kv(usage: float, preemptions: int = 0) -> Readings:
    return Readings(gpus=(), host=HOST_OK, engine=engine(usage, preemptions))


def host(avail_mib: float) -> Readings:
    return Readings(gpus=(), host=HostMemory(int(avail_mib * MIB), 64 * GIB), engine=engine())


def test_defaults_are_the_documented_ones() -> None:
    c = PressureConfig()
    assert (c.gpu_critical_free_mib, c.gpu_shed_free_mib, c.gpu_leave_free_mib) == (512, 1024, 2048)
    assert (c.kv_storm_usage, c.kv_critical_usage, c.preempt_window) == (0.90, 0.98, 5.0)
    assert (c.preempt_leave, c.preempt_shed, c.preempt_critical) == (5, 20, 100)
    assert c.min_dwell == 2.0 and c.unknown_shed_after == 4


@pytest.mark.parametrize(
    "changes",
    [
        {"gpu_shed_free_mib": 4096},  # leave must be above shed
        {"gpu_critical_free_mib": 1024},  # critical must be below shed
        {"kv_storm_usage": 0.99},  # storm counting must start at or below critical
        {"kv_critical_usage": 1.5},
        {"preempt_window": 0.0},
        {"preempt_leave": 0},
        {"preempt_leave": 30},  # leave above shed
        {"preempt_critical": 10},  # critical below shed
        {"host_leave_available_mib": 100},
        {"min_dwell": -1.0},
        {"unknown_shed_after": 0},
        {"abort_step_mib": -1},
    ],
)
def test_config_rejects_inconsistent_thresholds(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(PressureConfig(), **changes)  # type: ignore[arg-type]


def test_gpu_ok_shedding_critical_ok_with_hysteresis_and_dwell() -> None:
    p = PressurePolicy()
    assert p.update(gpu(8000), 0.0).state is State.OK
    # In the band between shed (1024) and leave (2048) while OK: stays OK.
    assert p.update(gpu(1500), 0.25).transition is None

    d = p.update(gpu(1000), 0.5)  # escalation is immediate
    assert d.state is State.SHEDDING
    assert d.transition is not None and d.transition.old is State.OK
    assert d.reason.signal == "gpu" and "free 1000 MiB" in d.reason.detail

    d = p.update(gpu(400), 0.75)
    assert d.state is State.CRITICAL and d.transition is not None
    assert d.abort_newest == 0  # entering critical aborts nothing by itself

    # Above critical but below shed: CRITICAL holds (no flapping at 512).
    assert p.update(gpu(700), 1.0).state is State.CRITICAL
    # Above shed, in the band: wants SHEDDING, but the dwell (2 s since 1.0) holds.
    assert p.update(gpu(1500), 1.25).state is State.CRITICAL
    assert p.update(gpu(1500), 2.9).state is State.CRITICAL
    d = p.update(gpu(1500), 3.0)
    assert d.state is State.SHEDDING and d.transition is not None
    assert d.transition.old is State.CRITICAL
    # Band keeps demanding SHEDDING: no relax however long it lasts.
    assert p.update(gpu(2000), 10.0).state is State.SHEDDING
    # Above leave: relax after min_dwell of calm (last demanded at 10.0).
    assert p.update(gpu(3000), 10.25).state is State.SHEDDING
    d = p.update(gpu(3000), 12.0)
    assert d.state is State.OK and d.transition is not None
    assert d.transition.reason.signal == "none"


def test_relax_needs_dwell_since_entry_even_if_memory_recovers_at_once() -> None:
    p = PressurePolicy(PressureConfig(min_dwell=2.0))
    p.update(gpu(900), 100.0)
    assert p.update(gpu(9000), 100.25).state is State.SHEDDING
    assert p.update(gpu(9000), 101.99).state is State.SHEDDING
    assert p.update(gpu(9000), 102.0).state is State.OK


def test_escalation_ignores_dwell() -> None:
    p = PressurePolicy(PressureConfig(min_dwell=60.0))
    p.update(gpu(900), 0.0)
    assert p.update(gpu(100), 0.01).state is State.CRITICAL


def test_worst_device_decides() -> None:
    p = PressurePolicy()
    d = p.update(gpu(20000, 900), 0.0)
    assert d.state is State.SHEDDING and "device 1" in d.reason.detail


def test_a_full_kv_cache_alone_is_not_pressure() -> None:
    # A busy engine: the backlog holds what does not fit; nothing to shed.
    p = PressurePolicy(PressureConfig(min_dwell=0.0))
    for i in range(40):
        d = p.update(kv(1.0), 0.25 * i)
        assert d.state is State.OK and d.abort_newest == 0


def test_preemption_storm_sheds_then_goes_critical_and_aborts() -> None:
    p = PressurePolicy(PressureConfig(min_dwell=0.0))
    total = 0

    def poll(t: float, usage: float, new: int) -> object:
        nonlocal total
        total += new
        return p.update(kv(usage, total), t)

    assert poll(0.0, 0.95, 0).state is State.OK  # first reading: the counter's base
    assert poll(0.5, 0.95, 19).state is State.OK  # 19 in 5 s: not a storm yet
    d = poll(1.0, 0.95, 1)
    assert d.state is State.SHEDDING and d.reason.signal == "kv"
    assert "20 preemptions in 5 s" in d.reason.detail
    # 100 within the window but the cache is not full to the critical level.
    assert poll(1.5, 0.95, 80).state is State.SHEDDING
    d = poll(2.0, 0.99, 1)
    assert d.state is State.CRITICAL and d.abort_newest == 0  # entering aborts nothing
    assert poll(2.5, 0.99, 3).abort_newest == 1  # still preempting: one per poll
    assert poll(2.8, 0.99, 0).abort_newest == 0
    assert poll(3.0, 0.99, 10).abort_newest == 1
    # The window forgets what is older than 5 s.
    assert poll(6.2, 0.95, 0).state is State.CRITICAL  # 94 since 1.5: still a storm
    assert poll(6.6, 0.95, 0).state is State.SHEDDING  # 14 since 2.0: below shed
    assert poll(8.1, 0.95, 0).state is State.OK  # nothing left in the window


def test_storm_hysteresis_leaves_shedding_below_preempt_leave() -> None:
    cfg = PressureConfig(min_dwell=0.0, preempt_shed=10, preempt_leave=4, preempt_window=10.0)
    p = PressurePolicy(cfg)
    p.update(kv(0.95, 0), 0.0)
    assert p.update(kv(0.95, 10), 1.0).state is State.SHEDDING
    # Ten left the window at 11.0; six more since: above leave, below shed.
    p.update(kv(0.95, 16), 2.0)
    assert p.update(kv(0.95, 16), 11.5).state is State.SHEDDING
    assert p.update(kv(0.95, 16), 12.5).state is State.OK
    # From OK, the same six do not shed.
    p.update(kv(0.95, 22), 13.0)
    assert p.update(kv(0.95, 22), 13.5).state is State.OK


def test_preemptions_with_room_in_the_cache_do_not_count() -> None:
    # Below kv_storm_usage vLLM is not short of blocks: these preemptions are its
    # priority scheduler making room for urgent requests on purpose.
    p = PressurePolicy(PressureConfig(min_dwell=0.0))
    p.update(kv(0.5, 0), 0.0)
    for i in range(1, 20):
        assert p.update(kv(0.85, 50 * i), 0.25 * i).state is State.OK


def test_a_few_deliberate_preemptions_per_window_do_not_shed() -> None:
    # A full cache and one priority preemption per urgent arrival, 3 per second.
    p = PressurePolicy(PressureConfig(min_dwell=0.0))
    p.update(kv(0.97, 0), 0.0)
    for i in range(1, 60):
        assert p.update(kv(0.97, 3 * i), float(i)).state is State.OK


def test_preemption_counter_reset_is_not_rising() -> None:
    p = PressurePolicy(PressureConfig(min_dwell=0.0))
    p.update(kv(0.99, preemptions=100), 0.0)
    assert p.update(kv(0.99, preemptions=0), 1.0).state is State.OK
    assert p.update(kv(0.99, preemptions=5), 2.0).state is State.OK


def ranks(*per_rank: tuple[float, int]) -> Readings:
    """Data-parallel ranks' (KV use, cumulative preemptions), summed and averaged
    into the engine's numbers as the engine adapter does (server/engines/vllm_adapter.py)."""
    stats = tuple(RankStats(u, 120, 0, preemptions_total=n) for u, n in per_rank)
    engine = EngineStats(
        kv_cache_usage=sum(r.kv_cache_usage for r in stats) / len(stats),
        running=sum(r.running for r in stats),
        waiting=0,
        preemptions_total=sum(r.preemptions_total for r in stats),
        ranks=stats,
    )
    return Readings(gpus=(), host=HOST_OK, engine=engine)


def test_a_storm_on_one_rank_sheds_beside_an_idle_rank() -> None:
    # Rank 0 full and evicting 20 in 5 s, rank 1 at 10%: the mean (55%) is below
    # kv_storm_usage, but rank 0's running requests are evicted again and again.
    p = PressurePolicy(PressureConfig(min_dwell=0.0))
    assert p.update(ranks((0.99, 0), (0.1, 0)), 0.0).state is State.OK
    d = p.update(ranks((0.99, 20), (0.1, 0)), 1.0)
    assert d.state is State.SHEDDING and d.reason.signal == "kv"
    assert d.reason.detail.startswith("rank 0 kv cache 99.0% used, 20 preemptions in 5 s")
    # 100 more on rank 0 with its cache past 98%: critical, though the mean is 55%.
    d = p.update(ranks((0.99, 120), (0.1, 0)), 1.5)
    assert d.state is State.CRITICAL and d.abort_newest == 0
    assert p.update(ranks((0.99, 125), (0.1, 0)), 2.0).abort_newest == 1  # still evicting
    # Preemptions on the idle rank are not the storming one's: no abort for them.
    assert p.update(ranks((0.99, 125), (0.1, 40)), 2.5).abort_newest == 0
    assert p.update(ranks((0.99, 125), (0.1, 40)), 7.1).state is State.OK


def test_ranks_each_below_the_storm_are_not_one_storm() -> None:
    # Both ranks full, each evicting 12 in 5 s (2.4/s): 24 in all, over
    # preempt_shed, but each scheduler is below what one storm is.
    p = PressurePolicy(PressureConfig(min_dwell=0.0))
    p.update(ranks((0.95, 0), (0.95, 0)), 0.0)
    for i in range(1, 13):
        assert p.update(ranks((0.95, i), (0.95, i)), 0.4 * i).state is State.OK
    # One rank's storm still counts on its own.
    assert p.update(ranks((0.95, 20), (0.95, 12)), 4.9).state is State.SHEDDING


def test_host_memory_signal() -> None:
    p = PressurePolicy(PressureConfig(min_dwell=0.0))
    assert p.update(host(4096), 0.0).state is State.OK
    d = p.update(host(1000), 1.0)
    assert d.state is State.SHEDDING and d.reason.signal == "host"
    assert p.update(host(500), 2.0).state is State.CRITICAL
    assert p.update(host(3000), 3.0).state is State.OK


def test_critical_aborts_one_per_poll_while_memory_keeps_falling() -> None:
    p = PressurePolicy(PressureConfig(abort_step_mib=64, abort_on_gpu=True))
    assert p.update(gpu(500), 0.0).state is State.CRITICAL
    assert p.update(gpu(430), 0.25).abort_newest == 1  # 70 MiB lower
    assert p.update(gpu(400), 0.5).abort_newest == 0  # 30 MiB: noise
    assert p.update(gpu(360), 0.75).abort_newest == 1  # 70 below the last abort: a slow leak
    assert p.update(gpu(380), 1.0).abort_newest == 0  # rising
    assert p.update(gpu(330), 1.25).abort_newest == 0  # 50 below the new high of 380
    assert p.update(gpu(300), 1.5).abort_newest == 1


def test_gpu_aborts_can_be_disabled() -> None:
    p = PressurePolicy(PressureConfig(abort_on_gpu=False))
    p.update(gpu(500), 0.0)
    assert p.update(gpu(100), 0.25).abort_newest == 0


def test_no_aborts_outside_critical() -> None:
    p = PressurePolicy()
    p.update(gpu(1000), 0.0)
    assert p.update(gpu(600), 0.25).abort_newest == 0


def test_failing_reader_counts_as_unknown_not_fine() -> None:
    p = PressurePolicy(PressureConfig(unknown_shed_after=4))
    p.update(gpu(8000), 0.0)
    lost = Readings(gpus=Unknown("NVMLError_GpuIsLost"), host=HOST_OK, engine=engine())
    for i in range(1, 4):
        d = p.update(lost, 0.25 * i)
        assert d.state is State.OK, i  # the last level holds for a few polls
    d = p.update(lost, 1.0)
    assert d.state is State.SHEDDING
    assert d.reason.signal == "gpu" and "unknown for 4 polls" in d.reason.detail
    # Recovery: the reader works again and shows plenty free; relax after dwell.
    assert p.update(gpu(8000), 1.25).state is State.SHEDDING
    assert p.update(gpu(8000), 3.25).state is State.OK


def test_unknown_keeps_a_higher_level() -> None:
    p = PressurePolicy(PressureConfig(unknown_shed_after=1, min_dwell=0.0))
    p.update(gpu(100), 0.0)
    lost = Readings(gpus=Unknown("x"), host=HOST_OK, engine=engine())
    assert p.update(lost, 1.0).state is State.CRITICAL


def test_reader_that_never_worked_is_ignored() -> None:
    p = PressurePolicy(PressureConfig(unknown_shed_after=1))
    absent = Readings(gpus=Unknown("nvml unavailable"), host=HOST_OK, engine=Unknown("no stats"))
    for i in range(20):
        assert p.update(absent, float(i)).state is State.OK


def test_unknown_policy_none_never_sheds() -> None:
    p = PressurePolicy(PressureConfig(unknown_shed_after=None))
    p.update(gpu(8000), 0.0)
    lost = Readings(gpus=Unknown("x"), host=HOST_OK, engine=engine())
    for i in range(1, 50):
        assert p.update(lost, float(i)).state is State.OK


def test_highest_signal_wins_and_reports_itself() -> None:
    p = PressurePolicy()
    r = Readings(
        gpus=(GpuMemory(0, 900 * MIB, 0, 24 * GIB),),
        host=HostMemory(100 * MIB, 64 * GIB),
        engine=engine(),
    )
    d = p.update(r, 0.0)
    assert d.state is State.CRITICAL and d.reason.signal == "host"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 6000), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(0, 60)
        ),
        min_size=1,
        max_size=60,
    )
)
def test_invariants_on_random_sequences(steps: list[tuple[int, float, float, int]]) -> None:
    """Never relaxes before min_dwell; aborts only in CRITICAL; KV never sheds alone."""
    cfg = PressureConfig()
    p = PressurePolicy(cfg)
    now, entered = 0.0, 0.0
    preemptions = 0
    for free_mib, dt, usage, new in steps:
        now += dt
        preemptions += new
        d = p.update(gpu(free_mib) if usage < 0.5 else kv(usage, preemptions), now)
        if d.reason.signal == "kv":
            assert preemptions >= cfg.preempt_leave
        t = d.transition
        if t is not None:
            if t.new < t.old:
                assert now - entered >= cfg.min_dwell
            entered = now
        if d.abort_newest:
            assert d.state is State.CRITICAL and t is None
        assert d.abort_newest in (0, 1)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 4),
    st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.8, 1.0), st.integers(0, 40)), max_size=40),
)
def test_identical_ranks_act_as_one_scheduler(
    n: int, steps: list[tuple[float, float, int]]
) -> None:
    """N ranks that each see the same KV use and preemptions get the decisions
    one engine with those numbers gets: the storm is a rank's, never the sum."""
    cfg = PressureConfig(min_dwell=0.5)
    one, many = PressurePolicy(cfg), PressurePolicy(cfg)
    now, total = 0.0, 0
    for dt, usage, new in steps:
        now += dt
        total += new
        a = one.update(kv(usage, total), now)
        b = many.update(ranks(*[(usage, total)] * n), now)
        assert (a.state, a.abort_newest, a.reason.signal) == (
            b.state,
            b.abort_newest,
            b.reason.signal,
        )
