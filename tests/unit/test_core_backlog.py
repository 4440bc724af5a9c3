"""The backlog by example: engine room (room.py), fair release order (backlog.py) and
the coalescer rules around them (rules 5-7). A fake clock is just floats."""

from __future__ import annotations

import dataclasses
import math

import pytest

from batching import (
    AdmissionState,
    Batch,
    CallerPolicy,
    Callers,
    Coalescer,
    CoalescerConfig,
    Ended,
    EngineCapacity,
    EngineLoad,
    EngineStep,
    Outcome,
    Refused,
    Released,
    ReleaseOrder,
    ReleaseReason,
    Request,
    group_key,
)

M = group_key("m")


def req(
    rid: str,
    now: float = 0.0,
    prompt: int = 4,
    new: int = 4,
    caller: str = "a",
    priority: int = 0,
    deadline: float | None = None,
    fp: str | None = None,
) -> Request:
    return Request(
        rid,
        M,
        tuple(range(100, 100 + prompt)),
        new,
        now,
        priority=priority,
        deadline=deadline,
        fingerprint=fp,
        caller=caller,
    )


def co_(
    seqs: int = 0,
    step: int = 0,
    kv: int = 0,
    callers: tuple[CallerPolicy, ...] = (),
    chunk: int = 0,
    **kw: object,
) -> Coalescer:
    kw.setdefault("window", 0.0)
    kw.setdefault("release_lone", False)
    # One step's work in the engine's queue (room.py rule 2): with `seqs` slots and
    # no step reported, `seqs` unstarted generations, so one slot means one at a
    # time, the order the backlog releases in.
    kw.setdefault("feed_steps", 1.0)
    cfg = CoalescerConfig(
        engine=EngineCapacity(max_seqs=seqs, step_tokens=step, kv_tokens=kv, prefill_chunk=chunk),
        callers=Callers(callers),
        **kw,  # type: ignore[arg-type]
    )
    return Coalescer(cfg)


def ids(batches: list[Batch]) -> list[str]:
    return [e.request.id for b in batches for e in b.entries]


def one_at_a_time(co: Coalescer, running: str, n: int, t: float) -> list[str]:
    """With one engine slot: finish what runs and take the next release, n times,
    one second apart from `t`; the order the backlog released them in."""
    order = []
    for i in range(n):
        co.finished(running, t + i)
        [running] = ids(co.due(t + i))
        order.append(running)
    return order


def release_all(co: Coalescer, now: float, load: EngineLoad | None = None) -> list[str]:
    """One due() call; every released generation is reported started at once."""
    got = ids(co.due(now, load))
    for rid in got:
        co.started(rid, now)
    return got


# -- room (rule 5, room.py) -----------------------------------------------------


def test_slots_hold_the_backlog_until_a_generation_finishes() -> None:
    co = co_(seqs=2)
    for r in "abc":
        co.add(req(r), 0.0)
    got = co.due(0.0)
    assert ids(got) == ["a", "b"] and got[0].reason is ReleaseReason.IMMEDIATE
    assert (co.backlog_generations, co.queued_requests, co.in_flight) == (1, 1, 2)
    co.pop_events()
    assert co.due(0.5) == []  # still no slot
    assert co.next_deadline() is None  # the backlog is not time-driven
    co.finished("a", 1.0)
    [b] = co.due(1.0)
    assert ids([b]) == ["c"] and b.reason is ReleaseReason.BACKLOG
    evs = co.pop_events()
    assert Ended("c", Outcome.DISPATCHED, 1.0, 1.0, "a") in evs
    assert Released(b.id, M, ReleaseReason.BACKLOG, 1, 8, 1.0) in evs
    assert co.backlog_generations == 0


def test_step_budget_counts_unstarted_prompts_until_their_first_output() -> None:
    co = co_(step=100)
    co.add(req("a", prompt=60), 0.0)
    co.add(req("b", prompt=60), 0.0)
    assert ids(co.due(0.0)) == ["a"]
    assert co.engine_waiting == 1
    assert co.due(0.1) == []  # a has not started: 60 + 60 > 100
    assert co.started("a", 0.2) is True
    assert co.started("a", 0.2) is False  # once
    assert co.engine_waiting == 0
    assert ids(co.due(0.2)) == ["b"]
    # A prompt larger than one step goes alone once nothing is unstarted.
    co.add(req("big", prompt=500), 0.3)
    assert co.due(0.3) == []
    co.started("b", 0.4)
    assert ids(co.due(0.4)) == ["big"]
    co.finished("big", 0.5)  # finished without started(): leaves the engine queue too
    assert co.engine_waiting == 0


