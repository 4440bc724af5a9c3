"""The README's flag table names every flag Sluice adds to `sluice serve`.

The flags come from the parser itself (server/cli.py, without vLLM's engine
flags), so a new flag without a line in the README fails here. A README
pattern such as `--gpu-*-free-mib` covers the flags it matches; `--no-X`
counts as documented with `--X`.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from server.cli import _add_sluice_flags

README = Path(__file__).resolve().parents[2] / "README.md"


def sluice_flags() -> set[str]:
    parser = argparse.ArgumentParser(add_help=False)
    _add_sluice_flags(parser)
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", parser.format_help()))
    return {f for f in flags if not f.startswith("--no-")}


def documented(readme: str) -> re.Pattern[str]:
    """Every `--flag` or `--flag-*-pattern` written in code spans of the README."""
    names = set(re.findall(r"`(--[a-z][a-z0-9*-]*)", readme))
    alternatives = "|".join(re.escape(n).replace(r"\*", "[a-z0-9-]+") for n in sorted(names))
    return re.compile(f"(?:{alternatives})")


def test_every_sluice_flag_is_in_the_readme() -> None:
    flags = sluice_flags()
    assert {"--window-ms", "--result-cache-ttl", "--gpu-shed-free-mib"} <= flags
    pattern = documented(README.read_text())
    missing = sorted(f for f in flags if not pattern.fullmatch(f))
    assert not missing, f"flags missing from README.md: {missing}"
