"""A prompt's prefix block hashes, computed as vLLM's prefix cache computes them.

Why this module exists: prefix placement (batching/prefix.py) needs to know which
blocks of a prompt a rank's prefix cache would hit, and the core must stay free of
vLLM. This is the one module over vLLM's block hashing (vllm/v1/core/kv_cache_utils.py):
the same block size, the hash function chosen by --prefix-caching-hash-algo, the same
NONE_HASH seed, a LoRA adapter's name and path in every block's extra keys (an
adapter's blocks are its own: they never hit the base model's or another adapter's),
and the caller's cache_salt in the first block's, so two callers with different
salts never share a hash (per-caller isolation holds across ranks). The core
receives each block hash as an int (its first 8 bytes).

Not covered: multimodal and prompt-embeds extra keys (Sluice's prompts are token
ids: neither reaches the engine from it).
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

    def raw(
        self,
        tokens: Sequence[int],
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> list[bytes]:
        """vLLM's own BlockHash values for the full blocks of `tokens`; `lora` the
        adapter's (name, path) as its LoRARequest carries them, None for the base
        weights. The extra keys in vLLM's order (generate_block_hash_extra_keys):
        the adapter's on every block, then the salt on the first."""
        size = self.block_size
        out: list[bytes] = []
        parent: bytes | None = None
        adapter: tuple[tuple[str, ...], ...] = (("lora", *lora),) if lora else ()
        salted = (*adapter, ("cache_salt", cache_salt)) if cache_salt else adapter
        for start in range(0, len(tokens) - size + 1, size):
            extra = (salted if start == 0 else adapter) or None
            parent = kv_cache_utils.hash_block_tokens(
                self._fn,
                parent,
                tokens[start : start + size],
                extra,
            )
            out.append(parent)
        return out

    def hashes(
        self,
        tokens: Sequence[int],
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> tuple[int, ...]:
        """The core's form: each block hash as an int of its first 8 bytes."""
        return tuple(int.from_bytes(h[:8], "big") for h in self.raw(tokens, cache_salt, lora))
