"""The engine's steps in the core (issue 27): the under-fed definition
(room.underfed), the counters, the time the backlog held work by rule, and the
feed rule that releases from the reported steps (room.py rule 2)."""

from __future__ import annotations

import dataclasses

import pytest

from batching import (
    Batch,
    CallerPolicy,
    Callers,
    Coalescer,
    CoalescerConfig,
    EngineCapacity,
    EngineLoad,
    EngineStep,
    Hold,
    Request,
    group_key,
    underfed,
)

M = group_key("m")
CAP = EngineCapacity(max_seqs=8, step_tokens=1000, kv_tokens=10_000, prefill_chunk=250)


def step(
    prefill: int = 0,
    decode: int = 4,
    requests: int = 4,
    running: int = 4,
    waiting: int = 0,
    kv: float = 0.1,
    rank: int = 0,
) -> EngineStep:
    return EngineStep(rank, prefill, decode, requests, running, waiting, kv)


def req(rid: str, prompt: int = 100, caller: str = "a", now: float = 0.0, new: int = 8) -> Request:
    return Request(rid, M, tuple(range(prompt)), new, now, caller=caller)


def co_(cap: EngineCapacity = CAP, **kw: object) -> Coalescer:
    kw.setdefault("window", 0.0)
    kw.setdefault("release_lone", False)
    kw.setdefault("kv_reserve_short", 0.0)
    return Coalescer(CoalescerConfig(engine=cap, **kw))  # type: ignore[arg-type]


def ids(batches: list[Batch]) -> list[str]:
    return [e.request.id for b in batches for e in b.entries]


# -- the definition --------------------------------------------------------------


def test_a_step_with_budget_slot_and_kv_left_beside_held_work_is_underfed() -> None:
    assert underfed(step(prefill=300), CAP, held=100)


@pytest.mark.parametrize(
    ("why", "s", "held"),
    [
        ("nothing held", step(), 0),
        ("the engine kept waiting work of its own", step(waiting=1), 100),
        ("every running slot scheduled", step(requests=8, decode=8), 100),
        ("the budget left is below the first chunk", step(prefill=760, decode=4), 250),
        ("the whole prompt's KV is not free", step(kv=0.95), 600),
    ],
)
def test_a_step_is_not_underfed_when(why: str, s: EngineStep, held: int) -> None:
    assert not underfed(s, CAP, held), why


def test_a_long_prompt_needs_its_first_chunk_of_budget_and_all_its_kv() -> None:
    # 2,000 tokens: the first chunk is vLLM's cap (250) ...
    assert underfed(step(prefill=700, decode=40), CAP, held=2000)  # 740 + 250 <= 1000
    assert not underfed(step(prefill=720, decode=40), CAP, held=2000)
    # ... but its KV is the whole prompt's: 2,000 of the 2,000 free at 80% use.
    assert underfed(step(kv=0.79), CAP, held=2000)
    assert not underfed(step(kv=0.81), CAP, held=2000)


def test_kv_still_to_come_for_the_prompts_in_prefill_is_not_free() -> None:
    """Free KV after the step is not free for a held prompt where released prompts
    have later chunks to come: their blocks are the engine's next, and a prompt that
    took them would be preempted (room.py rule 3's pending tokens)."""
    assert underfed(step(kv=0.2), CAP, held=2000)  # 8,000 free
    assert underfed(step(kv=0.2), CAP, held=2000, pending=6000)
    assert not underfed(step(kv=0.2), CAP, held=2000, pending=6500)


def test_the_core_judges_a_step_beside_the_kv_its_released_prompts_still_take() -> None:
    co = co_()
    co.add(req("big", 8500), 0.0)
    co.add(req("x", 2000), 0.0)
    assert ids(co.due(0.0)) == ["big"]  # "x" waits for KV: 8,500 + 2,000 > 10,000
    # The step prefilled big's first chunk: 250 tokens in KV, 8,250 still to come;
    # x's 2,000 fit in the 9,750 free, not beside those.
    co.due(0.1, steps=[step(prefill=250, decode=0, requests=1, running=1, kv=0.025)])
    c = co.room_counters
    assert (c.steps_held, c.underfed_steps) == (1, 0)


