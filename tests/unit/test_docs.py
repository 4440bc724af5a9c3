"""The README and docs/*.md against the repository and the code, without an engine.

Every relative link reaches a file and, for a page, a heading; every
`./scripts/serve` and `./scripts/bench` command in a shell block parses with
the parser that would run it (Sluice's and vLLM's flags, bench's own), and
every repository path a command names exists; docs/operations.md lists
exactly the metrics Sluice exports. So a renamed flag or metric, a moved
script or a page split apart fails here, not in a reader's terminal. (The
flags' own lines: test_readme_flags.py; the accepted-and-ignored lists:
test_ignored_fields.py; the Python examples run against the demo model in
tests/integration/test_docs_examples.py.)
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docpages import ROOT, Block, all_blocks, anchors, page, pages, prose, section

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`[^`]*`")


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line, target) of every inline link outside code blocks and code spans."""
    for number, line in prose(path):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            yield number, target


def broken(path: Path) -> list[str]:
    out = []
    for number, target in links(path):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            out.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{where} (no heading with that anchor in {dest.name})")
    return out


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert list(links(path)) or path.name == "DESIGN.md", "a page that links nowhere"
    bad = broken(path)
    assert not bad, "\n".join(bad)


def commands(block: Block) -> Iterator[list[str]]:
    """Each simple command of a shell block: continuations joined, comments,
    redirections and environment assignments dropped, split at | && ; ."""
    text = block.text.replace("\\\n", " ")
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        tokens = list(lexer)
        i = 0
        while i < len(tokens):
            tok = tokens[i]
            if tok in ("|", "||", "&&", ";", "&"):
                if words:
                    yield words
                words = []
            elif set(tok) <= set("<>&") and tok:  # a redirection: drop its target too
                if words and words[-1].isdigit():
                    words.pop()
                i += 1
            elif words or not re.match(r"[A-Z_][A-Z0-9_]*=", tok):
                words.append(tok)
            i += 1
        if words:
            yield words


SHELL = all_blocks("sh", "bash")


def _program(words: list[str], *names: str) -> list[str] | None:
    """The arguments after the first word that is one of `names` (after sudo)."""
    for i, w in enumerate(words):
        if w in names:
            return words[i + 1 :]
    return None


def test_the_docs_have_shell_commands_to_check() -> None:
    serve = [c for b in SHELL for c in commands(b) if _program(c, "./scripts/serve") is not None]
    assert len(serve) >= 8, serve


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_serve_and_bench_commands_parse(block: Block) -> None:
    from bench.__main__ import parse_args as bench_args
    from server.cli import build_serve_parser

    for words in commands(block):
        serve = _program(words, "./scripts/serve")
        if serve is not None and "--help" not in serve:
            try:
                build_serve_parser().parse_args(serve)
            except SystemExit:
                pytest.fail(f"{block.where}: `./scripts/serve {shlex.join(serve)}` does not parse")
        bench = _program(words, "./scripts/bench")
        if bench is not None:
            try:
                ns, engine = bench_args(bench)
                build_serve_parser().parse_args(engine)
            except SystemExit:
                pytest.fail(f"{block.where}: `./scripts/bench {shlex.join(bench)}` does not parse")
            from bench.scenarios import SCENARIOS

            unknown = {s for s in ns.scenarios.split(",") if s} - set(SCENARIOS)
            assert not unknown, f"{block.where}: unknown scenarios {unknown}"


_REPO_PATH = re.compile(r"^(?:\./)?(?:scripts|bench|tests|docs|systemd|server|batching)/\S*$")


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_every_repository_path_a_command_names_exists(block: Block) -> None:
    for words in commands(block):
        for w in words:
            if _REPO_PATH.match(w) and "*" not in w:
                assert (ROOT / w).exists(), f"{block.where}: {w} does not exist"


def exported_metrics() -> set[str]:
    """Every metric family /metrics can serve, as a scrape names it: the app's
    registry with the watchdog's gauges and two data-parallel ranks."""
    from collections import defaultdict

    from batching.pressure import RankStats
    from server.operations.metrics import Metrics
    from server.operations.watchdog import WatchdogMetrics

    metrics = Metrics()
    live: defaultdict[str, object] = defaultdict(float)
    live["ranks"] = [RankStats(0.5, 1, 0), RankStats(0.5, 1, 0)]
    metrics.watch(lambda: live)
    WatchdogMetrics(metrics.registry)
    return {f.name + ("_total" if f.type == "counter" else "") for f in metrics.registry.collect()}


def test_the_metrics_list_is_what_sluice_exports() -> None:
    text = section(page("docs/operations.md"), "Metrics")
    listed = re.findall(r"^\| `(sluice_[a-z_]+)` \|", text, re.M)
    assert len(listed) == len(set(listed)), "a metric listed twice"
    exported = exported_metrics()
    assert {"sluice_requests_total", "sluice_engine_rank_kv_cache_usage"} <= exported
    assert sorted(exported - set(listed)) == [], "exported, not in docs/operations.md"
    assert sorted(set(listed) - exported) == [], "in docs/operations.md, not exported"
