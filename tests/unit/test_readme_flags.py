"""The docs name every flag Sluice adds to `sluice serve`.

The flags come from the parser itself (server/cli.py, without vLLM's engine
flags), so a new flag without a line in the README or a page under docs/
fails here (docs/serving.md holds the table of them all). A pattern such as
`--gpu-*-free-mib` covers the flags it matches; `--no-X` counts as documented
with `--X`.
"""

from __future__ import annotations

import argparse
import re

from server.cli import _add_sluice_flags
from tests.docpages import ROOT, pages


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


def test_every_sluice_flag_is_in_the_docs() -> None:
    flags = sluice_flags()
    assert {"--window-ms", "--result-cache-ttl", "--gpu-shed-free-mib"} <= flags
    read = [p for p in pages() if p.name != "DESIGN.md"]
    pattern = documented("\n".join(p.read_text() for p in read))
    missing = sorted(f for f in flags if not pattern.fullmatch(f))
    names = ", ".join(str(p.relative_to(ROOT)) for p in read)
    assert not missing, f"flags missing from {names}: {missing}"
