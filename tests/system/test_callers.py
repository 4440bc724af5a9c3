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
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, SluiceProcess

pytestmark = pytest.mark.system

BODY = {"model": "sluice-demo", "prompt": "hi", "max_tokens": 2}


def _file(path: Path, *callers: str) -> None:
    path.write_text("".join(f'[callers.{c}]\nkey = "sk-{c}"\n' for c in callers))


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
async def test_sighup_reloads_the_callers_file(demo_cache_root: Path, tmp_path: Path) -> None:
    path = tmp_path / "callers.toml"
    _file(path, "chat")
    path.chmod(0o644)  # readable by others: a warning, not an error
    proc = SluiceProcess(
        ["--callers", str(path)], cache_dir=demo_cache_root, log_path=tmp_path / "sluice.log"
    )
    try:
        await asyncio.to_thread(proc.wait_ready)
        assert "readable by other users" in proc.tail(100_000)
        assert await asyncio.to_thread(_status, proc.base, "sk-chat") == 200
        assert await asyncio.to_thread(_status, proc.base, "sk-batch") == 401

        _file(path, "chat", "batch")
        proc.signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(_status, proc.base, "sk-batch") != 200:
            assert time.monotonic() < deadline, proc.tail()
            await asyncio.sleep(0.2)
        assert "callers reloaded" in proc.tail(100_000)

        path.write_text("[callers.chat\n")  # not TOML
        proc.signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "keeping the old callers" not in proc.tail(100_000):
            assert time.monotonic() < deadline, proc.tail()
            await asyncio.sleep(0.2)
        assert await asyncio.to_thread(_status, proc.base, "sk-batch") == 200
        assert proc.proc.poll() is None
        assert "sk-" not in proc.tail(100_000)  # keys never reach the log
    finally:
        assert proc.stop() == 0, proc.tail()
