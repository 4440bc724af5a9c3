"""Bind first (issue 41, server/listen.py): the address is read and bound before
anything slow, and a taken port is one clear line and exit 2, before vLLM is
imported (no engine start at all)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from server.listen import BindError, address, bind
from tests.support import ROOT


def test_the_address_is_read_from_the_command_line_or_the_defaults() -> None:
    assert address([], "127.0.0.1", 8000) == ("127.0.0.1", 8000)
    assert address(["--port", "9001", "--model", "x"], "127.0.0.1", 8000) == ("127.0.0.1", 9001)
    assert address(["--host=0.0.0.0", "--port=1"], "127.0.0.1", 8000) == ("0.0.0.0", 1)
    # Not readable yet: the full parser says what is wrong.
    assert address(["--port", "eighty"], "127.0.0.1", 8000) is None
    assert address(["--port", "70000"], "127.0.0.1", 8000) is None
    assert address(["--help"], "127.0.0.1", 8000) is None


def test_a_taken_port_is_a_bind_error_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BindError, match=f"127.0.0.1:{port}: .*in use"):
            bind("127.0.0.1", port)
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()


def test_sluice_serve_on_a_taken_port_exits_2_with_one_line_before_any_engine() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "server", "serve", "--port", str(port)],
            check=False,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"sluice serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ], lines[-5:]
    assert done.stdout == ""  # nothing started: not even vLLM's import logs


def test_a_bad_host_is_one_line_and_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--host", "no-such-host.invalid"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("sluice serve: error: cannot listen on no-such-host.invalid:8000")
