"""Who used the card: durable per-caller usage, counted per minute and per hour.

Why this module exists: Prometheus counters die with the process and hold no
history a budget or an invoice can be drawn from; OpenAI's Usage API
(server/api/usage/) and the budgets need each caller's tokens and engine
time over days and months, across restarts. This module keeps them in the
state database (server/operations/state_db.py), off the request path:

* `UsageBook.record` runs on the event loop once per finished request and
  only adds into two in-memory dicts (the pending minute and hour buckets,
  keyed by a tuple): no I/O, O(1); measured on the 2-core test machine,
  about 5 us a request.
* `UsageBook.run` writes what is pending every `flush_seconds` (2 s by
  default) in one transaction on the database's thread, adding the counts to
  the rows already there, and prunes expired rows at most once a minute:
  minute rows after 2 days (they answer `bucket_width=1m`), hour rows after
  400 days (`1h`, and `1d` in UTC days); 2,000 new minute keys took 46 ms
  on that thread (a busy server has far fewer a flush). It flushes once more when
  cancelled (a clean stop loses nothing).
* A SIGKILL (or OOM kill) loses at most the last `flush_seconds` of usage:
  what was recorded since the last flush. A power loss may lose the last
  commits too (the database runs with synchronous=NORMAL).

A failed write keeps its rows pending for the next flush (logged), so a
briefly locked or full disk delays usage rather than losing it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from server.operations.state_db import StateDB, UsageRow, UsageSum

__all__ = [
    "FLUSH_SECONDS",
    "HOUR_KEEP_S",
    "MINUTE_KEEP_S",
    "WIDTHS",
    "CallerUsage",
    "UsageBook",
    "UsageBucket",
    "UsageEvent",
    "UsagePage",
    "UsageQuery",
    "UsageResult",
]

log = logging.getLogger("sluice.usage")

FLUSH_SECONDS = 2.0
MINUTE_KEEP_S = 2 * 86400  # minute rows: 2 days
HOUR_KEEP_S = 400 * 86400  # hour rows: 400 days
_PRUNE_EVERY_S = 60.0
# The status page's view (`UsageBook.recent`) is read again at most this often.
_RECENT_EVERY_S = 10.0
# Bucket widths in seconds, by the Usage API's names.
WIDTHS: Mapping[str, int] = {"1m": 60, "1h": 3600, "1d": 86400}

# (bucket, caller, model, adapter or "", kind, api, class, batch_id or ""): one row's key.
_Key = tuple[int, str, str, str, str, str, str, str]
# requests, prompt_tokens, cached_tokens, completion_tokens, engine_seconds, block_seconds
_Counts = list[float]


@dataclass(frozen=True, slots=True)
class UsageEvent:
    """One finished request's usage, as the pipeline hands it over."""

    at: float  # unix seconds (time.time()) when the request ended
    caller: str  # caller name ("default" without keys)
    model: str  # served model name
    adapter: str | None  # LoRA adapter name or None
    kind: str  # "completions" or "embeddings": which Usage API endpoint counts it
    request_class: str  # "interactive" | "background"
    batch_id: str | None  # the batch it was a line of, else None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    completion_tokens: int
    engine_seconds: float  # its share of the engine's step time
    block_seconds: float  # KV blocks held x seconds
    # The API it came through (the access line's endpoint: chat, messages,
    # responses, ollama_chat, embeddings, ...); "" when not known.
    api: str = ""


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """Buckets of `width` seconds (60, 3600 or 86400: aligned to UTC minutes,
    hours, days) from `start` (rounded down to a bucket) to `end` (exclusive,
    rounded up), of one `kind`, grouped by the fields in `group_by` ("caller",
    "model", "batch", and Sluice's own "api"); `callers` and `models` keep only those (None: all),
    `batch` only batch lines (True) or only the rest (False)."""

    kind: str
    start: int
    end: int
    width: int = 86400
    group_by: frozenset[str] = frozenset()
    callers: frozenset[str] | None = None
    models: frozenset[str] | None = None
    batch: bool | None = None


