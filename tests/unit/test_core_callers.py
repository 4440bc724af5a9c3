"""Callers' own limits (callers.py, coalescer rule 2): 429-class refusals that touch
only the caller over its limit, priced from that caller's own drain."""

from __future__ import annotations

import pytest

from batching import (
    DEFAULT_CALLER,
    Admitted,
    CallerPolicy,
    Callers,
    Coalescer,
    CoalescerConfig,
    EngineCapacity,
    Refusal,
    RefusalReason,
    Refused,
    Request,
    group_key,
)

M = group_key("m")


def req(rid: str, caller: str = "a", prompt: int = 4, new: int = 4, now: float = 0.0) -> Request:
    return Request(rid, M, tuple(range(prompt)), new, now, caller=caller)


def co_(*policies: CallerPolicy, default: CallerPolicy | None = None, **kw: object) -> Coalescer:
    kw.setdefault("window", 0.0)
    kw.setdefault("release_lone", False)
    kw.setdefault("retry_after_min", 0.0)
    callers = Callers(policies, default) if default else Callers(policies)
    return Coalescer(CoalescerConfig(callers=callers, **kw))  # type: ignore[arg-type]


def refused(r: Admitted | Refused, reason: RefusalReason = RefusalReason.CALLER_LIMIT) -> Refused:
    assert isinstance(r, Refused) and r.reason is reason, r
    return r


def test_policy_validation_and_lookup() -> None:
    with pytest.raises(ValueError):
        CallerPolicy("x", weight=0)
    with pytest.raises(ValueError):
        CallerPolicy("x", max_concurrency=0)
    with pytest.raises(ValueError):
        CallerPolicy("x", max_queued=-1)
    with pytest.raises(ValueError):
        CallerPolicy("x", tokens_per_minute=0)
    with pytest.raises(ValueError):
        Callers((CallerPolicy("x"), CallerPolicy("x", weight=2)))
    chat = CallerPolicy("chat", weight=4)
    table = Callers((chat,), CallerPolicy("rest", max_queued=3))
    assert table.get("chat") is chat
    assert table.get("someone").max_queued == 3  # every other name: the default
    assert Request("r", M, (), 1, 0.0).caller == DEFAULT_CALLER


def test_max_queued_refuses_only_that_caller() -> None:
    co = co_(CallerPolicy("a", max_queued=2), window=1.0, retry_after_default=7.0)
    assert isinstance(co.add(req("a1"), 0.0), Admitted)
    assert isinstance(co.add(req("a2"), 0.0), Admitted)
    r = refused(co.add(req("a3"), 0.0))
    assert r.retry_after == 7.0  # no drain measured for a yet
    assert "max_queued 2" in r.message
    assert isinstance(co.add(req("b1", caller="b"), 0.0), Admitted)
    assert Refusal("a3", RefusalReason.CALLER_LIMIT, 7.0, 0.0, "a") in co.pop_events()
    st = co.caller("a")
    assert st is not None and (st.queued, st.refused, st.admitted) == (2, 1, 2)
    assert co.cancel("a1", 0.1)
    assert isinstance(co.add(req("a3", now=0.1), 0.1), Admitted)


def test_caller_retry_after_follows_its_own_drain() -> None:
    co = co_(CallerPolicy("a", max_queued=1, max_concurrency=1))
    # a finishes one request per 0.5 s: 2 requests/s of its own.
    for i in range(4):
        assert isinstance(co.add(req(f"a{i}", now=0.5 * i), 0.5 * i), Admitted)
        co.due(0.5 * i)
        co.finished(f"a{i}", 0.5 * (i + 1))
    co.add(req("x"), 2.0)
    co.due(2.0)  # in flight: one slot used
    co.add(req("y"), 2.0)  # waiting: max_queued used
    r = refused(co.add(req("z"), 2.0))
    assert r.retry_after == pytest.approx(0.5)  # one request over, at 2 per second


def test_max_concurrency_holds_the_rest_and_refuses_past_its_sum_with_max_queued() -> None:
    co = co_(CallerPolicy("a", max_concurrency=2, max_queued=1))
    for r in ("a1", "a2", "a3"):
        assert isinstance(co.add(req(r), 0.0), Admitted)
    refused(co.add(req("a4"), 0.0))  # 3 pending = 2 + 1
    assert [e.request.id for b in co.due(0.0) for e in b.entries] == ["a1", "a2"]
    refused(co.add(req("a4"), 0.0))  # still 2 in flight and 1 waiting
    co.finished("a1", 1.0)
    assert isinstance(co.add(req("a4", now=1.0), 1.0), Admitted)


def test_tokens_per_minute_bucket_with_refunds() -> None:
    co = co_(CallerPolicy("a", tokens_per_minute=600))  # 10 tokens per second
    assert isinstance(co.add(req("a1", prompt=100, new=400), 0.0), Admitted)  # 500 of 600
    r = refused(co.add(req("a2", prompt=100, new=100), 0.0))  # needs 200, has 100
    assert r.retry_after == pytest.approx(10.0)  # 100 missing at 10/s
    assert isinstance(co.add(req("b", prompt=100, new=400, caller="b"), 0.0), Admitted)
    co.due(0.0)
    co.finished("a1", 1.0, tokens=50)  # 350 unused come back; 10 refilled
    assert isinstance(co.add(req("a2", prompt=100, new=100, now=1.0), 1.0), Admitted)
    # A request that leaves before release gives all of its tokens back.
    co2 = co_(CallerPolicy("a", tokens_per_minute=600), window=1.0)
    co2.add(req("q", prompt=300, new=300), 0.0)
    refused(co2.add(req("q2", prompt=1, new=1), 0.0))
    co2.cancel("q", 0.0)
    assert isinstance(co2.add(req("q2", prompt=300, new=300), 0.0), Admitted)


