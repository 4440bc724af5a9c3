"""Start and stop the servers under test: Sluice and vLLM's own OpenAI server.

Why it exists: both servers must get the same engine flags, listen on loopback
only, and leave nothing behind. vLLM starts engine-core processes (spawn), so
each server runs in its own process group and is stopped by signalling the
whole group: SIGTERM, then SIGKILL after a grace period.

A process group, not a session: with the kernel's autogroup scheduling (on by
default), each session is a scheduling group of its own, and on a 2-core
machine a freshly started server's group starved the client's group for
seconds at a time: the client read whole responses in one piece, late. Every
process of a run (servers, raw engine, clients) stays in the runner's session.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from bench.report.systems import NOHOLD, SLUICE_SYSTEMS, VLLM

HOST = "127.0.0.1"


def free_port() -> int:
    """A free TCP port on loopback (bound and released: a small race, fine here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def server_command(
    system: str, port: int, engine_flags: Sequence[str], sluice_flags: Sequence[str] = ()
) -> list[str]:
    """The command line of one server; engine flags are passed unchanged to both.
    NOHOLD is Sluice with --no-hold-backlog."""
    if system in SLUICE_SYSTEMS:
        hold = ["--no-hold-backlog"] if system == NOHOLD else []
        return [
            sys.executable,
            "-m",
            "server",
            "serve",
            "--host",
            HOST,
            "--port",
            str(port),
            "--log-format",
            "plain",
            *hold,
            *sluice_flags,
            *engine_flags,
        ]
    if system == VLLM:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host",
            HOST,
            "--port",
            str(port),
            *engine_flags,
        ]
    raise ValueError(f"unknown server {system!r}")


def callers_toml(
    keys: Mapping[str, str],
    weights: Mapping[str, float] | None = None,
    background: Collection[str] = (),
) -> str:
    """A Sluice callers file (`--callers`, issue 11): one table per caller, its
    bearer key and weight (1 unless `weights` names it), `background = true` for
    the callers in `background` (issue 49), no limits (the benchmark measures
    sharing, not caps)."""
    out = ["# Written by the benchmark (bench/run/runner.py): one caller per client job."]
    for name, key in keys.items():
        if not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"caller name {name!r} is not a bare TOML key")
        weight = (weights or {}).get(name, 1)
        out += ["", f"[callers.{name}]", f"key = {json.dumps(key)}", f"weight = {weight:g}"]
        if name in background:
            out.append("background = true")
    return "\n".join(out) + "\n"


@functools.cache
def sluice_help(cwd: Path) -> str:
    """`sluice serve --help` of the checkout at `cwd` (once per run: it imports vLLM)."""
    done = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--help"],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        check=False,
    )
    return done.stdout


def has_flag(help_text: str, flag: str) -> bool:
    """Whether an argparse help text offers `flag` (a whole option, not a prefix)."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def sluice_has_flag(flag: str, cwd: Path) -> bool:
    """Whether this checkout's Sluice takes `flag`: the harness passes newer flags
    (such as issue 11's `--callers`) only to a Sluice that has them."""
    return has_flag(sluice_help(cwd), flag)


def ready_path(system: str) -> str:
    return "/ready" if system in SLUICE_SYSTEMS else "/health"


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return int(e.code), ""


@dataclass
class Server:
    """A running server in its own process group; a context manager that stops it."""

    system: str
    port: int
    command: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    start_seconds: float = 0.0

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, env: dict[str, str], timeout: float = 300.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                process_group=0,
            )
        url = self.base_url + ready_path(self.system)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.system} exited with {self.proc.returncode} during start-up; "
                    f"see {self.log_path}"
                )
            try:
                status, _ = http_get(url, timeout=2.0)
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise RuntimeError(
                    f"{self.system} not ready after {timeout:.0f} s; see {self.log_path}"
                )
            time.sleep(0.5)
        self.start_seconds = time.monotonic() - t0

    def metrics(self) -> str:
        status, body = http_get(self.base_url + "/metrics")
        if status != 200:
            raise RuntimeError(f"{self.system} /metrics answered {status}")
        return body

    def cpu_seconds(self) -> float:
        """The CPU time (user + system) of the server's own process so far: its
        front end, with the engine client's output processing that runs in it
        on both servers, but not its engine-core (or DP coordinator) children."""
        assert self.proc is not None
        return process_cpu_seconds(self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace` s, reap the leader."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # process_group=0: the leader's pid is the group id
        kill_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and group_alive(pgid):
            self.proc.poll()
            time.sleep(0.2)
        if group_alive(pgid):
            kill_group(pgid, signal.SIGKILL)
            time.sleep(0.5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_group(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> Server:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process, all its threads (its children excluded)."""
    # Fields after the ")" of the command: state is field 3, utime 14, stime 15.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether any process (not a zombie) is left in the group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # killpg(0) succeeds while zombies remain; look for a live member.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after the ")" of the command: state ppid pgrp ...
        rest = stat.rsplit(")", 1)[-1].split()
        if len(rest) >= 3 and int(rest[2]) == pgid and rest[0] != "Z":
            return True
    return False
