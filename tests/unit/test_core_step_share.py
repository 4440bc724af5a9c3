"""batching/step_share.py: how much background work an engine step takes (issue 49)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batching.step_share import FLOOR, MAX_PREEMPT, Plan, Sight, StepShare

BUSY = Sight(background_running=100, background_waiting=20, seats_free=10)
CHAT_WAITING = Sight(
    interactive_waiting=1, seats_free=10, background_running=100, background_waiting=20
)


def share(max_seqs: int = 128, step_tokens: int = 2048) -> StepShare:
    return StepShare(max_seqs, step_tokens, linger=1.0)


def test_rule_1_no_interactive_work_no_hold_no_cap() -> None:
    s = share()
    s.budget = 0.01  # even with a budget measured
    assert s.plan(100.0, BUSY) == Plan()


def test_rule_2_interactive_waiting_or_prefilling_holds_background() -> None:
    s = share()
    assert s.plan(0.0, CHAT_WAITING) == Plan(hold=True, present=True)
    prefill = Sight(interactive_prefill=True, interactive_running=1, background_running=5)
    assert s.plan(0.0, prefill).hold
    elsewhere = Sight(elsewhere=True, background_running=5)
    assert s.plan(0.0, elsewhere).hold
    # Nothing to hold: no background work.
    assert not s.plan(0.0, Sight(interactive_waiting=1, seats_free=3)).hold


def test_rule_2_a_turn_that_has_shown_its_client_no_token_holds_background() -> None:
    """Past its prefill, a streamed turn whose first tokens carried no text (the
    front's word) still holds the next step; once shown, its decode steps are
    background's to share (rule 4). The word outlives a turn that ended on its first
    output: with no interactive request admitted here it holds nothing, and it is not
    this engine's pending word to the others either."""
    s = share()
    s.budget = 0.02
    decoding = Sight(interactive_running=1, background_running=5)
    unshown = dataclasses.replace(decoding, interactive_unshown=True)
    assert s.plan(0.0, unshown) == Plan(hold=True, present=True)
    assert s.pending(unshown)
    assert not s.plan(0.0, decoding).hold and s.plan(0.0, decoding).cap is not None
    assert not s.pending(decoding)
    gone = Sight(interactive_unshown=True, background_running=5)
    assert not s.plan(0.0, gone).hold and not s.pending(gone)


def test_rule_3_a_seatless_interactive_request_preempts_the_newest_background() -> None:
    s = share()
    seatless = Sight(interactive_waiting=5, seats_free=0, background_running=128)
    plan = s.plan(0.0, seatless)
    assert plan.preempt == MAX_PREEMPT and plan.hold
    one = Sight(interactive_waiting=1, seats_free=0, background_running=128)
    assert s.plan(0.0, one).preempt == 1
    # Seats taken by interactive work only: nothing to preempt, nothing held for it.
    full = Sight(interactive_waiting=1, interactive_running=128, seats_free=0)
    assert s.plan(0.0, full) == Plan(present=True)
    # Seats free but too few KV blocks for the turn's prompt: the same.
    kv = Sight(interactive_waiting=1, seats_free=60, kv_short=True, background_running=68)
    assert s.plan(0.0, kv) == Plan(hold=True, preempt=1, present=True)


def test_rule_4_the_budget_is_the_measured_held_step_and_steers_the_cap() -> None:
    s = share()
    hold = s.plan(0.0, CHAT_WAITING)
    s.done(
        0.0,
        hold,
        0.010,
        tokens=64,
        interactive_prompt=True,
        background_run=0,
        background_left=100,
        interactive=True,
    )
    assert s.budget == pytest.approx(0.010)
    assert s.counters.held == 100
    decoding = Sight(interactive_running=1, background_running=100)
    plan = s.plan(0.1, decoding)
    # The first cap: the held step's tokens, which lasted the budget (it was the
    # step's whole 2,048: the noisy point's worst chat turn, 612 ms, waited for that
    # first capped step).
    assert plan.cap == 64 and not plan.hold
    # The capped step took four times the budget: the cap falls to a quarter at once
    # (it fell by half a step: a 2,048-token cap took five long steps to reach the
    # chat's own, the noisy point's first chat turns beside its flood waited 250-420 ms).
    s.done(
        0.1,
        plan,
        0.040,
        tokens=65,
        interactive_prompt=False,
        background_run=64,
        background_left=0,
        interactive=True,
    )
    assert s.cap == 16
    # Within budget and the cap filled: it grows again (at most doubles).
    plan = s.plan(0.2, decoding)
    s.done(
        0.2,
        plan,
        0.008,
        tokens=17,
        interactive_prompt=False,
        background_run=16,
        background_left=0,
        interactive=True,
    )
    assert s.cap == 20
    # A step short for want of background work does not grow the cap.
    plan = s.plan(0.3, decoding)
    s.done(
        0.3,
        plan,
        0.002,
        tokens=11,
        interactive_prompt=False,
        background_run=10,
        background_left=0,
        interactive=True,
    )
    assert s.cap == 20
    # Measured capped steps steer it now, not the interactive-alone steps' tokens.
    s.done(
        0.4,
        s.plan(0.4, CHAT_WAITING),
        0.010,
        tokens=300,
        interactive_prompt=True,
        background_run=0,
        background_left=100,
        interactive=True,
    )
    assert s.cap == 20
    assert s.counters.steps_present == 5


def test_rule_4_no_cap_before_a_budget_and_the_linger() -> None:
    s = share()
    decoding = Sight(interactive_running=1, background_running=100)
    assert s.plan(0.0, decoding).cap is None  # no budget yet
    s.budget = 0.01
    s.done(
        5.0,
        s.plan(5.0, decoding),
        0.01,
        tokens=2,
        interactive_prompt=False,
        background_run=1,
        background_left=0,
        interactive=True,
    )
    assert s.plan(5.5, BUSY).cap is not None  # within the linger of the last turn
    assert s.plan(6.5, BUSY) == Plan()  # past it: rule 1


def test_rule_4_a_chat_turn_before_any_background_work_sets_the_budget() -> None:
    """A step of interactive prompts with no background work measures the budget,
    so the first steps of a flood that arrives later are capped. (Only held steps
    measured it: the noisy point's flood, arriving after a chat-only phase, ran
    uncapped steps beside decoding chat turns until a held prefill was measured.)"""
    s = share()
    chat = Sight(interactive_waiting=1, seats_free=100)
    s.done(
        0.0,
        s.plan(0.0, chat),
        0.01,
        tokens=64,
        interactive_prompt=True,
        background_run=0,
        background_left=0,
        interactive=True,
    )
    assert s.budget == pytest.approx(0.01)
    flood = Sight(interactive_running=1, background_waiting=32)
    # Capped from the flood's first step, at the chat step's tokens.
    assert s.plan(0.1, flood).cap == 64


def test_rule_4_no_background_no_cap() -> None:
    """Interactive work alone after a budget was measured: no cap (the cap cut the
    waiting interactive prompts of a closed loop to the background's floor: 0.81x
    its throughput without the scheduler)."""
    s = share()
    s.budget, s.cap = 0.01, s.floor
    alone = Sight(interactive_running=128, interactive_waiting=128)
    assert s.plan(0.0, alone) == Plan(present=True)
    assert s.plan(0.0, Sight(interactive_running=128, background_waiting=1)).cap == s.floor


def test_rule_5_floor_runs_background_after_a_run_of_holds() -> None:
    s = share()
    for i in range(FLOOR - 1):
        plan = s.plan(float(i), CHAT_WAITING)
        assert plan.hold
        s.done(
            float(i),
            plan,
            0.01,
            tokens=64,
            interactive_prompt=True,
            background_run=0,
            background_left=100,
            interactive=True,
        )
    plan = s.plan(10.0, CHAT_WAITING)
    assert not plan.hold
    s.done(
        10.0,
        plan,
        0.02,
        tokens=114,
        interactive_prompt=True,
        background_run=50,
        background_left=50,
        interactive=True,
    )
    assert s.counters.floor_steps == 1
    assert s.plan(11.0, CHAT_WAITING).hold  # the count starts again


sights = st.builds(
    Sight,
    interactive_waiting=st.integers(0, 4),
    interactive_prefill=st.booleans(),
    interactive_running=st.integers(0, 4),
    interactive_unshown=st.booleans(),
    elsewhere=st.booleans(),
    seats_free=st.integers(0, 8),
    background_running=st.integers(0, 8),
    background_waiting=st.integers(0, 8),
)


@given(
    st.lists(
        st.tuples(
            sights, st.floats(0.0, 0.5), st.booleans(), st.integers(0, 4096), st.integers(0, 4096)
        ),
        max_size=60,
    ),
    st.integers(1, 1024),
)
def test_invariants(steps: list[tuple[Sight, float, bool, int, int]], max_seqs: int) -> None:
    """Background is never held FLOOR steps in a row; the cap stays within [floor, the
    step's tokens]; no interactive work present means no hold and no cap; at most
    MAX_PREEMPT preemptions, and only of background work that runs."""
    s = StepShare(max_seqs, 2048, linger=0.0)
    held_run = 0
    now = 0.0
    for sight, seconds, prompt, ran, more in steps:
        now += 0.01
        plan = s.plan(now, sight)
        assert plan == s.plan(now, sight)  # a query: no side effects
        if not s.present(now, sight):
            assert plan == Plan()
        assert plan.preempt <= min(MAX_PREEMPT, sight.background_running)
        assert plan.hold or not plan.preempt  # a preempted seat is the turn's
        held_run = held_run + 1 if plan.hold else 0
        assert held_run < FLOOR
        if plan.cap is not None:
            assert s.floor <= plan.cap <= s.ceiling
            # Only background tokens are capped: with none, interactive prompts run free.
            assert sight.background_running or sight.background_waiting
        s.done(
            now,
            plan,
            seconds,
            tokens=ran + more,
            interactive_prompt=prompt,
            background_run=ran,
            background_left=sight.background_running,
            interactive=bool(sight.interactive_running or sight.interactive_waiting),
        )
        assert s.floor == max(1, math.ceil(max_seqs / FLOOR)) <= s.cap <= s.ceiling


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_seqs"):
        StepShare(0, 2048, 1.0)


def test_rule_4_another_engines_budget_caps_background_here() -> None:
    s = share()
    other = Sight(elsewhere_budget=0.005, background_running=100)
    plan = s.plan(0.0, other)
    assert plan == Plan(cap=2048, budget=0.005, present=True)
    s.done(
        0.0,
        plan,
        0.02,
        tokens=2048,
        interactive_prompt=False,
        background_run=2048,
        background_left=0,
        interactive=False,
    )
    assert s.cap == 512  # scaled by the other engine's budget
    # Its own interactive work with its own budget measured: its own budget.
    s.budget = 0.05
    mine = Sight(interactive_running=1, elsewhere_budget=0.005, background_running=100)
    assert s.plan(1.0, mine).budget == 0.05


def test_rule_4_the_ratio_scales_the_budget_and_the_first_cap() -> None:
    """--background-step-ratio 0.5: capped steps aim at half the interactive step,
    and the first cap is half the tokens of the step that measured it."""
    s = StepShare(128, 2048, linger=1.0, ratio=0.5)
    s.done(
        0.0,
        s.plan(0.0, CHAT_WAITING),
        0.010,
        tokens=64,
        interactive_prompt=True,
        background_run=0,
        background_left=100,
        interactive=True,
    )
    plan = s.plan(0.1, Sight(interactive_running=1, background_running=100))
    assert plan.cap == 32 and plan.budget == pytest.approx(0.005)
    # A capped step of the full budget's length is twice the ratio's: the cap halves.
    s.done(
        0.1,
        plan,
        0.010,
        tokens=33,
        interactive_prompt=False,
        background_run=32,
        background_left=68,
        interactive=True,
    )
    assert s.cap == 16
    other = s.plan(5.0, Sight(elsewhere_budget=0.004, background_running=100))
    assert other.budget == pytest.approx(0.002)
    with pytest.raises(ValueError, match="ratio"):
        StepShare(128, 2048, linger=1.0, ratio=0.0)


def test_rule_6_an_engine_with_only_background_yields_to_anothers_turn() -> None:
    s = share()
    assert s.yields(0.0, Sight(elsewhere=True, background_running=5))
    assert s.yields(0.0, Sight(elsewhere_budget=0.01, background_waiting=5))
    assert not s.yields(0.0, BUSY)  # no interactive work anywhere
    # Its own interactive work, waiting, running or lingering: it keeps its share.
    assert not s.yields(0.0, Sight(elsewhere=True, interactive_waiting=1))
    assert not s.yields(0.0, Sight(elsewhere=True, interactive_running=1))
    s.done(
        0.0,
        Plan(present=True),
        0.01,
        tokens=1,
        interactive_prompt=False,
        background_run=0,
        background_left=0,
        interactive=True,
    )
    assert not s.yields(0.5, Sight(elsewhere=True))
    assert s.yields(1.5, Sight(elsewhere=True))
