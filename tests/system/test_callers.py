"""System tests of the callers file: Sluice as a subprocess, as systemd runs it.

* A bad callers file at start is a clear error on stderr and exit code 2,
  before any engine starts.
* SIGHUP (systemd's ExecReload) reloads the file: a new key works at once; a
  bad file keeps the old callers, says why in the log, and the server stays up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.shared_servers import callers_path, callers_toml
from tests.support import ROOT, SluiceProcess

pytestmark = pytest.mark.system

BODY = {"model": "sluice-demo", "prompt": "hi", "max_tokens": 2}
LATE = "sk-late"  # the key of the caller the SIGHUP test adds


def test_bad_callers_file_at_start_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "callers.toml"
    bad.write_text('[callers.chat]\nkey = "sk-chat"\nweight = -1\n')
    proc = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--callers", str(bad)],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"callers file {bad}: callers.chat.weight must be a number > 0" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "sk-chat" not in proc.stderr + proc.stdout


def _status(base: str, key: str) -> int:
    r = httpx.post(
        base + "/v1/completions",
        json=BODY,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    return r.status_code


@pytest.mark.engine
async def test_sighup_reloads_the_callers_file(callers_server: SluiceProcess) -> None:
    """On the suite's server with a callers file (tests/shared_servers.py), which
    started with the file readable by others. The file is written back and
    reloaded at the end; the server's clean exit is checked where it stops."""
    proc = callers_server
    path = callers_path(proc.log_path)

    def log() -> str:
        return proc.log_path.read_bytes().decode(errors="replace")

    reloaded, kept = log().count("callers reloaded"), log().count("keeping the old callers")
    assert "readable by other users" in log()  # a warning at start, not an error
    assert await asyncio.to_thread(_status, proc.base, "sk-chat") == 200
    assert await asyncio.to_thread(_status, proc.base, LATE) == 401
    try:
        path.write_text(callers_toml({"late": LATE}))
        proc.signal(signal.SIGHUP)
        await until_async(lambda: _status(proc.base, LATE) == 200, proc.tail)
        assert log().count("callers reloaded") == reloaded + 1

        path.write_text("[callers.chat\n")  # not TOML
        proc.signal(signal.SIGHUP)
        await until_async(lambda: log().count("keeping the old callers") > kept, proc.tail)
        assert await asyncio.to_thread(_status, proc.base, LATE) == 200
        assert proc.proc.poll() is None
        assert "sk-" not in log()  # keys never reach the log
    finally:
        path.write_text(callers_toml())
        proc.signal(signal.SIGHUP)
        await until_async(lambda: _status(proc.base, LATE) == 401, proc.tail)


async def until_async(cond: Callable[[], bool], tail: Callable[[], str]) -> None:
    """`cond` (blocking: run in a thread) within 30 s, polled every 0.2 s."""
    deadline = time.monotonic() + 30
    while not await asyncio.to_thread(cond):
        assert time.monotonic() < deadline, tail()
        await asyncio.sleep(0.2)
