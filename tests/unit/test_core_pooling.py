"""Pooling requests in the core (types.py, issue 30): an embedding or a rerank pair
is a Request with max_new_tokens 0, and `most_at_once` bounds what one multi-input
request may ask for at all."""

from __future__ import annotations

from batching import (
    Admitted,
    Batch,
    CallerPolicy,
    Callers,
    Coalescer,
    CoalescerConfig,
    EngineCapacity,
    EngineLoad,
    Request,
    group_key,
)

M = group_key("embedder")


def pooled(rid: str, caller: str, prompt: int, now: float = 0.0) -> Request:
    return Request(rid, M, tuple(range(1, prompt + 1)), 0, now, caller=caller)


def test_a_pooling_request_costs_its_prompt_and_ends_at_its_first_output() -> None:
    co = Coalescer(CoalescerConfig(window=0.01, release_lone=False))
    for i in range(3):
        assert isinstance(co.add(pooled(f"e{i}", "indexer", 7), 0.0), Admitted)
    assert (co.pending_requests, co.pending_tokens) == (3, 21)
    # The window holds them, then they go as one batch, in one engine submission.
    assert co.due(0.005) == []
    batches: list[Batch] = co.due(0.011)
    assert [len(b.entries) for b in batches] == [3] and batches[0].tokens == 21
    for e in batches[0].entries:
        co.started(e.request.id, 0.02)
        assert co.finished(e.request.id, 0.02, 0)
    assert (co.pending_requests, co.pending_tokens, co.in_flight) == (0, 0, 0)
    st = co.caller("indexer")
    # Fair share counts the input tokens as the whole service.
    assert st is not None and (st.prompt_tokens, st.generated_tokens, st.service) == (21, 0, 21)
    assert st.counter == 21


def test_fair_share_interleaves_an_indexing_flood_with_a_lone_caller() -> None:
    # The engine has room for one at a time: the backlog decides who goes next.
    co = Coalescer(
        CoalescerConfig(window=0.0, release_lone=False, engine=EngineCapacity(max_seqs=1))
    )
    for i in range(20):
        assert isinstance(co.add(pooled(f"flood{i}", "indexer", 8), 0.0), Admitted)
    order: list[str] = []
    now = 0.0
    added_search = False
    while co.pending_requests:
        now += 0.01
        for b in co.due(now, EngineLoad(running=0, waiting=0)):
            for e in b.entries:
                order.append(e.request.id)
                co.started(e.request.id, now)
                co.finished(e.request.id, now, 0)
        if len(order) == 2 and not added_search:
            added_search = True
            assert isinstance(co.add(pooled("search", "search", 8, now), now), Admitted)
    # The search caller's one request goes after one more of the flood, not behind
    # the other 17: a new caller starts level with the least-served waiting one
    # (backlog.py), and the tie goes to the earlier arrival.
    assert order.index("search") == 3


def test_most_at_once_is_the_tightest_of_the_global_and_the_callers_bounds() -> None:
    co = Coalescer(
        CoalescerConfig(
            max_pending_requests=1024,
            max_pending_tokens=50_000,
            callers=Callers(
                (
                    CallerPolicy("small", max_queued=100, max_concurrency=4),
                    CallerPolicy("metered", tokens_per_minute=6000),
                    CallerPolicy("queued_only", max_queued=10),
                )
            ),
        )
    )
    assert co.most_at_once("anyone") == (1024, 50_000)
    assert co.most_at_once("small") == (104, 50_000)
    assert co.most_at_once("metered") == (1024, 6000)
    assert co.most_at_once("queued_only") == (10, 50_000)


def test_most_at_once_matches_what_admission_takes() -> None:
    # The bound is exact: that many go in at once, one more is refused.
    co = Coalescer(
        CoalescerConfig(
            window=1.0,
            callers=Callers((CallerPolicy("small", max_queued=3, max_concurrency=2),)),
        )
    )
    n, _ = co.most_at_once("small")
    results = [co.add(pooled(f"s{i}", "small", 2), 0.0) for i in range(n + 1)]
    assert all(isinstance(r, Admitted) for r in results[:n])
    assert not isinstance(results[n], Admitted)
