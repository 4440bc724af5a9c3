"""Value types exchanged between the policy core and the server driver.

Why this module exists: the driver (asyncio, vLLM) and the core (pure policy) talk only
through these frozen values, so either side can be tested without the other.

Rules:

* Every value here is immutable (`frozen=True, slots=True`); the core keeps its own
  mutable bookkeeping privately and hands out fresh values.
* Time is always a float in seconds on the driver's monotonic clock (`loop.time()`);
  the core never reads a clock.
* `Request.priority` follows vLLM: a LOWER value is more urgent. It is passed through
  to vLLM's priority scheduler unchanged and orders each caller's backlog.
* `Request.caller` names who sent it (callers.py); it decides the request's fair
  share and limits. Requests without a name belong to `DEFAULT_CALLER`.
* `Request.tokens` (prompt + max_new_tokens) is the admission cost of a generation,
  except for an `open_ended` one (the client set no max_tokens, so max_new_tokens is
  the context's room): it is charged prompt + its caller's running estimate
  (coalescer.py rule 12). The batch token cap counts prompt tokens only (the
  engine's per-step prefill budget).
* A pooling request (an embedding, a rerank pair: one input of an embeddings or
  rerank request) is a `Request` with `max_new_tokens` 0: admission, fair share
  (its service is its prompt tokens), the window, the backlog and release treat
  it as a generation that ends at its first output. The core needs no kind of
  its own for it: with one engine per model, a GroupKey never mixes the two.
* `Entry.order` is the generation's release key (order.py), for the driver to hand
  to vLLM (`--engine-priority order`).
* `Request.fingerprint` is set by the server only when sampling is deterministic
  (greedy, or a fixed seed) and must cover every sampling parameter including
  max_new_tokens. None means "never deduplicate".
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

from .callers import DEFAULT_CALLER
from .keys import GroupKey
from .order import Key

__all__ = [
    "AdmissionState",
    "Admitted",
    "Batch",
    "EngineLoad",
    "EngineStep",
    "Entry",
    "Outcome",
    "RefusalReason",
    "Refused",
    "ReleaseReason",
    "Request",
]


@dataclass(frozen=True, slots=True)
class Request:
    """One caller's request, tokenized and admitted-to-be by the server."""

    id: str
    key: GroupKey
    prompt_tokens: tuple[int, ...]
    max_new_tokens: int
    arrival: float  # `now` when the server admitted it
    priority: int = 0  # vLLM convention: lower = more urgent
    deadline: float | None = None  # absolute; expires if not dispatched by then
    fingerprint: Hashable | None = None  # deterministic sampling digest, else None
    caller: str = DEFAULT_CALLER  # who sent it (fair share and limits)
    open_ended: bool = False  # no max_tokens from the client: charge an estimate
    # The prompt's prefix block hashes (server/engines/vllm_prefix.py), cache_salt
    # included; () = unknown: placed by room alone (prefix.py rule P1).
    prefix: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        """Admission cost: prompt tokens plus the most tokens it may generate."""
        return len(self.prompt_tokens) + self.max_new_tokens


class AdmissionState(enum.Enum):
    """What the watchdog (or shutdown) allows the core to do."""

    OK = "ok"  # admit and release normally
    SHEDDING = "shedding"  # refuse new work (reason MEMORY); queued work proceeds
    CRITICAL = "critical"  # refuse new work AND release nothing; expiry still applies
    DRAINING = "draining"  # refuse new work (reason DRAINING); queued work proceeds


class RefusalReason(enum.Enum):
    QUEUE_FULL_REQUESTS = "queue_requests"
    QUEUE_FULL_TOKENS = "queue_tokens"
    TOO_LARGE = "too_large"  # alone exceeds max_pending_tokens: retrying is pointless (400)
    MEMORY = "memory"
    DRAINING = "draining"
    DUPLICATE_ID = "duplicate_id"
    CALLER_LIMIT = "caller_limit"  # over the caller's own limit (429; see callers.py)


class Outcome(enum.Enum):
    """How an admitted subscriber left the core; each ends in exactly one."""

    DISPATCHED = "dispatched"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    REJECTED = "rejected"


class ReleaseReason(enum.Enum):
    DEADLINE = "deadline"  # the group's oldest request waited a full window
    SIZE_CAP = "size_cap"  # the group reached max_batch_seqs
    TOKEN_CAP = "token_cap"  # the group reached max_batch_tokens (prompt tokens)
    EARLY = "early"  # adaptive: the engine was idle, waiting is pure latency
    LONE = "lone"  # adaptive: arrived after a quiet spell longer than the window
    IMMEDIATE = "immediate"  # window == 0
    BACKLOG = "backlog"  # eligible earlier, held in the backlog until the engine had room


@dataclass(frozen=True, slots=True)
class Admitted:
    request_id: str
    joined: str | None = None  # id of the queued generation it joined (dedupe), else None


@dataclass(frozen=True, slots=True)
class Refused:
    reason: RefusalReason
    retry_after: float  # seconds; 0.0 when retrying cannot help (TOO_LARGE, DUPLICATE_ID)
    message: str


@dataclass(frozen=True, slots=True)
class Entry:
    """One engine generation.

    `subscribers` are the ids of every caller still waiting for it, never empty. The
    first is `request.id` unless that caller cancelled while others stayed.
    """

    request: Request
    subscribers: tuple[str, ...]
    order: Key = (0, 0.0, 0)  # its release key (order.py)
    # The data-parallel rank the engine should run it on (room.py `place`); None
    # with one rank.
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class Batch:
    """Generations of one GroupKey to submit to the engine together, in this order."""

    id: int
    key: GroupKey
    entries: tuple[Entry, ...]
    reason: ReleaseReason
    released_at: float
    tokens: int  # sum of entry.request.tokens


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A snapshot of the engine's scheduler, taken by the driver from its stats."""

    running: int  # requests the engine is running
    waiting: int  # requests in the engine's own waiting queue (preempted ones included)
    kv_usage: float = 0.0  # 0..1, fraction of KV-cache blocks in use
    # Data-parallel ranks: the least-used rank's KV use (None: one rank, or
    # unknown; batching/room.py rule 6).
    kv_usage_least: float | None = None


@dataclass(frozen=True, slots=True)
class EngineStep:
    """One engine step of one data-parallel rank, as the engine reported it.

    vLLM's per-step scheduler stats with its iteration details (server/engines/vllm_adapter.py):
    the tokens it scheduled (prompt chunks and decodes), the requests they belong to,
    and its queue and KV cache once the step was done.
    """

    rank: int  # the data-parallel rank (0 with one)
    prefill_tokens: int  # prompt tokens scheduled: whole prompts and chunks of prompts
    decode_tokens: int
    requests: int  # requests scheduled in the step (each holds a running slot)
    running: int  # the rank's running requests after the step
    waiting: int  # its own waiting queue after the step (what it could not schedule)
    kv_usage: float  # 0..1, its KV-cache use after the step

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens
