"""Run Sluice as a subprocess for integration and system tests; wait on a condition.

Each `SluiceProcess` is its own process group, so that stopping it also reaps
vLLM's engine processes: nothing a test starts outlives it. Loopback only,
free ports, bounded waits.

A process group, not a new session: with the kernel's autogroup scheduling on
(`/proc/sys/kernel/sched_autogroup_enabled`, on by default), a new session is
a new scheduling group, and on these two cores a freshly started server's
group starved the test process for 10-15 s at a time (its run-queue wait in
/proc/PID/schedstat grew 14.3 s in 15 s; it read its streams in one piece at
the end, and missed the drain it was meant to watch). One session, one group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


# Flags with which a test's engine decides torch.compile for itself; without
# one, SluiceProcess starts it eager (see there).
COMPILE_FLAGS = ("--enforce-eager", "--no-enforce-eager", "--models")


# Starts of one SluiceProcess on its own free port, each after the last found it
# taken (wait_ready).
_BIND_TRIES = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SluiceProcess:
    """`sluice serve` with `args`, its output in `log_path`.

    Eager (`--enforce-eager`) unless `args` decide (COMPILE_FLAGS): a start skips
    torch.compile, which in a fresh clone compiles anew for each engine shape, 25 s
    or more per start on two cores (issue 29: the suite's time was mostly engine
    starts). The shared server (tests/integration/conftest.py) runs compiled, as
    `sluice serve` does by default, so the compiled path stays under test.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        cache_dir: Path,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        # A given port: a restarted instance takes its old place (behind a balancer).
        # A free one may be taken by the time Sluice binds it, after its engine's
        # start (tens of seconds, in which another test's engine opens its own
        # ports): then wait_ready() starts it again on another (_BIND_TRIES).
        self._own_port = port is None
        self.port = port or free_port()
        # With --ssl-certfile: the client context that trusts its CA (wait_ready's).
        self.tls = tls
        self.scheme = "https" if tls else "http"
        self.base = f"{self.scheme}://127.0.0.1:{self.port}"
        self.log_path = log_path
        full_env = {
            **os.environ,
            "SLUICE_CACHE_DIR": str(cache_dir),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "PYTHONUNBUFFERED": "1",
            # vLLM's CPU backend pins each engine's OpenMP threads to core 0 by
            # default: a test's engine started beside another (the suite's shared
            # server, a balancer's twin) queued there for minutes using no CPU
            # (shared/DESIGN.md). Unbound, the kernel places them.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            # Each server's state.db (the default --state-dir) beside its log,
            # not in the home directory shared by every test's server.
            "XDG_STATE_HOME": str(log_path.parent / "xdg-state"),
            **(env or {}),
        }
        if not any(a in COMPILE_FLAGS for a in args):
            args = ["--enforce-eager", *args]
        self._args = list(args)
        self._env = full_env
        self._binds = 1
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--port", str(self.port), *self._args],
            cwd=ROOT,
            env=self._env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            process_group=0,
        )

    def _rebind(self) -> bool:
        """Start again on another free port if the last start exited because its
        own port was taken meanwhile; False if it exited for anything else."""
        if not self._own_port or self._binds >= _BIND_TRIES:
            return False
        if b"address already in use" not in self.log_path.read_bytes()[-4000:].lower():
            return False
        self.kill_group()
        self._binds += 1
        self.port = free_port()
        self.base = f"{self.scheme}://127.0.0.1:{self.port}"
        self._log.write(f"\n[tests] port taken; starting again on {self.port}\n".encode())
        self._log.flush()
        self.proc = self._spawn()
        return True

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self._rebind():
                    continue
                raise RuntimeError(f"sluice exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                ready = httpx.get(self.base + "/ready", timeout=2, verify=self.tls or True)
                if ready.status_code == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"sluice not ready after {timeout}s:\n{self.tail()}")

    @contextlib.contextmanager
    def running(self, timeout: float = 240.0) -> Iterator[SluiceProcess]:
        """Ready (see wait_ready), for the block; stopped afterwards, whatever happens."""
        try:
            self.wait_ready(timeout)
            yield self
        finally:
            self.stop()

    def tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def engine_core_pids(self) -> list[int]:
        """vLLM's engine core processes: live children of the server process whose
        title (vLLM sets it, `VLLM::EngineCore`, `_DP0`, ...) names one."""
        cores = []
        for kid in _live_children(self.proc.pid):
            with contextlib.suppress(OSError):
                if b"EngineCore" in Path(f"/proc/{kid}/cmdline").read_bytes():
                    cores.append(kid)
        return cores

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the exit, then kill the whole process group if needed.

        While it waits, an engine core whose workers have exited is killed: it
        has nothing left but the interpreter's exit, a cyclic-GC scan of torch's
        and vLLM's modules that took 2.5 s or more of a core here, and vLLM's
        process manager kills it at 5 s anyway ("force killing remaining
        processes", in every stop). Sluice's own shutdown still runs to its end
        and exit code, and its resource tracker unlinks the shared memory the
        core held (a warning in the log says so). The suite stops about 30
        servers: 5.3 s each became 3.2 s (issue 29).
        """
        if self.proc.poll() is None:
            cores = [pid for pid in self.engine_core_pids() if _live_children(pid)]
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                for pid in [p for p in cores if not _live_children(p)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    cores.remove(pid)
                time.sleep(0.05)
            # What the killed core left in shared memory, multiprocessing's
            # resource tracker unlinks once the server has exited: let it.
            end = time.monotonic() + 5
            while self.proc.poll() is not None and _group_alive(self.proc.pid):
                if time.monotonic() > end:
                    break
                time.sleep(0.05)
        self.kill_group()
        self._log.close()
        return int(self.proc.returncode)

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def _stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after the command: state, ppid, pgrp, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running (its exited children,
    reparented to an init that may reap late, left out)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                state, _, group = _stat(entry.name)[:3]
                if group == str(pgid) and state not in "ZX":
                    return True
    return False


def _live_children(pid: int) -> list[int]:
    """The child processes of `pid` that have not exited (zombies left out)."""
    kids: list[int] = []
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            kids += [int(k) for k in listing.read_text().split()]
    live = []
    for kid in kids:
        with contextlib.suppress(OSError):
            if _stat(kid)[0] not in "ZX":
                live.append(kid)
    return live


@contextlib.contextmanager
def vllm_on_demo(model_dir: Path, name: str, extra: Sequence[str], log_dir: Path) -> Iterator[str]:
    """vLLM's own OpenAI server on a demo model directory, with the engine flags
    `sluice serve` gives the demo model (server/engines/demo/model.py
    demo_engine_kwargs), eager as the tests' Sluice (SluiceProcess), and `extra`:
    the reference a test compares Sluice with.
    Yields its base URL; stopped afterwards (its whole process group)."""
    from bench.report import VLLM
    from bench.run.servers import Server, server_command
    from server.engines.demo.model import demo_engine_kwargs

    kw = demo_engine_kwargs(model_dir)
    flags = [
        "--model",
        str(kw["model"]),
        "--served-model-name",
        name,
        "--dtype",
        str(kw["dtype"]),
        "--max-model-len",
        str(kw["max_model_len"]),
        "--kv-cache-memory-bytes",
        str(kw["kv_cache_memory_bytes"]),
        "--enforce-eager",
        *extra,
    ]
    port = free_port()
    srv = Server(VLLM, port, server_command(VLLM, port, flags), log_dir / "vllm.log")
    try:
        # An engine start takes minutes on a loaded machine. Unbound OpenMP
        # threads, as SluiceProcess's engines run (see there).
        srv.start({**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}, timeout=540)
        yield srv.base_url
    finally:
        srv.stop()


async def until(cond: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    """Poll `cond` until true; fail (not hang) after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            pytest.fail(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.005)


async def cancel_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` (a test's open streams: their connections close, so the
    server stops their engine requests) and wait until each has ended."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


def metric(base: str, name: str) -> float:
    """One unlabelled sample from /metrics."""
    text = httpx.get(base + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


class ErrorRecords(logging.Handler):
    """Error records of Sluice's loggers: a 500 logs one (one hidden in a
    stream too), so a fuzz test can tell a handled refusal from a crash."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
