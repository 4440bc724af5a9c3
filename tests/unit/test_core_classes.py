"""The request class (batching/classes.py): one function decides interactive or background."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batching import (
    BACKGROUND_PRIORITY,
    CallerPolicy,
    ReleaseOrder,
    RequestClass,
    class_priority,
    request_class,
)

_TIERS = st.sampled_from([None, "auto", "default", "flex", "priority", "scale", "FLEX"])


@given(batch_line=st.booleans(), tier=_TIERS, background=st.booleans())
def test_background_is_a_batch_line_flex_or_a_background_caller(
    batch_line: bool, tier: str | None, background: bool
) -> None:
    """Rule 1: any of the three makes a request background; nothing else does."""
    cls = request_class(
        batch_line=batch_line, service_tier=tier, caller=CallerPolicy("c", background=background)
    )
    expected = batch_line or tier == "flex" or background
    assert cls is (RequestClass.BACKGROUND if expected else RequestClass.INTERACTIVE)
    assert cls.service_tier == ("flex" if expected else "default")


@given(
    mine=st.integers(-1000, 1000),
    other=st.integers(-1000, 1000),
    waited=st.floats(0, 3600),
    prompt=st.integers(1, 100_000),
)
def test_background_never_passes_interactive_of_its_caller(
    mine: int, other: int, waited: float, prompt: int
) -> None:
    """Rule 2: a background request's key orders after any interactive one's,
    however long it waited and whatever priority either body sent."""
    order = ReleaseOrder()
    bg = order.key(class_priority(mine, RequestClass.BACKGROUND), prompt, 0.0, 0)
    fg = order.key(class_priority(other, RequestClass.INTERACTIVE), 100_000, waited, 1)
    assert fg < bg
    assert class_priority(mine, RequestClass.BACKGROUND) == mine + BACKGROUND_PRIORITY
    assert class_priority(mine, RequestClass.INTERACTIVE) == mine