def test_unknown_capacity_numbers_never_make_a_step_look_full() -> None:
    assert underfed(step(requests=500, prefill=10**6, kv=1.0), EngineCapacity(), held=100)


# -- counted by the core ------------------------------------------------------------


def test_the_core_counts_steps_beside_a_held_backlog_and_the_underfed_ones() -> None:
    co = co_(dataclasses.replace(CAP, prefill_chunk=0), feed_steps=1.0)
    co.add(req("a", 900), 0.0)
    co.add(req("b", 900), 0.0)
    assert ids(co.due(0.0)) == ["a"]  # the engine's next step takes one of them
    c = co.room_counters
    assert (c.steps, c.steps_held, c.underfed_steps) == (0, 0, 0)
    # A step with budget left, but not for "b"'s 900 tokens: fed ("a" has 750 left
    # to prefill, and the next step's 1,000 take that and 250 more). Then one with
    # room for "b" in its budget, its KV and a slot: under-fed, and the feed's spare
    # grows by the 900 tokens it left, so "b" goes beside what is left of "a"
    # (room.py rule 2).
    assert co.due(0.1, steps=[step(prefill=150, decode=0, requests=1, running=1)]) == []
    assert ids(co.due(0.2, steps=[step(prefill=100, decode=0, requests=1, running=1)])) == ["b"]
    c = co.room_counters
    assert (c.steps, c.steps_held, c.underfed_steps) == (2, 2, 1)
    # With nothing held, steps count but none is beside a held backlog.
    co.due(0.4, steps=[step(prefill=900, decode=1, requests=2, running=2)])
    c = co.room_counters
    assert (c.steps, c.steps_held, c.underfed_steps) == (3, 2, 1)


def test_underfed_steps_beside_work_the_policy_rules_held_are_counted_apart() -> None:
    """Rules 4-5 hold work the engine would take, for a short turn's room: a step
    under-fed beside it counts, and counts again as their cost (POLICY); a step
    under-fed beside work the feed held does not."""
    co = co_(kv_reserve_short=0.5, short_prompt_tokens=64)
    co.add(req("a", 3000), 0.0)
    co.add(req("b", 2500), 0.0)
    assert ids(co.due(0.0)) == ["a"]  # "b" would pass half the KV cache: the reserve
    # A step that prefilled a's first chunk and had room for b's: under-fed, by policy.
    co.due(0.1, steps=[step(prefill=250, decode=0, requests=1, running=1, kv=0.03)])
    c = co.room_counters
    assert (c.underfed_steps, c.underfed_policy_steps) == (1, 1)

    fed = co_(EngineCapacity(max_seqs=8, step_tokens=1000), feed_steps=1.0)
    fed.add(req("x", 900), 0.0)
    fed.add(req("y", 900), 0.0)
    assert ids(fed.due(0.0)) == ["x"]
    fed.due(0.1, steps=[step(prefill=0, decode=1, requests=1, running=1)])
    c = fed.room_counters
    assert (c.underfed_steps, c.underfed_policy_steps) == (1, 0)


def test_work_held_by_its_callers_limit_leaves_no_step_underfed() -> None:
    callers = Callers((CallerPolicy("a", max_concurrency=1),))
    co = co_(callers=callers)
    co.add(req("a1"), 0.0)
    co.add(req("a2"), 0.0)
    assert ids(co.due(0.0)) == ["a1"]
    co.due(0.1, steps=[step(decode=1, requests=1, running=1)])
    assert co.room_counters.steps_held == 1
    assert co.room_counters.underfed_steps == 0
    held = dict(co.room_counters.held_seconds)
    assert held[Hold.CALLER.value] == pytest.approx(0.1)


