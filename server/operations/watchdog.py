"""The memory watchdog: read NVML, host RAM and engine stats; feed the policy.

Why it looks like this:

* All reads run in **one dedicated worker thread**, never on the event loop:
  an NVML call can take milliseconds (and much longer on a card that is
  falling off the bus), and /proc/meminfo is file I/O. A dedicated thread
  rather than the default executor, because the default one also runs
  tokenizer batches and would be saturated exactly when memory is tight.
  NVML init, every query and shutdown happen on that same thread.
* A read that hangs does not stall the watchdog: after ``read_timeout`` the
  poll counts as "unknown" for every reader, and so do the following polls
  until the stuck read returns (no second read is queued behind it).
* What the numbers mean is decided in batching/pressure.py (sans-IO). This
  module turns its transitions into one log line and a callback, and keeps
  the latest readings and the Prometheus gauges for /metrics.
* No NVML (no driver, no GPU, CPU-only CI): said once in the log, exported as
  ``sluice_nvml_available 0``, and the GPU signal is simply not watched.

The module imports neither vLLM nor pynvml at import time.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import psutil
from prometheus_client import CollectorRegistry, Gauge

from batching.pressure import (
    Decision,
    EngineReading,
    EngineStats,
    GpuMemory,
    GpuReading,
    HostMemory,
    HostReading,
    PressureConfig,
    PressurePolicy,
    Readings,
    State,
    Transition,
    Unknown,
)

log = logging.getLogger("sluice.watchdog")

__all__ = [
    "EngineReader",
    "HostMemoryReader",
    "NvmlReader",
    "Reader",
    "Watchdog",
    "WatchdogMetrics",
    "parse_cuda_visible_devices",
]


class Reader(Protocol):
    """One source of readings. ``read`` is synchronous and runs in the worker
    thread; it returns a frozen reading or :class:`Unknown` (raising is also
    turned into Unknown by the watchdog). ``close`` runs there too, at exit."""

    name: str

    def read(self) -> Any: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------
# NVML


def parse_cuda_visible_devices(value: str | None) -> list[int | str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: ``None`` = all devices.

    Entries are integer indices or ``GPU-``/``MIG-`` UUIDs; CUDA stops at the
    first invalid entry, and so do we ("0,1,x,3" is devices 0 and 1; "" or
    "-1" is none).
    """
    if value is None:
        return None
    out: list[int | str] = []
    for raw in value.split(","):
        item = raw.strip()
        if item.isdigit():
            out.append(int(item))
        elif item.startswith(("GPU-", "MIG-")):
            out.append(item)
        else:
            break
    return out


