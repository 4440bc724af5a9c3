"""Budgets (batching/budgets.py): UTC periods, spend, overdrafts, SIGHUP and seeding."""

from __future__ import annotations

import calendar
import copy
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from batching import Budget, Budgets, Clock, Spend

T0 = float(calendar.timegm((2026, 12, 5, 21, 0, 0)))  # a Saturday evening, UTC
MIDNIGHT = float(calendar.timegm((2026, 12, 6, 0, 0, 0)))
NEXT_MONTH = float(calendar.timegm((2027, 1, 1, 0, 0, 0)))


def test_calendar_periods_are_utc_days_and_months() -> None:
    clock = Clock()
    assert clock.day_of(T0) == (MIDNIGHT - 86400, MIDNIGHT)
    assert clock.month_of(T0) == (float(calendar.timegm((2026, 12, 1, 0, 0, 0))), NEXT_MONTH)
    feb = float(calendar.timegm((2028, 2, 29, 12, 0, 0)))
    assert clock.month_of(feb)[1] - clock.month_of(feb)[0] == 29 * 86400


def test_a_short_clock_has_short_days_and_thirty_day_months() -> None:
    clock = Clock(day=10.0)
    assert clock.day_of(25.0) == (20.0, 30.0)
    assert clock.month_of(25.0) == (0.0, 300.0)


def test_over_tokens_per_day_until_midnight_and_another_caller_untouched() -> None:
    b = Budgets({"a": Budget(tokens_per_day=100)})
    b.spend("a", 60, 0.0, T0)
    assert b.over("a", T0) is None
    b.spend("a", 40, 0.0, T0 + 1)
    o = b.over("a", T0 + 2)
    assert o is not None
    assert (o.limit, o.used, o.resets_at) == ("tokens_per_day", 100, MIDNIGHT)
    assert o.retry_after == MIDNIGHT - (T0 + 2)
    assert b.over("b", T0 + 2) is None
    assert b.over("a", MIDNIGHT) is None  # the day reset


def test_of_several_limits_the_one_that_resets_last_is_named() -> None:
    b = Budgets({"a": Budget(tokens_per_day=10, engine_seconds_per_month=5.0)})
    b.spend("a", 10, 5.0, T0)
    o = b.over("a", T0)
    assert o is not None and o.limit == "engine_seconds_per_month" and o.resets_at == NEXT_MONTH


def test_load_replaces_the_current_periods_spend() -> None:
    b = Budgets({"a": Budget(tokens_per_day=100, tokens_per_month=1000)})
    b.spend("a", 5, 0.0, T0)
    for _ in range(2):
        b.load(T0, day={"a": Spend(100, 0.0)}, month={"a": Spend(900, 0.0)})
    assert b.used("a", T0) == (Spend(100, 0.0), Spend(900, 0.0))
    assert b.over("a", T0) is not None
    assert b.periods(T0) == (MIDNIGHT - 86400, float(calendar.timegm((2026, 12, 1, 0, 0, 0))))


# -- invariants (hypothesis) ------------------------------------------------------

_spends = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 1000),
        st.floats(0, 100, allow_nan=False),
        st.floats(0, 3 * 86400, allow_nan=False),
    ),
    max_size=30,
)
_budget = st.builds(
    Budget,
    tokens_per_day=st.none() | st.integers(1, 5000),
    engine_seconds_per_day=st.none() | st.floats(0.5, 500),
    tokens_per_month=st.none() | st.integers(1, 50000),
    engine_seconds_per_month=st.none() | st.floats(0.5, 5000),
)
_table = st.dictionaries(st.sampled_from(["a", "b", "c"]), _budget, max_size=3)


def _run(b: Budgets, spends: list[tuple[str, int, float, float]]) -> None:
    for caller, tokens, secs, dt in sorted(spends, key=lambda s: s[3]):
        b.spend(caller, tokens, secs, T0 + dt)


@given(_table, _table, _spends, st.floats(0, 3 * 86400))
def test_set_budgets_never_loses_spend(
    before: dict[str, Budget], after: dict[str, Budget], spends: list[Any], dt: float
) -> None:
    kept, swapped = Budgets(before), Budgets(before)
    _run(kept, spends)
    _run(swapped, spends)
    swapped.set_budgets(after)
    at = T0 + dt
    for caller in "abc":
        assert swapped.used(caller, at) == kept.used(caller, at)
    fresh = Budgets(after)
    _run(fresh, spends)
    for caller in "abc":  # as if the new budgets had been there all along
        assert swapped.over(caller, at) == fresh.over(caller, at)


@given(_table, _spends)
def test_spend_in_one_day_is_the_sum_and_is_gone_the_next(
    table: dict[str, Budget], spends: list[Any]
) -> None:
    b = Budgets(table, Clock(day=3600.0))
    late = max((s[3] for s in spends), default=0.0)
    same_day = [(c, t, s, 0.0) for c, t, s, _ in spends]
    _run(b, same_day)
    for caller in "abc":
        mine = [s for s in same_day if s[0] == caller]
        day, month = b.used(caller, T0)
        assert day.tokens == month.tokens == sum(t for _, t, _, _ in mine)
        assert b.used(caller, T0 + 3600 * 24 * 30 + late)[0] == Spend()
        assert b.over(caller, T0 + 3600 * 24 * 30 + late) is None


@given(_table, _spends, st.floats(0, 4 * 86400))
def test_over_is_a_pure_query(table: dict[str, Budget], spends: list[Any], dt: float) -> None:
    b = Budgets(table)
    _run(b, spends)
    state = copy.deepcopy(b.__dict__)
    first = [b.over(c, T0 + dt) for c in "abc"]
    assert [b.over(c, T0 + dt) for c in "abc"] == first
    assert b.__dict__ == state
    for o in first:
        if o is not None:
            assert o.used >= o.allowed and o.retry_after > 0
            assert o.resets_at == T0 + dt + o.retry_after


@given(_spends)
def test_no_spend_is_dropped_within_a_period(spends: list[Any]) -> None:
    """Spends dated out of order in one month all count (rule 3)."""
    b = Budgets()
    for caller, tokens, secs, dt in spends:  # not sorted: late reports
        b.spend(caller, tokens, secs, T0 + dt % 3600)
    for caller in "abc":
        assert b.used(caller, T0 + 3599)[1].tokens == sum(s[1] for s in spends if s[0] == caller)