def test_changing_the_chunk_rebooks_the_unstarted_prompts() -> None:
    co = co_(step=2048, short_prompt_tokens=256)
    co.add(req("flood", prompt=2000), 0.0)
    assert ids(co.due(0.0)) == ["flood"]
    co.capacity = EngineCapacity(step_tokens=2048, prefill_chunk=512)
    co.add(req("chat", prompt=64), 0.1)
    assert ids(co.due(0.1)) == ["chat"]
    co.finished("flood", 0.2)
    co.finished("chat", 0.2)
    co.add(req("big", prompt=2040), 0.3)
    assert ids(co.due(0.3)) == ["big"]
    co.add(req("chat2", prompt=64), 0.3)
    assert ids(co.due(0.3)) == ["chat2"]  # the two finished ones left no booking


def test_by_default_the_engine_queue_holds_two_steps_of_work() -> None:
    # Room rule 2: a release reaches the engine a step late, so by default its
    # queue holds what two steps take: of an idle engine (no step reported yet),
    # two step budgets of prompts, and its slots (nothing runs that could end and
    # free one; issue 27's first feed took twice the slots, and half of them then
    # waited in vLLM's queue for a running request to end).
    assert CoalescerConfig().feed_steps == 2.0
    co = co_(step=100, feed_steps=2.0)
    for r in "abcdef":
        co.add(req(r, prompt=40), 0.0)
    assert ids(co.due(0.0)) == ["a", "b", "c", "d", "e"]  # 200 <= 200; 240 is not
    co = co_(seqs=32, feed_steps=2.0)
    for i in range(80):
        co.add(req(f"r{i}"), 0.0)
    assert len(ids(co.due(0.0))) == 32


def test_kv_room_counts_engine_usage_and_what_it_has_not_prefilled() -> None:
    co = co_(kv=1000, kv_reserve_short=0.0, short_prompt_tokens=50)  # rule 3 alone
    co.add(req("x", prompt=10), 0.0)
    assert release_all(co, 0.0) == ["x"]
    co.add(req("a", prompt=200), 0.1)
    co.add(req("b", prompt=400), 0.1)
    half = EngineLoad(running=1, waiting=0, kv_usage=0.5)
    # 500 in use + 200 = 700 fits; then + 200 not prefilled + 400 does not.
    assert ids(co.due(0.1, half)) == ["a"]
    # On its way to the engine, or in its queue: counted whatever the engine reports
    # waiting (issue 21's room counted the waiting share: nothing here).
    assert co.due(0.2, EngineLoad(1, 0, 0.5)) == []
    # A step prefilled 100 of its tokens, in the usage now: 100 left to count.
    step = EngineStep(0, 100, 1, 2, 2, 0, 0.6)
    assert co.due(0.3, EngineLoad(2, 0, 0.6), [step]) == []  # 600 + 100 + 400 > 1000
    assert ids(co.due(0.4, EngineLoad(2, 0, 0.5))) == ["b"]  # 500 + 100 + 400 <= 1000
    # The rest of "a" (50 tokens: its prefix cache held the other 50), and it starts.
    co.due(0.5, EngineLoad(2, 0, 0.55), [EngineStep(0, 50, 1, 2, 2, 0, 0.55)])
    assert co.started("a", 0.5, cached=50)
    co.add(req("c", prompt=100), 0.6)
    # "b" is unstarted and none of it prefilled: 550 + 400 + 100 > 1000.
    assert co.due(0.6, EngineLoad(2, 0, 0.55)) == []
    # A step prefills "b" whole: nothing left to allocate, 800 + 100 <= 1000.
    got = co.due(0.7, EngineLoad(3, 0, 0.8), [EngineStep(0, 400, 1, 3, 3, 0, 0.8)])
    assert ids(got) == ["c"]


