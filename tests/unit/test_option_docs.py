"""docs/serving.md's flag table and server/options.py's option table agree.

The README sends a reader to that table for every flag, and the option table
is what `sluice serve` takes, so each is checked against the other, both ways:

1. every row of the option table has its flag in the flag column of a docs
   row (a pattern such as `--gpu-*-free-mib` covers the flags it matches);
2. every flag the docs table names exists: in its flag column, one of
   Sluice's options (or, in a row that says "vLLM's", one of vLLM's flags),
   a `--no-X` only for a switch, a pattern only where it matches an option;
   in its other columns, any flag `sluice serve` takes;
3. the documented default is the option's (`on`/`off` for a switch, the
   number, `4 MiB`, the name), where a row names one default per flag or one
   for all; a flag whose default is "not given" (None) may be described in
   words, never as a number.

tests/unit/test_readme_flags.py checks the older, looser half of 1 (a flag
written anywhere in the section); this one reads the table's columns.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from typing import Any

import pytest

from server.options import OPTIONS, SWITCH, add_options
from tests.docpages import page, section

PAGE, SECTION = "docs/serving.md", "Sluice's flags"
_FLAG = re.compile(r"`(--[a-z][a-z0-9*-]*)")
_CELL = re.compile(r"(?<!\\)\|")
_NUMBER = re.compile(r"(\d+(?:\.\d+)?)\s*(KiB|MiB|GiB)?(?![\w.])")
_UNITS = {None: 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


@dataclass(frozen=True, slots=True)
class Row:
    """One row of the docs table: the flags its flag column names, its default
    column, and every flag its other columns mention."""

    line: str
    flags: tuple[str, ...]
    default: str
    mentioned: tuple[str, ...]

    @property
    def vllms(self) -> bool:
        return "vLLM's" in self.line.split("|")[1]


def doc_rows(text: str) -> list[Row]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert lines[0].replace(" ", "") == "|flag|default|what|", lines[0]
    rows = []
    for line in lines[2:]:  # below the header and its |---| line
        flag, default, what = (c.strip() for c in _CELL.split(line)[1:-1])
        rows.append(Row(line, tuple(_FLAG.findall(flag)), default, tuple(_FLAG.findall(what))))
    return rows


def _matches(name: str, flag: str) -> bool:
    return re.fullmatch(re.escape(name).replace(r"\*", "[a-z0-9-]+"), flag) is not None


def option_defaults() -> dict[str, Any]:
    """Each option's flag and its default, as `sluice serve --help` shows it."""
    parser = argparse.ArgumentParser(add_help=False)
    add_options(parser, OPTIONS)
    return {
        a.option_strings[0]: a.default
        for a in parser._actions  # argparse's own list; there is no public one
        if a.option_strings and not a.option_strings[0].startswith("--no-")
    }


def agrees(value: Any, text: str) -> bool:
    """Whether a default column's text states `value`."""
    words = text.replace("`", "").strip()
    first = words.split()[0].rstrip(";,") if words else ""
    number = _NUMBER.match(words)
    if isinstance(value, bool):
        return first == ("on" if value else "off")
    if value is None:
        return number is None
    if isinstance(value, int | float):
        if number is None:
            return False
        return math.isclose(float(number.group(1)) * _UNITS[number.group(2)], value)
    return first == str(value)


def _defaults(row: Row, ours: list[str]) -> list[tuple[str, str]]:
    """(flag, its default's text): one text per flag, or one for all."""
    parts = [p.strip() for p in row.default.split(", ")]
    if len(ours) == 1:
        return [(ours[0], row.default)]
    if len(parts) == len(ours):
        return list(zip(ours, parts, strict=True))
    assert len(parts) == 1, f"{row.line}: {len(ours)} flags, {len(parts)} defaults: whose is whose?"
    return [(flag, parts[0]) for flag in ours]


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    return doc_rows(section(page(PAGE), SECTION))


@pytest.fixture(scope="module")
def serve_flags() -> set[str]:
    """Every --flag `sluice serve` takes, vLLM's included."""
    from server.cli import build_serve_parser

    return {o for a in build_serve_parser()._actions for o in a.option_strings}


def test_the_tables_are_read(rows: list[Row]) -> None:
    # An empty table, or one the reader misses, would pass every test below.
    assert len(rows) >= 30 and len(OPTIONS) >= 50
    assert any("--window-ms" in r.flags for r in rows)


def test_every_option_has_its_row(rows: list[Row]) -> None:
    names = [name for r in rows if not r.vllms for name in r.flags]
    missing = [o.flag for o in OPTIONS if not any(_matches(n, o.flag) for n in names)]
    assert not missing, f'options with no row in {PAGE}, "{SECTION}": {missing}'


def test_every_documented_flag_exists(rows: list[Row], serve_flags: set[str]) -> None:
    ours = {o.flag for o in OPTIONS}
    switches = {o.flag for o in OPTIONS if o.action is SWITCH}
    wrong = []
    for r in rows:
        for name in r.flags:
            if "*" in name:
                ok = any(_matches(name, flag) for flag in ours)
            elif r.vllms:
                ok = name in serve_flags
            elif name.startswith("--no-"):
                ok = "--" + name[len("--no-") :] in switches
            else:
                ok = name in ours
            if not ok:
                wrong.append(name)
        wrong += [n for n in r.mentioned if not any(_matches(n, f) for f in serve_flags)]
    assert not wrong, f'flags in {PAGE}, "{SECTION}" that `sluice serve` does not take: {wrong}'


def test_every_documented_default_is_the_options(rows: list[Row]) -> None:
    defaults = option_defaults()
    wrong = []
    for r in rows:
        ours = [n for n in r.flags if n in defaults]
        for flag, text in _defaults(r, ours) if ours else ():
            if not agrees(defaults[flag], text):
                wrong.append(f"{flag}: documented {text!r}, is {defaults[flag]!r}")
    assert not wrong, f'defaults in {PAGE}, "{SECTION}" that are not the options\': {wrong}'


@pytest.mark.parametrize(
    ("value", "text", "expected"),
    [
        (True, "on", True),
        (False, "off (`/metrics` open)", True),
        (True, "off", False),
        (10.0, "`10`", True),
        (4 * 1024 * 1024, "4 MiB", True),
        (0.0, "`0` (off)", True),
        (8, "9", False),
        (8, "none", False),
        (None, "engine's `max_num_seqs`", True),
        (None, "`120`", False),
        ("json", "json", True),
        ("hermes", "`qwen3`", False),
    ],
)
def test_a_default_column_is_read_as_a_reader_reads_it(
    value: Any, text: str, expected: bool
) -> None:
    assert agrees(value, text) is expected