def test_held_time_is_integrated_by_the_rule_that_held_work() -> None:
    co = co_(
        EngineCapacity(max_seqs=8, step_tokens=400, kv_tokens=1000),
        feed_steps=1.0,
        kv_reserve_short=0.5,
        short_prompt_tokens=100,
    )
    co.add(req("a", 300), 0.0)
    co.add(req("b", 300), 0.0)
    assert ids(co.due(0.0)) == ["a"]
    co.due(1.0)  # held by the feed rule for 1 s: "a" is unstarted, 300 of 400
    co.started("a", 1.0)
    # "b" would pass the long prompts' half of the KV cache: the reserve holds it
    # (each round names the rule that holds work until the next round).
    load = EngineLoad(running=1, waiting=0, kv_usage=0.3)
    assert ids(co.due(1.0, load)) == []
    co.due(3.5, load)
    held = dict(co.room_counters.held_seconds)
    assert held[Hold.FEED.value] == pytest.approx(1.0)
    assert held[Hold.RESERVE.value] == pytest.approx(2.5)
    assert sum(held.values()) == pytest.approx(3.5)
    co.finished("a", 4.0)
    assert ids(co.due(4.0, EngineLoad(running=0, waiting=0))) == ["b"]
    co.due(9.0)  # nothing held since 4 s
    assert sum(dict(co.room_counters.held_seconds).values()) == pytest.approx(4.0)


# -- the feed rule (room.py rule 2) ---------------------------------------------------


def test_the_engine_queue_holds_two_steps_of_the_budget_its_last_step_left() -> None:
    co = co_(EngineCapacity(max_seqs=64, step_tokens=1000))
    for i in range(40):
        co.add(req(f"r{i}", 100), 0.0)
    # No step reported yet: an idle engine, two steps of its 1,000-token budget.
    assert len(ids(co.due(0.0))) == 20
    # The engine took them (their first outputs); its last step decoded 20
    # tokens, so two more steps take 2 x 980 tokens of prompts.
    for i in range(20):
        co.started(f"r{i}", 0.1)
    got = ids(co.due(0.1, steps=[step(prefill=900, decode=20, requests=29, running=20)]))
    assert len(got) == 19 and got[0] == "r20"


def test_the_engine_queue_holds_the_free_slots_and_those_the_next_step_frees() -> None:
    """Rule 2: the slots the last step left free, plus the running generations that
    end by the step a release reaches (endings.py): one that started at step s ends
    by step s + max_new_tokens - 1. Issue 27's first feed took twice the free slots,
    whether or not anything was about to end."""
    co = co_(EngineCapacity(max_seqs=8, step_tokens=10_000))
    for i in range(20):
        co.add(req(f"r{i}", 10), 0.0)
    assert len(ids(co.due(0.0))) == 8  # an idle engine's 8 slots
    for i in range(8):
        co.started(f"r{i}", 0.1)  # at step 0: each ends by step 7
    for i in range(3):
        co.finished(f"r{i}", 0.1)
    # The step ran 8, and 3 of them ended in it: 3 slots free; nothing else ends
    # by step 2.
    got = ids(co.due(0.1, steps=[step(decode=8, requests=8, running=5)]))
    assert got == ["r8", "r9", "r10"]
    for rid in got:
        co.started(rid, 0.2)  # at step 1: each ends by step 8
    full = step(decode=8, requests=8, running=8)
    for k in range(4):  # steps 2-5: full, and nothing ends by step 6
        assert ids(co.due(0.3 + k / 10, steps=[full])) == []
    # Step 6: r3-r7 end by step 7, when a release made now reaches the engine.
    assert ids(co.due(0.8, steps=[full])) == ["r11", "r12", "r13", "r14", "r15"]


def test_a_long_prompt_counts_what_the_next_steps_prefill_of_it() -> None:
    """With vLLM's per-prompt cap, an unstarted 2,000-token prompt takes 250 tokens
    of each step: over the two steps fed, 500 of the 2 x 1,000, so others join it."""
    co = co_(EngineCapacity(max_seqs=64, step_tokens=1000, prefill_chunk=250))
    co.add(req("long", 2000), 0.0)
    for i in range(14):
        co.add(req(f"s{i}", 100), 0.0)
    got = ids(co.due(0.0))
    assert got[-1] == "long" and len(got) == 15  # 14 x 100 + 2 x 250 <= 2 x 1,000
    assert co.backlog_generations == 0


