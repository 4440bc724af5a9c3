"""The core's private mutable records: one queued generation, one window group.

Why this module exists: the coalescer (window, admission) and the backlog (fair
release) both hold generations; they share these plain slotted classes instead of
importing each other. Nothing here is exported from `batching`.
"""

from __future__ import annotations

from collections.abc import Hashable

from .callers import CallerState
from .keys import GroupKey
from .types import ReleaseReason, Request

# Generation states. Plain ints: compared on the hot path.
QUEUED = 0  # in its window group, not yet eligible
BACKLOG = 1  # eligible, waiting in its caller's backlog for engine room
GONE = 2  # released to the engine, or dropped when its last subscriber left


class Gen:
    """One generation from admission to `finished()`."""

    __slots__ = (
        "bseq",
        "caller",
        "dkey",
        "group",
        "ptok",
        "reason",
        "request",
        "round",
        "seq",
        "started",
        "state",
        "subs",
        "tokens",
    )

    def __init__(
        self,
        request: Request,
        group: Group,
        caller: CallerState,
        seq: int,
        ptok: int,
        tokens: int,
        dkey: Hashable,
    ) -> None:
        self.request = request
        self.group = group
        self.caller = caller  # its owner: the caller of the first request
        self.seq = seq
        self.ptok = ptok
        self.tokens = tokens
        self.dkey = dkey  # dedupe key, or None
        self.state = QUEUED
        # Subscriber id -> its own Request (for its arrival, deadline and caller).
        # Dict order is subscription order, so the first caller stays first.
        self.subs: dict[str, Request] = {request.id: request}
        self.reason: ReleaseReason | None = None  # why it became eligible
        self.round = 0  # the due() call in which it became eligible
        self.bseq = 0  # its latest backlog entry; older heap entries are stale
        self.started = False  # the engine produced its first output


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