class NvmlReader:
    """Free/used/total VRAM of the engine's devices, through nvidia-ml-py.

    ``cuda_visible_devices`` is the engine's CUDA_VISIBLE_DEVICES (passed in,
    not read from os.environ). Integer entries are taken as NVML indices, which
    matches CUDA only when CUDA_DEVICE_ORDER=PCI_BUS_ID or all cards are the
    same model; UUID entries are exact. ``nvml`` injects a module for tests.
    """

    name = "gpu"

    def __init__(
        self, cuda_visible_devices: str | None = None, *, nvml: ModuleType | None = None
    ) -> None:
        self._visible = parse_cuda_visible_devices(cuda_visible_devices)
        self._nvml: Any = nvml
        self._handles: list[tuple[int, Any]] = []  # (NVML index, handle)
        self._v2: bool = False
        self._initialised = False
        self.available: bool | None = None  # None until the first read tried
        self.unavailable_reason: str | None = None

    def _init(self) -> None:
        """nvmlInit and device handles, once. Failure is logged once and final."""
        self._initialised = True
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            nvml = self._nvml
            nvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded...
            self._nvml = None
            self._mark_unavailable(f"{type(exc).__name__}: {exc}")
            return
        try:
            self._handles = self._open_handles(nvml)
            self._v2 = self._probe_v2(nvml)
        except Exception as exc:
            self._shutdown_quietly(nvml)
            self._nvml = None
            self._mark_unavailable(f"{type(exc).__name__}: {exc}")
            return
        self.available = True
        log.info(
            "NVML: watching device(s) %s (memory info %s)",
            ", ".join(str(i) for i, _ in self._handles) or "none",
            "v2" if self._v2 else "v1",
        )

    def _open_handles(self, nvml: Any) -> list[tuple[int, Any]]:
        visible = self._visible
        wanted = list(range(nvml.nvmlDeviceGetCount())) if visible is None else visible
        handles: list[tuple[int, Any]] = []
        for dev in wanted:
            if isinstance(dev, int):
                handle = nvml.nvmlDeviceGetHandleByIndex(dev)
                index = dev
            else:
                handle = nvml.nvmlDeviceGetHandleByUUID(dev)
                try:
                    index = int(nvml.nvmlDeviceGetIndex(handle))
                except Exception:  # MIG handles have no index of their own
                    index = len(handles)
            handles.append((index, handle))
        return handles

    def _probe_v2(self, nvml: Any) -> bool:
        """Use nvmlDeviceGetMemoryInfo_v2 where both pynvml and the driver have it.

        v2 reports driver-reserved memory separately, so ``used`` is what
        processes hold; ``free`` is the same in both.
        """
        version = getattr(nvml, "nvmlMemory_v2", None)
        if version is None or not self._handles:
            return False
        try:
            nvml.nvmlDeviceGetMemoryInfo(self._handles[0][1], version=version)
        except Exception:  # NVMLError_FunctionNotFound on old drivers, NotSupported
            return False
        return True

    def _mark_unavailable(self, reason: str) -> None:
        self.available = False
        self.unavailable_reason = reason
        log.warning("NVML unavailable (%s): GPU memory will not be watched", reason)

    def read(self) -> GpuReading:
        if not self._initialised:
            self._init()
        nvml = self._nvml
        if nvml is None:
            return Unknown(f"nvml unavailable: {self.unavailable_reason}")
        out: list[GpuMemory] = []
        for index, handle in self._handles:
            if self._v2:
                info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            else:
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(GpuMemory(index, int(info.free), int(info.used), int(info.total)))
        return tuple(out)

    def gpu_pids(self) -> frozenset[int] | None:
        """The pids of the processes that hold memory on the watched devices
        (NVML's compute processes; a restart waits until the dead engine's are
        gone: server/engines/supervisor.py). None without NVML. In a container
        NVML may name the host's pids, which match none of ours: then nothing
        is waited for, as on CPU."""
        if not self._initialised:
            self._init()
        nvml = self._nvml
        if nvml is None:
            return None
        return frozenset(
            int(p.pid)
            for _, handle in self._handles
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        )

    def close(self) -> None:
        if self._nvml is not None:
            self._shutdown_quietly(self._nvml)
            self._nvml = None

    @staticmethod
    def _shutdown_quietly(nvml: Any) -> None:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown failed: %s", exc)


# --------------------------------------------------------------------------
# Host memory and engine stats


class HostMemoryReader:
    """MemAvailable and MemTotal via psutil (reads /proc/meminfo)."""

    name = "host"

    def __init__(self, virtual_memory: Callable[[], Any] = psutil.virtual_memory) -> None:
        self._virtual_memory = virtual_memory

    def read(self) -> HostReading:
        vm = self._virtual_memory()
        return HostMemory(available=int(vm.available), total=int(vm.total))

    def close(self) -> None:
        pass


class EngineReader:
    """Wraps the engine adapter's zero-argument stats getter.

    The getter runs in the watchdog thread: it must only hand back the latest
    immutable snapshot (EngineAdapter.stats does, under a lock). ``None`` means
    no stats yet.
    """

    name = "engine"

    def __init__(self, get_stats: Callable[[], EngineStats | None]) -> None:
        self._get = get_stats

    def read(self) -> EngineReading:
        stats = self._get()
        return Unknown("engine has no stats yet") if stats is None else stats

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------
# Metrics


