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
   that ends: on shared cores the chat turn's engine runs first. While it
   yields, its processes also run under SCHED_IDLE, with rule 5's floor over
   each `COUNT_S` window rather than since a start (`Yielding`): an engine that
   had less than `FLOOR_CORES` of a core in the last window runs the next at the
   start value alone. At nice +10 alone a chat turn beside another model's
   embedding flood took 1.41-1.56x its alone time at p95 (5 runs of 3
   repetitions); under SCHED_IDLE 1.17-1.33x, the flood at about half its rate
   at nice +10 (bench/results/interactive-first-cpu.md).
5. While an engine builds and another engine of this server has interactive work
   (the board's word: server/engines/board.py), the build's thread and every
   process it has started run under Linux's SCHED_IDLE policy, and back at the
   start value (SCHED_OTHER) when that ends (`build_lowered`'s `contended`,
   looked at every `WATCH_S`). A nice value only weighs a share: a niced start
   runs out its slice on the core a chat turn's step wakes on. An idle-policy
   thread is preempted at once by any other thread's wakeup and takes only the
   time no other thread wants. The floor: a build that has had less than
   `FLOOR_CORES` of a core on average so far (its thread and its processes'
   CPU time over its wall time) runs at the start value until it has, so on
   cores that stay busy it still starts at about rule 1's pace (nice +10's share
   of a contended core is about a tenth); where a core is idle now and then,
   as beside a chat caller, it gets far more (in an instrumented restart the
   floor never acted). Measured beside a closed-loop chat caller on 2 cores
   (bench/results/interactive-first-cpu.md), per repetition the chat's TTFT p95
   during another model's restart against its calm p95 just before: 1.48x
   (median of 10) at nice +10 alone, 1.17x (median of 14) with this rule; the
   restart took 30-74 s at nice +10, 56-90 s with it. Without any interactive
   work the build runs at the start value, so a start on a machine that only
   runs background work is no slower than rule 1's. Rule 3's permission covers
   the way back (an unprivileged thread leaves SCHED_IDLE within RLIMIT_NICE;
   sched(7)).

The card has no such knob here: NVIDIA's time slicing gives each process
its turn, and a per-process share needs MPS (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``),
which a start could only set for the process's whole life. On the card an
engine's start is mostly copying weights and profiling, and Sluice's memory
budget (server/engines/registry.py) already keeps it from the others' KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from server.engines.procs import process_tree, stat_fields

T = TypeVar("T")

# Nice +10: a CFS weight of 110 against a serving engine's 1024, about a tenth
# of the cores while both want them, all of them while the others idle.
START_NICE = 10
_CAP_SYS_NICE = 23
# Listings of a task directory taken at most, waiting for two that agree.
_LISTINGS = 20
_HZ = os.sysconf("SC_CLK_TCK")
# Rule 5: how often a build's watcher looks at the board (a chat turn's prefill
# on the demo model lasts a few milliseconds; a turn's presence lasts a second
# past its end: batching/step_share.py's linger).
WATCH_S = 0.05
FLOOR_CORES = 0.1  # rule 5's floor: a build's least average CPU, in cores
# How often the watcher counts the build's processes and their CPU time (reading
# /proc on the event loop; an average over tens of seconds moves slowly).
COUNT_S = 1.0


def idles(contended: bool, cpu_s: float, elapsed_s: float) -> bool:
    """Rule 5: does a build run under SCHED_IDLE now, contended or not, having
    had `cpu_s` CPU seconds in its `elapsed_s` seconds?"""
    return contended and cpu_s >= FLOOR_CORES * elapsed_s


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


async def build_lowered(
    priority: StartPriority,
    build: Callable[[], T],
    contended: Callable[[], bool] | None = None,
) -> T:
    """``build()`` on a thread of its own at the start nice value (rule 1):
    not the event loop's default pool, whose threads would keep it. While it
    runs, ``contended()`` (another engine has interactive work) puts the build
    under SCHED_IDLE, and its end back (rule 5). A cancelled wait returns at
    once, as `asyncio.to_thread`'s does."""
    tid: list[int] = []

    def run() -> T:
        tid.append(threading.get_native_id())
        if priority.start is not None:
            os.setpriority(os.PRIO_PROCESS, tid[0], priority.start)
        return build()

    watch = contended if priority.start is not None else None
    before = set(process_tree(os.getpid())) if watch is not None else set()
    pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-engine-start")
    try:
        done = asyncio.get_running_loop().run_in_executor(pool, run)
        if watch is not None:
            await _watch(done, tid, before, priority, watch)
        return await done
    finally:
        pool.shutdown(wait=False)  # its one thread ends with the build


