"""Value types, keys and config of the policy core (batching/)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from batching import (
    Admitted,
    Batch,
    CoalescerConfig,
    Ended,
    Entry,
    GroupKey,
    Outcome,
    Released,
    ReleaseReason,
    Request,
    _fast,
    group_key,
)


def test_group_key_equality_hash_and_interning() -> None:
    a = group_key("m")
    assert a == GroupKey("m") == group_key("m", "")
    assert hash(a) == hash(GroupKey("m", None))
    assert a is group_key("m")  # interned: dict lookups are identity checks
    assert group_key("m", "lora") != a
    assert repr(a) == "GroupKey(model='m', adapter=None)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.model = "x"  # type: ignore[misc]


def test_group_key_pickles_without_its_cached_hash() -> None:
    a = group_key("m", "lora")
    b = pickle.loads(pickle.dumps(a))
    assert b == a and hash(b) == hash(a) and b.adapter == "lora"
    assert copy.copy(a) == a


def test_request_tokens_is_prompt_plus_max_new() -> None:
    r = Request("r", group_key("m"), (1, 2, 3), 10, 0.0)
    assert r.tokens == 13
    assert r.priority == 0 and r.deadline is None and r.fingerprint is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": -1.0},
        {"max_batch_seqs": 0},
        {"max_batch_tokens": 0},
        {"max_pending_requests": 0},
        {"max_pending_tokens": 0},
        {"retry_after_min": 5.0, "retry_after_max": 1.0},
        {"retry_after_default": -1.0},
    ],
)
def test_config_rejects_invalid_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CoalescerConfig(**kwargs)  # type: ignore[arg-type]


def test_fast_constructors_match_the_dataclasses() -> None:
    key = group_key("m")
    req = Request("r", key, (1,), 1, 0.0)
    e = _fast.entry(req, ("r",), (0, 0.0, 0))
    assert e == Entry(req, ("r",)) and type(e) is Entry
    assert _fast.ended("r", Outcome.EXPIRED, 0.5, 1.0, "c") == Ended(
        "r", Outcome.EXPIRED, 0.5, 1.0, "c"
    )
    assert _fast.admitted("r", "j") == Admitted("r", "j")
    assert hash(_fast.admitted("r", None)) == hash(Admitted("r"))
    b = _fast.batch(1, key, (e,), ReleaseReason.DEADLINE, 2.0, 2)
    assert b == Batch(1, key, (e,), ReleaseReason.DEADLINE, 2.0, 2)
    assert repr(b) == repr(Batch(1, key, (e,), ReleaseReason.DEADLINE, 2.0, 2))
    rel = _fast.released(1, key, ReleaseReason.EARLY, 1, 2, 3.0)
    assert rel == Released(1, key, ReleaseReason.EARLY, 1, 2, 3.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.tokens = 3  # type: ignore[misc]


def test_fast_constructors_refuse_a_changed_type() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Changed:
        a: int
        b: int = 0

    with pytest.raises(TypeError):
        _fast._setters(Changed, ("a",))
