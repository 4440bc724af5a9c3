"""server/engines/vllm_prefix.py: Sluice's block hashes equal vLLM's own."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

from server.engines.vllm_prefix import PrefixHasher


def _vllm(
    tokens: list[int], salt: str | None, size: int, lora: LoRARequest | None = None
) -> list[bytes]:
    hasher = get_request_block_hasher(size, get_hash_fn_by_name("sha256"))
    req = Request(
        "r",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        block_hasher=hasher,
        lora_request=lora,
    )
    return [bytes(h) for h in req.block_hashes]


def test_hashes_equal_vllms_own_for_the_same_tokens_and_salt() -> None:
    tokens = list(range(100, 170))  # 4 full blocks of 16 and 6 tokens over
    h = PrefixHasher(block_size=16)
    for salt in (None, "caller-a"):
        ours = h.raw(tokens, salt)
        assert len(ours) == 4
        assert [bytes(x) for x in ours] == _vllm(tokens, salt, 16)


def test_a_lora_requests_hashes_equal_vllms_own_and_not_the_base_models() -> None:
    """vLLM keys every block of an adapter's request by the adapter (name and
    path): Sluice's hashes are vLLM's, with and without a salt, and share no
    block with the base model's or another adapter's."""
    tokens = list(range(200, 264))
    h = PrefixHasher(block_size=16)
    alpha = LoRARequest("alpha", 1, "/adapters/alpha")
    for salt in (None, "caller-a"):
        ours = h.raw(tokens, salt, ("alpha", "/adapters/alpha"))
        assert [bytes(x) for x in ours] == _vllm(tokens, salt, 16, alpha)
    base = set(h.hashes(tokens))
    a = set(h.hashes(tokens, lora=("alpha", "/adapters/alpha")))
    b = set(h.hashes(tokens, lora=("beta", "/adapters/beta")))
    assert base.isdisjoint(a) and base.isdisjoint(b) and a.isdisjoint(b)


def test_different_salts_share_no_block() -> None:
    tokens = list(range(64))
    h = PrefixHasher(block_size=16)
    a, b = set(h.hashes(tokens, "a")), set(h.hashes(tokens, "b"))
    assert a.isdisjoint(b)
    assert h.hashes([*tokens, 1, 2], "a")[:4] == h.hashes(tokens, "a")


def test_each_ranks_prefix_cache_hits_are_its_own() -> None:
    """The hit rate per rank (sluice_engine_rank_prefix_cache_*): each rank's logger
    adds its own steps' prefix-cache numbers, through vLLM's per-engine adapter."""
    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

    from server.operations.metrics import Metrics
    from tests.unit.test_engine_lora_slots import _LIVE
    from tests.unit.test_scale_capacity import dp_stat_loggers

    def sched(queries: int, hits: int) -> SchedulerStats:
        pc = PrefixCacheStats(queries=queries, hits=hits)
        return SchedulerStats(num_running_reqs=1, kv_cache_usage=0.1, prefix_cache_stats=pc)

    box, adapter = dp_stat_loggers()
    adapter.record(sched(100, 0), None, engine_idx=0)
    adapter.record(sched(100, 96), None, engine_idx=1)
    adapter.record(sched(50, 48), None, engine_idx=1)
    ranks = box.get().ranks
    assert [(r.prefix_cache_queries_total, r.prefix_cache_hits_total) for r in ranks] == [
        (100, 0),
        (150, 144),
    ]
    m = Metrics()
    m.watch(lambda: {**_LIVE, "ranks": ranks})
    text = m.render().decode()
    assert 'sluice_engine_rank_prefix_cache_hits_total{rank="1"} 144.0' in text
    assert 'sluice_engine_rank_prefix_cache_queries_total{rank="0"} 100.0' in text
