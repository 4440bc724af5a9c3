"""HAProxy in front of two Sluice instances, for a benchmark: the shipped example
config (docs/haproxy.cfg) as it is, or with its affinity taken out.

Why it exists: issue 43 item 4 asks what keeping a conversation on one instance
buys, measured. The point (bench/points/prefix_point.py) runs the balancer on
the file users copy, not a benchmark's own, and compares it with the same file
as it was before affinity: the frontend's `use_backend affinity` line
removed, so every request goes round robin. The balancer runs in a process
group of its own and is stopped by its pid, as bench/run/servers.py stops a
server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.run.servers import HOST, group_alive, kill_group

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "docs" / "haproxy.cfg"
HAPROXY = "haproxy"
# The frontend's line that sends a keyed request to the consistent-hash backend.
AFFINITY_LINE = "use_backend affinity"


def round_robin_config(config: str) -> str:
    """`config` (docs/haproxy.cfg's text) without the frontend's `use_backend
    affinity ...` line: every request goes to the round-robin backend.
    Raises ValueError unless exactly one such line is there (a changed example
    must not quietly stay affine)."""
    lines = config.splitlines(keepends=True)
    kept = [line for line in lines if not line.strip().startswith(AFFINITY_LINE)]
    if len(lines) - len(kept) != 1:
        raise ValueError(
            f"expected one {AFFINITY_LINE!r} line in the HAProxy config, "
            f"found {len(lines) - len(kept)}"
        )
    return "".join(kept)


def instance_of(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """(status, X-Sluice-Instance) of a GET through the balancer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), str(r.headers.get("X-Sluice-Instance", ""))
    except urllib.error.HTTPError as e:
        return int(e.code), str(e.headers.get("X-Sluice-Instance", ""))


@dataclass
class Balancer:
    """`haproxy -db -f CONFIG` on loopback `port`, in front of instances `a` and `b`
    (their ports), started when both are ready."""

    config: Path
    port: int
    a: int
    b: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "SLUICE_LB_BIND": f"{HOST}:{self.port}",
            "SLUICE_A": f"{HOST}:{self.a}",
            "SLUICE_B": f"{HOST}:{self.b}",
        }

    def start(self, timeout: float = 60.0) -> None:
        """Start HAProxy and wait until its frontend answers /ready with 200 from
        both instances (unkeyed, so round robin: X-Sluice-Instance says which)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [HAPROXY, "-db", "-f", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(),
                process_group=0,
            )
        seen: set[str] = set()
        t0 = time.monotonic()
        while seen != {"a", "b"}:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"haproxy exited with {self.proc.returncode}; see {self.log_path}"
                )
            try:
                status, instance = instance_of(self.base_url + "/ready")
                if status == 200:
                    seen.add(instance)
            except OSError:
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise RuntimeError(
                    f"haproxy: /ready not 200 via both instances after {timeout:.0f} s "
                    f"(seen {sorted(seen)}); see {self.log_path}"
                )
            time.sleep(0.2)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM HAProxy's process group, SIGKILL it after `grace` s, reap it."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # process_group=0: its pid is the group id
        kill_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            kill_group(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if group_alive(pgid):
            kill_group(pgid, signal.SIGKILL)
        self.proc = None
