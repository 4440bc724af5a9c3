"""Dedupe of identical deterministic requests (rule 6) and the TTL result cache."""

from __future__ import annotations

from collections.abc import Hashable

from batching import (
    Admitted,
    Coalescer,
    CoalescerConfig,
    DedupeHit,
    Ended,
    Outcome,
    RefusalReason,
    Refused,
    Request,
    ResultCache,
    group_key,
)

M = group_key("m")
PROMPT = (1, 2, 3, 4)
FP = ("greedy", 16)  # what the server would derive from the sampling params


def req(
    rid: str,
    now: float = 0.0,
    prompt: tuple[int, ...] = PROMPT,
    fp: Hashable | None = FP,
    deadline: float | None = None,
    model: str = "m",
) -> Request:
    return Request(rid, group_key(model), prompt, 16, now, deadline=deadline, fingerprint=fp)


def co_(**kw: object) -> Coalescer:
    kw.setdefault("release_lone", False)
    return Coalescer(CoalescerConfig(**kw))  # type: ignore[arg-type]


def test_identical_deterministic_request_joins_the_queued_generation() -> None:
    co = co_()
    assert co.add(req("a"), 0.0) == Admitted("a", None)
    assert co.add(req("b", 0.002), 0.002) == Admitted("b", "a")
    assert (co.queued_requests, co.queued_generations, co.queued_tokens) == (2, 1, 20)
    assert (co.pending_requests, co.pending_tokens) == (2, 20)  # one request, no tokens
    assert DedupeHit("b", "a") in co.pop_events()
    [b] = co.due(0.010)
    [entry] = b.entries
    assert entry.request.id == "a" and entry.subscribers == ("a", "b")
    evs = [e for e in co.pop_events() if isinstance(e, Ended)]
    assert [(e.request_id, e.outcome) for e in evs] == [
        ("a", Outcome.DISPATCHED),
        ("b", Outcome.DISPATCHED),
    ]
    assert co.counters.dedupe_hits == 1
    co.finished("a", 0.5)
    assert (co.pending_requests, co.pending_tokens) == (0, 0)


def test_no_dedupe_without_fingerprint_or_when_anything_differs_or_disabled() -> None:
    co = co_()
    co.add(req("a", fp=None), 0.0)
    assert co.add(req("b", fp=None), 0.0) == Admitted("b", None)
    co.add(req("c"), 0.0)
    assert co.add(req("d", fp=("seed", 7)), 0.0) == Admitted("d", None)
    assert co.add(req("e", prompt=(9, 9)), 0.0) == Admitted("e", None)
    assert co.add(req("f", model="other"), 0.0) == Admitted("f", None)
    assert co.add(req("g"), 0.0) == Admitted("g", "c")
    off = co_(dedupe=False)
    off.add(req("a"), 0.0)
    assert off.add(req("b"), 0.0) == Admitted("b", None)


def test_first_caller_cancels_and_the_generation_stays_for_the_others() -> None:
    co = co_()
    co.add(req("a"), 0.0)
    co.add(req("b"), 0.0)
    assert co.cancel("a", 0.001)
    assert (co.queued_requests, co.queued_tokens) == (1, 20)
    assert co.add(req("c"), 0.002) == Admitted("c", "a")  # still joinable, keyed by "a"
    [b] = co.due(0.010)
    [entry] = b.entries
    assert entry.request.id == "a" and entry.subscribers == ("b", "c")
    # The generation id "a" is in flight: a new "a" would collide with finished("a").
    r = co.add(req("a"), 0.02)
    assert isinstance(r, Refused) and r.reason is RefusalReason.DUPLICATE_ID


def test_generation_leaves_with_its_last_subscriber() -> None:
    co = co_()
    co.add(req("a"), 0.0)
    co.add(req("b"), 0.0)
    co.cancel("b", 0.001)
    co.cancel("a", 0.001)
    assert (co.queued_requests, co.queued_tokens, co.queued_generations) == (0, 0, 0)
    assert co.due(1.0) == []
    assert co.add(req("c"), 1.0) == Admitted("c", None)  # nothing left to join


def test_joiner_costs_one_request_against_the_limit() -> None:
    co = co_(max_pending_requests=2, max_pending_tokens=20)
    co.add(req("a"), 0.0)  # uses all 20 tokens
    assert co.add(req("b"), 0.0) == Admitted("b", "a")
    r = co.add(req("c"), 0.0)
    assert isinstance(r, Refused) and r.reason is RefusalReason.QUEUE_FULL_REQUESTS


def test_dispatched_generations_are_not_joined() -> None:
    co = co_(window=0.0)
    co.add(req("a"), 0.0)
    co.due(0.0)
    assert co.add(req("b"), 0.0) == Admitted("b", None)


def test_each_subscriber_keeps_its_own_deadline() -> None:
    co = co_(window=0.050)
    co.add(req("a", deadline=1.0), 0.0)
    co.add(req("b", deadline=0.010), 0.0)
    co.due(0.020)
    assert [(e.request_id, e.outcome) for e in co.pop_events() if isinstance(e, Ended)] == [
        ("b", Outcome.EXPIRED)
    ]
    [b] = co.due(0.050)
    assert b.entries[0].subscribers == ("a",)


# -- ResultCache -------------------------------------------------------------


def test_result_cache_is_off_by_default() -> None:
    cache: ResultCache[str] = ResultCache()
    assert not cache.enabled
    cache.put("k", "v", 0.0)
    assert cache.get("k", 0.0) is None and len(cache) == 0


def test_result_cache_ttl_and_size() -> None:
    cache: ResultCache[str] = ResultCache(ttl=1.0, max_entries=2)
    key = (M, PROMPT, FP)
    cache.put(key, "first", 0.0)
    assert cache.get(key, 0.5) == "first"
    assert cache.get(key, 1.0) is None  # expired at put + ttl
    cache.put("a", "A", 2.0)
    cache.put("b", "B", 2.1)
    cache.put("a", "A2", 2.2)  # re-put refreshes and moves to the back
    cache.put("c", "C", 2.3)  # over max_entries: "b", the oldest put, goes
    assert cache.get("b", 2.3) is None
    assert (cache.get("a", 2.3), cache.get("c", 2.3)) == ("A2", "C")
    assert (cache.hits, cache.misses) == (3, 2)
    cache.clear()
    assert len(cache) == 0
