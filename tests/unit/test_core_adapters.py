"""LoRA slots by example: adapters.py rules 1-4, room.py rule 7, backlog.py rule 5.
A fake clock is just floats; window 0, so a due() makes everything admitted eligible."""

from __future__ import annotations

import pytest

from batching import (
    Batch,
    CallerPolicy,
    Callers,
    Coalescer,
    CoalescerConfig,
    EngineCapacity,
    Request,
    group_key,
)


def req(rid: str, caller: str, adapter: str | None, now: float = 0.0, prompt: int = 4) -> Request:
    return Request(
        rid, group_key("m", adapter), tuple(range(100, 100 + prompt)), 4, now, caller=caller
    )


def co_(max_loras: int = 2, seqs: int = 0, wait: float = 1.0) -> Coalescer:
    names = ("p", "q", "r", "s", "x", "y")
    return Coalescer(
        CoalescerConfig(
            window=0.0,
            adaptive=False,
            release_lone=False,
            dedupe=False,
            engine=EngineCapacity(max_seqs=seqs, max_loras=max_loras),
            feed_steps=1.0,
            adapter_wait=wait,
            callers=Callers(tuple(CallerPolicy(n) for n in names)),
        )
    )


def ids(batches: list[Batch]) -> list[str]:
    return [e.request.id for b in batches for e in b.entries]


def test_rule1_2_distinct_adapters_in_flight_stay_within_max_loras() -> None:
    co = co_(max_loras=2)
    for rid, caller, adapter in (("p1", "p", "a"), ("q1", "q", "b"), ("r1", "r", "c")):
        co.add(req(rid, caller, adapter), 0.0)
    assert sorted(ids(co.due(0.0))) == ["p1", "q1"]  # c would be a third adapter
    assert co.backlog_generations == 1
    # A second request on a resident adapter needs no new slot.
    co.add(req("p2", "p", "a"), 0.1)
    assert ids(co.due(0.1)) == ["p2"]


def test_rule1_base_model_work_takes_no_slot() -> None:
    co = co_(max_loras=1)
    co.add(req("p1", "p", "a"), 0.0)
    assert ids(co.due(0.0)) == ["p1"]
    co.add(req("q1", "q", "b"), 0.0)
    co.add(req("s1", "s", None), 0.0)
    assert ids(co.due(0.0)) == ["s1"]  # the slot is a's; base weights go


def test_rule1_a_slot_frees_when_the_last_of_its_work_ends() -> None:
    co = co_(max_loras=1)
    co.add(req("p1", "p", "a"), 0.0)
    co.add(req("p2", "p", "a"), 0.0)
    assert sorted(ids(co.due(0.0))) == ["p1", "p2"]
    co.add(req("q1", "q", "b"), 0.0)
    assert ids(co.due(0.0)) == []
    co.finished("p1", 0.1, 4)
    assert ids(co.due(0.1)) == []  # p2 still holds a's slot
    co.finished("p2", 0.2, 4)
    assert ids(co.due(0.2)) == ["q1"]
    assert co.adapter_slots(0.2).in_flight == (("b", 1),)


def test_rule3_4_the_waiting_head_gets_the_slot_after_wait() -> None:
    co = co_(max_loras=1, wait=1.0)
    co.add(req("p1", "p", "a"), 0.0)
    assert ids(co.due(0.0)) == ["p1"]
    co.add(req("q1", "q", "b"), 0.0)  # q: the fair-share head, waiting for a slot
    assert ids(co.due(0.0)) == []
    assert co.adapter_slots(0.0).waiting_since == 0.0
    # Before the bound, work on the resident adapter keeps the engine busy.
    co.add(req("p2", "p", "a"), 0.5)
    assert ids(co.due(0.5)) == ["p2"]
    # Past it, a is closed to new work and drains for q.
    co.add(req("p3", "p", "a"), 1.0)
    assert ids(co.due(1.0)) == []
    view = co.adapter_slots(1.0)
    assert (view.wanted, view.victim) == ("b", "a")
    co.finished("p1", 1.1, 4)
    assert ids(co.due(1.1)) == []
    co.finished("p2", 1.2, 4)
    assert ids(co.due(1.2)) == ["q1"]  # a drained: its slot is q's, not p3's
    view = co.adapter_slots(1.2)  # now p3 waits, for a, from here
    assert (view.wanted, view.victim, view.waiting_since) == ("a", None, 1.2)


