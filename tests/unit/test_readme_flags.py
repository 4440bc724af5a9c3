"""docs/serving.md's flag table names every flag Sluice adds to `sluice serve`.

The flags come from the parser itself (server/cli.py, without vLLM's engine
flags), so a new flag without a line in the table fails here; a flag written
only on its topic's page (queue.md, operations.md) is not enough, since the
table is where a reader looks for all of them. A pattern such as
`--gpu-*-free-mib` covers the flags it matches; `--no-X` counts as documented
with `--X`.
"""

from __future__ import annotations

import argparse
import re

from server.cli import _add_sluice_flags
from tests.docpages import page, section

PAGE, SECTION = "docs/serving.md", "Sluice's flags"


def sluice_flags() -> set[str]:
    parser = argparse.ArgumentParser(add_help=False)
    _add_sluice_flags(parser)
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", parser.format_help()))
    return {f for f in flags if not f.startswith("--no-")}


def documented(text: str) -> re.Pattern[str]:
    """Every `--flag` or `--flag-*-pattern` written in code spans of the text."""
    names = set(re.findall(r"`(--[a-z][a-z0-9*-]*)", text))
    alternatives = "|".join(re.escape(n).replace(r"\*", "[a-z0-9-]+") for n in sorted(names))
    return re.compile(f"(?:{alternatives})")


def test_every_sluice_flag_is_in_the_flag_table() -> None:
    flags = sluice_flags()
    assert {"--window-ms", "--result-cache-ttl", "--gpu-shed-free-mib"} <= flags
    pattern = documented(section(page(PAGE), SECTION))
    missing = sorted(f for f in flags if not pattern.fullmatch(f))
    assert not missing, f'flags missing from {PAGE}, "{SECTION}": {missing}'
