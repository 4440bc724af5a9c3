"""The test harness itself: a Sluice whose free port was taken while its engine
started is started again on another one (tests/support.py, `SluiceProcess`).

Why it exists: a fresh-clone CI run lost a module's tests at setup when another
test's engine took the port `free_port()` had picked, in the tens of seconds before
Sluice bound it ("address already in use"). The stand-in process here plays both
outcomes of a start: the port taken, then a server that is ready.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import SluiceProcess, free_port

# First start: exit as Sluice does when its port is taken. Later ones: answer
# /ready on the port given, as a started Sluice does.
_STAND_IN = """
import http.server, sys
port, first = int(sys.argv[1]), sys.argv[2] == "1"
if first:
    print("OSError: [Errno 98] error while attempting to bind on address "
          f"('127.0.0.1', {port}): address already in use", flush=True)
    sys.exit(1)
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), Ready).serve_forever()
"""


class _StandIn(SluiceProcess):
    def _spawn(self) -> subprocess.Popen[bytes]:
        first = self._binds == 1
        return subprocess.Popen(
            [sys.executable, "-c", _STAND_IN, str(self.port), "1" if first else "0"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            process_group=0,
        )


def test_a_start_whose_port_was_taken_starts_again_on_another(tmp_path: Path) -> None:
    proc = _StandIn([], cache_dir=tmp_path, log_path=tmp_path / "log")
    first = proc.port
    with proc.running(timeout=30):
        assert proc.port != first
        assert proc.base.endswith(f":{proc.port}")
    assert b"port taken; starting again" in (tmp_path / "log").read_bytes()


def test_a_port_the_test_gave_is_not_changed(tmp_path: Path) -> None:
    """A given port is a place to keep (a restart behind a balancer): a start that
    finds it taken fails, as any other exit does."""
    proc = _StandIn([], cache_dir=tmp_path, log_path=tmp_path / "log", port=free_port())
    with pytest.raises(RuntimeError, match="address already in use"), proc.running(timeout=30):
        pass
