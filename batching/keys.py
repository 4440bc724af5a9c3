"""Grouping keys: what must be equal for two requests to share one engine submission.

Why this module exists: the coalescer only ever batches requests that vLLM can run
under one set of weights, so "compatible" has to be one small, hashable value that the
server builds once per request and the core compares in O(1).

Rules:

* Two requests may share a batch only if their `GroupKey`s are equal. Nothing else is
  compared; token budgets are enforced by the batch caps, not by the key.
* `adapter` is the LoRA adapter name, or None for the base weights. An empty string
  means "no adapter" too, so `group_key` folds it into None.
* `group_key` interns its results: equal keys are usually the *same* object, which makes
  the dict lookups on the hot path an identity check instead of a tuple compare.
* A `GroupKey` caches its hash: a frozen dataclass would otherwise rebuild and hash a
  `(model, adapter)` tuple on every dict operation (about 150 ns each, several per
  request on the hot path). Pickling rebuilds the key, so the cache never travels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

__all__ = ["GroupKey", "group_key"]


@dataclass(frozen=True, slots=True)
class GroupKey:
    """What must be equal for two requests to share one engine submission."""

    model: str
    adapter: str | None = None
    # Cached hash; excluded from equality and repr (see the module docstring).
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.model, self.adapter)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[GroupKey], tuple[str, str | None]]:
        # Rebuild through __init__ so an unpickled key (another process, another
        # PYTHONHASHSEED) recomputes its hash instead of carrying a stale one.
        return (GroupKey, (self.model, self.adapter))


def group_key(model: str, adapter: str | None = None) -> GroupKey:
    """Return the (interned) grouping key for a model and an optional LoRA adapter.

    `adapter=""` is treated as no adapter. The intern table is bounded (4096 distinct
    keys, far more than one engine can serve) so a caller inventing adapter names
    cannot grow it without limit; a key evicted from it is still correct, only not
    shared.
    """
    return _intern(model, adapter or None)


@lru_cache(maxsize=4096)
def _intern(model: str, adapter: str | None) -> GroupKey:
    return GroupKey(model, adapter)
