"""A prompt's prefix block hashes, computed as vLLM's prefix cache computes them.

Why this module exists: prefix placement (batching/prefix.py) needs to know which
blocks of a prompt a rank's prefix cache would hit, and the core must stay free of
vLLM. This is the one module over vLLM's block hashing (vllm/v1/core/kv_cache_utils.py):
the same block size, the hash function chosen by --prefix-caching-hash-algo, the same
NONE_HASH seed, and the caller's cache_salt in the first block's extra keys, so two
callers with different salts never share a hash (per-caller isolation holds across
ranks). The core receives each block hash as an int (its first 8 bytes).

Not covered: LoRA and multimodal extra keys (a LoRA request's blocks differ from
the base model's in vLLM; here they hash alike, so placement may follow a prefix the
rank does not hold for that adapter: it costs only load placement's miss).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils


class PrefixHasher:
    """Block hashes of token ids, as the engine's prefix cache chains them."""

    __slots__ = ("_fn", "block_size")

    def __init__(self, block_size: int, algo: str = "sha256") -> None:
        self.block_size = block_size
        self._fn: Callable[[Any], bytes] = get_hash_fn_by_name(algo)
        if getattr(kv_cache_utils, "NONE_HASH", None) is None:
            kv_cache_utils.init_none_hash(self._fn)

    def raw(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """vLLM's own BlockHash values for the full blocks of `tokens`."""
        size = self.block_size
        out: list[bytes] = []
        parent: bytes | None = None
        for start in range(0, len(tokens) - size + 1, size):
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = kv_cache_utils.hash_block_tokens(
                self._fn,
                parent,
                tokens[start : start + size],
                extra,
            )
            out.append(parent)
        return out

    def hashes(self, tokens: Sequence[int], cache_salt: str | None = None) -> tuple[int, ...]:
        """The core's form: each block hash as an int of its first 8 bytes."""
        return tuple(int.from_bytes(h[:8], "big") for h in self.raw(tokens, cache_salt))
