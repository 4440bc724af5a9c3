"""Prefix-warm release: among what the order allows, the request whose prefix is cached.

Why this module exists: Sluice holds the backlog and keeps the engine's own queue a
few requests deep, so its release order is the engine's admission order. Where the
prefixes in use do not all fit in the KV cache (many long system prompts, agents
resending long contexts), releases in key order interleave the prefixes, each is
evicted before its next sibling reaches the engine, and every request prefills its
whole prompt again. Released while its prefix is still cached, a request prefills
only its own tail, and its siblings follow it. Sans-IO like the other rules: the
engine adapter hashes the prompt's leading blocks (server/engines/vllm_prefix.py,
per caller salt) into `Request.prefix`; time is an argument; the record is a
`PrefixMap` (prefix.py) of the blocks Sluice released, sized from the KV cache.

Rules (W for warm; backlog.py's rules 1-5 and order.py's 1-3 stand as they are):

W1. Only among what the order already allows. Warmth chooses only within the caller
    fair share (backlog.py rule 1) chose, only when that caller's head fits the room
    (otherwise rule 3 applies, unchanged), and only among the caller's generations
    that follow the head in key order with the head's priority (order.py rule 1:
    warmth never passes a more urgent request) and each arrived at most `max_delay`
    after every generation it passes (order.py rule 3's bound), at most `SCAN` of
    them, each fitting the room and its LoRA slot.
W2. Warmth is the number of a prompt's leading blocks the engine is believed to
    hold: the longest leading run of its block hashes that the record holds on any
    rank (a prefix cache hits only on a leading run: each block's hash is chained on
    its parent's).
W3. The head goes unless a candidate holds at least `min_gain` more leading blocks
    than the head; then the warmest candidate goes (ties: key order). A release
    records its blocks, so the group's next sibling is the warmest at the next
    pick: siblings follow while the prefix is warm, and each pass still meets W1.
W4. Fair share is untouched: warmth never changes which caller goes (DLPM's
    quantum Q is 0 tokens here), so backlog.py's bound (2 U + R at a release)
    holds as it is. Callers with different cache salts share no block anyway.
W5. Nothing to gain, nothing changed: no hashes (the engine's prefix cache off, or
    `--no-prefix-order`), an empty record, or no candidate `min_gain` blocks warmer
    than the head: the head goes, today's order. Only the first `HASHED` blocks of
    a prompt are hashed for the order alone (one engine): enough to tell a warm
    system prompt or context from a cold one at a bounded cost per request.
W6. The record's belief is bounded: at most the engine's KV cache in blocks
    (`capacity`: least recently released out first, as vLLM's free queue evicts the
    least recently used) and `TTL` seconds. It knows nothing of the engine's
    decode blocks or of its own running requests' pinned blocks, so it may believe
    in blocks the engine evicted: the cost of a wrong belief is one release in
    another order that W1 allowed anyway. Its error is measured: each release's
    predicted cached tokens against the engine's own count (`Coalescer.warm_counters`).

Why the record, not vLLM's KV events (--kv-events-config): the events need a ZMQ
subscriber per rank whose reports lag the releases (a sibling released right after
its group's first would find nothing stored yet); the record knows a release the
moment it is made, and W6 bounds its belief in evicted blocks.

Why passed-over time, not a pass count, is the visible bound: a request passed for
warmth waits, from its first pass to its release, at most the time the work that
arrived within `max_delay` after it takes to run (order.py rule 3), whatever the
warmth; `Coalescer.warm_counters.passed_max` is the longest it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .prefix import PrefixMap

__all__ = ["HASHED", "SCAN", "TTL", "WarmCounters", "WarmOrder", "capacity", "choose", "warmth"]

# W1: candidates tried past the head (backlog.py rule 3's scan depth).
SCAN = 32
# W5: the leading blocks hashed for the order alone (2,048 tokens at vLLM's 16).
HASHED = 128
# W6: seconds a released block is believed held at most, whatever the pressure.
TTL = 600.0


@dataclass(frozen=True, slots=True)
class WarmOrder:
    """W3's tunable, validated once."""

    # Leading blocks a candidate must hold beyond the head's to pass it: a chat
    # template's shared first block is no reason to reorder.
    min_gain: int = 4

    def __post_init__(self) -> None:
        if self.min_gain < 1:
            raise ValueError("min gain must be >= 1 block")


@dataclass(frozen=True, slots=True)
class WarmCounters:
    """Cumulative: releases made for warmth (W3) and the prompt tokens the engine's
    prefix cache held of them (the prefill they saved, by the engine's count), the
    longest a request waited from its first pass to its release (seconds), and the
    record's error (W6): prompt tokens it predicted cached at release against the
    engine's own count, over the releases it predicted for and the engine reported,
    and the tokens predicted and not cached (its belief in evicted blocks)."""

    releases: int = 0
    saved: int = 0
    passed_max: float = 0.0
    predicted: int = 0
    cached: int = 0
    overbelief: int = 0


def capacity(kv_tokens: int, block: int, ranks: int) -> int:
    """W6: the record's size in (block, rank) entries: the engine's KV cache in
    blocks on every rank; 1 where unknown (then nothing is believed held long)."""
    if block <= 0 or kv_tokens <= 0:
        return 1
    return max(1, kv_tokens // block) * max(1, ranks)


def warmth(record: PrefixMap, hashes: Sequence[int], ranks: int, now: float) -> int:
    """W2: the longest leading run of `hashes` the record holds on any rank."""
    if not hashes or not len(record):
        return 0
    return max(record.held(hashes, ranks, now))


def choose(held: Sequence[int], min_gain: int) -> int:
    """W3: the index of the candidate to release; `held[0]` is the head's warmth,
    the rest the candidates W1 allows, in key order."""
    best, top = 0, held[0] + min_gain - 1
    for i in range(1, len(held)):
        if held[i] > top:
            best, top = i, held[i]
    return best
