"""Prefix placement: which data-parallel rank most likely holds a prompt's prefix.

Why this module exists: with data parallelism each rank has its own prefix cache, and
room.py's `place` chooses a rank by load alone, so a conversation's next turn lands on
the other rank about half the time and its whole prefix is prefilled again. This
module keeps a bounded, ageing memory of which rank was given which prefix block
(`PrefixMap`) and decides, as one pure function (`choose`), whether a release follows
its prefix or falls back to load. Sans-IO: the engine adapter computes the block
hashes (server/engines/vllm_prefix.py, the way vLLM's prefix cache does, with the
caller's cache_salt) and passes them in as a tuple of ints; time is an argument.

Source of truth: the blocks Sluice placed, not vLLM's KV cache events. The events
(--kv-events-config) need a ZMQ publisher per rank and a subscriber task with its own
ordering and lag against the releases (a turn released before the previous turn's
blocks are reported stored would miss them); the map knows a placement the moment it
is made, which is what a closed-loop conversation's next turn needs. Its error is
the other way: it may believe in blocks the engine has evicted, so entries age out
(`ttl`) and the map is bounded (`capacity` blocks, least recently used out first),
and a wrong guess costs only what load placement would have cost anyway, since the
bound (rule P3) keeps the guess from piling work on one rank.

Rules (numbered after room.py's 1-7):

P1. No known prefix (no block hash of the prompt is on any rank with room): place by
    room, as rule 6 does (`fallback`, the rank room.py's `place` chose).
P2. Longest prefix: among the ranks with room, the one holding the longest run of the
    prompt's leading blocks (a prefix cache hits only on a leading run: vLLM chains
    each block's hash on its parent's); ties to the rank `place` chose, then lower.
P3. Bounded load: a rank whose load (its unfinished generations) exceeds
    `BOUND` x (the least loaded rank's load + 1) does not get the request by prefix
    (it is `overridden` and falls back to P1). 1.25 is the classic margin of
    consistent hashing with bounded loads (Mirrokni et al.): it keeps every rank
    within a quarter of the least loaded one, so a hot conversation or shared
    system prompt cannot starve the other rank, while a near-tie in load still
    follows the cache. The +1 lets an idle pair (0 and 1) still follow the prefix.
P4. Never a rank without room when one has it: a rank without room is never chosen
    by prefix; the fallback is room.py's choice, which prefers room.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BOUND = 1.25


class Placed(enum.Enum):
    """Why a release went where it went (counted in /metrics)."""

    PREFIX = "prefix"  # P2: followed its prefix
    LOAD = "load"  # P1: no known prefix; placed by room
    BOUND = "bound"  # P3: a prefix was known but its rank was too busy


@dataclass(frozen=True, slots=True)
class Choice:
    rank: int
    placed: Placed
    matched: int  # leading blocks the chosen rank is believed to hold (0 on LOAD)


class PrefixMap:
    """Bounded map from (block hash, rank) to when that block was last placed there.

    At most `capacity` (block, rank) entries (least recently placed out first); an entry older than
    `ttl` seconds counts as gone, as the engine's cache would have evicted it under
    other work. Queries (`held`) have no side effects; `placed` records.
    """

    __slots__ = ("_entries", "capacity", "ttl")

    def __init__(self, capacity: int, ttl: float) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.ttl = ttl
        self._entries: OrderedDict[tuple[int, int], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def placed(self, hashes: Sequence[int], rank: int, now: float) -> None:
        """The request whose prompt has these block hashes went to `rank` at `now`."""
        entries = self._entries
        for h in hashes:
            key = (h, rank)
            entries[key] = now
            entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def held(self, hashes: Sequence[int], ranks: int, now: float) -> list[int]:
        """For each rank, how many of the prompt's leading blocks it is believed to
        hold: a prefix cache hits only on a leading run (each hash is chained on its
        parent's), so a rank's count stops at its first block missing or aged out."""
        entries = self._entries
        out = []
        for r in range(ranks):
            n = 0
            for h in hashes:
                t = entries.get((h, r))
                if t is None or now - t > self.ttl:
                    break
                n += 1
            out.append(n)
        return out


def allowed(loads: Sequence[int], rank: int, bound: float = BOUND) -> bool:
    """P3: is `rank` within the bound of the least loaded rank?"""
    return loads[rank] <= bound * (min(loads) + 1)


def choose(
    held: Sequence[int],
    room: Sequence[bool],
    loads: Sequence[int],
    fallback: int,
    bound: float = BOUND,
) -> Choice:
    """P1-P4: the rank for a release, and why.

    `held[r]`: leading blocks rank r is believed to hold (PrefixMap.held); `room[r]`:
    whether rank r has room for it now; `loads[r]`: its unfinished generations;
    `fallback`: the rank room.py's `place` chose by room.
    """
    any_room = any(room)
    best, best_key = -1, (0, False, 0)
    for r, n in enumerate(held):
        if n <= 0 or (any_room and not room[r]):
            continue
        key = (n, r == fallback, -r)
        if best < 0 or key > best_key:
            best, best_key = r, key
    if best < 0:
        return Choice(fallback, Placed.LOAD, 0)
    if not allowed(loads, best, bound):
        return Choice(fallback, Placed.BOUND, 0)
    return Choice(best, Placed.PREFIX, held[best])
