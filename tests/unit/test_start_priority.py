"""server/engines/start_priority.py: an engine is built at a lower CPU priority
where the OS lets Sluice raise it back (rule 3), and raised back once ready."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from server.engines import start_priority
from server.engines.start_priority import StartPriority, build_lowered, can_raise_to, restore
from tests.support import until


@pytest.mark.parametrize(
    ("nice", "rlimit", "caps", "ok"),
    [
        (0, 0, 0, False),  # the default: no RLIMIT_NICE, no capability
        (0, 20, 0, True),  # systemd's LimitNICE=20: ceiling 0
        (5, 15, 0, True),  # a front at nice 5 with ceiling 5
        (0, 19, 0, False),  # ceiling 1: 0 is out of reach
        (0, 0, 1 << 23, True),  # CAP_SYS_NICE
        (0, 0, (1 << 64) - 1 - (1 << 23), False),  # every capability but that one
    ],
)
def test_rule_3_raising_back_needs_the_limit_or_the_capability(
    nice: int, rlimit: int, caps: int, ok: bool
) -> None:
    assert can_raise_to(nice, rlimit_nice=rlimit, cap_eff=caps) is ok


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


async def test_rule_1_a_thread_of_its_own_and_what_it_spawns() -> None:
    """The build runs on its own thread at the start value; a process it starts
    inherits it; the event loop's thread (and its default pool) keep theirs."""
    prio = StartPriority(start=_nice(0) + 3, serve=_nice(0))

    def build() -> tuple[int, int, int]:
        child = subprocess.run(
            ["sh", "-c", "cut -d' ' -f19 /proc/self/stat"],
            check=True,
            capture_output=True,
            text=True,
        )
        return threading.get_native_id(), _nice(threading.get_native_id()), int(child.stdout)

    tid, own, spawned = await build_lowered(prio, build)
    assert tid != threading.get_native_id()
    assert own == spawned == prio.start
    assert _nice(threading.get_native_id()) == prio.serve
    assert await asyncio.to_thread(lambda: _nice(threading.get_native_id())) == prio.serve


async def test_rule_2_the_threads_a_build_starts_in_this_process() -> None:
    """A thread the build starts here (vLLM's engine client's I/O threads) has
    the start value, and is set back with the engine; every time, though the
    build's own thread is ending as the list is taken (the kernel's listing of a
    task directory skips a live thread while another exits: CI failed twice on
    it, and a single listing missed the new thread in 254 of 500 tries here)."""
    prio = start_priority.plan()
    if prio.start is None:
        pytest.skip("this process may not raise a priority back (rule 3)")
    for _ in range(50):
        stop = threading.Event()
        started: list[int] = []

        def build() -> None:
            t = threading.Thread(target=stop.wait, daemon=True)  # noqa: B023
            t.start()
            assert t.native_id is not None
            started.append(t.native_id)  # noqa: B023

        before = start_priority.threads()
        try:
            await build_lowered(prio, build)
            new = start_priority.threads() - before
            assert set(started) <= {t.tid for t in new} and _nice(started[0]) == prio.start
            # The build's own executor thread may have ended by now: not counted.
            assert restore(prio, [], new) >= len(started) and _nice(started[0]) == prio.serve
        finally:
            stop.set()


def test_a_thread_is_its_id_and_its_start_time() -> None:
    """Rule 2 tells threads apart by id and start time (an id is reused once the
    kernel's counter wraps), read past a name that holds spaces and parentheses."""
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    try:
        assert t.native_id is not None
        Path(f"/proc/self/task/{t.native_id}/comm").write_text("a) 1 2 (b")
        stat = Path("/proc/self/stat").read_text()
        process_start = int(stat[stat.rindex(")") + 2 :].split()[19])
        now = time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK")
        (mine,) = [s for s in start_priority.threads() if s.tid == t.native_id]
        assert process_start <= mine.started <= now
    finally:
        stop.set()


async def test_a_failed_build_raises_in_the_awaiting_task() -> None:
    def build() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        await build_lowered(StartPriority(start=None, serve=0), build)


def test_rule_2_every_thread_back_at_the_serving_value() -> None:
    prio = start_priority.plan()
    if prio.start is None:
        pytest.skip("this process may not raise a priority back (rule 3)")
    sleeper = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start()"
    proc = subprocess.Popen(
        ["nice", "-n", str(start_priority.START_NICE), "python3", "-c", sleeper]
    )
    try:
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{proc.pid}/task")) < 2:
            assert time.monotonic() < deadline, "the sleeper's second thread never started"
            time.sleep(0.01)
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert {_nice(t) for t in tids} == {prio.serve + start_priority.START_NICE}
        assert restore(prio, [proc.pid, 2**22 + 1]) == len(tids)  # a gone pid is skipped
        assert {_nice(t) for t in tids} == {prio.serve}
        # Rule 4: lowered again while another model's turn runs, and back.
        assert start_priority.lower(prio, [proc.pid]) == len(tids)
        assert {_nice(t) for t in tids} == {prio.start}
        assert restore(prio, [proc.pid]) == len(tids)
        assert {_nice(t) for t in tids} == {prio.serve}
    finally:
        proc.kill()
        proc.wait()