def test_a_prompt_in_prefill_counts_only_what_is_left_of_it() -> None:
    """Rule 2 counts an unstarted prompt at what the engine still prefills of it:
    a 300-token prompt whose first 250-token chunk the last step ran has 50 left, not
    300. Counted whole until its first output, the feed held back a step's worth of
    prompts (at the c=384 spread, modelled: bench/points/room_sim.py, under-fed steps 2.4-2.7%
    against 0.7-1.0% counted this way)."""
    co = co_(EngineCapacity(max_seqs=64, step_tokens=1000, prefill_chunk=250))
    co.add(req("p", 300), 0.0)
    assert ids(co.due(0.0)) == ["p"]
    for i in range(30):
        co.add(req(f"s{i}", 100), 0.05)
    got = ids(co.due(0.1, steps=[step(prefill=250, decode=0, requests=1, running=1)]))
    assert len(got) == 19  # 50 + 19 x 100 <= 2 x 1,000 (counted whole: 17)


def ranks(batches: list[Batch]) -> list[int | None]:
    return [e.rank for b in batches for e in b.entries]


def test_the_feed_follows_each_ranks_own_step_and_places_work_where_it_fits() -> None:
    """Rules 2 and 6: each rank's free slots; each release names the rank with room
    (vLLM's own client would balance unfinished requests instead)."""
    two = EngineCapacity(max_seqs=4, step_tokens=1000, ranks=2)
    co = co_(two)
    for i in range(30):
        co.add(req(f"r{i}", 10, new=100), 0.0)
    assert ranks(co.due(0.0)) == [0, 1] * 4  # 2 ranks x 4 slots, placed in turn
    for i in range(8):
        co.started(f"r{i}", 0.1)
    for rid in ("r1", "r3", "r5"):
        co.finished(rid, 0.1)
    # Rank 0 full (4 running), rank 1 ran 4 and 3 of them finished: 3 free, there.
    steps = [step(decode=4, requests=4, running=4), step(decode=4, requests=4, running=1, rank=1)]
    assert ranks(co.due(0.1, steps=steps)) == [1, 1, 1]


def test_a_release_goes_to_the_rank_whose_running_work_ends_next() -> None:
    """Both ranks full; rank 1's generations end by the step a release reaches: the
    release goes there, not to rank 0 where it would wait for seconds."""
    two = EngineCapacity(max_seqs=2, step_tokens=1000, ranks=2)
    co = co_(two)
    for i in range(10):
        co.add(req(f"r{i}", 10, new=8), 0.0)
    assert ranks(co.due(0.0)) == [0, 1, 0, 1]
    for rid in ("r1", "r3"):
        co.started(rid, 0.1)  # rank 1, at its step 0: they end by its step 7
    on1 = step(decode=2, requests=2, running=2, rank=1)
    for k in range(5):  # rank 1's steps 1-5
        assert co.due(0.2 + k / 10, steps=[on1]) == []
    for rid in ("r0", "r2"):
        co.started(rid, 0.7)  # rank 0, at its step 0
    on0 = step(decode=2, requests=2, running=2)
    assert ranks(co.due(0.8, steps=[on0, on1])) == [1, 1]  # rank 1's step 6


def test_replacing_the_engine_capacity_keeps_the_feed_count_exact() -> None:
    co = co_(EngineCapacity(max_seqs=64, step_tokens=1000, prefill_chunk=250))
    co.add(req("long", 2000), 0.0)
    assert ids(co.due(0.0)) == ["long"]
    co.capacity = dataclasses.replace(co.capacity, prefill_chunk=0, ranks=2)
    for i in range(30):
        co.add(req(f"s{i}", 100), 1.0)
    # Now it counts whole: 2,000 of 2 steps x 2 ranks x 1,000 tokens.
    assert len(ids(co.due(1.0))) == 20


def test_an_underfed_step_adds_what_it_left_to_the_feed_and_waiting_work_takes_it_back() -> None:
    """Room.py rule 2's spare: the engine's queue grows by what an under-fed step
    left unused of the dimension the feed ran short of (slots here), and shrinks by
    a 256th after each step that left the engine waiting work of its own."""
    co = co_(EngineCapacity(max_seqs=8, step_tokens=10_000), feed_steps=1.0)
    for i in range(30):
        co.add(req(f"r{i}", 10, new=100), 0.0)  # nothing ends within the test
    assert len(ids(co.due(0.0))) == 8
    for i in range(8):
        co.started(f"r{i}", 0.1)
    # 8 running, and the step finished 6 of them in it: 6 free, 2 requests scheduled.
    for i in range(6):
        co.finished(f"r{i}", 0.1)
    full = step(decode=8, requests=8, running=8)
    assert ids(co.due(0.1, steps=[full])) == []  # no slot free after that step
    short = step(decode=2, requests=2, running=2)
    got = ids(co.due(0.2, steps=[short]))  # under-fed by 6 slots: 6 free + 6 spare
    assert len(got) == 12
    assert co.room_counters.underfed_steps == 1
    for rid in got:
        co.started(rid, 0.3)
    waiting = step(decode=8, requests=8, running=8, waiting=2)
    for k in range(16):
        co.due(0.3 + k / 100, steps=[waiting])
    assert co.feed_spare[0] == pytest.approx(6 * (255 / 256) ** 16)


