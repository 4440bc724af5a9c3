"""The callers file and the ways a request gets its caller name (server/callers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from batching import DEFAULT_CALLER, Budget, CallerPolicy
from server.callers import (
    MAX_USER_NAMES,
    OTHER_CALLER,
    CallerDirectory,
    CallersError,
    load_callers,
    parse_callers,
    world_readable,
)

GOOD = """
[callers.chat]
key = "sk-chat"
weight = 4
max_concurrency = 16

[callers.batch]
key = "sk-batch"
max_queued = 200
tokens_per_minute = 2000000
background = true
tokens_per_day = 50000
engine_seconds_per_month = 36
"""


def test_a_good_file() -> None:
    table = parse_callers(GOOD)
    assert table.names == ("chat", "batch")
    assert table.policies.get("chat") == CallerPolicy("chat", 4.0, max_concurrency=16)
    assert table.policies.get("batch") == CallerPolicy(
        "batch", 1.0, max_queued=200, tokens_per_minute=2_000_000, background=True
    )
    assert table.identify("sk-chat") == "chat" and table.identify("sk-batch") == "batch"
    assert table.identify("sk-cha") is None and table.identify("") is None
    assert "sk-" not in repr(table)  # keys never printed
    assert table.budget_table() == {
        "batch": Budget(tokens_per_day=50_000, engine_seconds_per_month=36.0)
    }


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[callers.chat\nkey = 1", "not valid TOML"),
        ("", "no callers"),
        ("[other]\nx = 1\n[callers.a]\nkey = 'k'", "unknown top-level key(s) other"),
        ("[callers.a]\nweight = 2", "callers.a.key must be a non-empty string"),
        ("[callers.a]\nkey = '  '", "callers.a.key must be a non-empty string"),
        ("[callers.a]\nkey = 'k'\nweight = 0", "callers.a.weight must be a number > 0"),
        ("[callers.a]\nkey = 'k'\nweight = true", "callers.a.weight must be a number > 0"),
        ("[callers.a]\nkey = 'k'\nmax_concurrency = 0", "callers.a.max_concurrency must be"),
        ("[callers.a]\nkey = 'k'\nmax_queued = 1.5", "callers.a.max_queued must be an integer"),
        ("[callers.a]\nkey = 'k'\ntokens_per_minute = -1", "tokens_per_minute must be"),
        ("[callers.a]\nkey = 'k'\nbackground = 1", "callers.a.background must be true or false"),
        ("[callers.a]\nkey = 'k'\nmax_conc = 2", "unknown field(s) max_conc"),
        ("[callers.a]\nkey = 'k'\ntokens_per_day = 0", "callers.a.tokens_per_day must be"),
        ("[callers.a]\nkey = 'k'\ntokens_per_month = 1.5", "tokens_per_month must be an int"),
        (
            "[callers.a]\nkey = 'k'\nengine_seconds_per_day = 0",
            "callers.a.engine_seconds_per_day must be a number > 0",
        ),
        (
            "[callers.a]\nkey = 'k'\nengine_seconds_per_month = '1'",
            "callers.a.engine_seconds_per_month must be a number > 0",
        ),
        ("[callers.'a b']\nkey = 'k'", "a name is 1-64 letters"),
        ("[callers]\na = 'k'", "callers.a must be a table"),
        ("[callers.a]\nkey = 'k'\n[callers.b]\nkey = 'k'", "is also the key of callers.a"),
    ],
)
def test_bad_files_say_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(CallersError, match=None) as err:
        parse_callers(text)
    assert why in str(err.value)


def test_load_names_the_file_and_checks_permissions(tmp_path: Path) -> None:
    path = tmp_path / "callers.toml"
    with pytest.raises(CallersError, match="cannot read it"):
        load_callers(path)
    path.write_text(GOOD)
    path.chmod(0o640)
    assert load_callers(path).names == ("chat", "batch") and not world_readable(path)
    path.chmod(0o644)
    assert world_readable(path)
    path.write_text("[callers.a]\nkey = 1\n")
    with pytest.raises(CallersError, match=f"callers file {path}: callers.a.key"):
        load_callers(path)


def test_directory_modes() -> None:
    table = parse_callers(GOOD)
    by_file = CallerDirectory(table, None)
    assert not by_file.open
    assert by_file.authenticate("Bearer sk-chat") == "chat"
    assert by_file.authenticate("bearer  sk-batch ") == "batch"
    assert by_file.authenticate("Basic sk-chat") is None
    assert by_file.authenticate("") is None
    one_key = CallerDirectory(None, "secret")
    assert one_key.authenticate("Bearer secret") == DEFAULT_CALLER
    assert one_key.authenticate("Bearer nope") is None
    assert CallerDirectory(None, None).open


def test_user_names_are_bounded() -> None:
    d = CallerDirectory(None, None)
    assert d.from_user(None) == DEFAULT_CALLER and d.from_user("") == DEFAULT_CALLER
    assert d.from_user("alice") == "alice"
    assert d.from_user("bad name!") == OTHER_CALLER  # not fit for a metric label
    assert d.from_user("x" * 65) == OTHER_CALLER
    for i in range(MAX_USER_NAMES - 1):
        assert d.from_user(f"u{i}") == f"u{i}"
    assert d.from_user("late") == OTHER_CALLER  # past the bound: counted as one
    assert d.from_user("alice") == "alice"  # names already seen stay themselves
