"""Shared-prefix leaders and followers (rule 7)."""

from __future__ import annotations

import pytest

from batching import (
    Batch,
    Coalescer,
    CoalescerConfig,
    Ended,
    EngineLoad,
    Outcome,
    PrefixLeader,
    ReleaseReason,
    Request,
    group_key,
)
from batching.prefix import PrefixMemory, block_key, plan_followers, shared_blocks

M = group_key("m")
SYS = tuple(range(1000, 1008))  # two 4-token blocks of "system prompt"


def req(rid: str, prompt: tuple[int, ...], now: float = 0.0, **kw: object) -> Request:
    return Request(rid, M, prompt, 8, now, **kw)  # type: ignore[arg-type]


def co_(**kw: object) -> Coalescer:
    kw.setdefault("prefix_block", 4)
    kw.setdefault("prefix_follow_delay", 0.005)
    kw.setdefault("prefix_memory", 2.0)
    kw.setdefault("release_lone", False)
    return Coalescer(CoalescerConfig(**kw))  # type: ignore[arg-type]


def ids(b: Batch) -> list[str]:
    return [e.request.id for e in b.entries]


def test_helpers() -> None:
    assert block_key(M, (1, 2, 3), 4) is None
    assert block_key(M, (1, 2, 3, 4, 5), 4) == block_key(M, (1, 2, 3, 4, 9), 4)
    assert block_key(M, (1, 2, 3, 4), 4) != block_key(group_key("m", "lora"), (1, 2, 3, 4), 4)
    assert shared_blocks((1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 3, 4, 5, 6, 7, 8), 4) == 8
    assert shared_blocks((1, 2, 3, 4, 5, 6, 7), (1, 2, 3, 4, 5, 6, 0, 8), 4) == 4
    assert shared_blocks((1, 2, 3), (1, 2, 3), 4) == 0
    mem = PrefixMemory(1.0)
    assert plan_followers([7, None, 7, 8, 7, 8], mem, 0.0) == [(0, [2, 4]), (3, [5])]
    mem.remember(7, 0.0)
    assert plan_followers([7, 7, 8, 8], mem, 0.5) == [(2, [3])]
    assert plan_followers([7, 7], mem, 1.0) == [(0, [1])]  # memory ran out
    mem.prune(1.0)
    assert len(mem) == 0


def test_leader_goes_now_and_followers_one_step_later() -> None:
    co = co_()
    co.add(req("lead", (*SYS, 1)), 0.0)
    co.add(req("other", (5, 5, 5, 5, 5)), 0.0)
    co.add(req("f1", (*SYS, 2, 2)), 0.0)
    co.add(req("f2", (*SYS[:4], 3, 3, 3, 3, 3)), 0.0)  # shares one whole block only
    [b] = co.due(0.010)
    assert ids(b) == ["other", "lead"]  # shortest first; followers held back
    assert b.reason is ReleaseReason.DEADLINE
    evs = co.pop_events()
    assert PrefixLeader("lead", 2, 4, 0.010) in evs
    assert {e.request_id for e in evs if isinstance(e, Ended)} == {"lead", "other"}
    assert co.queued_requests == 2  # followers still count as queued
    assert co.next_deadline() == pytest.approx(0.015)
    assert co.due(0.014) == []
    assert co.due(0.014, EngineLoad(0, 0)) == []  # adaptive does not cut the delay short
    [f] = co.due(0.015)
    assert ids(f) == ["f2", "f1"] and f.reason is ReleaseReason.PREFIX_FOLLOW
    c = co.counters
    assert (c.prefix_leaders, c.prefix_followers, c.batches) == (1, 2, 2)


def test_no_hold_for_partial_blocks_or_when_disabled() -> None:
    co = co_()
    co.add(req("a", (1, 2, 3)), 0.0)
    co.add(req("b", (1, 2, 3)), 0.0)
    [b] = co.due(0.010)
    assert ids(b) == ["a", "b"]
    off = co_(prefix_block=0)
    off.add(req("a", SYS), 0.0)
    off.add(req("b", SYS), 0.0)
    [b] = off.due(0.010)
    assert ids(b) == ["a", "b"]


def test_recently_released_prefix_is_not_held_back() -> None:
    co = co_(prefix_memory=2.0)
    co.add(req("first", SYS), 0.0)
    co.due(0.010)  # released alone: its prefix is now cached
    co.add(req("a", (*SYS, 1)), 1.0)
    co.add(req("b", (*SYS, 2)), 1.0)
    [b] = co.due(1.010)
    assert ids(b) == ["a", "b"]
    co.add(req("c", (*SYS, 1)), 3.1)  # memory (2 s from 1.010) ran out
    co.add(req("d", (*SYS, 2)), 3.1)
    [b] = co.due(3.110)
    assert ids(b) == ["c"]


def test_held_followers_can_be_cancelled_expire_or_be_rejected() -> None:
    co = co_()
    co.add(req("lead", SYS), 0.0)
    co.add(req("f1", SYS), 0.0)
    co.add(req("f2", SYS, deadline=0.012), 0.0)
    co.add(req("f3", SYS), 0.0)
    co.due(0.010)
    assert co.cancel("f1", 0.011)
    co.due(0.012)
    co.pop_events()
    assert co.reject_queued(0.013) == ["f3"]
    assert co.due(1.0) == []
    assert co.next_deadline() is None
    outcomes = {e.request_id: e.outcome for e in co.pop_events() if isinstance(e, Ended)}
    assert outcomes == {"f3": Outcome.REJECTED}


def test_all_followers_gone_means_no_follow_batch() -> None:
    co = co_()
    co.add(req("lead", SYS), 0.0)
    co.add(req("f1", SYS), 0.0)
    co.due(0.010)
    co.cancel("f1", 0.011)
    assert co.next_deadline() is None
    assert co.due(0.020) == []


def test_two_prefixes_in_one_batch_have_two_leaders() -> None:
    co = co_()
    other = (7, 7, 7, 7, 7, 7)
    co.add(req("a1", SYS), 0.0)
    co.add(req("b1", other), 0.0)
    co.add(req("a2", SYS), 0.0)
    co.add(req("b2", other), 0.0)
    [b] = co.due(0.010)
    assert ids(b) == ["b1", "a1"]
    leaders = {e.request_id for e in co.pop_events() if isinstance(e, PrefixLeader)}
    assert leaders == {"a1", "b1"}
    [f] = co.due(0.015)
    assert ids(f) == ["b2", "a2"]