def test_a_short_prompt_counts_the_engines_use_not_what_long_prompts_have_to_come() -> None:
    """Room rule 3: vLLM allocates a short prompt whole in its first step; a long
    prompt in prefill waits for its later chunks' blocks (rule 4's room)."""
    co = co_(kv=1000, kv_reserve_short=0.0, short_prompt_tokens=50)
    co.add(req("x", prompt=10), 0.0)
    assert release_all(co, 0.0) == ["x"]
    co.add(req("long", prompt=600), 0.1)
    assert ids(co.due(0.1, EngineLoad(1, 0, 0.3))) == ["long"]  # 300 + 600
    co.due(0.2, EngineLoad(2, 0, 0.5), [EngineStep(0, 200, 1, 2, 2, 0, 0.5)])  # 400 to come
    for i, rid in enumerate(("chat1", "chat2", "chat3")):
        co.add(req(rid, prompt=40, now=0.3 + i / 1000), 0.3)
    co.add(req("long2", prompt=60, now=0.3), 0.3)
    # 500 in use: each chat turn counts that and the turns before it in the round
    # (not the 400 to come of "long"); "long2" counts them all: 500 + 400 + 120 + 60.
    assert ids(co.due(0.3, EngineLoad(2, 0, 0.5))) == ["chat1", "chat2", "chat3"]
    co.add(req("chat4", prompt=40), 0.4)
    assert ids(co.due(0.4, EngineLoad(2, 0, 0.97))) == []  # 970 + 40 > 1000


def test_work_conserving_a_too_large_head_goes_when_nothing_is_in_flight() -> None:
    co = co_(seqs=4, step=100, kv=1000)
    co.add(req("huge", prompt=5000), 0.0)
    assert ids(co.due(0.0, EngineLoad(0, 0, 0.99))) == ["huge"]


def test_kv_headroom_keeps_room_for_short_prompts() -> None:
    co = co_(kv=1000, kv_reserve_short=0.4, short_prompt_tokens=50)
    co.add(req("x", prompt=10), 0.0)
    release_all(co, 0.0)
    load = EngineLoad(1, 0, 0.3)  # 300 in use
    co.add(req("long1", prompt=250), 0.1)
    co.add(req("long2", prompt=250), 0.1)
    co.add(req("chat", prompt=40), 0.1)
    # Shorter first: chat (340 of 1000), long1 (590 <= 600), long2 (840 > 600) held.
    assert release_all(co, 0.1, load) == ["chat", "long1"]
    co.add(req("chat2", prompt=40), 0.2)
    assert release_all(co, 0.2, EngineLoad(3, 0, 0.59)) == ["chat2"]  # 630 <= 1000
    without = co_(kv=1000)
    without.add(req("x", prompt=10), 0.0)
    release_all(without, 0.0)
    for r in ("long1", "long2"):
        without.add(req(r, prompt=250), 0.1)
    assert release_all(without, 0.1, load) == ["long1", "long2"]  # 800 <= 1000


# -- order (rule 6, backlog.py) --------------------------------------------------


def test_priority_then_shorter_prompt_then_arrival_across_the_whole_backlog() -> None:
    co = co_(seqs=1)
    co.add(req("first"), 0.0)
    co.due(0.0)  # the one slot is taken; what follows waits in the backlog
    co.add(req("p1-short", 0.1, prompt=2, priority=1), 0.1)
    co.due(0.1)
    co.add(req("p0-long", 0.2, prompt=200), 0.2)
    co.due(0.2)
    co.add(req("p0-short-1", 0.3, prompt=3), 0.3)
    co.add(req("p0-short-2", 0.3, prompt=3), 0.3)
    co.add(req("urgent", 0.4, prompt=500, priority=-1), 0.4)
    co.due(0.4)
    order = one_at_a_time(co, "first", 5, 1.0)
    assert order == ["urgent", "p0-short-1", "p0-short-2", "p0-long", "p1-short"]


def test_fair_share_alternates_between_equal_callers() -> None:
    co = co_(seqs=1)
    co.add(req("a0", caller="a"), 0.0)
    release_all(co, 0.0)
    for i in range(1, 4):
        co.add(req(f"a{i}", caller="a"), 0.1)
    co.due(0.1)
    for i in range(3):
        co.add(req(f"b{i}", caller="b"), 0.2)
    co.due(0.2)
    order = []
    done = "a0"
    for i in range(6):
        co.finished(done, 1.0 + i, tokens=4)
        [done] = release_all(co, 1.0 + i)
        order.append(done)
    # b arrived when a was ahead by a0 (4 + 2 x 4): b catches up first, then turns.
    assert order == ["b0", "a1", "b1", "a2", "b2", "a3"]


