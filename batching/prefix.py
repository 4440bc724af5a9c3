"""Shared-prefix leaders and followers.

Why this module exists: vLLM's automatic prefix cache reuses KV blocks that are already
computed, but requests submitted in the same engine step all miss it and compute the
shared prefix each. Releasing one "leader" first and its "followers" one engine step
later (`prefix_follow_delay`) lets the leader fill the cache so the followers hit it.

Rules:

* Prefixes are compared in whole KV blocks (`block` tokens), because vLLM caches whole
  blocks only; a shared prefix shorter than one block is worth nothing.
* Entries are bucketed by a hash of their first block (and GroupKey: an adapter changes
  the KV values, so vLLM keys its cache by adapter too). A bucket with two or more
  entries has a leader, the first entry in batch order; the rest are its followers.
  Bucketing by the first block means every follower shares at least one whole block
  with its leader, which is all the rule needs.
* A prefix whose leader (or any entry with it) was released within `memory` seconds is
  assumed to be cached already: nobody is held back for it.
* Hash collisions are harmless: at worst a follower waits a few milliseconds for
  nothing, or is not held when it could have been.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["PrefixMemory", "block_key", "plan_followers", "shared_blocks"]


def block_key(key: Hashable, prompt: tuple[int, ...], block: int) -> int | None:
    """Hash of the group key and the first whole block, or None if there is none."""
    if len(prompt) < block:
        return None
    return hash((key, prompt[:block]))


def shared_blocks(a: tuple[int, ...], b: tuple[int, ...], block: int) -> int:
    """Length in tokens of the longest common prefix of a and b, in whole blocks."""
    n = 0
    limit = min(len(a), len(b))
    # Tuple-slice comparison runs in C; one block per step.
    while n + block <= limit and a[n : n + block] == b[n : n + block]:
        n += block
    return n


class PrefixMemory:
    """Block keys of recently released prefixes, with the time they were released."""

    __slots__ = ("_seen", "memory")

    def __init__(self, memory: float) -> None:
        self.memory = memory
        # key -> released_at; dict order is release order (re-inserted on each release),
        # so the oldest entries are at the front and pruning is O(1) amortised.
        self._seen: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def cached(self, bkey: int, now: float) -> bool:
        t = self._seen.get(bkey)
        return t is not None and now - t < self.memory

    def remember(self, bkey: int, now: float) -> None:
        seen = self._seen
        if bkey in seen:
            del seen[bkey]
        seen[bkey] = now

    def prune(self, now: float) -> None:
        seen = self._seen
        horizon = now - self.memory
        while seen:
            first = next(iter(seen))
            if seen[first] > horizon:
                break
            del seen[first]


def plan_followers(
    bkeys: Sequence[int | None], memory: PrefixMemory, now: float
) -> list[tuple[int, list[int]]]:
    """Leaders and their followers among entries in batch order.

    `bkeys[i]` is entry i's `block_key`. Returns `(leader_index, follower_indices)` for
    every prefix shared by two or more entries and not remembered as cached; an entry
    index appears at most once overall.
    """
    first: dict[int, int] = {}
    followers: dict[int, list[int]] = {}
    for i, bk in enumerate(bkeys):
        if bk is None:
            continue
        lead = first.get(bk)
        if lead is None:
            first[bk] = i
        elif lead in followers:
            followers[lead].append(i)
        elif not memory.cached(bk, now):
            followers[lead] = [i]
    return list(followers.items())
