"""The stored-response store: bounded by count and bytes, oldest dropped, owned."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from server.api.openai_responses.store import ResponseStore
from server.wire.request import Message

CONVO = (Message("user", "hi"), Message("assistant", "hello"))


def test_owner_only() -> None:
    store = ResponseStore()
    assert store.put("resp_1", "alice", b"{}", CONVO)
    assert store.get("resp_1", "alice") is not None
    assert store.get("resp_1", "bob") is None and store.get("resp_1", None) is None
    assert not store.delete("resp_1", "bob")
    assert store.delete("resp_1", "alice") and store.get("resp_1", "alice") is None
    assert len(store) == 0 and store.bytes == 0


def test_count_cap_drops_the_oldest() -> None:
    store = ResponseStore(max_count=2)
    for i in range(3):
        store.put(f"r{i}", None, b"{}", CONVO)
    assert store.get("r0", None) is None
    assert store.get("r1", None) is not None and store.get("r2", None) is not None


def test_byte_cap_and_an_oversized_response() -> None:
    store = ResponseStore(max_bytes=100)
    assert store.put("a", None, b"x" * 40, ())
    assert store.put("b", None, b"x" * 40, ())
    assert store.put("c", None, b"x" * 40, ())  # drops a
    assert store.get("a", None) is None and store.bytes == 80
    assert not store.put("huge", None, b"x" * 101, ())  # never kept, nothing dropped
    assert len(store) == 2


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 60)), max_size=40))
def test_caps_always_hold(puts: list[tuple[str, int]]) -> None:
    store = ResponseStore(max_count=3, max_bytes=100)
    for rid, size in puts:
        store.put(rid, None, b"x" * size, ())
        assert len(store) <= 3 and 0 <= store.bytes <= 100
        assert store.bytes == sum(store.get(r, None).size for r in "abcdef" if store.get(r, None))  # type: ignore[union-attr]
