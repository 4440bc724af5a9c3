"""The stored-response policy: bounded by count and bytes, oldest dropped, owned, retained."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from server.api.openai_responses.store import (
    ResponseStore,
    decode_conversation,
    encode_conversation,
)
from server.wire.request import Message, ToolCall


def test_owner_only() -> None:
    store = ResponseStore()
    assert store.admit("resp_1", "alice", 10, 0.0) == ()
    assert store.visible("resp_1", "alice", 1.0)
    assert not store.visible("resp_1", "bob", 1.0) and not store.visible("resp_1", None, 1.0)
    store.forget(["resp_1"])
    assert not store.visible("resp_1", "alice", 1.0) and len(store) == 0 and store.bytes == 0


def test_count_cap_drops_the_oldest() -> None:
    store = ResponseStore(max_count=2)
    assert [store.admit(f"r{i}", None, 1, float(i)) for i in range(3)] == [(), (), ("r0",)]
    assert not store.visible("r0", None, 3.0) and store.visible("r2", None, 3.0)


def test_byte_cap_and_an_oversized_response() -> None:
    store = ResponseStore(max_bytes=100)
    store.admit("a", None, 40, 0.0)
    store.admit("b", None, 40, 0.0)
    assert store.admit("c", None, 40, 0.0) == ("a",) and store.bytes == 80
    assert store.admit("huge", None, 101, 0.0) is None  # never kept, nothing dropped
    assert len(store) == 2


def test_retention_hides_at_once_and_sweeps_the_oldest() -> None:
    store = ResponseStore(retention=100.0)
    store.admit("old", None, 1, 0.0)
    store.admit("new", None, 1, 50.0)
    assert store.visible("old", None, 99.9) and not store.visible("old", None, 100.0)
    assert store.expired(100.0) == ("old",) and store.expired(99.0) == ()
    assert store.visible("new", None, 100.0)


def test_load_applies_todays_caps_and_retention() -> None:
    store = ResponseStore(max_count=2, retention=100.0)
    rows = [("a", None, 0.0, 1), ("b", "x", 10.0, 1), ("c", None, 20.0, 1), ("d", None, 30.0, 1)]
    assert store.load(rows, now=105.0) == ["a", "b"]  # a expired, b past the count
    assert store.visible("c", None, 105.0) and store.visible("d", None, 105.0)


def test_a_conversation_round_trips() -> None:
    convo = (
        Message("system", "be brief", name="s"),
        Message("assistant", "", tool_calls=(ToolCall("c1", "f", '{"a": 1}'),), reasoning="hm"),
        Message("tool", "42", tool_call_id="c1"),
    )
    assert decode_conversation(encode_conversation(convo)) == convo


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 60)), max_size=40))
def test_caps_always_hold(puts: list[tuple[str, int]]) -> None:
    store = ResponseStore(max_count=3, max_bytes=100)
    sizes: dict[str, int] = {}
    for rid, size in puts:
        dropped = store.admit(rid, None, size, 0.0)
        if dropped is not None:
            sizes[rid] = size
            for d in dropped:
                sizes.pop(d)
        assert len(store) <= 3 and 0 <= store.bytes <= 100
        assert store.bytes == sum(sizes.values()) and len(store) == len(sizes)