def test_tokens_per_minute_too_large_is_not_a_retry() -> None:
    co = co_(CallerPolicy("a", tokens_per_minute=100))
    r = refused(co.add(req("a", prompt=60, new=60), 0.0), RefusalReason.TOO_LARGE)
    assert r.retry_after == 0.0 and "100 per minute" in r.message


def test_caller_limit_comes_before_the_global_queue() -> None:
    co = co_(CallerPolicy("a", max_queued=0), max_pending_requests=1, window=1.0)
    co.add(req("b1", caller="b"), 0.0)
    refused(co.add(req("a1"), 0.0))  # its own limit: 429, not the global 503
    refused(co.add(req("b2", caller="b"), 0.0), RefusalReason.QUEUE_FULL_REQUESTS)


def test_unknown_names_get_the_default_policy_each_on_its_own() -> None:
    co = co_(default=CallerPolicy("default", max_queued=1), window=1.0)
    assert isinstance(co.add(req("u1", caller="alice"), 0.0), Admitted)
    assert isinstance(co.add(req("u2", caller="bob"), 0.0), Admitted)
    refused(co.add(req("u3", caller="alice"), 0.0))
    assert sorted(s.name for s in co.callers()) == ["alice", "bob"]


def test_set_callers_applies_new_limits_and_keeps_queued_work() -> None:
    co = co_(window=1.0, engine=EngineCapacity(max_seqs=100))
    for i in range(3):
        co.add(req(f"a{i}"), 0.0)
    co.set_callers(Callers((CallerPolicy("a", max_queued=2, max_concurrency=1, weight=2),)))
    refused(co.add(req("a9"), 0.1))
    st = co.caller("a")
    assert st is not None and (st.queued, st.weight) == (3, 2.0)
    assert [e.request.id for b in co.due(1.0) for e in b.entries] == ["a0"]  # capped at 1
    co.set_callers(Callers())  # back to no limits
    assert [e.request.id for b in co.due(1.1) for e in b.entries] == ["a1", "a2"]
    co.set_callers(Callers((CallerPolicy("a", tokens_per_minute=60),)))
    refused(co.add(req("big", prompt=50, new=20), 1.2), RefusalReason.TOO_LARGE)


def open_ended(rid: str, caller: str = "a", prompt: int = 100, now: float = 0.0) -> Request:
    """A request without max_tokens: it may run to the end of a 40k context."""
    return Request(
        rid, M, tuple(range(prompt)), 40_000 - prompt, now, caller=caller, open_ended=True
    )


def test_a_request_without_max_tokens_is_charged_its_callers_estimate() -> None:
    # Below the context length: charged prompt + max_new it would be TOO_LARGE.
    co = co_(CallerPolicy("a", tokens_per_minute=6000), max_pending_tokens=1000)
    assert isinstance(co.add(open_ended("a1"), 0.0), Admitted)
    assert co.pending_tokens == 100 + 256  # no finish yet: the default estimate
    co.due(0.0)
    co.finished("a1", 1.0, tokens=16)  # the mean moves 1/16 of the way to 16
    assert isinstance(co.add(open_ended("a2", now=1.0), 1.0), Admitted)
    assert co.pending_tokens == 100 + 241  # 256 + (16 - 256) / 16 = 241
    # Requests with max_tokens are charged it, and do not move the estimate.
    assert isinstance(co.add(req("a3", prompt=10, new=5, now=1.0), 1.0), Admitted)
    co.due(1.0)
    co.finished("a3", 2.0, tokens=5)
    assert co.pending_tokens == 100 + 241


def test_the_estimate_is_settled_at_finish_both_ways() -> None:
    co = co_(CallerPolicy("a", tokens_per_minute=600))  # 10 tokens per second
    assert isinstance(co.add(open_ended("a1"), 0.0), Admitted)  # takes 356 of 600
    co.due(0.0)
    co.finished("a1", 0.0, tokens=500)  # 244 more than charged: the bucket pays them
    # 600 - 356 - 244 = 0 left: even a 1-token request waits for the refill.
    r = refused(co.add(req("b", prompt=1, new=0), 0.0))
    assert r.retry_after == pytest.approx(0.1)
    co2 = co_(CallerPolicy("a", tokens_per_minute=600))
    co2.add(open_ended("c1"), 0.0)
    co2.due(0.0)
    co2.finished("c1", 0.0, tokens=6)  # 250 unused come back: 600 - 106 = 494 left
    assert isinstance(co2.add(req("c2", prompt=400, new=94), 0.0), Admitted)
    refused(co2.add(req("c3", prompt=1, new=0), 0.0))


def test_the_estimate_is_bounded_by_what_the_request_may_generate() -> None:
    co = co_()
    r = Request("short", M, (1, 2, 3), 5, 0.0, open_ended=True)  # 5 tokens of context left
    assert isinstance(co.add(r, 0.0), Admitted)
    assert co.pending_tokens == 3 + 5
