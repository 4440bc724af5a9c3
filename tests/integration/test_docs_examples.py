"""The docs' examples run as written, but for the server's address, on the demo model.

Every Python block of the README and docs/*.md, and every shell block made
only of curl commands to the plain server, runs against tests/integration's
one Sluice (no engine of its own: the package shares it). A page's Python
blocks run in order in one namespace, as a reader pastes them into one
session (docs/tools.md's structured-output example reuses the tool example's
client). A curl block followed by a JSON block (the README's first request
and the answer it shows) must answer with that id and that shape, and the
log line the docs' `grep` shows for it is the one Sluice writes. The other
shell blocks start servers with other flags, install units or run agents:
they are checked without running (tests/unit/test_docs.py: flags parse, paths
exist, every curl names a route Sluice serves with a JSON body, the TOML,
JSON and YAML examples load) and run for real by the tests that own those
paths (test_lora with lora.md's flags and seeds, test_lora_runtime,
test_balancer, test_coding_agents).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.docpages import ROOT, Block, all_blocks, blocks, commands, pages
from tests.support import SluiceProcess

pytestmark = pytest.mark.engine

ADDRESS = re.compile(r"(?:http://)?(?:localhost|127\.0\.0\.1):8000")
# Pages whose examples need a model of another kind than the shared server's,
# and the module that runs them on its own server.
ELSEWHERE = {ROOT / "docs/pooling.md": "tests/integration/test_pooling.py"}
PYTHON_PAGES = [
    p for p in pages() if p not in ELSEWHERE and any(b.lang == "python" for b in blocks(p))
]


def curl_blocks(*, on: tuple[Path, ...] | None = None) -> list[Block]:
    """The blocks that are curl commands only: of every page run here, or `on`'s."""
    return [
        b
        for b in all_blocks("sh", "bash")
        if (b.page in on if on is not None else b.page not in ELSEWHERE)
        and (cmds := list(commands(b)))
        and all(c[0] == "curl" for c in cmds)
    ]


CURL_BLOCKS = curl_blocks()


def test_the_docs_have_examples_to_run() -> None:
    names = {str(p.relative_to(ROOT)) for p in PYTHON_PAGES}
    assert {"README.md", "docs/apis.md", "docs/tools.md"} <= names, names
    assert CURL_BLOCKS
    assert len(GREP_BLOCKS) == 2, GREP_BLOCKS


def local(text: str, base: str) -> str:
    """The text with the docs' address (loopback, port 8000) turned into `base`'s."""
    host = base.removeprefix("http://")
    return ADDRESS.sub(lambda m: base if m[0].startswith("http") else host, text)


# Runs a page's Python blocks, in order, in one namespace, as a reader's script:
# a process of its own, so the clients the examples open and never close (as a
# reader's script need not) are not left to this session's garbage collector,
# where pytest's warnings-as-errors turned an unclosed socket into another
# test's failure.
_RUNNER = """
import json, sys
scope = {"__name__": "__main__", "print": lambda *a, **k: None}
for where, text in json.load(sys.stdin):
    exec(compile(text, where, "exec"), scope)
"""


@pytest.mark.parametrize("path", PYTHON_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_run(sluice_server: SluiceProcess, path: Path) -> None:
    run_python(path, sluice_server.base)


def run_python(path: Path, base: str) -> None:
    """A page's Python blocks run against the server at `base` (see _RUNNER)."""
    code = [(b.where, local(b.text, base)) for b in blocks(path) if b.lang == "python"]
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(code),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]


def shape(value: Any) -> Any:
    """A JSON value's structure: its keys and the types of its leaves."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__


def answer_shown(block: Block) -> dict[str, Any] | None:
    """The JSON block right after a curl block: the answer the page shows."""
    following = blocks(block.page)
    after = following[following.index(block) + 1 :]
    return json.loads(after[0].text) if after and after[0].lang == "json" else None


def run_curl(block: Block, base: str) -> dict[str, Any]:
    """A curl block's answer, the block run by bash against the server."""
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", local(block.text, base)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    body: dict[str, Any] = json.loads(done.stdout)
    assert "error" not in body, body
    return body


@pytest.mark.parametrize("block", CURL_BLOCKS, ids=lambda b: b.where)
def test_curl_examples_run(sluice_server: SluiceProcess, block: Block) -> None:
    check_curl(block, sluice_server.base)


def check_curl(block: Block, base: str) -> None:
    """A curl block runs against `base` without an error, and answers with the
    id and shape of the answer the page shows after it, if it shows one."""
    body = run_curl(block, base)
    shown = answer_shown(block)
    if shown is not None:  # the page's answer has this one's id and shape, not its text
        assert body["id"] == shown["id"]
        assert shape({**body, "created": 0}) == shape({**shown, "created": 0})


GREP_BLOCKS = [b for b in all_blocks("sh") if b.text.startswith('grep \'"request_id"')]


@pytest.mark.parametrize("grep", GREP_BLOCKS, ids=lambda b: b.where)
def test_the_log_line_shown_is_the_one_written(sluice_server: SluiceProcess, grep: Block) -> None:
    """A `grep` for the README curl's request id (README, docs/operations.md)
    shows the access line Sluice writes for it: the same fields in the same
    order, the same values but for the timings and the batch. (The shared
    server logs `key=value` pairs, --log-format plain; the docs show the
    default JSON of the same record, so a value is compared as Python's str()
    of the JSON one.)"""
    rid = re.search(r'"request_id":"([^"]+)"', grep.text.splitlines()[0])
    assert rid, grep.where
    comment = "".join(ln.removeprefix("#").strip() for ln in grep.text.splitlines()[1:])
    shown = {k: str(v) for k, v in json.loads(comment).items()}
    for envelope in ("ts", "level", "logger", "msg"):
        del shown[envelope]
    (curl,) = [b for b in CURL_BLOCKS if f"x-request-id: {rid[1]}" in b.text]
    run_curl(curl, sluice_server.base)
    access = re.compile(rf"sluice\.access: request (request_id={re.escape(rid[1])} .*)")
    deadline = time.monotonic() + 30  # the line goes through the log's writer thread
    while not (lines := access.findall(sluice_server.tail(200_000))):
        assert time.monotonic() < deadline, sluice_server.tail()
        time.sleep(0.05)
    written = dict(re.findall(r"(?:^| )(\w+)=(\S*)", lines[-1]))
    where = f"{grep.where} shows {shown}; Sluice writes {lines[-1]}"
    assert list(shown) == list(written), where
    varying = {
        "queue_wait_ms",
        "ttft_ms",
        "total_ms",
        "batch_id",
        "batch_size",
        "release",
        "engine_ms",
    }
    assert {k: v for k, v in shown.items() if k not in varying} == {
        k: v for k, v in written.items() if k not in varying
    }, where
