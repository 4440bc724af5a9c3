"""batching/prefix.py: placement by prefix, bounded by load (rules P1-P4)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batching import Coalescer, CoalescerConfig, EngineCapacity, Request, group_key
from batching.prefix import BOUND, Placed, PrefixMap, allowed, choose


def test_a_conversations_next_turn_follows_its_first_turns_rank() -> None:
    m = PrefixMap(capacity=1000, ttl=60.0)
    first = (1, 2, 3)
    m.placed(first, rank=1, now=0.0)
    second = (1, 2, 3, 4, 5)  # the same leading blocks, then the new turn's
    held = m.held(second, ranks=2, now=1.0)
    assert held == [0, 3]
    c = choose(held, room=[True, True], loads=[0, 1], fallback=0)
    assert (c.rank, c.placed, c.matched) == (1, Placed.PREFIX, 3)


def test_no_known_prefix_places_by_room() -> None:
    m = PrefixMap(capacity=10, ttl=60.0)
    c = choose(m.held((7, 8), 2, 0.0), room=[True, True], loads=[3, 0], fallback=1)
    assert (c.rank, c.placed) == (1, Placed.LOAD)


def test_only_a_leading_run_counts() -> None:
    """Block 2 without block 1 is a different prefix: vLLM chains each hash on its
    parent's, so the cache would not hit it."""
    m = PrefixMap(capacity=10, ttl=60.0)
    m.placed((2, 3), rank=0, now=0.0)
    assert m.held((1, 2, 3), 2, 0.0) == [0, 0]


def test_a_shared_prefix_on_both_ranks_counts_on_both() -> None:
    m = PrefixMap(capacity=100, ttl=60.0)
    m.placed((1, 2), rank=0, now=0.0)
    m.placed((1, 2, 3), rank=1, now=0.0)
    assert m.held((1, 2, 3, 4), 2, 0.0) == [2, 3]


def test_entries_age_out() -> None:
    m = PrefixMap(capacity=10, ttl=5.0)
    m.placed((1, 2), rank=0, now=0.0)
    assert m.held((1, 2), 2, 5.0) == [2, 0]
    assert m.held((1, 2), 2, 5.1) == [0, 0]


def test_an_overloaded_rank_is_overridden_by_the_bound() -> None:
    held = [0, 4]
    c = choose(held, room=[True, True], loads=[2, 10], fallback=0)
    assert (c.rank, c.placed) == (0, Placed.BOUND)
    assert not allowed([2, 10], 1)
    assert allowed([0, 1], 1)  # an idle pair still follows the cache


def test_a_rank_without_room_is_not_chosen_by_prefix() -> None:
    c = choose([5, 0], room=[False, True], loads=[0, 0], fallback=1)
    assert (c.rank, c.placed) == (1, Placed.LOAD)


RANKS = st.integers(min_value=1, max_value=4)


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[int], list[bool], list[int], int]:
    n = draw(RANKS)
    held = draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
    room = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    loads = draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
    # The fallback is room.py's choice: a rank with room when one has it.
    with_room = [r for r in range(n) if room[r]]
    fallback = draw(st.sampled_from(with_room or list(range(n))))
    return held, room, loads, fallback


@given(situations())
def test_never_a_rank_without_room_when_one_has_it(
    s: tuple[list[int], list[bool], list[int], int],
) -> None:
    held, room, loads, fallback = s
    c = choose(held, room, loads, fallback)
    if any(room):
        assert room[c.rank]
    if c.placed is Placed.PREFIX:
        assert allowed(loads, c.rank)
        assert c.matched == max(h for h, ok in zip(held, room, strict=True) if ok or not any(room))
    else:
        assert c.rank == fallback


@given(
    st.lists(st.integers(0, 2**63), min_size=1, max_size=6, unique=True),
    st.lists(st.tuples(st.integers(0, 1), st.integers(0, 30)), min_size=1, max_size=6),
)
def test_a_conversation_keeps_its_rank_while_the_bound_allows(
    first: list[int], turns: list[tuple[int, int]]
) -> None:
    """Each turn extends the last one's prompt; the other rank's load varies. While
    the first turn's rank is within the bound, every turn goes back to it."""
    m = PrefixMap(capacity=10_000, ttl=600.0)
    home = 0
    prompt = list(first)
    m.placed(prompt, home, 0.0)
    for i, (_, other_load) in enumerate(turns, start=1):
        prompt = [*prompt, 2**63 + i]
        loads = [other_load + 2, other_load]  # the home rank is a little busier
        fallback = 1  # load alone would move the conversation
        c = choose(m.held(prompt, 2, float(i)), [True, True], loads, fallback)
        if loads[home] <= BOUND * (min(loads) + 1):
            assert c.rank == home and c.placed is Placed.PREFIX
        else:
            assert c.placed is Placed.BOUND and c.rank == fallback
        m.placed(prompt, c.rank, float(i))
        if c.rank != home:
            break


@given(
    st.integers(1, 50),
    st.lists(
        st.tuples(st.lists(st.integers(0, 200), max_size=10), st.integers(0, 3)),
        max_size=40,
    ),
)
def test_the_map_stays_bounded(capacity: int, placements: list[tuple[list[int], int]]) -> None:
    m = PrefixMap(capacity=capacity, ttl=60.0)
    for t, (hashes, rank) in enumerate(placements):
        m.placed(hashes, rank, float(t))
        assert len(m) <= capacity


def test_the_coalescer_sends_a_conversations_next_turn_to_its_first_turns_rank() -> None:
    """Wired into rule 6's release: load alone would send B's second turn to rank 0
    (both idle, ties to the lower rank); its prefix is on rank 1."""
    co = Coalescer(
        CoalescerConfig(
            engine=EngineCapacity(max_seqs=4, step_tokens=1000, ranks=2),
            window=0.0,
            release_lone=False,
            kv_reserve_short=0.0,
        )
    )
    key = group_key("m")

    def turn(rid: str, blocks: tuple[int, ...], now: float) -> int:
        co.add(Request(rid, key, tuple(range(16 * len(blocks))), 4, now, prefix=blocks), now)
        (entry,) = [e for b in co.due(now) for e in b.entries]
        co.started(rid, now)
        co.finished(rid, now)
        assert entry.rank is not None
        return entry.rank

    assert turn("a1", (1, 2), 0.0) == 0
    co.add(Request("b1", key, tuple(range(32)), 4, 0.0, prefix=(7, 8)), 0.0)
    co.add(Request("a1x", key, tuple(range(8)), 4, 0.0), 0.0)  # a no-prefix neighbour
    placed = {e.request.id: e.rank for b in co.due(0.0) for e in b.entries}
    assert placed == {"a1x": 0, "b1": 1}
    for rid in placed:
        co.started(rid, 0.0)
        co.finished(rid, 0.0)
    assert turn("b2", (7, 8, 9), 1.0) == 1
    assert turn("a2", (1, 2, 3), 2.0) == 0
    assert [p for p in co.placements if p[0] == Placed.PREFIX.value] == [
        ("prefix", 0, 1),
        ("prefix", 1, 1),
    ]
