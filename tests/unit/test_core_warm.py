"""The prefix-warm release order (batching/warm.py W1-W6): by example, and its bounds
under hypothesis.

The bounds reuse test_core_backlog_stateful.py's machines with prompts that carry
prefixes from a few groups and the engine's prefix cache on, so the warm order
reorders their releases: every check of those machines holds as it is, among them
order.py rule 3's bound (no release while a same-caller, same-priority request that
arrived more than max_delay before it is held) and backlog.py's fair-share bound
between two callers (W4: warmth never changes which caller goes).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import invariant

from batching import (
    Batch,
    Coalescer,
    CoalescerConfig,
    EngineCapacity,
    ReleaseOrder,
    Request,
    WarmCounters,
    WarmOrder,
    group_key,
)
from batching.prefix import PrefixMap
from batching.warm import HASHED, capacity, choose, warmth
from tests.unit.test_core_backlog_stateful import AgingMachine, BacklogMachine, FairnessMachine

M = group_key("m")
BLOCK = 16
PROMPT = 200  # every prompt one length: the key is arrival order


def pfx(group: int, n: int, shared: int = 10) -> tuple[int, ...]:
    """A prompt under system prompt `group`: `shared` blocks of it, then its own."""
    return (*(group * 1000 + i for i in range(shared)), 10**6 + n)


def co_(
    on: bool = True, block: int = BLOCK, ranks: int = 1, delay: float = 1.0, seqs: int = 1
) -> Coalescer:
    return Coalescer(
        CoalescerConfig(
            window=0.0,
            release_lone=False,
            engine=EngineCapacity(
                max_seqs=seqs,
                step_tokens=4096,
                kv_tokens=64 * 1024,
                prefix_block=block,
                ranks=ranks,
            ),
            order=ReleaseOrder(max_delay=delay),
            prefix_order=on,
        )
    )


def req(rid: str, at: float, prefix: tuple[int, ...], priority: int = 0) -> Request:
    return Request(rid, M, (7,) * PROMPT, 4, at, priority=priority, prefix=prefix)


def ids(batches: list[Batch]) -> list[str]:
    return [e.request.id for b in batches for e in b.entries]


def run(co: Coalescer, reqs: list[Request], at: float = 0.5) -> list[str]:
    """Admit `reqs`, then release one at a time (each finishing before the next):
    the order in which they went."""
    for r in reqs:
        co.add(r, r.arrival)
    order: list[str] = []
    now = at
    while len(order) < len(reqs):
        got = ids(co.due(now))
        assert got, "nothing released with an idle engine"
        for rid in got:
            co.started(rid, now)
            co.finished(rid, now, 4)
        order += got
        now += 0.01
    return order


def interleaved(n: int = 6) -> list[Request]:
    """System prompts 1 and 2 in turn, 10 ms apart: a1, b2, a3, b4, ..."""
    return [req(f"{'ab'[i % 2]}{i}", i * 0.01, pfx(1 + i % 2, i)) for i in range(n)]


# -- W3, W6: the pure parts -------------------------------------------------------


def test_choose_the_head_unless_a_candidate_is_min_gain_warmer() -> None:
    assert choose([0], 4) == 0
    assert choose([0, 3, 3], 4) == 0  # less than min_gain: the head
    assert choose([0, 3, 5, 5, 6], 4) == 4  # the warmest
    assert choose([0, 5, 4, 5], 4) == 1  # ties: key order
    assert choose([2, 5, 6], 4) == 2
    assert choose([9, 40, 12], 4) == 1


def test_the_record_is_the_kv_cache_in_blocks() -> None:
    assert capacity(64 * 1024, 16, 1) == 4096
    assert capacity(64 * 1024, 16, 2) == 8192  # per rank
    assert capacity(0, 16, 1) == 1 and capacity(1024, 0, 1) == 1  # unknown
    with pytest.raises(ValueError):
        WarmOrder(min_gain=0)


def test_warmth_is_the_longest_leading_run_on_any_rank() -> None:
    rec = PrefixMap(capacity=8, ttl=10.0)
    assert warmth(rec, (1, 2, 3), 2, 0.0) == 0
    rec.placed((1, 2), 1, 0.0)
    rec.placed((1,), 0, 0.0)
    assert warmth(rec, (1, 2, 3), 2, 1.0) == 2
    assert warmth(rec, (3, 2), 2, 1.0) == 0  # held, but not a leading run
    assert warmth(rec, (1, 2, 3), 2, 11.0) == 0  # aged out (TTL)
    rec.placed(tuple(range(100, 108)), 0, 2.0)  # 8 more: the least recent go first
    assert warmth(rec, (1, 2, 3), 2, 2.0) == 0


# -- W1-W5 on the coalescer ---------------------------------------------------------


def test_siblings_follow_while_their_prefix_is_warm() -> None:
    reqs = interleaved()
    assert run(co_(on=False), reqs) == ["a0", "b1", "a2", "b3", "a4", "b5"]
    co = co_()
    assert run(co, interleaved()) == ["a0", "a2", "a4", "b1", "b3", "b5"]
    w = co.warm_counters
    assert w.releases == 2  # a2 past b1, a4 past b3 (and b1, b3 then were the head)
    # b1 was first passed at the first backlog release (0.5) and went at 0.52.
    assert w.passed_max == pytest.approx(0.02)


def test_siblings_follow_within_one_round() -> None:
    """Several releases in one due(): each is recorded as it is picked, so the
    next pick of the round already finds its prefix warm."""
    co = co_(seqs=4)
    co.add(req("x", 0.0, pfx(9, 99)), 0.0)
    assert ids(co.due(0.0)) == ["x"]  # in flight: the rest waits in the backlog
    for r in interleaved():
        co.add(r, r.arrival)
    got = ids(co.due(0.1))
    assert len(got) >= 3, got
    assert got[:3] == ["a0", "a2", "a4"]


def test_never_past_order_rule_3s_bound() -> None:
    # a2 arrived more than max_delay (1 s) after b1: warm or not, it does not pass.
    reqs = [req("a0", 0.0, pfx(1, 0)), req("b1", 0.1, pfx(2, 1)), req("a2", 1.2, pfx(1, 2))]
    assert run(co_(), reqs, at=1.3) == ["a0", "b1", "a2"]
    # Within it, it does.
    reqs = [req("a0", 0.0, pfx(1, 0)), req("b1", 0.1, pfx(2, 1)), req("a2", 1.0, pfx(1, 2))]
    assert run(co_(), reqs, at=1.3) == ["a0", "a2", "b1"]


def test_never_past_a_more_urgent_request() -> None:
    co = co_()
    co.add(req("a0", 0.0, pfx(1, 0)), 0.0)
    assert ids(co.due(0.0)) == ["a0"]  # system prompt 1 is warm from here
    reqs = [
        req("c1", 0.1, pfx(3, 1)),
        req("b2", 0.2, pfx(2, 2), priority=-1),
        req("a3", 0.3, pfx(1, 3)),
        req("a4", 0.4, pfx(1, 4), priority=1),
    ]
    co.started("a0", 0.4)
    co.finished("a0", 0.4, 4)
    # b2 first (more urgent), then warm a3 past cold c1, and a4 (warm, but less
    # urgent) only after c1.
    assert run(co, reqs) == ["b2", "a3", "c1", "a4"]


def test_nothing_shared_or_nothing_hashed_is_todays_order() -> None:
    distinct = [req(f"r{i}", i * 0.01, pfx(i, i)) for i in range(8)]
    order = [r.id for r in distinct]
    co = co_()
    assert run(co, distinct) == order
    assert co.warm_counters == WarmCounters(predicted=0, cached=0)
    # One shared first block (a chat template's) is less than min_gain: no reorder.
    template = [req(f"r{i}", i * 0.01, (5, *pfx(10 + i, i))) for i in range(8)]
    assert run(co_(), template) == order
    # The engine's prefix cache off (no block size) or the order off: nothing to hash.
    assert co_(block=0).prefix_tokens == 0 and not co_(block=0).orders_prefix
    assert co_(on=False).prefix_tokens == 0
    assert co_().prefix_tokens == HASHED * BLOCK  # one engine: the leading blocks only
    assert co_(ranks=2).prefix_tokens is None  # placement hashes the whole prompt


def test_the_records_error_is_counted() -> None:
    co = co_()
    for r in interleaved(4):
        co.add(r, r.arrival)
    got = ids(co.due(0.5))
    assert got == ["a0"]
    co.started("a0", 0.5, cached=0)
    co.finished("a0", 0.5, 4)
    assert ids(co.due(0.6)) == ["a2"]
    # a2's ten shared blocks were believed cached; the engine says it had 96 tokens.
    co.started("a2", 0.6, cached=96)
    assert co.warm_counters == WarmCounters(
        releases=1, saved=96, passed_max=0.0, predicted=160, cached=96, overbelief=64
    )


# -- the bounds under hypothesis ---------------------------------------------------

SETTINGS = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _groups(caller: str, group: int, blocks: int) -> tuple[int, ...]:
    """Leading blocks of system prompt `group` of `caller` (own salt: own hashes)."""
    base = (ord(caller[0]) * 10 + group) * 1000
    return tuple(base + i for i in range(blocks))


class _Warm:
    """What each warm machine adds to its backlog machine: prompts under three
    system prompts per caller, a block per prompt token (up to 30, or 120,
    leading blocks, so that warmth differs by min_gain and more; the record holds
    the KV cache's tokens), and an event when a release went for warmth."""

    PREFIX_BLOCK = 1

    def prefix(self, caller: str, plen: int) -> tuple[int, ...]:
        return _groups(caller, plen % 3, plen)

    @invariant()
    def warm_releases_happen(self) -> None:
        if hasattr(self, "co") and self.co.warm_counters.releases:
            event("released for warmth")


class WarmBacklogMachine(_Warm, BacklogMachine):
    """Every backlog check, with prompts under three system prompts per caller."""


class WarmAgingMachine(_Warm, AgingMachine):
    """The aging machine (order.py rule 3's bound, one caller mostly, long heads
    waiting for room) with warm prefixes."""


class WarmFairnessMachine(_Warm, FairnessMachine):
    """Two equal-weight callers always backlogged, each with warm prefixes: the
    fair-share bound holds as it is (W4)."""

    PREFIX_BLOCK = 4

    def prefix(self, caller: str, n: int) -> tuple[int, ...]:
        # a's prompts under one warm system prompt, b's under three.
        return _groups(caller, 0 if caller == "a" else n % 3, 8)


TestWarmBacklogMachine = WarmBacklogMachine.TestCase
TestWarmBacklogMachine.settings = SETTINGS
TestWarmAgingMachine = WarmAgingMachine.TestCase
TestWarmAgingMachine.settings = SETTINGS
TestWarmFairnessMachine = WarmFairnessMachine.TestCase
TestWarmFairnessMachine.settings = SETTINGS