def test_rule4_the_victim_is_the_adapter_held_longest() -> None:
    co = co_(max_loras=2, wait=1.0)
    co.add(req("p1", "p", "a"), 0.0)
    co.add(req("q1", "q", "b"), 0.0)
    assert sorted(ids(co.due(0.0))) == ["p1", "q1"]
    co.add(req("r1", "r", "c"), 0.0)  # r waits (head: the least counter)
    assert ids(co.due(0.0)) == []
    assert ids(co.due(1.0)) == []  # overdue: a (held longest) is the victim
    assert co.adapter_slots(1.0).victim == "a"
    co.add(req("q2", "q", "b"), 1.0)
    assert ids(co.due(1.0)) == ["q2"]  # b, held later, stays open
    co.finished("p1", 1.1, 4)
    co.add(req("x1", "x", "d"), 1.1)  # a new caller wakes at the floor, behind r
    assert ids(co.due(1.1)) == ["r1"]


def test_rule5_resident_work_first_among_equal_counters() -> None:
    # Two slots in the engine, one in flight on adapter a: x (adapter b) and y
    # (adapter a) wake together at the same counter, and only one may go.
    co = co_(max_loras=2, seqs=2)
    co.add(req("p1", "p", "a"), 0.0)
    assert ids(co.due(0.0)) == ["p1"]
    co.add(req("x1", "x", "b"), 0.1)
    co.add(req("y1", "y", "a"), 0.1)
    assert ids(co.due(0.1)) == ["y1"]  # x arrived first, but y needs no new slot


def test_lora_off_changes_nothing() -> None:
    co = co_(max_loras=0)
    for i, adapter in enumerate("abcdef"):
        co.add(req(f"p{i}", "p", adapter), 0.0)
    assert len(ids(co.due(0.0))) == 6
    assert co.adapter_slots(0.0).in_flight == ()


def test_adapter_wait_is_validated() -> None:
    with pytest.raises(ValueError, match="adapter wait"):
        CoalescerConfig(adapter_wait=-1.0)
    with pytest.raises(ValueError, match=">= 0"):
        EngineCapacity(max_loras=-1)


def test_rule5_the_victim_reopens_in_the_round_its_slot_is_given() -> None:
    # a (p) is the victim when b's slot frees and goes to r; p, tried before r in that
    # round (its counter is lower) and passed over, goes in the same round.
    co = co_(max_loras=2, wait=1.0)
    co.add(req("r0", "r", "c", prompt=64), 0.0)
    assert ids(co.due(0.0)) == ["r0"]
    co.finished("r0", 0.05, 4)
    co.add(req("p1", "p", "a", prompt=1), 0.05)
    co.add(req("q1", "q", "b"), 0.05)
    assert ids(co.due(0.05)) == ["p1", "q1"]
    co.add(req("r1", "r", "c"), 0.1)
    assert ids(co.due(0.1)) == []
    co.add(req("p2", "p", "a", prompt=1), 1.1)
    assert ids(co.due(1.1)) == []
    assert co.adapter_slots(1.1).victim == "a"
    co.finished("q1", 1.2, 0)
    assert sorted(ids(co.due(1.2))) == ["p2", "r1"]


def test_rule3_the_victim_reopens_when_the_waiting_caller_leaves() -> None:
    co = co_(max_loras=1, wait=1.0)
    co.add(req("p1", "p", "a"), 0.0)
    assert ids(co.due(0.0)) == ["p1"]
    co.add(req("q1", "q", "b"), 0.0)
    assert ids(co.due(0.0)) == []
    co.add(req("p2", "p", "a"), 1.0)
    assert ids(co.due(1.0)) == []  # a is the victim, drained for q
    assert co.cancel("q1", 1.1)
    assert ids(co.due(1.1)) == ["p2"]  # nobody waits for a slot: a is open again
    assert co.adapter_slots(1.1).waiting_since is None