@dataclass(frozen=True, slots=True)
class UsageResult:
    """One group's counts in one bucket; a field not grouped by is None."""

    caller: str | None
    model: str | None  # an adapter's requests: the adapter's name
    batch: bool | None
    api: str | None  # grouped by "api" (Sluice's own): the API the requests came through
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    engine_seconds: float
    block_seconds: float


@dataclass(frozen=True, slots=True)
class UsageBucket:
    start: int
    end: int
    results: tuple[UsageResult, ...]


@dataclass(frozen=True, slots=True)
class UsagePage:
    """Every bucket of the query's range, in order, the empty ones included."""

    buckets: tuple[UsageBucket, ...]


@dataclass(frozen=True, slots=True)
class CallerUsage:
    """One caller's line of the status page: the last hour and the last day."""

    hour_requests: int
    hour_tokens: int
    hour_engine_seconds: float
    day_requests: int
    day_tokens: int
    day_engine_seconds: float


def _add(pending: dict[_Key, _Counts], key: _Key, e: UsageEvent) -> None:
    c = pending.get(key)
    if c is None:
        pending[key] = [
            1,
            e.prompt_tokens,
            e.cached_tokens,
            e.completion_tokens,
            e.engine_seconds,
            e.block_seconds,
        ]
        return
    c[0] += 1
    c[1] += e.prompt_tokens
    c[2] += e.cached_tokens
    c[3] += e.completion_tokens
    c[4] += e.engine_seconds
    c[5] += e.block_seconds


def _rows(pending: Mapping[_Key, _Counts]) -> list[UsageRow]:
    return [
        (*k, int(c[0]), int(c[1]), int(c[2]), int(c[3]), float(c[4]), float(c[5]))
        for k, c in pending.items()
    ]


def _merge(into: dict[_Key, _Counts], rows: Iterable[UsageRow]) -> None:
    """Rows a failed write held, back into what is pending."""
    for r in rows:
        key: _Key = r[:8]
        counts: _Counts = list(r[8:])
        c = into.get(key)
        if c is None:
            into[key] = counts
        else:
            for i, v in enumerate(counts):
                c[i] += v


