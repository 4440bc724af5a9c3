"""An engine starts at a lower CPU priority, and runs at the front's once ready.

Why this module exists (issue 49, item 3): an engine's start (three
interpreters importing torch and vLLM, the model's load, compilation and the
KV cache's profiling) takes the machine's cores for tens of seconds to
minutes. Beside a model that serves (another model's on-demand load, its
restart after a crash), that start made the serving model's chat turns
wait: 2.04x their alone time during another model's restart
(bench/results/faults-cpu.md). Started niced, its processes take the cores
only when the serving model leaves them idle.

The rules:

1. An engine is built on a thread of its own whose nice value is the
   front's plus ``START_NICE``; the processes it spawns (the engine core,
   which spawns its workers) inherit it, as does every thread they start.
2. Once the engine is ready, every thread of every one of its processes is
   set back to the front's nice value, and so is every thread the build
   started in the front's own process (vLLM's engine client: its ZMQ I/O
   threads, which carry the model's requests and outputs for its whole
   life): a serving engine is never demoted.
3. Rule 2 (and 4) needs the OS to let an unprivileged process raise a priority back:
   RLIMIT_NICE (systemd's ``LimitNICE=``, systemd/sluice.service) or
   CAP_SYS_NICE. Without either, rule 1 does not apply: an engine that could
   never be raised again would serve at a tenth of the others' CPU share.
   ``plan`` says which holds, once, at start.
4. A serving engine with only background work, while another model of this
   server has interactive work (batching/step_share.py rule 6), is set to the
   start value too (`lower`), by its own scheduler, and back (`restore`) when
   that ends: on shared cores the chat turn's engine runs first.

The card has no such knob here: NVIDIA's time slicing gives each process
its turn, and a per-process share needs MPS (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``),
which a start could only set for the process's whole life. On the card an
engine's start is mostly copying weights and profiling, and Sluice's memory
budget (server/engines/registry.py) already keeps it from the others' KV.
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

T = TypeVar("T")

# Nice +10: a CFS weight of 110 against a serving engine's 1024, about a tenth
# of the cores while both want them, all of them while the others idle.
START_NICE = 10
_CAP_SYS_NICE = 23
# Listings of a task directory taken at most, waiting for two that agree.
_LISTINGS = 20


@dataclass(frozen=True, slots=True)
class StartPriority:
    """What rule 1 does on this machine: the nice value an engine starts at
    (None: the front's own, rule 3) and the one it runs at once ready."""

    start: int | None
    serve: int


def _capabilities(status: str) -> int:
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def can_raise_to(nice: int, *, rlimit_nice: int, cap_eff: int) -> bool:
    """Whether a thread at a higher nice value may be set back to ``nice``
    (rule 3): RLIMIT_NICE's ceiling is ``20 - limit``, CAP_SYS_NICE has none."""
    return bool(cap_eff >> _CAP_SYS_NICE & 1) or nice >= 20 - rlimit_nice


@functools.cache
def plan() -> StartPriority:
    """This process's rule: read once, at the first engine's start (its nice
    value, its limits)."""
    serve = os.getpriority(os.PRIO_PROCESS, 0)
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    try:
        caps = _capabilities(Path("/proc/self/status").read_text())
    except OSError:
        caps = 0
    limit = 40 if soft == resource.RLIM_INFINITY else int(soft)
    ok = can_raise_to(serve, rlimit_nice=limit, cap_eff=caps)
    return StartPriority(start=min(serve + START_NICE, 19) if ok else None, serve=serve)


async def build_lowered(priority: StartPriority, build: Callable[[], T]) -> T:
    """``build()`` on a thread of its own at the start nice value (rule 1):
    not the event loop's default pool, whose threads would keep it. A
    cancelled wait returns at once, as `asyncio.to_thread`'s does."""

    def run() -> T:
        if priority.start is not None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), priority.start)
        return build()

    pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-engine-start")
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, run)
    finally:
        pool.shutdown(wait=False)  # its one thread ends with the build


class Thread(NamedTuple):
    """A thread as rule 2 tells it from others: its id and its start time (in
    clock ticks since boot). An id alone is reused once the kernel's counter
    wraps (32,768 here), so a thread that ended during the build could hide a
    new one."""

    tid: int
    started: int


def _tids(pid: int | str) -> list[str]:
    """The thread ids of a process, listed until two listings agree: the kernel's
    listing of a task directory skips a live thread while another thread exits
    (the build's own thread ends as the engine returns; measured here: the newest
    thread missing from 254 of 500 listings taken then)."""
    last: list[str] | None = None
    for _ in range(_LISTINGS):
        try:
            now = sorted(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            return []
        if now == last:
            break
        last = now
    return last or []


def threads(pid: int | str = "self") -> set[Thread]:
    """The threads of a process (this one by default); empty if it has gone, and
    without one that ends while they are read."""
    found: set[Thread] = set()
    for tid in _tids(pid):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        # Field 22, counted after the command's closing parenthesis (a command
        # may hold spaces and parentheses).
        found.add(Thread(int(tid), int(stat[stat.rindex(")") + 2 :].split()[19])))
    return found


def restore(priority: StartPriority, pids: Iterable[int], these: Iterable[Thread] = ()) -> int:
    """Rule 2: every thread of ``pids``, and the threads ``these``, back at the
    serving nice value. Returns how many were set; one that has gone is skipped."""
    if priority.start is None:
        return 0
    return _set(priority.serve, [*_every(pids), *(t.tid for t in these)])


def lower(priority: StartPriority, pids: Iterable[int]) -> int:
    """Rule 4: every thread of ``pids`` at the start value (none where rule 3 has
    none). Returns how many were set."""
    if priority.start is None:
        return 0
    return _set(priority.start, _every(pids))


def _every(pids: Iterable[int]) -> list[int]:
    """The thread ids of every process of ``pids`` (rules 2 and 4 set them all)."""
    return [int(t) for pid in pids for t in _tids(pid)]


def _set(nice: int, tids: Iterable[int]) -> int:
    count = 0
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (ProcessLookupError, PermissionError):
            continue
        count += 1
    return count
