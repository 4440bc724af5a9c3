"""The watchdog's readers and poller, with fake readers and a fake pynvml."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from batching.pressure import (
    MIB,
    EngineStats,
    GpuMemory,
    HostMemory,
    PressureConfig,
    State,
    Transition,
    Unknown,
)
from server.operations.watchdog import (
    EngineReader,
    HostMemoryReader,
    NvmlReader,
    Watchdog,
    parse_cuda_visible_devices,
)
from tests.support import until

GIB = 1024 * MIB


class FakeReader:
    """Returns queued values (or raises queued exceptions); records its threads."""

    def __init__(self, name: str, *values: Any) -> None:
        self.name = name
        self.values = list(values)
        self.threads: list[int] = []
        self.closed_in: int | None = None

    def read(self) -> Any:
        self.threads.append(threading.get_ident())
        value = self.values.pop(0) if len(self.values) > 1 else self.values[0]
        if isinstance(value, BaseException):
            raise value
        return value

    def close(self) -> None:
        self.closed_in = threading.get_ident()


def gpu_free(mib: float) -> tuple[GpuMemory, ...]:
    return (GpuMemory(0, int(mib * MIB), 0, 24 * GIB),)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    gpu: Any = None, *, clock: Clock | None = None, **kw: Any
) -> tuple[Watchdog, list[tuple[State, Transition]], CollectorRegistry]:
    seen: list[tuple[State, Transition]] = []
    registry = CollectorRegistry()
    wd = Watchdog(
        gpu=gpu,
        host=FakeReader("host", HostMemory(32 * GIB, 64 * GIB)),
        engine=None,
        on_state=lambda s, t: seen.append((s, t)),
        registry=registry,
        clock=clock or Clock(),
        **kw,
    )
    return wd, seen, registry


async def test_reads_run_in_one_worker_thread_never_on_the_loop() -> None:
    reader = FakeReader("gpu", gpu_free(8000))
    wd, _, _ = make(reader)
    try:
        for _ in range(5):
            await wd.poll_once()
    finally:
        await wd.aclose()
    loop_thread = threading.get_ident()
    assert len(reader.threads) == 5
    assert loop_thread not in reader.threads
    assert len(set(reader.threads)) == 1  # init, reads and close on the same thread
    assert reader.closed_in == reader.threads[0]


async def test_transition_calls_back_and_logs_one_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    reader = FakeReader("gpu", gpu_free(8000), gpu_free(900), gpu_free(900))
    wd, seen, registry = make(reader, clock=clock)
    caplog.set_level(logging.INFO, logger="sluice.watchdog")
    try:
        await wd.poll_once()
        clock.now = 0.25
        caplog.clear()
        await wd.poll_once()
        clock.now = 0.5
        await wd.poll_once()
    finally:
        await wd.aclose()
    assert [s for s, _ in seen] == [State.SHEDDING]
    lines = [r.getMessage() for r in caplog.records if "admission" in r.getMessage()]
    assert len(lines) == 1
    assert "OK -> SHEDDING" in lines[0] and "free 900 MiB" in lines[0]
    assert registry.get_sample_value("sluice_admission_state") == 1
    assert registry.get_sample_value("sluice_gpu_memory_free_bytes", {"device": "0"}) == 900 * MIB
    assert registry.get_sample_value("sluice_gpu_memory_total_bytes", {"device": "0"}) == 24 * GIB
    assert registry.get_sample_value("sluice_host_memory_available_bytes") == 32 * GIB
    assert registry.get_sample_value("sluice_nvml_available") == 1
    assert wd.state is State.SHEDDING and wd.latest is not None


async def test_raising_reader_counts_as_unknown_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    err = RuntimeError("GPU is lost")
    reader = FakeReader("gpu", gpu_free(8000), err)
    wd, seen, registry = make(reader, clock=clock, config=PressureConfig(unknown_shed_after=3))
    caplog.set_level(logging.INFO, logger="sluice.watchdog")
    try:
        for i in range(6):
            clock.now = i * 0.25
            await wd.poll_once()
    finally:
        await wd.aclose()
    assert [s for s, _ in seen] == [State.SHEDDING]  # after the 3rd unknown
    assert "unknown for 3 polls" in str(seen[0][1])
    failures = [r for r in caplog.records if "reading failed" in r.getMessage()]
    assert len(failures) == 1
    assert registry.get_sample_value("sluice_nvml_available") == 0


async def test_hung_read_becomes_unknown_without_queueing_more_reads() -> None:
    release = threading.Event()

    class Hung(FakeReader):
        def read(self) -> Any:
            self.threads.append(threading.get_ident())
            if len(self.threads) > 1:
                release.wait(5)
            return gpu_free(8000)

    reader = Hung("gpu")
    wd, _, _ = make(reader, read_timeout=0.05, config=PressureConfig(unknown_shed_after=2))
    try:
        await wd.poll_once()  # the first read works: the reader counts as "was working"
        d1 = await wd.poll_once()
        d2 = await wd.poll_once()
        assert len(reader.threads) == 2  # the stuck read was not re-submitted
        assert wd.latest is not None and isinstance(wd.latest.gpus, Unknown)
        assert d1.state is State.OK and d2.state is State.SHEDDING
        release.set()
        # Once the stuck read returns, the next poll reads again (under load
        # the worker thread may take a while to run: poll until it has).
        for _ in range(100):
            await asyncio.sleep(0.05)
            await wd.poll_once()
            if isinstance(wd.latest.gpus, tuple):
                break
        assert isinstance(wd.latest.gpus, tuple)
    finally:
        release.set()
        await wd.aclose()


async def test_run_polls_on_interval_and_closes_on_cancel() -> None:
    reader = FakeReader("gpu", gpu_free(8000))
    wd, _, _ = make(reader, interval=0.01)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    task = asyncio.ensure_future(wd.run())
    await until(lambda: len(reader.threads) >= 3, timeout=10, what="three polls")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # On an interval, not in a spin: no more polls than the time allowed for.
    assert len(reader.threads) <= (loop.time() - t0) / 0.01 + 2
    assert reader.closed_in is not None and reader.closed_in != threading.get_ident()


async def test_on_abort_and_callback_errors_do_not_stop_polling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    aborts: list[int] = []

    def boom(state: State, t: Transition) -> None:
        raise ValueError("bug in callback")

    reader = FakeReader("gpu", gpu_free(500), gpu_free(400), gpu_free(300))
    wd = Watchdog(
        gpu=reader,
        on_state=boom,
        on_abort=lambda n, d: aborts.append(n),
        config=PressureConfig(abort_on_gpu=True),
        clock=clock,
    )
    try:
        for i in range(3):
            clock.now = i * 0.25
            await wd.poll_once()
    finally:
        await wd.aclose()
    assert wd.state is State.CRITICAL
    assert aborts == [1, 1]
    assert any("callback" in r.getMessage() for r in caplog.records)


async def test_engine_and_host_readers() -> None:
    stats = EngineStats(0.5, running=3, waiting=1, preemptions_total=0)
    box: list[EngineStats | None] = [None]
    eng = EngineReader(lambda: box[0])
    assert isinstance(eng.read(), Unknown)
    box[0] = stats
    assert eng.read() is stats

    vm = types.SimpleNamespace(available=5 * GIB, total=8 * GIB)
    assert HostMemoryReader(lambda: vm).read() == HostMemory(5 * GIB, 8 * GIB)
    real = HostMemoryReader().read()
    assert isinstance(real, HostMemory) and 0 < real.available <= real.total


# --------------------------------------------------------------------------
# NVML


class FakeNVMLError(Exception):
    pass


def fake_nvml(
    *,
    count: int = 2,
    init_error: Exception | None = None,
    v2: bool = True,
    free: Callable[[int], int] = lambda i: (10 + i) * GIB,
) -> Any:
    calls: list[tuple[str, int]] = []
    mod = types.SimpleNamespace(calls=calls, NVMLError=FakeNVMLError)

    def record(name: str) -> None:
        calls.append((name, threading.get_ident()))

    def nvmlInit() -> None:
        record("init")
        if init_error is not None:
            raise init_error

    def get_info(handle: int, version: int | None = None) -> Any:
        record(f"mem{'_v2' if version else ''}")
        if version and not v2:
            raise FakeNVMLError("Function Not Found")
        return types.SimpleNamespace(free=free(handle), used=GIB, total=24 * GIB)

    mod.nvmlInit = nvmlInit
    mod.nvmlShutdown = lambda: record("shutdown")
    mod.nvmlDeviceGetCount = lambda: count
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetHandleByUUID = lambda u: int(u.rsplit("-", 1)[1])
    mod.nvmlDeviceGetIndex = lambda h: h
    mod.nvmlDeviceGetMemoryInfo = get_info
    mod.nvmlMemory_v2 = 0x02000028
    return mod


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("-1", []),
        ("1,0", [1, 0]),
        (" 2 , 3 ", [2, 3]),
        ("0,x,1", [0]),  # CUDA stops at the first invalid entry
        ("GPU-aaaa-1,MIG-bbbb", ["GPU-aaaa-1", "MIG-bbbb"]),
    ],
)
def test_parse_cuda_visible_devices(value: str | None, expected: list[int | str] | None) -> None:
    assert parse_cuda_visible_devices(value) == expected


def test_nvml_reader_all_devices_v2() -> None:
    nvml = fake_nvml(count=2)
    r = NvmlReader(None, nvml=nvml)  # type: ignore[arg-type]
    out = r.read()
    assert out == (GpuMemory(0, 10 * GIB, GIB, 24 * GIB), GpuMemory(1, 11 * GIB, GIB, 24 * GIB))
    r.read()
    names = [n for n, _ in nvml.calls]
    assert names.count("init") == 1 and "mem" not in names
    r.close()
    assert names[-1] != "shutdown" and nvml.calls[-1][0] == "shutdown"
    assert r.available is True


def test_nvml_reader_falls_back_to_v1_and_honours_visible_devices() -> None:
    nvml = fake_nvml(count=4, v2=False)
    r = NvmlReader("3,GPU-x-1", nvml=nvml)  # type: ignore[arg-type]
    out = r.read()
    assert isinstance(out, tuple) and [g.index for g in out] == [3, 1]
    assert [n for n, _ in nvml.calls][-2:] == ["mem", "mem"]


def test_nvml_absent_is_logged_once_and_never_crashes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    caplog.set_level(logging.INFO, logger="sluice.watchdog")
    r = NvmlReader()
    for _ in range(5):
        out = r.read()
        assert isinstance(out, Unknown) and "nvml unavailable" in out.reason
    assert r.available is False
    warnings = [rec for rec in caplog.records if "NVML unavailable" in rec.getMessage()]
    assert len(warnings) == 1
    r.close()


def test_nvml_init_error_is_logged_once() -> None:
    nvml = fake_nvml(init_error=FakeNVMLError("Driver Not Loaded"))
    r = NvmlReader(nvml=nvml)  # type: ignore[arg-type]
    assert isinstance(r.read(), Unknown) and isinstance(r.read(), Unknown)
    assert [n for n, _ in nvml.calls] == ["init"]  # no retry storm
    assert r.unavailable_reason is not None and "Driver Not Loaded" in r.unavailable_reason


def test_real_pynvml_on_this_machine_reads_what_the_machine_has() -> None:
    """The real NVML (or its absence): with NVIDIA's driver loaded, every device
    with sane sizes; without it, Unknown with a reason, and not available."""
    r = NvmlReader()
    try:
        out = r.read()
        if Path("/proc/driver/nvidia/version").exists():  # the kernel driver is loaded
            assert isinstance(out, tuple) and out, out
            for g in out:
                assert g.total > 0 and 0 <= g.free <= g.total and 0 <= g.used <= g.total
            assert r.available is True
        else:
            assert isinstance(out, Unknown) and out.reason, out
            assert r.available is False
    finally:
        r.close()


async def test_watchdog_without_nvml_stays_ok_and_exports_unavailable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    caplog.set_level(logging.INFO, logger="sluice.watchdog")
    clock = Clock()
    wd, seen, registry = make(NvmlReader(), clock=clock)
    try:
        for i in range(10):
            clock.now = i * 0.25
            assert (await wd.poll_once()).state is State.OK
    finally:
        await wd.aclose()
    assert seen == []
    assert wd.nvml_available is False
    assert registry.get_sample_value("sluice_nvml_available") == 0
    assert len([r for r in caplog.records if "NVML" in r.getMessage()]) == 1
    assert not [r for r in caplog.records if "reading failed" in r.getMessage()]


async def test_nvml_calls_happen_on_the_worker_thread() -> None:
    nvml = fake_nvml()
    wd, _, _ = make(NvmlReader(nvml=nvml))  # type: ignore[arg-type]
    try:
        await wd.poll_once()
        await wd.poll_once()
    finally:
        await wd.aclose()
    threads = {t for _, t in nvml.calls}
    assert threading.get_ident() not in threads and len(threads) == 1
    assert nvml.calls[-1][0] == "shutdown"


def test_modules_import_without_vllm_or_torch() -> None:
    # In a fresh interpreter where importing vllm, torch or pynvml would fail.
    code = (
        "import sys; sys.modules.update(vllm=None, torch=None, pynvml=None); "
        "import server.operations.watchdog, server.operations.sdnotify, batching.pressure"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)
