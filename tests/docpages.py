"""The documentation as the tests read it: README.md and docs/*.md, their
fenced code blocks, headings, anchors and sections.

Why this exists: the docs are checked against the code (their flags, the
accepted-and-ignored lists, the metrics list, the commands, the links:
tests/unit/test_docs.py and its neighbours) and their Python examples run
against the demo model (tests/integration/test_docs_examples.py). One reader
keeps those tests agreeing on what a block, a section and an anchor are, so a
text moved from one page to another needs no test rewritten, only found.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^ {0,3}```\s*([A-Za-z0-9_+-]*)\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def pages() -> tuple[Path, ...]:
    """The README and every page under docs/, in a stable order."""
    return (ROOT / "README.md", *sorted(DOCS.glob("*.md")))


def page(name: str) -> Path:
    """A page by its path from the repository root (`docs/apis.md`)."""
    path = ROOT / name
    assert path.is_file(), f"{name}: no such page"
    return path


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced code block: its page, the nearest heading above, language, text."""

    page: Path
    line: int  # of the opening fence, 1-based
    heading: str
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.heading})"


@dataclass(frozen=True, slots=True)
class _Line:
    number: int
    text: str
    fenced: bool  # inside a code block (its fences included)


def _lines(text: str) -> list[_Line]:
    out: list[_Line] = []
    inside = False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            out.append(_Line(i, line, True))
            inside = not inside
        else:
            out.append(_Line(i, line, inside))
    return out


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of one page."""
    out: list[Block] = []
    heading = "(top)"
    body: list[str] | None = None
    start, lang = 0, ""
    for i, line in enumerate(path.read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if body is None:
            if fence:
                body, start, lang = [], i, fence.group(1)
            elif m := _HEADING.match(line):
                heading = m.group(2)
        elif fence and not fence.group(1):
            out.append(Block(path, start, heading, lang, "\n".join(body) + "\n"))
            body = None
        else:
            body.append(line)
    assert body is None, f"{path.relative_to(ROOT)}:{start}: a code block is never closed"
    return out


def all_blocks(*langs: str) -> list[Block]:
    """Every fenced block of the README and docs/*.md in one of these languages."""
    return [b for p in pages() for b in blocks(p) if b.lang in langs]


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of the page outside its code blocks."""
    return [(ln.number, ln.text) for ln in _lines(path.read_text()) if not ln.fenced]


def headings(path: Path) -> list[tuple[int, str]]:
    """(level, text) of every heading outside code blocks."""
    out = []
    for _, line in prose(path):
        if m := _HEADING.match(line):
            out.append((len(m.group(1)), m.group(2)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, without
    punctuation but `-` and `_`, spaces as `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a page (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, text in headings(path):
        base = slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def section(path: Path, heading: str) -> str:
    """The text under a heading (named without its #s), down to the next
    heading of the same or a higher level; code blocks included."""
    lines = _lines(path.read_text())
    level = 0
    out: list[str] = []
    for ln in lines:
        m = None if ln.fenced else _HEADING.match(ln.text)
        if level:
            if m and len(m.group(1)) <= level:
                break
            out.append(ln.text)
        elif m and m.group(2) == heading:
            level = len(m.group(1))
    assert level, f"{path.relative_to(ROOT)} has no heading {heading!r}"
    return "\n".join(out) + "\n"


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
