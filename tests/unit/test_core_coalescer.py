"""The coalescer's rules by example: admission, window, caps, order, cancel, expiry,
adaptive release, admission states and events. A fake clock is just floats."""

from __future__ import annotations

import pytest

from batching import (
    BACKGROUND_PRIORITY,
    AdmissionState,
    Admitted,
    Batch,
    Coalescer,
    CoalescerConfig,
    Ended,
    EngineLoad,
    GroupKey,
    Outcome,
    Refusal,
    RefusalReason,
    Refused,
    Released,
    ReleaseReason,
    Request,
    group_key,
)

M = group_key("m")
IDLE = EngineLoad(running=0, waiting=0)
BUSY = EngineLoad(running=3, waiting=0)


def req(
    rid: str,
    now: float = 0.0,
    prompt: int | tuple[int, ...] = 4,
    new: int = 4,
    key: GroupKey = M,
    priority: int = 0,
    deadline: float | None = None,
) -> Request:
    toks = tuple(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    return Request(rid, key, toks, new, now, priority=priority, deadline=deadline)


def cfg(**kw: object) -> CoalescerConfig:
    kw.setdefault("release_lone", False)  # the lone-arrival rule off unless a test is about it
    return CoalescerConfig(**kw)  # type: ignore[arg-type]


def ids(batch: Batch) -> list[str]:
    return [e.request.id for e in batch.entries]


def ended(events: list[object]) -> dict[str, Outcome]:
    out: dict[str, Outcome] = {}
    for ev in events:
        if isinstance(ev, Ended):
            assert ev.request_id not in out
            out[ev.request_id] = ev.outcome
    return out


# -- admission (rule 1) -------------------------------------------------------


def test_admit_counts_queued_and_pending() -> None:
    co = Coalescer(cfg())
    assert co.add(req("a", prompt=10, new=5), 0.0) == Admitted("a", None)
    assert (co.queued_requests, co.queued_tokens) == (1, 15)
    assert (co.pending_requests, co.pending_tokens, co.in_flight) == (1, 15, 0)
    assert len(co.due(0.010)) == 1
    assert (co.queued_requests, co.queued_tokens) == (0, 0)
    assert (co.pending_requests, co.pending_tokens, co.in_flight) == (1, 15, 1)
    assert co.finished("a", 0.5) is True
    assert (co.pending_requests, co.pending_tokens, co.in_flight) == (0, 0, 0)
    assert co.finished("a", 0.6) is False  # twice, or unknown: a no-op


def test_request_limit_counts_in_flight_and_refuses_with_default_retry() -> None:
    co = Coalescer(cfg(max_pending_requests=2, window=0.0, retry_after_default=3.0))
    assert isinstance(co.add(req("a"), 0.0), Admitted)
    co.due(0.0)  # a is in flight now, still pending
    assert isinstance(co.add(req("b"), 0.0), Admitted)
    r = co.add(req("c"), 0.0)
    assert r == Refused(RefusalReason.QUEUE_FULL_REQUESTS, 3.0, r.message)
    assert r.message
    assert [e for e in co.pop_events() if isinstance(e, Refusal)] == [
        Refusal("c", RefusalReason.QUEUE_FULL_REQUESTS, 3.0, 0.0)
    ]
    co.finished("a", 0.1)
    assert isinstance(co.add(req("c"), 0.1), Admitted)


def test_token_limit_and_too_large() -> None:
    co = Coalescer(cfg(max_pending_tokens=100))
    assert isinstance(co.add(req("a", prompt=50, new=30), 0.0), Admitted)
    r = co.add(req("b", prompt=10, new=11), 0.0)
    assert isinstance(r, Refused) and r.reason is RefusalReason.QUEUE_FULL_TOKENS
    assert isinstance(co.add(req("c", prompt=10, new=10), 0.0), Admitted)  # exactly full
    big = co.add(req("d", prompt=90, new=11), 0.0)
    assert isinstance(big, Refused) and big.reason is RefusalReason.TOO_LARGE
    assert big.retry_after == 0.0  # retrying cannot help: the server answers 400


def test_retry_after_follows_the_measured_drain_rate() -> None:
    co = Coalescer(cfg(window=0.0, max_pending_tokens=1000, retry_after_min=0.01))
    # 10 generations of 100 tokens each, finished over 1 s of busy time: 1000 tok/s.
    for i in range(10):
        co.add(req(f"g{i}", prompt=50, new=50), 0.0)
    co.due(0.0)
    for i in range(10):
        co.finished(f"g{i}", 0.1 * (i + 1))
    assert co.drain_rate == pytest.approx(1000.0, rel=0.05)
    for i in range(9):
        co.add(req(f"h{i}", prompt=50, new=50), 1.0)
    r = co.add(req("x", prompt=100, new=100), 1.0)  # 200 over a 100-token headroom
    assert isinstance(r, Refused) and r.reason is RefusalReason.QUEUE_FULL_TOKENS
    assert r.retry_after == pytest.approx(0.1, rel=0.1)  # 100 excess / 1000 tok/s


def test_finished_tokens_are_generated_tokens_plus_the_prompt() -> None:
    co = Coalescer(cfg(window=0.0))
    co.add(req("a", prompt=40, new=1000), 0.0)
    co.due(0.0)
    co.finished("a", 1.0, tokens=60)  # stopped early: 40 prompt + 60 generated in 1 s
    assert co.drain_rate == pytest.approx(100.0)
    co.add(req("b", 1.0, prompt=40, new=1000), 1.0)
    co.due(1.0)
    co.finished("b", 2.0)  # unknown: counts the admission cost, 1040 in 1 s
    assert co.drain_rate is not None and co.drain_rate > 100.0


def test_retry_after_is_clamped() -> None:
    co = Coalescer(cfg(window=0.0, max_pending_tokens=100, retry_after_max=5.0))
    co.add(req("a", prompt=50, new=50), 0.0)
    co.due(0.0)
    co.finished("a", 100.0)  # 1 token/s
    co.add(req("b", prompt=50, new=50), 100.0)
    r = co.add(req("c", prompt=50, new=50), 100.0)
    assert isinstance(r, Refused) and r.retry_after == 5.0
    co2 = Coalescer(cfg(window=0.0, max_pending_tokens=100))  # min 1 s by default
    co2.add(req("a", prompt=50, new=50), 0.0)
    co2.due(0.0)
    co2.finished("a", 0.001)
    co2.add(req("b", prompt=50, new=50), 0.001)
    r2 = co2.add(req("c", prompt=50, new=50), 0.001)
    assert isinstance(r2, Refused) and r2.retry_after == 1.0


def test_duplicate_ids_are_refused_while_queued_or_in_flight() -> None:
    co = Coalescer(cfg(window=0.0))
    co.add(req("a"), 0.0)
    r = co.add(req("a"), 0.0)
    assert isinstance(r, Refused) and r.reason is RefusalReason.DUPLICATE_ID
    co.due(0.0)
    assert isinstance(co.add(req("a"), 0.0), Refused)  # in flight
    co.finished("a", 0.1)
    assert isinstance(co.add(req("a"), 0.1), Admitted)  # done: the id is free again


def test_admission_states() -> None:
    co = Coalescer(cfg())
    co.add(req("q"), 0.0)
    co.state = AdmissionState.SHEDDING
    r = co.add(req("a"), 0.0)
    assert isinstance(r, Refused) and r.reason is RefusalReason.MEMORY and r.retry_after >= 1
    assert [ids(b) for b in co.due(0.010)] == [["q"]]  # queued work still proceeds
    co.state = AdmissionState.DRAINING
    r = co.add(req("b"), 0.1)
    assert isinstance(r, Refused) and r.reason is RefusalReason.DRAINING
    co.state = AdmissionState.OK
    assert isinstance(co.add(req("b", 0.2), 0.2), Admitted)


def test_critical_releases_nothing_but_still_expires() -> None:
    co = Coalescer(cfg(adaptive=True))
    co.add(req("a", 0.0), 0.0)
    co.add(req("b", 0.0, deadline=0.5), 0.0)
    co.state = AdmissionState.CRITICAL
    r = co.add(req("c"), 0.0)
    assert isinstance(r, Refused) and r.reason is RefusalReason.MEMORY
    assert co.next_deadline() == 0.5  # expiry only: a driver must not spin on the window
    assert co.due(0.1, IDLE) == []
    co.pop_events()
    assert co.due(0.6) == []
    assert ended(co.pop_events()) == {"b": Outcome.EXPIRED}
    assert co.next_deadline() is None
    co.state = AdmissionState.OK
    assert co.next_deadline() == 0.010
    assert [ids(b) for b in co.due(0.6)] == [["a"]]


# -- window and caps (rules 2, 3) --------------------------------------------


def test_deadline_release_after_one_window() -> None:
    co = Coalescer(cfg(window=0.010))
    assert co.next_deadline() is None
    co.add(req("a", 1.0), 1.0)
    co.add(req("b", 1.004), 1.004)
    assert co.next_deadline() == pytest.approx(1.010)
    assert co.due(1.0099) == []
    [b] = co.due(1.010)
    assert ids(b) == ["a", "b"] and b.reason is ReleaseReason.DEADLINE
    assert b.key == M and b.released_at == 1.010 and b.tokens == 16
    assert co.due(1.010) == []  # calling again is safe
    assert co.next_deadline() is None


def test_window_zero_releases_immediately() -> None:
    co = Coalescer(cfg(window=0.0))
    co.add(req("a", 2.0), 2.0)
    assert co.next_deadline() == 2.0
    [b] = co.due(2.0)
    assert ids(b) == ["a"] and b.reason is ReleaseReason.IMMEDIATE


def test_size_cap_releases_at_once() -> None:
    co = Coalescer(cfg(max_batch_seqs=3))
    for i in range(3):
        co.add(req(f"r{i}", 0.001 * i), 0.001 * i)
    assert co.next_deadline() == 0.002  # when the cap was reached
    [b] = co.due(0.002)
    assert ids(b) == ["r0", "r1", "r2"] and b.reason is ReleaseReason.SIZE_CAP


def test_token_cap_counts_prompt_tokens_and_takes_what_fits_in_order() -> None:
    co = Coalescer(cfg(max_batch_tokens=100))
    co.add(req("long", prompt=60, new=1000), 0.0)  # max_new does not count for the cap
    co.add(req("short", prompt=30), 0.0)
    assert co.due(0.0) == []
    co.add(req("mid", prompt=40), 0.001)  # 130 prompt tokens >= 100
    [b] = co.due(0.001)
    assert ids(b) == ["short", "mid"] and b.reason is ReleaseReason.TOKEN_CAP
    assert co.queued_requests == 1  # "long" waits for its window
    [b2] = co.due(0.010)
    assert ids(b2) == ["long"] and b2.reason is ReleaseReason.DEADLINE


def test_lone_oversize_request_forms_its_own_batch() -> None:
    co = Coalescer(cfg(max_batch_tokens=100))
    co.add(req("small", prompt=10), 0.0)
    co.add(req("huge", prompt=500), 0.0)
    got = co.due(0.0)
    assert [ids(b) for b in got] == [["small"], ["huge"]]
    assert all(b.reason is ReleaseReason.TOKEN_CAP for b in got)


def test_overdue_group_is_released_whole_in_as_many_batches_as_caps_demand() -> None:
    co = Coalescer(cfg(max_batch_seqs=3))
    for i in range(7):  # the driver did not call due() in between
        co.add(req(f"r{i}", 0.0), 0.0)
    got = co.due(0.050)
    assert [len(b.entries) for b in got] == [3, 3, 1]
    assert co.queued_requests == 0


def test_batches_never_mix_group_keys() -> None:
    co = Coalescer(cfg())
    lora = group_key("m", "lora")
    co.add(req("a", key=M), 0.0)
    co.add(req("b", key=lora), 0.0)
    co.add(req("c", key=M), 0.0)
    got = co.due(0.010)
    assert sorted((b.key.adapter or "", ids(b)) for b in got) == [("", ["a", "c"]), ("lora", ["b"])]


# -- ordering (rule 4) -------------------------------------------------------


def test_order_is_priority_then_shorter_prompt_then_arrival() -> None:
    co = Coalescer(cfg())
    co.add(req("p1-long", prompt=100, priority=1), 0.0)
    co.add(req("p0-long", prompt=100), 0.0)
    co.add(req("p0-short-1", prompt=3), 0.0)
    co.add(req("p0-short-2", prompt=3), 0.0)
    co.add(req("urgent", prompt=500, priority=-1), 0.0)
    [b] = co.due(0.010)
    assert ids(b) == ["urgent", "p0-short-1", "p0-short-2", "p0-long", "p1-long"]


def test_the_window_cut_keeps_near_equal_prompts_first_come_first_served() -> None:
    # 64 and 60 tokens are one length class (16 tokens): arrival order decides.
    co = Coalescer(cfg())
    co.add(req("64-first", prompt=64), 0.0)
    co.add(req("60-second", 0.001, prompt=60), 0.001)
    co.add(req("65-third", 0.002, prompt=65), 0.002)
    [b] = co.due(0.010)
    assert ids(b) == ["64-first", "60-second", "65-third"]


def test_split_takes_in_order() -> None:
    co = Coalescer(cfg(max_batch_seqs=2))
    co.add(req("low", priority=5), 0.0)
    co.add(req("high", priority=0), 0.0)
    co.add(req("x", priority=5), 0.0)
    co.add(req("y", priority=1, prompt=90), 0.0)
    co.add(req("z", priority=1, prompt=2), 0.0)
    # Caps were reached; the rest (under the caps) keeps waiting for its window.
    got = co.due(0.0)
    assert [ids(b) for b in got] == [["high", "z"], ["y", "low"]]
    assert [b.reason for b in got] == [ReleaseReason.SIZE_CAP] * 2
    assert [ids(b) for b in co.due(0.010)] == [["x"]]


# -- cancel and expiry (rule 5) ----------------------------------------------


def test_cancel_removes_queued_work() -> None:
    co = Coalescer(cfg())
    co.add(req("a", 0.0), 0.0)
    co.add(req("b", 0.0), 0.0)
    assert co.cancel("a", 0.004) is True
    assert co.cancel("a", 0.004) is False
    assert co.cancel("nope", 0.004) is False
    assert (co.queued_requests, co.pending_tokens) == (1, 8)
    [b] = co.due(0.010)
    assert ids(b) == ["b"]
    assert co.cancel("b", 0.02) is False  # dispatched: the driver aborts in the engine
    evs = co.pop_events()
    assert ended(evs) == {"a": Outcome.CANCELLED, "b": Outcome.DISPATCHED}
    [cancel] = [e for e in evs if isinstance(e, Ended) and e.request_id == "a"]
    assert cancel.queue_wait == pytest.approx(0.004)


def test_cancel_of_the_only_request_empties_the_schedule() -> None:
    co = Coalescer(cfg())
    co.add(req("a", 0.0), 0.0)
    co.cancel("a", 0.001)
    assert co.next_deadline() is None
    assert co.due(1.0) == []


def test_expiry_before_dispatch() -> None:
    co = Coalescer(cfg(window=0.050))
    co.add(req("a", 0.0, deadline=0.020), 0.0)
    co.add(req("b", 0.0), 0.0)
    assert co.next_deadline() == 0.020
    assert co.due(0.020) == []
    assert ended(co.pop_events()) == {"a": Outcome.EXPIRED}
    assert co.next_deadline() == 0.050
    [b] = co.due(0.050)
    assert ids(b) == ["b"]


def test_expiry_and_release_due_together_expire_first() -> None:
    co = Coalescer(cfg(window=0.010))
    co.add(req("a", 0.0, deadline=0.005), 0.0)
    assert co.due(0.5) == []
    assert co.pending_requests == 0


# -- adaptive (rule 8) -------------------------------------------------------


def test_idle_engine_releases_early() -> None:
    co = Coalescer(cfg(window=0.010))
    co.add(req("a", 0.0), 0.0)
    assert co.due(0.001, BUSY) == []
    assert co.due(0.001, EngineLoad(running=0, waiting=2)) == []
    [b] = co.due(0.001, IDLE)
    assert ids(b) == ["a"] and b.reason is ReleaseReason.EARLY


def test_idle_snapshot_is_ignored_while_our_own_work_is_in_flight() -> None:
    co = Coalescer(cfg(window=0.010))
    co.add(req("a", 0.0), 0.0)
    co.due(0.0, IDLE)
    co.add(req("b", 0.001), 0.001)
    assert co.due(0.001, IDLE) == []  # the snapshot predates our dispatch of "a"
    co.finished("a", 0.002)
    assert [ids(b) for b in co.due(0.002, IDLE)] == [["b"]]


def test_adaptive_off() -> None:
    co = Coalescer(cfg(window=0.010, adaptive=False))
    co.add(req("a", 0.0), 0.0)
    assert co.due(0.001, IDLE) == []


def test_lone_arrival_is_released_at_once_and_a_burst_behind_it_coalesces() -> None:
    co = Coalescer(cfg(window=0.010, release_lone=True))
    co.add(req("a", 0.0), 0.0)  # nothing admitted before: a quiet spell
    assert co.next_deadline() == 0.0
    [b] = co.due(0.0, BUSY)  # even with a busy engine
    assert ids(b) == ["a"] and b.reason is ReleaseReason.LONE
    co.add(req("b", 0.002), 0.002)  # 2 ms after "a": company is likely
    co.add(req("c", 0.005), 0.005)
    assert co.due(0.005, BUSY) == []
    assert co.next_deadline() == 0.012
    [b] = co.due(0.012, BUSY)
    assert ids(b) == ["b", "c"] and b.reason is ReleaseReason.DEADLINE
    co.add(req("d", 0.0151), 0.0151)  # 10.1 ms after "c": quiet again
    [b] = co.due(0.0151, BUSY)
    assert ids(b) == ["d"] and b.reason is ReleaseReason.LONE


def test_a_lone_arrival_is_judged_among_its_own_class() -> None:
    # Issue 49: a batch's lines are admitted all the time beside a chat caller, and
    # a chat turn 2 ms behind one waited out the window (10 ms, the whole of its alone
    # TTFT on a fast machine) for company that would never go before it. Background
    # arrivals neither make an interactive arrival company nor the other way round.
    co = Coalescer(cfg(window=0.010, release_lone=True))
    bg = BACKGROUND_PRIORITY
    co.add(req("line1", 0.0, priority=bg), 0.0)
    assert [ids(b) for b in co.due(0.0, BUSY)] == [["line1"]]  # lone among background
    co.add(req("turn1", 0.002), 0.002)  # 2 ms behind a batch line: lone among turns
    [b] = co.due(0.002, BUSY)
    assert ids(b) == ["turn1"] and b.reason is ReleaseReason.LONE
    co.add(req("line2", 0.004, priority=bg), 0.004)  # 4 ms behind line1: company likely
    assert co.due(0.004, BUSY) == []
    co.add(req("turn2", 0.006), 0.006)  # 4 ms behind turn1: a burst of turns coalesces
    assert co.due(0.006, BUSY) == []
    [b] = co.due(0.014, BUSY)
    assert sorted(ids(b)) == ["line2", "turn2"] and b.reason is ReleaseReason.DEADLINE


def test_joins_count_as_arrivals() -> None:
    co = Coalescer(cfg(window=0.010, release_lone=True))

    def greedy(rid: str, now: float) -> Request:
        return Request(rid, M, (7, 8, 9), 4, now, fingerprint="greedy")

    co.add(req("a", 0.0), 0.0)
    assert ids(co.due(0.0)[0]) == ["a"]  # lone
    co.add(greedy("b", 0.005), 0.005)  # 5 ms later: queued
    co.add(greedy("c", 0.014), 0.014)  # joins "b"
    [b] = co.due(0.015)
    assert [e.subscribers for e in b.entries] == [("b", "c")]
    co.add(req("d", 0.020), 0.020)  # 6 ms after the join ("b" was 15 ms ago)
    assert co.due(0.020) == []


def test_lone_rule_off_or_window_zero() -> None:
    co = Coalescer(cfg(window=0.010, release_lone=False))
    co.add(req("a", 0.0), 0.0)
    assert co.due(0.001, BUSY) == []
    co = Coalescer(cfg(window=0.0, release_lone=True))
    co.add(req("a", 0.0), 0.0)
    [b] = co.due(0.0)
    assert b.reason is ReleaseReason.IMMEDIATE


# -- events, counters, reject (rules 1, 9) -----------------------------------


def test_events_and_counters() -> None:
    co = Coalescer(cfg(max_pending_requests=2))
    co.add(req("a", 0.0), 0.0)
    co.add(req("b", 0.002), 0.002)
    co.add(req("c", 0.003), 0.003)  # refused
    [b] = co.due(0.010)
    evs = co.pop_events()
    assert evs[0] == Refusal("c", RefusalReason.QUEUE_FULL_REQUESTS, 1.0, 0.003)
    assert evs[1:] == [
        Ended("a", Outcome.DISPATCHED, pytest.approx(0.010), 0.010),  # type: ignore[arg-type]
        Ended("b", Outcome.DISPATCHED, pytest.approx(0.008), 0.010),  # type: ignore[arg-type]
        Released(b.id, M, ReleaseReason.DEADLINE, 2, 16, 0.010),
    ]
    assert co.pop_events() == []
    c = co.counters
    assert (c.admitted, c.refused, c.dispatched, c.batches, c.generations) == (2, 1, 2, 1, 2)


def test_reject_queued_ends_everything_queued() -> None:
    co = Coalescer(cfg(window=0.0))
    co.add(req("flying", 0.0), 0.0)
    co.due(0.0)
    co.add(req("a", 0.1, deadline=5.0), 0.1)
    co.add(req("b", 0.1), 0.1)
    co.pop_events()
    assert sorted(co.reject_queued(0.2)) == ["a", "b"]
    assert ended(co.pop_events()) == {"a": Outcome.REJECTED, "b": Outcome.REJECTED}
    assert (co.queued_requests, co.queued_tokens, co.pending_requests) == (0, 0, 1)
    assert co.next_deadline() is None and co.due(10.0) == []
    assert co.counters.rejected == 2
    assert isinstance(co.add(req("a", 0.3), 0.3), Admitted)  # the ids are free again


def test_next_deadline_is_a_query_and_skips_what_left() -> None:
    co = Coalescer(cfg())
    co.add(req("a", 0.0, deadline=5.0), 0.0)
    co.add(req("b", 0.004), 0.004)
    heaps = (list(co._wheap), list(co._xheap))
    assert co.next_deadline() == pytest.approx(0.010)
    assert co.next_deadline() == pytest.approx(0.010)
    assert (list(co._wheap), list(co._xheap)) == heaps  # nothing was touched
    # A cancel leaves the heaps' tops live: the next deadline is b's window.
    assert co.cancel("a", 0.005)
    assert co.next_deadline() == pytest.approx(0.014)
    co.due(0.014)
    assert co.next_deadline() is None
