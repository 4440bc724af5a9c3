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
* `callers` is the caller policy table (callers.py); `engine` the engine's capacity
  (room.py; all 0 = unknown: eligible work is released at once, as before the
  backlog existed). Both can be replaced at run time (`set_callers`, `capacity`).
* `order` is the release key's tunables (order.py): short-first at `exchange_rate`
  prompt tokens per second of waiting, never more than `max_delay` seconds behind
  first-come-first-served within a caller and priority.
* `kv_reserve_short` (0 <= x < 1) is the share of the KV cache that prompts longer
  than `short_prompt_tokens` may not use (room.py rule 4); 0 turns it off. A tenth
  by default: beside two KV-bound bulk callers a chat turn otherwise waits for a
  bulk request to end (issue 21: chat TTFT p95 534 ms at 0, 72 ms at 0.1, bulk
  throughput unchanged; 0.2 cost a 2,000-token flood 8%).
* `feed_steps` (>= 1) sizes the engine's own queue (room.py rule 2): what this many
  of its steps take, as its last step showed (the slots it left free, and those its
  running generations free by then; the budget its decodes left, this many times),
  plus the spare its under-fed steps set. 2 by default: a release reaches the engine
  one step late (the driver hears of step N when step N+1 is scheduled). Issue 21's
  room (released slots up to max_num_seqs + 1/16, unstarted prompt tokens up to one
  step's budget) left 89% of the steps under-fed at the c=384 spread (issue 27).
* `long_prefills` (>= 0; 0 turns it off) bounds, while more than one caller has work,
  the unstarted prompts that take more than one step's prefill chunk (room.py rule 5,
  which gives the numbers): one by default, so a chat turn finds budget in the next
  step beside a flood of long prompts.
* `adapter_wait` (seconds >= 0) is how long the fair-share head may wait for a LoRA
  slot before the adapter in flight longest is drained for it (adapters.py rule 4;
  only with `engine.max_loras` > 0). 0 by default: the drain starts as soon as the
  head waits. Measured (issue 20's point: 4 callers on 4 adapters, max_loras 2,
  16 streams each): at 1 s the worst caller's TTFT p95 was 12.5 s (vLLM's server
  3.1 s) and the shares of service 0.18-0.33; at 0, 3.9 s and 0.24-0.26, at
  16.1 req/s against 14.7 (one repetition).
* `prefix_order` (off by default: on issue 62's mixed load it gained little, see
  docs/queue.md): among what the order allows, a caller's release prefers a
  generation whose leading blocks the engine's prefix cache is believed to hold
  (warm.py W1-W6; `warm.min_gain` blocks beyond the head's), with the engine's
  prefix cache on (`engine.prefix_block` > 0); off, or with the cache off, today's
  order and nothing hashed.
* Invalid values raise ValueError at construction, never later on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass

from .adapters import check_wait
from .callers import Callers
from .order import ReleaseOrder
from .room import EngineCapacity
from .warm import WarmOrder

__all__ = ["CoalescerConfig"]

_NO_CALLERS = Callers()  # every caller gets the default policy: weight 1, no limits
_UNKNOWN_ENGINE = EngineCapacity()  # nothing held back
_ORDER = ReleaseOrder()
_WARM = WarmOrder()


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
    retry_after_default: float = 1.0  # before any drain rate has been measured
    retry_after_max: float = 60.0
    # Added to the spec: the floor of every Retry-After the core computes. HTTP's
    # Retry-After is whole seconds anyway, and a retry sooner than about a second
    # mostly re-meets the same full queue.
    retry_after_min: float = 1.0
    callers: Callers = _NO_CALLERS
    engine: EngineCapacity = _UNKNOWN_ENGINE
    order: ReleaseOrder = _ORDER  # the release key (order.py)
    kv_reserve_short: float = 0.1  # KV share long prompts leave free for short ones
    short_prompt_tokens: int = 256  # a prompt this long or shorter counts as short
    feed_steps: float = 2.0  # engine steps of work kept in the engine's queue (room.py rule 2)
    long_prefills: int = 1  # multi-step prompts unstarted beside others' work (room.py rule 5)
    # The engines run Sluice's scheduler, which puts interactive work first in its
    # steps (room.py rule 8; server/engines/vllm_scheduler.py). Set by the server.
    interactive_first: bool = False
    adapter_wait: float = 0.0  # seconds the head may wait for a LoRA slot (adapters.py)
    # Data-parallel ranks: a release follows its prompt's prefix (prefix.py P1-P4);
    # off, every release is placed by room alone (room.py rule 6).
    prefix_placement: bool = True
    # A caller's release prefers a warm prefix among what the order allows (warm.py).
    prefix_order: bool = False
    warm: WarmOrder = _WARM

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError("window must be >= 0")
        if self.max_batch_seqs < 1 or self.max_batch_tokens < 1:
            raise ValueError("batch caps must be >= 1")
        if self.max_pending_requests < 1 or self.max_pending_tokens < 1:
            raise ValueError("pending limits must be >= 1")
        if not 0 <= self.retry_after_min <= self.retry_after_max:
            raise ValueError("need 0 <= retry_after_min <= retry_after_max")
        if self.retry_after_default < 0:
            raise ValueError("retry_after_default must be >= 0")
        if not 0.0 <= self.kv_reserve_short < 1.0:
            raise ValueError("kv_reserve_short must be in [0, 1)")
        if self.short_prompt_tokens < 0:
            raise ValueError("short_prompt_tokens must be >= 0")
        if not self.feed_steps >= 1.0:
            raise ValueError("need feed_steps >= 1")
        if self.long_prefills < 0:
            raise ValueError("long_prefills must be >= 0 (0: no bound)")
        check_wait(self.adapter_wait)
