"""The registry's room rule (server/engines/registry.py rule 6) as a property:
whatever the models' states, footprints and ages, `plan_room` unloads only idle
on-demand models that are loaded, least recently used first and as few as
needed, and what it leaves fits; None only when even every such model would
not make room."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from server.engines.lora import AdapterRegistry
from server.engines.registry import (
    OCCUPYING,
    Load,
    ModelEntry,
    ModelSpec,
    State,
    idle_deadline,
    plan_room,
)
from tests.fakes import FakeEngine

BUDGET = 1000


def _entry(i: int, load: Load, state: State, footprint: int, leases: int, used: float) -> Any:
    name = f"m{i}"
    e = ModelEntry(
        spec=ModelSpec(name=name, load=load, footprint=footprint, unload_after=10.0),
        engine=FakeEngine(),
        adapters=AdapterRegistry(name, ()),
    )
    e.state, e.leases, e.last_used = state, leases, used
    return e


# Weighted toward what makes the rule work: loaded, on-demand, idle models
# that fill the card (every state and kind still comes up).
models = st.lists(
    st.tuples(
        st.sampled_from([Load.ON_DEMAND, Load.ON_DEMAND, Load.START]),
        st.sampled_from([State.LOADED] * len(State) + list(State)),
        st.integers(0, 600),
        st.sampled_from([0, 0, 1]),
        st.floats(0, 100),
    ),
    min_size=1,
    max_size=6,
)


def _evictable(e: ModelEntry) -> bool:
    return e.spec.load is Load.ON_DEMAND and e.state is State.LOADED and e.leases == 0


@given(models, st.integers(0, 600))
def test_plan_room_unloads_the_fewest_idle_least_recently_used(
    specs: list[tuple[Load, State, int, int, float]], want_size: int
) -> None:
    entries = [_entry(i, *s) for i, s in enumerate(specs)]
    want = _entry(99, Load.ON_DEMAND, State.WAITING, want_size, 1, 100.0)
    plan = plan_room([*entries, want], want, BUDGET)
    used = sum(e.spec.footprint for e in entries if e.state in OCCUPYING)
    candidates = sorted((e for e in entries if _evictable(e)), key=lambda e: e.last_used)
    if plan is None:
        freed = sum(e.spec.footprint for e in candidates)
        assert used - freed + want_size > BUDGET
        return
    assert all(_evictable(e) for e in plan)  # never a start model, a busy one, one not loaded
    assert plan == candidates[: len(plan)]  # least recently used first
    left = used - sum(e.spec.footprint for e in plan)
    assert left + want_size <= BUDGET  # it fits
    if plan:  # and one fewer would not have
        assert left + plan[-1].spec.footprint + want_size > BUDGET


@given(models)
def test_only_idle_loaded_on_demand_models_have_an_idle_deadline(
    specs: list[tuple[Load, State, int, int, float]],
) -> None:
    for e in (_entry(i, *s) for i, s in enumerate(specs)):
        deadline = idle_deadline(e)
        assert (deadline is not None) == _evictable(e)
        if deadline is not None:
            assert deadline == e.last_used + 10.0
