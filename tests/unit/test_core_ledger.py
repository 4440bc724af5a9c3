"""The step ledger (batching/ledger.py): each step's seconds split among its requests."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batching import Charge, StepLedger, StepOutput


def test_decodes_share_a_step_by_their_tokens() -> None:
    led = StepLedger()
    for rid in ("a", "b"):
        led.admit(rid, 10)
        led.step(0.01, 10, 0, [StepOutput(rid, 1, computed=10)])
    led.step(0.3, 0, 3, [StepOutput("a", 2), StepOutput("b", 1)])
    assert led.close("a").engine_seconds == pytest.approx(0.01 + 0.2)
    assert led.close("b").engine_seconds == pytest.approx(0.01 + 0.1)


def test_a_long_prefill_beside_a_decode_takes_its_tokens_share() -> None:
    led = StepLedger()
    led.admit("chat", 20)
    led.step(0.02, 20, 0, [StepOutput("chat", 1, computed=20)])
    led.admit("long", 3000)
    # A 1,000-token budget: two partial chunks (rule 4), then the last (rule 3).
    led.step(1.0, 999, 1, [StepOutput("chat", 1)])
    led.step(1.0, 999, 1, [StepOutput("chat", 1)])
    led.step(1.0, 1000, 1, [StepOutput("chat", 1), StepOutput("long", 1, computed=2998)])
    long = led.close("long")
    chat = led.close("chat")
    assert long.engine_seconds == pytest.approx(999 / 1000 * 2 + 1000 / 1001)
    assert chat.engine_seconds == pytest.approx(0.02 + 1 / 1000 * 2 + 1 / 1001)
    assert long.engine_seconds + chat.engine_seconds == pytest.approx(3.02)


def test_a_prefix_cache_hit_is_not_charged() -> None:
    led = StepLedger()
    led.admit("hit", 1000)
    led.admit("miss", 1000)
    led.step(1.0, 1100, 0, [StepOutput("hit", 1, computed=100), StepOutput("miss", 1)])
    assert led.close("hit").engine_seconds == pytest.approx(100 / 1100)
    assert led.close("miss").engine_seconds == pytest.approx(1000 / 1100)


def test_a_step_of_unknown_requests_is_charged_to_nobody() -> None:
    led = StepLedger()
    led.step(0.5, 10, 0, [StepOutput("ghost", 1)])
    assert led.unattributed == 0.5
    led.admit("a", 5)
    # Telemetry that names no request of ours: spread over the rank's open ones.
    led.step(0.25, 0, 1, [StepOutput("ghost", 1)])
    assert led.close("a").engine_seconds == 0.25


def test_block_seconds_follow_what_the_cache_holds() -> None:
    led = StepLedger(block_size=16)
    led.admit("a", 40)
    led.step(1.0, 40, 0, [StepOutput("a", 1, computed=40)])  # 41 tokens: 3 blocks
    led.step(2.0, 0, 1, [StepOutput("a", 1)])  # 42 tokens: 3 blocks
    assert led.close("a") == Charge(3.0, 3 * 1.0 + 3 * 2.0)


def test_ranks_charge_their_own_requests() -> None:
    led = StepLedger()
    led.admit("r0", 100, rank=0)
    led.admit("r1", 100, rank=1)
    led.step(1.0, 50, 0, [], rank=1)
    assert led.charged("r0").engine_seconds == 0.0
    assert led.charged("r1").engine_seconds == 1.0


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 7), st.integers(0, 5000), st.integers(0, 1)),
        st.tuples(
            st.just("step"),
            st.floats(0, 5, allow_nan=False),
            st.integers(0, 4096),
            st.integers(0, 64),
            st.lists(
                st.tuples(
                    st.integers(0, 9),
                    st.integers(0, 4),
                    st.one_of(st.none(), st.integers(0, 5000)),
                ),
                max_size=8,
            ),
            st.integers(0, 1),
        ),
        st.tuples(st.just("close"), st.integers(0, 9)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_every_step_second_is_charged_once(ops: list[tuple[object, ...]]) -> None:
    """Rules 5-6: whatever the telemetry says, the requests' charges (closed and
    open) and the unattributed time add up to the steps' seconds, none negative."""
    led = StepLedger()
    closed: list[Charge] = []
    for op in ops:
        match op:
            case ("admit", int(i), int(prompt), int(rank)):
                led.admit(f"r{i}", prompt, rank)
            case ("step", float(s), int(pre), int(dec), list(outs), int(rank)):
                led.step(s, pre, dec, [StepOutput(f"r{i}", n, c) for i, n, c in outs], rank)
            case ("close", int(i)):
                closed.append(led.close(f"r{i}"))
    assert all(c.engine_seconds >= -1e-12 and c.block_seconds >= 0 for c in closed)
    charged = led.closed_seconds + led.open_seconds() + led.unattributed
    assert math.isclose(charged, led.seconds_total, rel_tol=1e-9, abs_tol=1e-9)
    # An id admitted again closes its first life (rule 1): counted, not lost.
    assert led.closed_seconds >= sum(c.engine_seconds for c in closed) - 1e-9
