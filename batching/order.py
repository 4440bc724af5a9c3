"""The release key: the one order in which a caller's work goes to the engine.

Why this module exists: the window's cut, each caller's backlog, the tie-break between
callers (after the fair-share counter) and the priority handed to vLLM
(`--engine-priority order`) must agree, so the order is computed here, once per
generation at admission, and everything else compares the keys.

Rules:

1. The key is (priority, virtual start, admission seq); the smaller key goes first.
   Priority follows vLLM (lower = more urgent) and is stronger than length: no wait
   lets a request pass one of a more urgent priority.
2. Virtual start = arrival + min(class tokens / exchange_rate, max_delay). A prompt's
   cost is its length rounded up to a length class (`length_class` tokens, vLLM's KV
   block of 16 by default), so near-equal prompts (64 and 65 tokens are one class
   apart, 64 and 60 none) differ by at most one class's worth of seconds and
   otherwise keep first-come-first-served order.
3. Bound (the aging's ceiling, not a separate rule): a request never goes behind one
   of its caller's same-priority requests that arrived more than `max_delay` after it
   (that one's virtual start is later than its arrival, which is later than this
   one's virtual start). So against first-come-first-served within its caller and
   priority, a request is delayed by at most the work admitted in `max_delay` after
   it. When the head does not fit the engine's room, the backlog lets only requests
   that arrived within `max_delay` of the skipped head go instead (backlog.py rule 4),
   so the bound holds there too.

Why a virtual start time, not highest-response-ratio-next: the key is fixed at
admission, so a heap orders it in O(log n) and it can be handed to vLLM as a fixed
integer priority; a response ratio changes with `now` and would need re-sorting on
every release. The exchange rate says how many prompt tokens one second of waiting
is worth: at 500 tokens/s a 700-token prompt yields 1.0 s (the ceiling) to a
16-token one, and a 65-token prompt yields 32 ms to a 64-token one instead of
waiting behind every 64-token arrival (the c=512 tail of bench/results/ANALYSIS.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Key", "ReleaseOrder", "engine_priority"]

# Key = (priority, virtual start, admission seq).
Key = tuple[int, float, int]

# An engine priority packs (priority, virtual start in ms) into one int; 2**42 ms is
# 139 years of monotonic clock, so the start never spills into the priority.
_MS_SPAN = 1 << 42


@dataclass(frozen=True, slots=True)
class ReleaseOrder:
    """The tunables of the key (rules 2-3); validated once."""

    exchange_rate: float = 500.0  # prompt tokens one second of waiting is worth
    max_delay: float = 1.0  # seconds: the ceiling of a prompt's handicap
    length_class: int = 16  # tokens: prompts within one class are equal

    def __post_init__(self) -> None:
        if not (self.exchange_rate > 0 and not math.isnan(self.exchange_rate)):
            raise ValueError("exchange rate must be > 0 tokens per second (inf: FCFS)")
        if not (self.max_delay >= 0 and math.isfinite(self.max_delay)):
            raise ValueError("max delay must be a finite number of seconds >= 0")
        if self.length_class < 1:
            raise ValueError("length class must be >= 1 token")

    def delay(self, prompt_tokens: int) -> float:
        """A prompt's handicap in seconds (rule 2)."""
        lc = self.length_class
        cls = -(-prompt_tokens // lc) * lc
        return min(cls / self.exchange_rate, self.max_delay)

    def key(self, priority: int, prompt_tokens: int, arrival: float, seq: int) -> Key:
        """The release key (rule 1)."""
        return (priority, arrival + self.delay(prompt_tokens), seq)


def engine_priority(key: Key) -> int:
    """The key as one vLLM priority (`--engine-priority order`): the priority, then
    the virtual start in whole ms. vLLM's priority scheduler breaks ties by its own
    arrival time, which is the admission order here."""
    prio, start, _ = key
    ms = min(max(int(start * 1000.0), 0), _MS_SPAN - 1)
    return prio * _MS_SPAN + ms
