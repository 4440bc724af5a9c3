"""Rule 2 of server/wire/ignored.py: accepted and ignored, logged once, counted.

The counter's `field` label holds only names the code lists (or `other`),
each (api, field) is logged once, a client inventing names cannot grow the
log set without bound, and the docs list, per API, every name the code does
(docs/apis.md, "What the APIs accept"; Ollama's in docs/ollama.md, the
pooling APIs' in docs/pooling.md).
"""

from __future__ import annotations

import logging
import re

import pytest
from prometheus_client import CollectorRegistry, Counter

from server.operations import ignored_log as ignored_fields
from server.operations.ignored_log import IgnoredFields
from server.wire.ignored import KNOWN, OTHER, Ignored, Notes
from tests.docpages import page, section

PAGE, SECTION = "docs/apis.md", "What the APIs accept"
# An API whose list is on its own page: the page and its section.
OWN_PAGE = {
    "ollama": ("docs/ollama.md", "What is accepted and ignored"),
    "embeddings": ("docs/pooling.md", "Fields"),
    "rerank": ("docs/pooling.md", "Fields"),
}


def recorder() -> tuple[IgnoredFields, Counter]:
    counter = Counter("t_ignored", "t", ["api", "field"], registry=CollectorRegistry())
    return IgnoredFields(counter), counter


def count(counter: Counter, api: str, field: str) -> float:
    return float(counter.labels(api, field)._value.get())


def test_unknown_names_count_as_other_and_nulls_as_absent() -> None:
    notes = Notes("chat")
    notes.extra_keys({"model": "m", "store": True, "x_new": 1, "gone": None}, {"model"})
    assert notes.done() == (Ignored("store", "store"), Ignored(OTHER, "x_new"))


def test_each_field_is_logged_once_and_counted_every_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec, counter = recorder()
    items = (Ignored("store", "store"), Ignored(OTHER, "x_new"))
    with caplog.at_level(logging.INFO, logger="sluice.ignored"):
        for _ in range(3):
            rec.record("chat", items)
        rec.record("completions", items[:1])
    logged = [(r.fields["api"], r.fields["field"]) for r in caplog.records]  # type: ignore[attr-defined]
    assert logged == [("chat", "store"), ("chat", "x_new"), ("completions", "store")]
    assert count(counter, "chat", "store") == 3 and count(counter, "chat", OTHER) == 3
    assert count(counter, "completions", "store") == 1


def test_a_client_inventing_names_does_not_grow_what_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ignored_fields, "_LOGGED_MAX", 4)
    rec, counter = recorder()
    with caplog.at_level(logging.INFO, logger="sluice.ignored"):
        for i in range(10):
            rec.record("chat", (Ignored(OTHER, f"f{i}"),))
    assert len(caplog.records) == 4
    assert count(counter, "chat", OTHER) == 10


def _documented_lists() -> dict[str, set[str]]:
    """Per API, the names in backticks of the docs' "accepts and ignores" list."""
    out: dict[str, set[str]] = {}
    for api in KNOWN:
        where, heading = OWN_PAGE.get(api, (PAGE, SECTION))
        text = section(page(where), heading)
        m = re.search(
            rf"^\* \*\*{api}\*\* accepts and ignores: (.*?)(?=^\* |\Z)", text, re.M | re.S
        )
        assert m, f'{where}, "{heading}", has no list for {api}'
        out[api] = set(re.findall(r"`([^`]+)`", m.group(1)))
    return out


def test_the_docs_list_what_each_api_accepts_and_ignores() -> None:
    listed = _documented_lists()
    for api, fields in KNOWN.items():
        assert set(fields) - listed[api] == set(), api