def test_weights_divide_service() -> None:
    heavy = CallerPolicy("heavy", weight=2.0)
    co = co_(seqs=1, callers=(heavy,))
    co.add(req("x", caller="light"), 0.0)
    release_all(co, 0.0)
    for i in range(30):
        co.add(req(f"h{i}", caller="heavy"), 0.1)
        co.add(req(f"l{i}", caller="light"), 0.1)
    co.due(0.1)
    order = []
    done = "x"
    for i in range(30):
        co.finished(done, 1.0 + i, tokens=0)
        [done] = release_all(co, 1.0 + i)
        order.append(done[0])
    assert order.count("h") in (19, 20, 21)  # 2 : 1, give or take one request
    h, light = co.caller("heavy"), co.caller("light")
    assert h is not None and light is not None
    assert abs(h.counter - light.counter) <= 4  # within one request's cost


def test_a_caller_back_from_idle_cannot_bank_credit() -> None:
    co = co_(seqs=1)
    co.add(req("a0", caller="a"), 0.0)
    release_all(co, 0.0)
    for i in range(1, 6):
        co.add(req(f"a{i}", caller="a"), 0.0)
    done = "a0"
    for i in range(5):  # a is served alone for a while: its counter grows
        co.finished(done, 1.0 + i, tokens=4)
        [done] = release_all(co, 1.0 + i)
    a = co.caller("a")
    assert a is not None and a.counter == pytest.approx(5 * 12 + 4)
    for i in range(2):
        co.add(req(f"b{i}", caller="b"), 7.0)
    co.due(7.0)  # into the backlog: nobody else is backlogged, so b starts where
    b = co.caller("b")  # the last served caller was before its charge (a5's release)
    assert b is not None and b.counter == a.counter - 4
    co.add(req("a9", caller="a"), 7.0)
    co.due(7.0)  # a is back too: it keeps its own, higher counter
    a = co.caller("a")
    assert a is not None and a.counter == 64
    co.finished(done, 8.0, tokens=4)
    assert release_all(co, 8.0) == ["b0"]
    co.finished("b0", 9.0, tokens=4)  # b: 60 + 4 + 8 = 72, a: 64 + 8 = 72: a tie,
    assert release_all(co, 9.0) == ["b1"]  # and b1 arrived before a9


def test_a_new_caller_released_at_once_cannot_bank_credit_either() -> None:
    # The bench's three_callers starvation: work released without passing the backlog
    # (it is empty and the engine has room) must start its caller at the floor too, or
    # a new caller keeps its 0 and then outruns everyone who was served before.
    co = co_(seqs=1)
    done = ""
    for i in range(5):  # a, alone and never held: each release goes at once
        if done:
            co.finished(done, float(i), tokens=4)
        co.add(req(f"a{i}", float(i), caller="a"), float(i))
        [done] = release_all(co, float(i))
    a = co.caller("a")
    assert a is not None and a.counter == pytest.approx(4 * 12 + 4)
    co.finished(done, 5.0, tokens=4)
    co.add(req("b0", 5.0, caller="b"), 5.0)
    assert release_all(co, 5.0) == ["b0"]  # at once, as a's were
    b = co.caller("b")  # it started where a was at a4's release, before its charge
    assert b is not None and b.counter == pytest.approx(4 * 12 + 4)
    for i in range(3):
        co.add(req(f"b{i + 1}", 5.0, caller="b"), 5.0)
        co.add(req(f"a{i + 5}", 5.0, caller="a"), 5.0)
    order = []
    for i in range(6):  # one slot: finish, release the next
        co.finished(done if i else "b0", 6.0 + i, tokens=4)
        [done] = release_all(co, 6.0 + i)
        order.append(done[0])
    # Both at 60 after the finishes; a tie goes to the smaller key (b1 came first).
    assert order == ["b", "a", "b", "a", "b", "a"]  # not b, b, b first


