"""The core's private mutable records: one caller, one queued generation, one group.

Why this module exists: the coalescer (window, admission) and the backlog (fair
release) both hold generations and callers; they share these plain slotted classes
instead of importing each other. callers.py holds the frozen policy these records
follow; nothing here is exported from `batching`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from .callers import CallerPolicy, CallerStats
from .classes import is_background
from .drain import DrainRate
from .keys import GroupKey
from .order import Key
from .types import ReleaseReason, Request

# Generation states. Plain ints: compared on the hot path.
QUEUED = 0  # in its window group, not yet eligible
BACKLOG = 1  # eligible, waiting in its caller's backlog for engine room
GONE = 2  # released to the engine, or dropped when its last subscriber left

# Generated tokens charged for a request without max_tokens before its caller has
# finished one (coalescer.py rule 12): a chat reply is typically a few hundred tokens,
# and a low first guess only admits a little more at first, reconciled at finish.
DEFAULT_ESTIMATE = 256.0
# Weight of the newest finish in the running mean: about the last 16 generations.
_ESTIMATE_WEIGHT = 1.0 / 16.0


class TokenBucket:
    """tokens_per_minute as a bucket (see callers.py). `level` may go below 0 when a
    generation generated more than it was charged; refills pay that back first."""

    __slots__ = ("at", "capacity", "level", "rate")

    def __init__(self, per_minute: int) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.at = -math.inf  # full until first used: refilling from -inf stays full

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
            self.at = now

    def wait(self, cost: int, now: float) -> float:
        """Seconds until `cost` tokens fit (0.0: they fit now)."""
        self._refill(now)
        missing = cost - self.level
        return missing / self.rate if missing > 0 else 0.0

    def take(self, cost: int) -> None:
        self.level -= cost

    def give(self, tokens: int) -> None:
        self.level = min(self.capacity, self.level + tokens)

    def resize(self, per_minute: int) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = min(self.level, self.capacity)


class CallerState:
    """The core's mutable record of one caller.

    `heap` holds (release key, backlog seq, generation) for its backlog, smallest key
    first (order.py). Entries go stale when a generation leaves the backlog and are
    skipped (their backlog seq no longer matches the generation's).
    """

    __slots__ = (
        "admitted",
        "backlog",
        "bucket",
        "counter",
        "drain",
        "estimate",
        "generated_tokens",
        "heap",
        "in_flight",
        "name",
        "policy",
        "prompt_tokens",
        "queued",
        "refused",
        "weight",
    )

    def __init__(self, policy: CallerPolicy, name: str) -> None:
        self.name = name
        self.policy = policy
        self.weight = policy.weight
        tpm = policy.tokens_per_minute
        self.bucket = None if tpm is None else TokenBucket(tpm)
        self.drain = DrainRate()
        self.counter = 0.0
        self.heap: list[tuple[Key, int, Gen]] = []
        self.backlog = 0
        self.queued = 0
        self.in_flight = 0
        self.admitted = 0
        self.refused = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.estimate = DEFAULT_ESTIMATE  # running mean of open-ended generations

    def set_policy(self, policy: CallerPolicy) -> None:
        if self.policy.max_queued is None and policy.max_queued is not None:
            self.drain = DrainRate()  # it was not measured without the limit
        self.policy = policy
        self.weight = policy.weight
        tpm = policy.tokens_per_minute
        if tpm is None:
            self.bucket = None
        elif self.bucket is None:
            self.bucket = TokenBucket(tpm)
        else:
            self.bucket.resize(tpm)

    def charge(self, service: float) -> None:
        """The one fair-share charge (backlog.py rule 1): service / weight."""
        self.counter += service / self.weight

    def expect(self, max_new: int) -> int:
        """Generated tokens to charge for an open-ended request (coalescer.py rule
        12): the running mean, bounded by what the request may generate."""
        return min(max_new, max(1, round(self.estimate)))

    def learn(self, generated: int) -> None:
        """An open-ended generation finished: move the running mean toward it."""
        self.estimate += (generated - self.estimate) * _ESTIMATE_WEIGHT

    def capped(self) -> bool:
        mc = self.policy.max_concurrency
        return mc is not None and self.in_flight >= mc

    def stats(self) -> CallerStats:
        return CallerStats(
            self.name,
            self.weight,
            self.queued,
            self.backlog,
            self.in_flight,
            self.counter,
            self.admitted,
            self.refused,
            self.prompt_tokens,
            self.generated_tokens,
            self.prompt_tokens + 2 * self.generated_tokens,
        )


class Gen:
    """One generation from admission to `finished()`.

    `tokens` is its admission charge (prompt + max_new, or prompt + the caller's
    estimate when open-ended); `new` is the generated-token part of it. `key` is its
    release key (order.py), computed once at admission.
    """

    __slots__ = (
        "bseq",
        "caller",
        "dkey",
        "for_warmth",
        "group",
        "key",
        "new",
        "passed",
        "predicted",
        "ptok",
        "rank",
        "reason",
        "request",
        "round",
        "seq",
        "started",
        "state",
        "subs",
        "tokens",
    )

    @property
    def interactive(self) -> bool:
        """Not background work (classes.py; room.py rule 8)."""
        return not is_background(self.request.priority)

    def __init__(
        self,
        request: Request,
        group: Group,
        caller: CallerState,
        seq: int,
        ptok: int,
        new: int,
        key: Key,
        dkey: Hashable,
    ) -> None:
        self.request = request
        self.group = group
        self.caller = caller  # its owner: the caller of the first request
        self.seq = seq
        self.ptok = ptok
        self.new = new
        self.tokens = ptok + new
        self.key = key
        self.dkey = dkey  # dedupe key, or None
        self.state = QUEUED
        # Subscriber id -> its own Request (for its arrival, deadline and caller).
        # Dict order is subscription order, so the first caller stays first.
        self.subs: dict[str, Request] = {request.id: request}
        self.reason: ReleaseReason | None = None  # why it became eligible
        self.round = 0  # the due() call in which it became eligible
        self.bseq = 0  # its latest backlog entry; older heap entries are stale
        self.started = False  # the engine produced its first output
        self.rank = 0  # the data-parallel rank it was placed on, once released
        self.passed: float | None = None  # first passed for warmth (warm.py W3)
        self.for_warmth = False  # released past others for warmth (W3)
        self.predicted = -1  # prompt tokens the record believed cached at release (W6)


class Group:
    """Queued (not yet eligible) generations of one GroupKey.

    `gens` may hold stale (not QUEUED) records after cancels; `n` and `ptok` count the
    live ones only, and a cut filters the list.
    """

    __slots__ = ("gens", "key", "n", "ptok", "ready")

    def __init__(self, key: GroupKey) -> None:
        self.key = key
        self.gens: list[Gen] = []
        self.n = 0
        self.ptok = 0
        self.ready = False  # a cap was reached; cut by the next due()
