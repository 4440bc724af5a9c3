"""Budgets: how much each caller may spend per day and per month, and what it has spent.

Why this module exists: issue 52's budgets. `tokens_per_minute` (callers.py) is
a rate held by each model's core; a budget is a caller's total across every
model, so it cannot live in one model's Coalescer. This is its policy, sans-IO
like the rest of the core: the server passes the wall-clock time (`at`, POSIX
seconds) into every call and acts on what comes back.

Rules:

1. A `Budget` holds up to four limits (None = none of that kind): tokens
   (prompt + generated) and engine seconds, per day and per month. A caller
   with no budget is never over; its spend is still counted, so that a budget
   given later (rule 6) starts from what it has already used.
2. Periods are UTC: a day from 00:00 UTC, a month from 00:00 UTC on its 1st.
   A `Clock` with `day` set (a test's short clock, SLUICE_BUDGET_DAY_SECONDS)
   makes a day `day` seconds from the epoch and a month 30 such days; without
   it, days and months are the calendar's.
3. `spend(caller, tokens, engine_seconds, at)` adds to the caller's current
   day and month; a spend in a later period than the one counted starts that
   period afresh (the old one's spend is gone: it has reset). A spend dated in
   an earlier period than the one counted (a request that finished late) goes
   to the current one: spend is never dropped.
4. `over(caller, at)` is a query, without side effects: the `Overdraft` of a
   caller whose spend in the period containing `at` has reached a limit
   (used >= limit), else None. Of several limits reached it names the one that
   resets last, since the caller can spend again only once all have reset;
   `retry_after` is the seconds from `at` to that reset.
5. Work already admitted is not this module's business: the server checks
   `over` at admission, and a request admitted under the limit is charged in
   full when it ends, so a caller may end a period somewhat past its limit.
6. `set_budgets(budgets)` (SIGHUP) swaps every caller's limits; spend stays.
   A caller absent from the new table has no budget, and keeps its spend.
7. `load(at, day=..., month=...)` seeds spend from the durable store at start:
   each given caller's totals since the start of the current day and of the
   current month (`periods(at)` gives those instants) replace what is counted
   for them, so loading the store's record twice counts it once.
"""

from __future__ import annotations

import calendar
import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Budget", "Budgets", "Clock", "Overdraft", "Spend"]

_DAY = 86400.0
_MONTH_DAYS = 30  # a short clock's month, in its days (rule 2)
_LIMITS = (
    "tokens_per_day",
    "engine_seconds_per_day",
    "tokens_per_month",
    "engine_seconds_per_month",
)


@dataclass(frozen=True, slots=True)
class Budget:
    """One caller's limits (rule 1); None: no limit of that kind."""

    tokens_per_day: int | None = None
    engine_seconds_per_day: float | None = None
    tokens_per_month: int | None = None
    engine_seconds_per_month: float | None = None

    def __post_init__(self) -> None:
        for name in _LIMITS:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0")

    @property
    def limited(self) -> bool:
        return any(getattr(self, name) is not None for name in _LIMITS)


@dataclass(frozen=True, slots=True)
class Spend:
    """What a caller has spent in one period."""

    tokens: int = 0
    engine_seconds: float = 0.0

    def plus(self, tokens: int, engine_seconds: float) -> Spend:
        return Spend(self.tokens + tokens, self.engine_seconds + engine_seconds)


@dataclass(frozen=True, slots=True)
class Overdraft:
    """Why a caller may not spend now (rule 4)."""

    caller: str
    limit: str  # the Budget field reached, e.g. "tokens_per_day"
    allowed: float  # that limit
    used: float  # the spend it counts, this period
    resets_at: float  # POSIX seconds
    retry_after: float  # seconds from the query's `at` to `resets_at`