def test_generated_tokens_are_charged_at_finish_twice() -> None:
    co = co_()
    co.add(req("a", prompt=10, new=100), 0.0)
    release_all(co, 0.0)
    st = co.caller("a")
    assert st is not None and (st.counter, st.prompt_tokens, st.service) == (10.0, 10, 10)
    co.finished("a", 1.0, tokens=7)
    st = co.caller("a")
    assert st is not None and (st.counter, st.generated_tokens, st.service) == (24.0, 7, 24)


def test_no_head_of_line_blocking_within_a_caller() -> None:
    co = co_(kv=1000)
    co.add(req("x", prompt=10), 0.0)
    release_all(co, 0.0)
    co.add(req("long", 0.1, prompt=600, priority=-1), 0.1)
    co.add(req("short", 0.1, prompt=10, priority=5), 0.1)
    # long is first by priority but 500 + 600 > 1000; the short one behind it goes.
    assert release_all(co, 0.1, EngineLoad(1, 0, 0.5)) == ["short"]
    assert release_all(co, 0.2, EngineLoad(2, 0, 0.3)) == ["long"]


def _long_beside_shorts(reserve: float, big: int, shorts: int) -> Coalescer:
    """A 2,000-token cache with work in flight (c's), prompts over 100 tokens long:
    caller a's one long prompt of `big` tokens, caller b's `shorts` of 100, all
    queued at 0.1, nothing new to generate (each costs its prompt)."""
    co = co_(kv=2000, kv_reserve_short=reserve, short_prompt_tokens=100)
    co.add(req("x", prompt=10, caller="c"), 0.0)
    release_all(co, 0.0)
    co.add(req("big", 0.1, prompt=big, new=0, caller="a"), 0.1)
    for i in range(shorts):
        co.add(req(f"b{i}", 0.1, prompt=100, new=0, caller="b"), 0.1)
    return co


def test_a_blocked_caller_is_skipped_by_at_most_one_request_worth() -> None:
    # No reserve: the long prompt (costs 800) waits for KV (room.py rule 3).
    co = _long_beside_shorts(reserve=0.0, big=800, shorts=10)
    # a and b start at 0 (the counter c had before its charge). b0 is shorter; then a
    # is the least but blocked (1,400 in use), and b may pass it only while b's
    # counter < 0 + 800: six fit the 600 tokens free, then two more next round.
    assert release_all(co, 0.1, EngineLoad(1, 0, 0.7)) == [f"b{i}" for i in range(6)]
    busy = EngineLoad(7, 0, 0.65)  # 1,300 in use: big still does not fit, 7 b's would
    assert release_all(co, 0.2, busy) == ["b6", "b7"]
    assert release_all(co, 0.3, busy) == []  # room for b, but it is a's turn
    a = co.caller("a")
    assert a is not None and a.backlog == 1
    assert release_all(co, 0.4, EngineLoad(9, 0, 0.1)) == ["big", "b8", "b9"]


def test_a_caller_the_reserve_holds_is_passed_by_up_to_the_reserve_more() -> None:
    """Backlog.py rule 3: the short-prompt reserve holds a long prompt to keep room
    for short turns, so the turns it keeps room for may pass its caller by the
    reserve's tokens beyond one request's worth; past that, the floor holds as for KV.
    (Without the allowance, at three callers on a slow engine, a chat caller waited
    behind a bulk caller the reserve held, while the reserve's room went unused.)"""
    # Long prompts may use half of the cache, short ones all; the long one costs 600.
    co = _long_beside_shorts(reserve=0.5, big=600, shorts=20)
    busy = EngineLoad(1, 0, 0.4)  # 800 in use: over the line for big, not for b
    # b may pass a while its counter < 0 + 600 + 1,000 (the reserve): twelve fit the
    # 1,200 tokens free, then four more next round, then none.
    assert release_all(co, 0.1, busy) == [f"b{i}" for i in range(12)]
    assert release_all(co, 0.2, busy) == [f"b{i}" for i in range(12, 16)]
    assert release_all(co, 0.3, busy) == []
    assert release_all(co, 0.4, EngineLoad(17, 0, 0.1)) == [
        "big",
        *(f"b{i}" for i in range(16, 20)),
    ]


