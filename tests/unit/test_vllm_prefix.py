"""server/engines/vllm_prefix.py: Sluice's block hashes equal vLLM's own."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

from server.engines.vllm_prefix import PrefixHasher


def _vllm(tokens: list[int], salt: str | None, size: int) -> list[bytes]:
    hasher = get_request_block_hasher(size, get_hash_fn_by_name("sha256"))
    req = Request(
        "r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt, block_hasher=hasher
    )
    return [bytes(h) for h in req.block_hashes]


def test_hashes_equal_vllms_own_for_the_same_tokens_and_salt() -> None:
    tokens = list(range(100, 170))  # 4 full blocks of 16 and 6 tokens over
    h = PrefixHasher(block_size=16)
    for salt in (None, "caller-a"):
        ours = h.raw(tokens, salt)
        assert len(ours) == 4
        assert [bytes(x) for x in ours] == _vllm(tokens, salt, 16)


def test_different_salts_share_no_block() -> None:
    tokens = list(range(64))
    h = PrefixHasher(block_size=16)
    a, b = set(h.hashes(tokens, "a")), set(h.hashes(tokens, "b"))
    assert a.isdisjoint(b)
    assert h.hashes([*tokens, 1, 2], "a")[:4] == h.hashes(tokens, "a")
