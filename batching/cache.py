"""A small TTL cache for results of deterministic requests.

Why this module exists: dedupe (in the coalescer) only merges identical deterministic
requests that are queued at the same time. A caller that repeats one a second later
(retries, a UI re-render) would cost a whole generation again; with the cache switched
on, the server can answer it from the first result.

Rules:

* Off unless the server builds one with `ttl > 0` and `max_entries > 0`; a disabled
  cache misses every `get` and ignores every `put`.
* Keys must include everything that makes the result what it is: the GroupKey, the
  prompt tokens and the request's fingerprint (which covers all sampling parameters).
  Only deterministic requests (fingerprint not None) belong here.
* An entry lives `ttl` seconds from its `put`; putting a key again restarts its life.
* At most `max_entries`; beyond that the oldest `put` is evicted first. Entries are
  kept in put order, so expiry and eviction are O(1) amortised from the front.
* Time is an argument, like everywhere in `batching/`. Values must not be None (None
  is what `get` returns on a miss).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["ResultCache"]

V = TypeVar("V")


class ResultCache(Generic[V]):
    __slots__ = ("_data", "hits", "max_entries", "misses", "ttl")

    def __init__(self, ttl: float = 0.0, max_entries: int = 0) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        # key -> (expires_at, value); dict order is put order (see the docstring).
        self._data: dict[Hashable, tuple[float, V]] = {}
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.ttl > 0 and self.max_entries > 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: Hashable, now: float) -> V | None:
        item = self._data.get(key)
        if item is None or item[0] <= now:
            if item is not None:
                del self._data[key]
            self.misses += 1
            return None
        self.hits += 1
        return item[1]

    def put(self, key: Hashable, value: V, now: float) -> None:
        if not self.enabled:
            return
        data = self._data
        data.pop(key, None)  # re-insert at the end: put order stays time order
        data[key] = (now + self.ttl, value)
        self._prune(now)

    def clear(self) -> None:
        self._data.clear()

    def _prune(self, now: float) -> None:
        data = self._data
        while data:
            first = next(iter(data))
            if len(data) > self.max_entries or data[first][0] <= now:
                del data[first]
            else:
                break