async def _watch(
    done: asyncio.Future[Any],
    tid: list[int],
    before: set[int],
    priority: StartPriority,
    contended: Callable[[], bool],
) -> None:
    """Rule 5 until the build is `done`: its thread (`tid`, once it runs) and the
    processes it started (not in `before`) under SCHED_IDLE while `idles` says so.
    What it started keeps its policy at the end: rule 2's restore sets it back."""
    idle = False
    start = counted = time.monotonic()
    spawned: list[int] = []
    used = 0.0
    while not done.done():
        if tid:
            now = time.monotonic()
            if now - counted >= COUNT_S or not spawned:
                spawned = _spawned(before)
                used, counted = _cpu_seconds(tid[0], spawned), now
            if idles(contended(), used, counted - start) != idle:
                idle = not idle
                spawned = _spawned(before)
                _idle(idle, priority, [*tid, *_every(spawned)])
        await asyncio.wait([done], timeout=WATCH_S)


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
        fields = stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if fields is not None:
            found.add(Thread(int(tid), int(fields[19])))  # proc(5)'s field 22
    return found


def restore(priority: StartPriority, pids: Iterable[int], these: Iterable[Thread] = ()) -> int:
    """Rule 2: every thread of ``pids``, and the threads ``these``, back at the
    serving nice value (and out of rule 5's SCHED_IDLE). Returns how many were
    set; one that has gone is skipped."""
    if priority.start is None:
        return 0
    return _set(priority.serve, [*_every(pids), *(t.tid for t in these)])


def lower(priority: StartPriority, pids: Iterable[int]) -> int:
    """Rule 4: every thread of ``pids`` at the start value (none where rule 3 has
    none). Returns how many were set."""
    if priority.start is None:
        return 0
    return _set(priority.start, _every(pids))


class Yielding:
    """Rule 4 for one serving engine's processes (`root`, its engine core, and its
    descendants): lowered while it yields, under SCHED_IDLE while the floor allows
    (rule 5's `idles` over each `COUNT_S` window), back at the serving value when it
    ends. Its scheduler calls `set` when the answer changes and `tick` at each step;
    `tick` reads /proc once a window, not each step."""

    def __init__(self, priority: StartPriority, root: int) -> None:
        self.priority = priority
        self.root = root
        self.on = False  # yielding
        self.idle = False  # under SCHED_IDLE now
        self._since = 0.0  # the window's start
        self._used = 0.0  # the processes' CPU seconds then

    def set(self, on: bool, now: float) -> None:
        """Start yielding (lowered, and idle at once: the floor looks back at the
        end of the first window) or end it (rule 2's serving value)."""
        self.on = on
        tree = process_tree(self.root)
        if not on:
            restore(self.priority, tree)
            self.idle = False
        elif self.priority.start is not None:  # rule 3: else nothing is lowered
            lower(self.priority, tree)
            self._switch(True, _every(tree))
            self._since, self._used = now, _cpu_seconds(None, tree)

    def tick(self, now: float) -> None:
        """While yielding, at the end of each window: idle or not for the next (the floor)."""
        if not self.on or self.priority.start is None or now - self._since < COUNT_S:
            return
        tree = process_tree(self.root)
        used = _cpu_seconds(None, tree)
        idle = idles(True, used - self._used, now - self._since)
        if idle != self.idle:
            self._switch(idle, _every(tree))
        self._since, self._used = now, used

    def _switch(self, idle: bool, tids: list[int]) -> None:
        self.idle = idle
        _idle(idle, self.priority, tids)


def _every(pids: Iterable[int]) -> list[int]:
    """The thread ids of every process of ``pids`` (rules 2 and 4 set them all)."""
    return [int(t) for pid in pids for t in _tids(pid)]


def _set(nice: int, tids: Iterable[int]) -> int:
    count = 0
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:  # rule 5's, ended
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (ProcessLookupError, PermissionError):
            continue
        count += 1
    return count


def _spawned(before: set[int]) -> list[int]:
    """This process's descendants that were not there before the build."""
    return [p for p in process_tree(os.getpid()) if p not in before]


def _cpu_seconds(tid: int | None, pids: Iterable[int]) -> float:
    """CPU seconds of this process's thread ``tid`` (None: none) and of the processes
    ``pids`` (user and system, from /proc; one that has gone counts nothing)."""
    ticks = 0
    own = [] if tid is None else [f"/proc/self/task/{tid}/stat"]
    for path in [*own, *(f"/proc/{pid}/stat" for pid in pids)]:
        if (fields := stat_fields(path)) is not None:
            ticks += int(fields[11]) + int(fields[12])  # proc(5)'s utime and stime
    return ticks / _HZ


def _idle(idle: bool, priority: StartPriority, tids: Iterable[int]) -> None:
    """Rule 5: ``tids`` under SCHED_IDLE, or back at the start value."""
    if not idle:
        _set(priority.start if priority.start is not None else priority.serve, tids)
        return
    for tid in tids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