class WatchdogMetrics:
    """The watchdog's gauges, on a registry the caller owns (never the global one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.gpu_free = Gauge(
            "sluice_gpu_memory_free_bytes",
            "Free VRAM per device as NVML reports it",
            ["device"],
            registry=registry,
        )
        self.gpu_total = Gauge(
            "sluice_gpu_memory_total_bytes",
            "Total VRAM per device",
            ["device"],
            registry=registry,
        )
        self.host_available = Gauge(
            "sluice_host_memory_available_bytes",
            "Host MemAvailable",
            registry=registry,
        )
        self.state = Gauge(
            "sluice_admission_state",
            "Memory admission state: 0 ok, 1 shedding, 2 critical",
            registry=registry,
        )
        self.nvml_available = Gauge(
            "sluice_nvml_available",
            "1 when the last NVML read succeeded, 0 when NVML is absent or failing",
            registry=registry,
        )

    def observe(self, readings: Readings, state: State) -> None:
        # On a failed read the last values stay; sluice_nvml_available says so.
        if isinstance(readings.gpus, tuple):
            self.nvml_available.set(1)
            for g in readings.gpus:
                self.gpu_free.labels(device=str(g.index)).set(g.free)
                self.gpu_total.labels(device=str(g.index)).set(g.total)
        else:
            self.nvml_available.set(0)
        if isinstance(readings.host, HostMemory):
            self.host_available.set(readings.host.available)
        self.state.set(int(state))


# --------------------------------------------------------------------------
# The poller


@dataclass(frozen=True, slots=True)
class _ReaderSet:
    gpu: Reader | None
    host: Reader | None
    engine: Reader | None


OnState = Callable[[State, Transition], None]
OnAbort = Callable[[int, Decision], None]


class Watchdog:
    """Polls the readers every ``interval`` seconds and drives the policy.

    Run ``await watchdog.run()`` inside the app's task group; cancel it to stop
    (readers are closed - NVML shut down - on the way out). ``on_state`` is
    called on the event loop at every transition; ``on_abort(n, decision)``
    when the policy, in CRITICAL, asks for ``n`` running requests to be
    aborted. ``latest`` and ``decision`` are the last poll's, for /metrics.
    """

    def __init__(
        self,
        *,
        gpu: Reader | None = None,
        host: Reader | None = None,
        engine: Reader | None = None,
        config: PressureConfig | None = None,
        interval: float = 0.25,
        read_timeout: float | None = None,
        on_state: OnState | None = None,
        on_abort: OnAbort | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not (interval > 0 and math.isfinite(interval)):
            raise ValueError("interval must be a positive number of seconds")
        self._readers = _ReaderSet(gpu, host, engine)
        self.policy = PressurePolicy(config)
        self.interval = interval
        # 1 s at the 250 ms default: four missed polls, as unknown_shed_after.
        self.read_timeout = read_timeout if read_timeout is not None else max(1.0, 4 * interval)
        self._on_state = on_state
        self._on_abort = on_abort
        self._metrics = WatchdogMetrics(registry) if registry is not None else None
        self._clock = clock
        self._executor: ThreadPoolExecutor | None = None
        self._pending: asyncio.Future[Readings] | None = None
        self._failing: set[str] = set()  # readers whose failure was logged
        self.latest: Readings | None = None
        self.decision: Decision | None = None

    @property
    def state(self) -> State:
        return self.policy.state

    def gpu_pids(self) -> frozenset[int] | None:
        """The GPU reader's `NvmlReader.gpu_pids`; None without one. Blocking:
        call it in a thread."""
        gpu = self._readers.gpu
        return gpu.gpu_pids() if isinstance(gpu, NvmlReader) else None

    @property
    def nvml_available(self) -> bool | None:
        gpu = self._readers.gpu
        return getattr(gpu, "available", None) if gpu is not None else None

    # -- reading (worker thread) ----------------------------------------

    def _read_one(self, reader: Reader | None) -> Any:
        if reader is None:
            return Unknown("not configured")
        try:
            value = reader.read()
        except Exception as exc:
            value = Unknown(f"{type(exc).__name__}: {exc}")
        if isinstance(value, Unknown):
            if reader.name not in self._failing and not value.reason.startswith("nvml unavail"):
                self._failing.add(reader.name)
                log.warning("watchdog: %s reading failed: %s", reader.name, value.reason)
        elif reader.name in self._failing:
            self._failing.discard(reader.name)
            log.info("watchdog: %s reading recovered", reader.name)
        return value

    def _read_all(self) -> Readings:
        r = self._readers
        return Readings(
            gpus=self._read_one(r.gpu),
            host=self._read_one(r.host),
            engine=self._read_one(r.engine),
        )

    def _close_all(self) -> None:
        for reader in (self._readers.gpu, self._readers.host, self._readers.engine):
            if reader is not None:
                try:
                    reader.close()
                except Exception as exc:
                    log.debug("closing %s reader failed: %s", reader.name, exc)

    # -- polling (event loop) -------------------------------------------

    def _ensure_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="sluice-watchdog")
        return self._executor

    async def poll_once(self) -> Decision:
        """One read (in the worker thread) and one policy step."""
        loop = asyncio.get_running_loop()
        if self._pending is None:
            self._pending = loop.run_in_executor(self._ensure_executor(), self._read_all)
        done, _ = await asyncio.wait({self._pending}, timeout=self.read_timeout)
        if done:
            readings = self._pending.result()
            self._pending = None
        else:
            # Still stuck: this poll saw nothing. The same read is awaited next time.
            stuck = Unknown(f"read still running after {self.read_timeout:.1f} s")
            readings = Readings(gpus=stuck, host=stuck, engine=stuck)
        now = self._clock() if self._clock is not None else loop.time()
        return self._apply(readings, now)

    def _apply(self, readings: Readings, now: float) -> Decision:
        decision = self.policy.update(readings, now)
        self.latest, self.decision = readings, decision
        if self._metrics is not None:
            self._metrics.observe(readings, decision.state)
        t = decision.transition
        if t is not None:
            level = logging.WARNING if t.new > t.old else logging.INFO
            log.log(level, "%s", t)
            if self._on_state is not None:
                self._call(self._on_state, t.new, t)
        if decision.abort_newest and self._on_abort is not None:
            log.warning(
                "memory still falling in CRITICAL: aborting %d request(s) (%s)",
                decision.abort_newest,
                decision.reason,
            )
            self._call(self._on_abort, decision.abort_newest, decision)
        return decision

    @staticmethod
    def _call(callback: Callable[..., None], *args: Any) -> None:
        # A bug in a callback must not stop the watchdog: log it and keep polling.
        try:
            callback(*args)
        except Exception:
            log.exception("watchdog callback %r failed", callback)

    async def run(self) -> None:
        """Poll until cancelled, on a fixed grid (missed ticks are skipped, not
        bunched up), then close the readers in their thread."""
        loop = asyncio.get_running_loop()
        try:
            next_at = loop.time()
            while True:
                await self.poll_once()
                next_at += self.interval
                now = loop.time()
                if next_at < now:
                    next_at = now + self.interval - (now - next_at) % self.interval
                await asyncio.sleep(next_at - now)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close the readers (NVML shutdown) in the worker thread, then the thread.

        Bounded: if a read is stuck, closing waits at most ``read_timeout``
        and leaves the thread behind (systemd's TimeoutStopSec ends it).
        """
        executor, self._executor = self._executor, None
        if executor is None:
            return
        loop = asyncio.get_running_loop()
        closing = loop.run_in_executor(executor, self._close_all)
        try:
            await asyncio.wait({closing}, timeout=self.read_timeout)
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
        if not closing.done():
            log.warning("watchdog: readers did not close within %.1f s", self.read_timeout)
        if self._pending is not None:
            # A stuck read: drop interest so its late result is not delivered to
            # a loop that may be closed by then.
            self._pending.cancel()
            self._pending = None
