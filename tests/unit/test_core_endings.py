"""batching/endings.py: which running generations end within the feed's steps."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batching.endings import GRACE, Endings


def test_a_generation_counts_from_its_horizon_until_it_ends() -> None:
    e = Endings(ahead=1.0)
    e.start("a", 4)  # first output at step 0: ends by step 3
    e.start("one", 1)  # one token: done with its first output
    assert e.soon == 1
    e.advance(1.0)
    assert e.soon == 1  # "a" ends by 3, beyond step 1 + 1
    e.advance(1.0)
    assert e.soon == 2  # step 2: "a" ends by the step a release reaches
    e.end("a")
    e.end("a")  # twice, or for an unknown id: a no-op
    e.end("never")
    assert e.soon == 1


def test_one_still_running_past_its_end_stops_counting() -> None:
    """Preempted and recomputed, or heard of late: counting it until it ends would
    hold a place in the feed for as long as it runs."""
    e = Endings(ahead=1.0)
    e.start("a", 2)  # ends by step 1
    e.advance(1.0 + GRACE)
    assert e.soon == 1
    e.advance(1.0)
    assert e.soon == 0
    e.end("a")
    assert e.soon == 0


def test_a_new_look_ahead_applies_at_once() -> None:
    e = Endings(ahead=0.0)
    e.start("a", 3)  # ends by step 2
    assert e.soon == 0
    e.ahead = 2.0
    assert e.soon == 1


# One operation: start a generation of this many tokens, end the k-th started, or
# advance the clock.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(0, 12)),
        st.tuples(st.just("end"), st.integers(0, 40)),
        st.tuples(st.just("advance"), st.sampled_from([0.0, 0.5, 1.0, 3.0])),
    ),
    max_size=80,
)


@given(ahead=st.sampled_from([0.0, 1.0, 2.5]), ops=_ops)
def test_soon_is_the_live_generations_between_late_and_the_horizon(
    ahead: float, ops: list[tuple[str, float]]
) -> None:
    e = Endings(ahead)
    clock = 0.0
    live: dict[str, float] = {}  # id -> end step
    started: list[str] = []
    for op, arg in ops:
        if op == "start":
            gid = f"g{len(started)}"
            started.append(gid)
            live[gid] = clock + max(0, int(arg) - 1)
            e.start(gid, int(arg))
        elif op == "end":
            if started:
                gid = started[int(arg) % len(started)]
                live.pop(gid, None)
                e.end(gid)
        else:
            clock += arg
            e.advance(arg)
        assert e.soon == sum(1 for end in live.values() if clock - GRACE <= end <= clock + ahead)