def test_the_spare_stays_within_one_engine_of_slots() -> None:
    co = co_(EngineCapacity(max_seqs=4, step_tokens=10_000), feed_steps=1.0)
    for i in range(200):
        co.add(req(f"r{i}", 10), 0.0)
    co.due(0.0)
    for k in range(50):  # every step under-fed by all its slots, nothing taken
        co.due(0.01 * k, steps=[step(decode=0, requests=0, running=4)])
    assert co.feed_spare == (4, 0)


def test_beside_another_callers_work_one_long_prompt_is_in_prefill_at_a_time() -> None:
    """Room.py rule 5: vLLM schedules running prefills first, a chunk each; with
    several long prompts in prefill a step is all chunks and a chat turn waits."""
    cap = EngineCapacity(max_seqs=64, step_tokens=2048, prefill_chunk=512)
    callers = Callers((CallerPolicy("chat"), CallerPolicy("batch")))
    alone = co_(cap, callers=callers)
    for i in range(4):
        alone.add(req(f"f{i}", 2000, caller="batch"), 0.0)
    # One caller: nobody else's turn to keep room for; the feed alone bounds it
    # (two steps of 2,048, each long prompt counting two 512-token chunks).
    assert ids(alone.due(0.0)) == ["f0", "f1", "f2", "f3"]
    co = co_(cap, callers=callers)
    co.add(req("c0", 64, caller="chat"), 0.0)
    for i in range(4):
        co.add(req(f"f{i}", 2000, caller="batch"), 0.0)
    assert ids(co.due(0.0)) == ["c0", "f0"]
    co.add(req("c1", 64, caller="chat"), 0.1)
    assert ids(co.due(0.1)) == ["c1"]  # short prompts are not bound
    assert dict(co.room_counters.held_seconds)[Hold.LONG.value] == pytest.approx(0.1)
    co.started("f0", 0.2)
    assert ids(co.due(0.2)) == ["f1"]
    # The other caller's work has ended: the bound is off.
    for rid in ("c0", "c1"):
        co.started(rid, 0.3)
        co.finished(rid, 0.3)
    assert ids(co.due(0.3)) == ["f2", "f3"]
    assert co.config.long_prefills == 1  # the default


# -- interactive first (room.py rule 8) ------------------------------------------------


@pytest.mark.parametrize("first", [True, False], ids=["interactive-first", "off"])
def test_background_filling_the_seats_does_not_hold_a_chat_turn(first: bool) -> None:
    """Rule 8: with Sluice's scheduler in the engine, the seats background work runs
    in are an interactive prompt's to take (the scheduler preempts for it), and the
    background unstarted in the engine's queue is not ahead of it. Off, the turn
    waits in the backlog for a seat to free."""
    co = co_(EngineCapacity(max_seqs=8, step_tokens=10_000), interactive_first=first)
    for i in range(12):
        co.add(dataclasses.replace(req(f"b{i}", 10, caller="batch"), priority=1 << 20), 0.0)
    assert len(ids(co.due(0.0))) == 8
    for i in range(8):
        co.started(f"b{i}", 0.1)
    full = step(decode=8, requests=8, running=8)
    assert ids(co.due(0.2, steps=[full])) == []
    co.add(req("chat", 10, caller="chat", now=0.25, new=64), 0.25)
    got = ids(co.due(0.3, steps=[full]))
    assert got == (["chat"] if first else [])
    # Background work keeps rule 2: nothing more of it goes.
    assert ids(co.due(0.4, steps=[full])) == []