def test_without_rule_3_nothing_is_lowered_or_raised() -> None:
    assert restore(StartPriority(start=None, serve=0), [os.getpid()]) == 0
    assert start_priority.lower(StartPriority(start=None, serve=0), [os.getpid()]) == 0


def test_rule_5_the_floor_a_build_below_a_tenth_of_a_core_does_not_idle() -> None:
    assert start_priority.idles(True, 0.0, 0.0)
    assert start_priority.idles(True, 1.0, 10.0)
    assert start_priority.idles(True, 8.0, 10.0)
    assert not start_priority.idles(True, 0.99, 10.0)  # the floor
    assert not start_priority.idles(False, 8.0, 10.0)  # nobody to give way to


async def test_rule_5_a_build_idles_while_another_engine_has_interactive_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While `contended()` holds, the build's thread and the process it started run
    under SCHED_IDLE; when it ends, at the start value again; after the build,
    rule 2 puts what it started back at the serving value, out of SCHED_IDLE.
    (No floor here: the test looks at the policy while contended.)"""
    monkeypatch.setattr(start_priority, "FLOOR_CORES", 0.0)
    prio = start_priority.plan()
    if prio.start is None:
        pytest.skip("this process may not raise a priority back (rule 3)")
    contended = threading.Event()
    release = threading.Event()
    seen: dict[str, int] = {}

    def build() -> subprocess.Popen[bytes]:
        seen["tid"] = threading.get_native_id()
        child = subprocess.Popen(["sleep", "30"])
        seen["child"] = child.pid
        release.wait(20)
        return child

    def policy(tid: int) -> int:
        return os.sched_getscheduler(tid)

    task = asyncio.create_task(build_lowered(prio, build, contended.is_set))
    try:
        await until(lambda: "child" in seen, what="the build's child")
        tid, child = seen["tid"], seen["child"]
        assert policy(tid) == policy(child) == os.SCHED_OTHER
        contended.set()
        await until(lambda: policy(child) == os.SCHED_IDLE, what="the child idle")
        assert policy(tid) == os.SCHED_IDLE
        contended.clear()
        await until(lambda: policy(child) == os.SCHED_OTHER, what="the child back")
        assert policy(tid) == os.SCHED_OTHER
        assert _nice(child) == _nice(tid) == prio.start
        contended.set()
        await until(lambda: policy(child) == os.SCHED_IDLE, what="the child idle again")
    finally:
        release.set()
        proc = await asyncio.wait_for(task, 20)
    try:
        assert policy(proc.pid) == os.SCHED_IDLE  # the build ended while contended
        assert restore(prio, [proc.pid]) == 1
        assert policy(proc.pid) == os.SCHED_OTHER and _nice(proc.pid) == prio.serve
    finally:
        proc.kill()
        proc.wait()


def test_rule_5_the_floor_counts_the_builds_thread_and_its_processes() -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    spin += "print(1)"
    with subprocess.Popen(["python3", "-c", spin], stdout=subprocess.PIPE) as child:
        me = threading.get_native_id()
        assert child.stdout is not None and child.stdout.readline() == b"1\n"
        used = start_priority._cpu_seconds(me, [child.pid])
        assert used >= 0.3 + start_priority._cpu_seconds(me, []) - 0.05
        child.wait()
    assert start_priority._cpu_seconds(me, [child.pid]) < used  # gone: counts nothing


def test_rule_4_a_yielding_engine_idles_above_its_floor() -> None:
    """A serving engine that yields (its scheduler's `Yielding`): lowered and under
    SCHED_IDLE at once; at the end of a window in which it had less than the floor's
    CPU, at the start value alone, and idle again after one in which it had more;
    at the serving value when the yield ends."""
    prio = start_priority.plan()
    if prio.start is None:
        pytest.skip("this process may not raise a priority back (rule 3)")
    spin = "import sys, time\nprint(0, flush=True)\nfor _ in sys.stdin:\n"
    spin += "    t = time.process_time()\n    while time.process_time() - t < 0.3: pass\n"
    spin += "    print(1, flush=True)\n"
    with subprocess.Popen(
        ["python3", "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline() == b"0\n"  # started: its start's CPU is not counted
        y = start_priority.Yielding(prio, root=proc.pid)
        y.set(True, now=100.0)
        assert y.idle and os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        assert _nice(proc.pid) == prio.start
        y.tick(now=100.0 + start_priority.COUNT_S / 2)  # the window goes on
        assert y.idle
        y.tick(now=100.0 + start_priority.COUNT_S)  # idle in it: the floor
        assert not y.idle and os.sched_getscheduler(proc.pid) == os.SCHED_OTHER
        assert _nice(proc.pid) == prio.start
        proc.stdin.write(b"spin\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"1\n"  # 0.3 CPU seconds in the next window
        y.tick(now=100.0 + 2 * start_priority.COUNT_S)
        assert y.idle and os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        y.set(False, now=100.0 + 2.5 * start_priority.COUNT_S)
        assert not y.idle and os.sched_getscheduler(proc.pid) == os.SCHED_OTHER
        assert _nice(proc.pid) == prio.serve
        proc.stdin.close()
        proc.wait()
