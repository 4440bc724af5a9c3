"""The coalescer's tunables, validated once when the server builds them.

Why this module exists: settings are read once (from the CLI and environment, in the
server) into a frozen object and passed down; the core never looks anything up itself.

Rules:

* All times are seconds. `window == 0` turns coalescing off: every request is released
  on the next `due()` with reason IMMEDIATE.
* `max_batch_tokens` caps the sum of *prompt* tokens in one batch (vLLM's per-step
  prefill budget, `max_num_batched_tokens`); a single larger request forms a batch of
  its own rather than being refused.
* `max_pending_*` bound everything admitted and not yet finished: queued plus in flight.
  Requests count subscribers (callers); tokens count generations (a deduplicated caller
  costs one request and no tokens).
* `prefix_block == 0` disables the shared-prefix leader/follower rule.
* Invalid values raise ValueError at construction, never later on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CoalescerConfig"]


@dataclass(frozen=True, slots=True)
class CoalescerConfig:
    window: float = 0.010  # seconds; 0 = release immediately
    max_batch_seqs: int = 256  # entries per batch (the server sets the engine's max_num_seqs)
    max_batch_tokens: int = 8192  # prompt tokens per batch (engine per-step budget)
    max_pending_requests: int = 1024  # queued + in-flight subscribers
    max_pending_tokens: int = 4_000_000  # queued + in-flight tokens (prompt + max_new)
    adaptive: bool = True  # release early when the engine is idle
    release_lone: bool = True  # release at once a request that follows a quiet spell
    dedupe: bool = True
    # Tokens per KV block for the shared-prefix rule; 0 (the default) disables it:
    # measured, it saved no prefill (12,428 against 12,428 tokens on a burst).
    prefix_block: int = 0
    prefix_follow_delay: float = 0.005  # followers go this long after their leader
    prefix_memory: float = 2.0  # a released prefix is assumed cached this long
    retry_after_default: float = 1.0  # before any drain rate has been measured
    retry_after_max: float = 60.0
    # Added to the spec: the floor of every Retry-After the core computes. HTTP's
    # Retry-After is whole seconds anyway, and a retry sooner than about a second
    # mostly re-meets the same full queue.
    retry_after_min: float = 1.0

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError("window must be >= 0")
        if self.max_batch_seqs < 1 or self.max_batch_tokens < 1:
            raise ValueError("batch caps must be >= 1")
        if self.max_pending_requests < 1 or self.max_pending_tokens < 1:
            raise ValueError("pending limits must be >= 1")
        if self.prefix_block < 0:
            raise ValueError("prefix_block must be >= 0")
        if self.prefix_follow_delay < 0 or self.prefix_memory < 0:
            raise ValueError("prefix delays must be >= 0")
        if not 0 <= self.retry_after_min <= self.retry_after_max:
            raise ValueError("need 0 <= retry_after_min <= retry_after_max")
        if self.retry_after_default < 0:
            raise ValueError("retry_after_default must be >= 0")