def test_a_caller_the_long_prefill_bound_holds_is_passed_by_up_to_the_reserve_too() -> None:
    """Backlog.py rule 3: a caller whose long prompt waits for another long prompt's
    prefill (room.py rule 5) is held for the same short turns, and is passed by as
    much; it goes as soon as that prompt has started, its counter the least."""
    co = co_(
        64,
        2048,
        100_000,  # a tenth kept for short prompts: 10,000 tokens
        chunk=512,
        callers=(CallerPolicy("chat"), CallerPolicy("batch", 10.0)),
    )
    co.add(req("c0", prompt=64, new=0, caller="chat"), 0.0)
    co.add(req("f0", prompt=2000, new=0, caller="batch"), 0.0)
    co.add(req("f1", prompt=2000, new=0, caller="batch"), 0.0)
    # f1 waits for f0's prefill. Batch's counter is 200 and one more request of its
    # costs 200, the reserve 1,000 at its weight: chat may pass it up to 1,400.
    assert ids(co.due(0.0)) == ["c0", "f0"]
    for i in range(1, 25):
        co.add(req(f"c{i}", 0.1, prompt=64, new=0, caller="chat"), 0.1)
    # Chat wakes at batch's 200 and climbs 64 a turn: its 19th starts at 1,352.
    assert ids(co.due(0.1)) == [f"c{i}" for i in range(1, 20)]
    assert ids(co.due(0.15)) == []
    co.started("f0", 0.2)
    assert ids(co.due(0.2))[0] == "f1"  # then chat's, as far as the feed allows


def test_a_later_short_prompt_overtakes_only_within_the_max_delay() -> None:
    co = co_(seqs=1, order=ReleaseOrder(exchange_rate=100.0, max_delay=2.0))
    co.add(req("run"), 0.0)
    co.due(0.0)
    co.add(req("long", 0.0, prompt=1000), 0.0)  # 10 s of handicap, capped at 2 s
    # Its virtual start is 1.8 + 16 / 100 = 1.96 s, before the long one's 2 s.
    co.add(req("soon", 1.8, prompt=4), 1.8)
    co.add(req("late", 2.1, prompt=4), 2.1)  # arrived over 2 s later: never first
    co.due(2.1)
    assert one_at_a_time(co, "run", 3, 3.0) == ["soon", "long", "late"]


def test_a_head_waiting_for_room_is_passed_only_within_the_max_delay() -> None:
    co = co_(kv=1000, order=ReleaseOrder(max_delay=1.0))
    co.add(req("x", prompt=10), 0.0)
    release_all(co, 0.0)
    co.add(req("old", 0.0, prompt=300), 0.0)
    # Shorter requests keep arriving and keep filling what room there is (250 free).
    passed = []
    for t in (0.5, 1.0, 1.5, 2.0):
        co.add(req(f"s{t}", t, prompt=50), t)
        passed += release_all(co, t, EngineLoad(1, 0, 0.75))
    # Those that arrived within 1 s of "old" went past it; the later ones wait for it.
    assert passed == ["s0.5", "s1.0"]
    assert release_all(co, 2.1, EngineLoad(1, 0, 0.6)) == ["old", "s1.5", "s2.0"]


def test_capped_caller_waits_without_blocking_others() -> None:
    capped = CallerPolicy("a", max_concurrency=1)
    co = co_(callers=(capped,))
    co.add(req("a1", caller="a"), 0.0)
    co.add(req("a2", caller="a"), 0.0)
    co.add(req("b1", caller="b"), 0.0)
    assert sorted(ids(co.due(0.0))) == ["a1", "b1"]
    st = co.caller("a")
    assert st is not None and (st.in_flight, st.backlog, st.queued) == (1, 1, 1)
    co.finished("a1", 1.0)
    assert ids(co.due(1.0)) == ["a2"]


# -- the coalescer's rules around the backlog ---------------------------------------


def test_window_still_decides_eligibility() -> None:
    co = co_(seqs=8, window=0.010)
    co.add(req("a", 0.0), 0.0)
    assert co.due(0.005) == [] and co.backlog_generations == 0
    [b] = co.due(0.010)
    assert ids([b]) == ["a"] and b.reason is ReleaseReason.DEADLINE


def test_critical_releases_nothing_from_the_backlog_draining_does() -> None:
    co = co_(seqs=1)
    co.add(req("a"), 0.0)
    co.add(req("b"), 0.0)
    co.due(0.0)
    co.finished("a", 0.1)
    co.state = AdmissionState.CRITICAL
    assert co.due(0.1) == []
    co.state = AdmissionState.DRAINING
    assert ids(co.due(0.2)) == ["b"]


def test_cancel_expiry_and_dedupe_act_on_backlogged_work() -> None:
    co = co_(seqs=1)
    co.add(req("run"), 0.0)
    co.due(0.0)
    co.add(req("c", prompt=5), 0.0)
    co.add(req("x", prompt=6, deadline=0.5), 0.0)
    co.add(req("d", prompt=7, fp="greedy"), 0.0)
    co.due(0.0)
    assert co.backlog_generations == 3
    co.pop_events()
    assert co.cancel("c", 0.1)
    co.due(0.6)  # x expires in the backlog
    assert co.add(req("d2", 0.7, prompt=7, fp="greedy", caller="b"), 0.7).joined == "d"
    evs = co.pop_events()
    outcomes = {e.request_id: e.outcome for e in evs if isinstance(e, Ended)}
    assert outcomes == {"c": Outcome.CANCELLED, "x": Outcome.EXPIRED}
    assert co.backlog_generations == 1
    co.finished("run", 1.0)
    [b] = co.due(1.0)
    assert [e.subscribers for e in b.entries] == [("d", "d2")]
    ends = [e for e in co.pop_events() if isinstance(e, Ended)]
    assert [(e.request_id, e.caller) for e in ends] == [("d", "a"), ("d2", "b")]
    b_stats = co.caller("b")
    assert b_stats is not None and b_stats.queued == 0 and b_stats.in_flight == 0


def test_reject_queued_empties_the_backlog() -> None:
    co = co_(seqs=1)
    for r in "abc":
        co.add(req(r), 0.0)
    co.due(0.0)
    assert sorted(co.reject_queued(0.1)) == ["b", "c"]
    assert co.backlog_generations == 0
    st = co.caller("a")
    assert st is not None and (st.queued, st.backlog) == (0, 0)
    co.finished("a", 0.2)
    assert co.due(0.2) == []


def test_batches_group_one_round_by_key_and_reason_and_respect_the_caps() -> None:
    lora = group_key("m", "lora")
    co = co_(seqs=2, max_batch_seqs=2)
    co.add(req("a"), 0.0)
    co.add(req("b"), 0.0)
    co.add(Request("l", lora, (1, 2), 4, 0.0), 0.0)
    co.add(req("c"), 0.0)
    first = co.due(0.0)
    # Two callers ("a", and "default" for l), equal counters and one length class:
    # a arrived first.
    assert [(b.key, ids([b])) for b in first] == [(M, ["a"]), (lora, ["l"])]
    for r in ids(first):
        co.finished(r, 0.1)
    later = co.due(0.1)
    assert [(b.key, b.reason, ids([b])) for b in later] == [(M, ReleaseReason.BACKLOG, ["b", "c"])]


def test_capacity_and_order_validation() -> None:
    with pytest.raises(ValueError):
        EngineCapacity(max_seqs=-1)
    for bad in ({"exchange_rate": 0.0}, {"max_delay": -1.0}, {"max_delay": math.inf}):
        with pytest.raises(ValueError):
            ReleaseOrder(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CoalescerConfig(kv_reserve_short=1.0)
    assert ReleaseOrder(exchange_rate=math.inf).delay(10_000) == 0.0
    co = co_()
    co.capacity = EngineCapacity(max_seqs=1)
    co.add(req("a"), 0.0)
    co.add(req("b"), 0.0)
    assert ids(co.due(0.0)) == ["a"]


def test_replacing_the_config_applies_to_queued_work() -> None:
    # The server builds the core first and gives it the engine's numbers at boot.
    co = co_()
    co.add(req("a"), 0.0)
    co.add(req("b"), 0.0)
    co.config = dataclasses.replace(
        co.config,
        engine=EngineCapacity(max_seqs=1),
        callers=Callers((CallerPolicy("a", max_queued=1),)),
    )
    assert co.capacity == EngineCapacity(max_seqs=1)
    assert ids(co.due(0.0)) == ["a"]
    assert isinstance(co.add(req("c"), 0.0), Refused)  # b waits: max_queued reached