@dataclass(frozen=True, slots=True)
class Clock:
    """Where periods begin and end (rule 2); `day` set: a short test clock."""

    day: float | None = None

    def __post_init__(self) -> None:
        if self.day is not None and not self.day > 0:
            raise ValueError("a budget day must be > 0 seconds")

    def day_of(self, at: float) -> tuple[float, float]:
        """The [start, end) of the day containing `at`."""
        length = self.day or _DAY
        start = (at // length) * length
        return start, start + length

    def month_of(self, at: float) -> tuple[float, float]:
        """The [start, end) of the month containing `at`."""
        if self.day is not None:
            length = self.day * _MONTH_DAYS
            start = (at // length) * length
            return start, start + length
        when = dt.datetime.fromtimestamp(at, dt.UTC)
        year, month = when.year, when.month
        after = (year + month // 12, month % 12 + 1)
        first = calendar.timegm((year, month, 1, 0, 0, 0))
        return float(first), float(calendar.timegm((*after, 1, 0, 0, 0)))


@dataclass(slots=True)
class _Account:
    """One caller's spend in the day and month it was last counted in."""

    day_start: float
    day: Spend
    month_start: float
    month: Spend


class Budgets:
    """Every caller's budget and spend (the module docstring's rules)."""

    def __init__(
        self, budgets: Mapping[str, Budget] | None = None, clock: Clock | None = None
    ) -> None:
        self.clock = clock or Clock()
        self._budgets: dict[str, Budget] = {}
        self._accounts: dict[str, _Account] = {}
        self.set_budgets(budgets or {})

    def set_budgets(self, budgets: Mapping[str, Budget]) -> None:
        """Rule 6: new limits, the spend kept."""
        self._budgets = {name: b for name, b in budgets.items() if b.limited}

    def budget(self, caller: str) -> Budget | None:
        return self._budgets.get(caller)

    def periods(self, at: float) -> tuple[float, float]:
        """The starts of the day and the month containing `at` (for `load`)."""
        return self.clock.day_of(at)[0], self.clock.month_of(at)[0]

    def spend(self, caller: str, tokens: int, engine_seconds: float, at: float) -> None:
        """Rule 3: add to the caller's current day and month."""
        acct = self._account(caller, at)
        acct.day = acct.day.plus(tokens, engine_seconds)
        acct.month = acct.month.plus(tokens, engine_seconds)

    def load(
        self,
        at: float,
        *,
        day: Mapping[str, Spend] | None = None,
        month: Mapping[str, Spend] | None = None,
    ) -> None:
        """Rule 7: each caller's totals since `periods(at)` replace its counts."""
        for caller, spent in (day or {}).items():
            self._account(caller, at).day = spent
        for caller, spent in (month or {}).items():
            self._account(caller, at).month = spent

    def used(self, caller: str, at: float) -> tuple[Spend, Spend]:
        """The caller's spend in the day and the month containing `at` (a query)."""
        acct = self._accounts.get(caller)
        if acct is None:
            return Spend(), Spend()
        day_start, _ = self.clock.day_of(at)
        month_start, _ = self.clock.month_of(at)
        return (
            acct.day if acct.day_start >= day_start else Spend(),
            acct.month if acct.month_start >= month_start else Spend(),
        )

    def over(self, caller: str, at: float) -> Overdraft | None:
        """Rule 4: the limit the caller has reached that resets last, or None."""
        budget = self._budgets.get(caller)
        if budget is None:
            return None
        day, month = self.used(caller, at)
        day_end = self.clock.day_of(at)[1]
        month_end = self.clock.month_of(at)[1]
        found: Overdraft | None = None
        for limit, allowed, used, end in (
            ("tokens_per_day", budget.tokens_per_day, day.tokens, day_end),
            ("engine_seconds_per_day", budget.engine_seconds_per_day, day.engine_seconds, day_end),
            ("tokens_per_month", budget.tokens_per_month, month.tokens, month_end),
            (
                "engine_seconds_per_month",
                budget.engine_seconds_per_month,
                month.engine_seconds,
                month_end,
            ),
        ):
            if allowed is not None and used >= allowed and (found is None or end > found.resets_at):
                found = Overdraft(caller, limit, allowed, used, end, end - at)
        return found

    def callers(self) -> Iterable[str]:
        """The callers with spend counted."""
        return tuple(self._accounts)

    def _account(self, caller: str, at: float) -> _Account:
        """The caller's account, its periods moved on to those of `at` when
        later (rule 3: an earlier `at` counts in the current ones)."""
        day_start, _ = self.clock.day_of(at)
        month_start, _ = self.clock.month_of(at)
        acct = self._accounts.get(caller)
        if acct is None:
            acct = self._accounts[caller] = _Account(day_start, Spend(), month_start, Spend())
        if day_start > acct.day_start:
            acct.day_start, acct.day = day_start, Spend()
        if month_start > acct.month_start:
            acct.month_start, acct.month = month_start, Spend()
        return acct
