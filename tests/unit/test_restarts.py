"""The restart rules (server/engines/restarts.py): back-off, budget window, causes."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.engines.restarts import Death, RestartPolicy, backoff, decide, exits, recent

POLICY = RestartPolicy(restarts=5, window=600.0, base=1.0, cap=30.0)


def test_the_back_off_doubles_from_one_second_up_to_the_cap() -> None:
    assert [backoff(POLICY, n) for n in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff(POLICY, 10_000) == 30.0  # no overflow


@given(
    st.integers(min_value=0, max_value=200),
    st.floats(min_value=0.01, max_value=10),
    st.floats(min_value=0, max_value=1000),
)
def test_the_back_off_never_shrinks_and_stays_within_its_bounds(
    used: int, base: float, extra: float
) -> None:
    policy = RestartPolicy(restarts=5, window=60, base=base, cap=base + extra)
    delay = backoff(policy, used)
    assert base <= delay <= policy.cap
    assert backoff(policy, used + 1) >= delay


def test_the_budget_counts_restarts_within_the_window_only() -> None:
    history = (0.0, 100.0, 200.0, 300.0, 400.0)
    spent = decide(POLICY, history, 500.0)
    assert not spent.restart and spent.used == 5
    # At 650 s the first restart (at 0 s) has left the window: one is free again.
    again = decide(POLICY, history, 650.0)
    assert again.restart and again.used == 4 and again.delay == 16.0
    assert recent(history, 650.0, 600.0) == (100.0, 200.0, 300.0, 400.0)


def test_a_first_death_restarts_after_the_base_back_off() -> None:
    assert decide(POLICY, (), 10.0).restart
    assert decide(POLICY, (), 10.0).delay == 1.0
    assert not decide(RestartPolicy(restarts=0), (), 10.0).restart


@given(
    st.lists(st.floats(min_value=0, max_value=10_000), max_size=20),
    st.floats(min_value=0, max_value=10_000),
    st.integers(min_value=0, max_value=8),
)
def test_a_restart_is_granted_exactly_while_the_window_has_budget(
    history: list[float], now: float, restarts: int
) -> None:
    policy = RestartPolicy(restarts=restarts, window=600.0)
    verdict = decide(policy, sorted(history), now)
    in_window = [t for t in history if now - 600.0 < t <= now]
    assert verdict.used == len(in_window)
    assert verdict.restart == (len(in_window) < restarts)
    if verdict.restart:
        assert verdict.delay == backoff(policy, len(in_window))


def test_a_death_names_its_cause() -> None:
    assert Death(code=-signal.SIGKILL).label == "SIGKILL"
    assert "SIGKILL" in Death(code=-signal.SIGKILL).describe
    assert Death(code=1).label == "exit_1"
    assert "exited with code 1" in Death(code=1).describe
    assert Death(hung=True).label == "health_check"
    assert Death().label == "unknown"
    assert Death(code=-200).label == "signal_200"


def test_only_an_essential_failed_model_stops_the_process() -> None:
    assert exits(essential=True, failed=True)
    assert not exits(essential=False, failed=True)
    assert not exits(essential=True, failed=False)


@pytest.mark.parametrize(
    "kwargs",
    [{"restarts": -1}, {"window": 0}, {"base": 0}, {"base": 5, "cap": 1}],
)
def test_a_bad_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]