class UsageBook:
    """The usage ledger of one process: pending buckets in memory, rows in `db`.

    `clock`: wall-clock seconds (tests inject one); the buckets, the retention
    and `totals_since` are all in it. `engine_seconds` holds each caller's
    engine seconds since the process started (the Prometheus counter
    `sluice_caller_engine_seconds_total` reads it); `recent` the status page's
    per-caller view, refreshed by `run`."""

    def __init__(
        self,
        db: StateDB,
        *,
        flush_seconds: float = FLUSH_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if flush_seconds <= 0:
            raise ValueError("flush_seconds must be > 0")
        self.db = db
        self.flush_seconds = flush_seconds
        self._clock = clock
        self._minutes: dict[_Key, _Counts] = {}
        self._hours: dict[_Key, _Counts] = {}
        self._pruned_at = float("-inf")
        self._recent_at = float("-inf")
        self.engine_seconds: dict[str, float] = {}
        self.recent: dict[str, CallerUsage] = {}

    # -- the request path --------------------------------------------------
    def record(self, event: UsageEvent) -> None:
        """Count one finished request (on the event loop; no I/O)."""
        rest = (
            event.caller,
            event.model,
            event.adapter or "",
            event.kind,
            event.api,
            event.request_class,
            event.batch_id or "",
        )
        at = int(event.at)
        _add(self._minutes, (at - at % 60, *rest), event)
        _add(self._hours, (at - at % 3600, *rest), event)
        self.engine_seconds[event.caller] = (
            self.engine_seconds.get(event.caller, 0.0) + event.engine_seconds
        )

    @property
    def pending(self) -> int:
        """Minute buckets not yet written."""
        return len(self._minutes)

    # -- writing -----------------------------------------------------------
    async def run(self) -> None:
        """Flush every `flush_seconds` until cancelled, then once more."""
        try:
            while True:
                await asyncio.sleep(self.flush_seconds)
                await self.flush()
                try:
                    await self.refresh_recent()
                except Exception:  # the page's table waits for the next one
                    log.exception("usage: reading the status page's view failed")
        finally:
            await self.flush()

    async def flush(self) -> None:
        """Write what is pending (and prune, at most once a minute), in one
        transaction. Taking the pending buckets and queueing the write happen
        in one step of the loop: a read queued after this sees it."""
        now = self._clock()
        prune: tuple[int, int] | None = None
        if now - self._pruned_at >= _PRUNE_EVERY_S:
            prune = (int(now - MINUTE_KEEP_S), int(now - HOUR_KEEP_S))
            self._pruned_at = now
        if not self._minutes and prune is None:
            return
        minutes, hours = _rows(self._minutes), _rows(self._hours)
        self._minutes, self._hours = {}, {}
        try:
            await self.db.add_usage(minutes, hours, prune)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("usage: a write of %d rows failed; kept for the next flush", len(minutes))
            _merge(self._minutes, minutes)
            _merge(self._hours, hours)

    # -- reading -----------------------------------------------------------
    async def totals_since(self, since: float) -> dict[str, tuple[int, float]]:
        """Per caller: (prompt + completion tokens, engine seconds) of the hour
        buckets that start at `since` or later, written or pending."""
        out: dict[str, tuple[int, float]] = {}
        for key, c in self._hours.items():
            if key[0] >= since:
                tokens, seconds = out.get(key[1], (0, 0.0))
                out[key[1]] = (tokens + int(c[1] + c[3]), seconds + float(c[4]))
        # Queued in the same step as the pending copy above: nothing counted twice.
        written = await self.db.usage_totals(int(-(-since // 1)))
        for caller, (tokens, seconds) in written.items():
            t0, s0 = out.get(caller, (0, 0.0))
            out[caller] = (t0 + tokens, s0 + seconds)
        return out

    async def query(self, q: UsageQuery) -> UsagePage:
        """Every bucket of `q`'s range with its groups' counts (pending usage
        is written first, so a query sees every request recorded before it)."""
        if q.width not in WIDTHS.values():
            raise ValueError(f"no bucket width of {q.width} s")
        w = q.width
        start = q.start - q.start % w
        end = -(-q.end // w) * w
        await self.flush()
        sums: list[UsageSum] = []
        if end > start and q.callers != frozenset() and q.models != frozenset():
            sums = await self.db.usage_sums(
                "usage_minutes" if w == 60 else "usage_hours",
                kind=q.kind,
                start=start,
                end=end,
                width=w,
                by_caller="caller" in q.group_by,
                by_model="model" in q.group_by,
                by_batch="batch" in q.group_by,
                by_api="api" in q.group_by,
                callers=None if q.callers is None else sorted(q.callers),
                models=None if q.models is None else sorted(q.models),
                batch=q.batch,
            )
        by_bucket: dict[int, list[UsageResult]] = {}
        for s in sums:
            by_bucket.setdefault(s[0], []).append(UsageResult(*s[1:]))
        return UsagePage(
            tuple(UsageBucket(b, b + w, tuple(by_bucket.get(b, ()))) for b in range(start, end, w))
        )

    async def refresh_recent(self, *, force: bool = False) -> None:
        """The status page's per-caller last hour and last day (minute rows),
        at most every 10 s (`force`: now)."""
        now = self._clock()
        if not force and now - self._recent_at < _RECENT_EVERY_S:
            return
        self._recent_at = now
        hour = await self.db.usage_by_caller(int(now - 3600))
        day = await self.db.usage_by_caller(int(now - 86400))
        self.recent = {
            caller: CallerUsage(*hour.get(caller, (0, 0, 0.0)), *d) for caller, d in day.items()
        }
