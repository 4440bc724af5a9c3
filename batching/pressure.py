"""Memory-pressure policy: readings in, admission state out (sans-IO).

Why a separate, pure module: the watchdog (server/operations/watchdog.py) only *reads*
NVML, /proc/meminfo and the engine's stats; every decision about what those
numbers mean lives here, where a test can replay any sequence of readings with
any timestamps and no threads, sleeps or GPU.

Three signals feed one state:

* **gpu** - the lowest free VRAM over the engine's devices (tensor parallel
  fails when *any* card runs out). vLLM reserves its KV cache up front, so this
  mostly tracks *other* processes on the workstation.
* **kv** - a preemption storm: the engine evicting running requests (to recompute
  them later) over and over while its KV cache is full. A full KV cache alone is
  not pressure: vLLM reserves the cache up front and never runs out of memory
  because of it; it is a busy engine, and the backlog (batching/backlog.py) holds
  the work that does not fit. Only preemptions counted while KV use is at least
  ``kv_storm_usage``, and at least ``preempt_shed`` of them within
  ``preempt_window`` seconds, make a storm. That threshold is also how the policy
  tells a storm from the preemptions vLLM's priority scheduler makes on purpose
  (``--scheduling-policy priority``: one running request per urgent arrival that
  finds no room): set ``preempt_shed`` above the number of urgent arrivals a window
  can bring.
  With data-parallel ranks (vLLM's --data-parallel-size) the storm is judged per
  rank, each rank's preemptions against its own KV use, and the worst rank
  decides: each rank has its own scheduler and cache, and evicts only its own
  requests. Not the mean: one full rank evicting beside an idle one averages
  0.55 used, below ``kv_storm_usage``, and its storm would never count. Not the
  least-used rank: the free rank takes new work, but the running requests of
  the full one are still evicted again and again. Not preemptions summed over
  ranks: the thresholds are one scheduler's (two ranks each evicting 12 in 5 s
  are two busy engines, not one storm of 24).
* **host** - available host RAM (MemAvailable), for the OOM killer's sake.

Each signal keeps its own level with hysteresis (enter below one level, leave
above a higher one), the state is the highest level of any signal, escalation
is immediate and relaxing waits until no signal has demanded the current state
for ``min_dwell`` seconds. A reader that *was* working and now fails counts as
unknown, never as fine: after ``unknown_shed_after`` consecutive unknowns it
demands SHEDDING. A reader that never worked (no NVML on this machine, engine
not started) is ignored.

In CRITICAL the policy also asks the server to abort running requests, one per
poll, while a critical signal keeps getting worse (free memory at least
``abort_step_mib`` below the reference, or vLLM still preempting).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

MIB = 1024 * 1024


class State(enum.IntEnum):
    """Admission state; the int value is what ``sluice_admission_state`` exports.

    The batching core's own ``AdmissionState`` (batching/types.py) adds DRAINING,
    which is the server's business, not memory's; the server maps between them.
    """

    OK = 0
    SHEDDING = 1
    CRITICAL = 2


# --------------------------------------------------------------------------
# Readings: one frozen snapshot per poll.


@dataclass(frozen=True, slots=True)
class Unknown:
    """A reader failed (or has no data yet). ``reason`` goes into the log line."""

    reason: str


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One device as NVML reports it. ``index`` is NVML's (nvidia-smi's) index."""

    index: int
    free: int  # bytes
    used: int  # bytes
    total: int  # bytes


@dataclass(frozen=True, slots=True)
class HostMemory:
    available: int  # bytes, MemAvailable: what can be allocated without swapping
    total: int  # bytes


@dataclass(frozen=True, slots=True)
class RankStats:
    """One data-parallel rank's scheduler, from its latest step."""

    kv_cache_usage: float  # 0..1
    running: int
    waiting: int
    preemptions_total: int = 0  # cumulative, this rank's own (the storm is per rank)
    # Its prefix cache's prompt tokens looked up and found, cumulative (vLLM's
    # per-step prefix_cache_stats): the hit rate per rank prefix placement aims at.
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # What the watchdog's reason calls it; "" is "rank N". With several models
    # each engine is a scheduler of its own, named by its model (server/app.py).
    name: str = ""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine adapter's latest stats snapshot (counters are cumulative).

    With data-parallel ranks, `running` and `waiting` are summed over them and
    `kv_cache_usage` is their mean (ranks have equal caches), and `ranks` holds
    each rank's own numbers, in rank order; with one rank, `ranks` is empty.
    """

    kv_cache_usage: float  # 0..1, fraction of KV-cache blocks in use
    running: int
    waiting: int
    preemptions_total: int
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    ranks: tuple[RankStats, ...] = ()
    # Engine steps in which a LoRA adapter had waiting requests and none running
    # (server/engines/vllm_adapter.py, adapter_waited): its work waited for an adapter slot.
    adapter_wait_steps_total: int = 0
    # Engine steps reported (each rank's stats count once): the denominator for
    # the adapter-wait share.
    steps_total: int = 0
    # Tokens the engine's steps scheduled (vLLM's iteration details): prompt tokens
    # (whole prompts and chunks) and decode tokens.
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    # Seconds those steps ran (iteration details' elapsed_ms: from the scheduled
    # batch to its model output), summed over ranks: against the wall clock, how
    # much of it the engine spent in steps rather than between them (issue 27).
    step_seconds_total: float = 0.0
    # The longest step of the last minute (of the latest steps, once the engine has
    # idled since): how long a health check may wait for the step in progress
    # (server/engines/restarts.py, rule 1).
    longest_step_s: float = 0.0

    @property
    def kv_usage_least(self) -> float | None:
        """The least-used rank's KV use (None with one rank)."""
        return min(r.kv_cache_usage for r in self.ranks) if self.ranks else None


# Before the engine has reported anything: nothing in use, nothing counted.
ENGINE_IDLE = EngineStats(kv_cache_usage=0.0, running=0, waiting=0, preemptions_total=0)

GpuReading = tuple[GpuMemory, ...] | Unknown
HostReading = HostMemory | Unknown
EngineReading = EngineStats | Unknown

_NOT_READ = Unknown("not read")


@dataclass(frozen=True, slots=True)
class Readings:
    """Everything one poll saw. An empty ``gpus`` tuple means "no GPU to watch"."""

    gpus: GpuReading = _NOT_READ
    host: HostReading = _NOT_READ
    engine: EngineReading = _NOT_READ


# --------------------------------------------------------------------------
# Configuration.


@dataclass(frozen=True, slots=True)
class PressureConfig:
    """Thresholds; the CLI has one flag per field (server/options.py).

    Defaults, and why:

    * GPU free VRAM: shed below 1024 MiB, leave above 2048 MiB, critical below
      512 MiB. vLLM has its KV cache already; what still allocates at run time
      is the CUDA context of a newcomer, cuBLAS workspaces, sampler scratch and
      the caching allocator's growth - tens to hundreds of MiB. 1 GiB leaves
      room for that plus one more small process; 512 MiB is one bad allocation
      from an OOM. The 1 GiB gap between enter and leave is wider than the
      jitter of a desktop compositor (a few hundred MiB) so the state does not
      flap. A card is watched only if it is one the engine uses.
    * Preemption storm: preemptions count only in polls where KV use is
      >= 0.90 (``kv_storm_usage``: below that vLLM has free blocks and does not
      preempt for memory). Shed at >= 20 within 5 s (``preempt_window``),
      stay shedding while >= 5, critical at >= 100 within 5 s with KV use
      >= 0.98, and stay critical while the count is >= 20 and KV use >= 0.90.
      Why: a preemption throws away a request's KV and recomputes it later;
      a few per second is a busy engine (and, with priority scheduling, one per
      urgent arrival is by design), 4 per second sustained for 5 s means the
      same requests are evicted again and again, and 20 per second with a
      full cache is a collapse where aborting the newest request is cheaper.
      These are judgments, not measurements; the flags exist to tune them.
    * Host MemAvailable: shed below 1024 MiB, leave above 2048 MiB, critical
      below 512 MiB - the same reasoning as VRAM, for the kernel's OOM killer.
    * ``min_dwell`` 2 s: 8 polls at 250 ms; longer than a client's typical
      first retry, so refused clients do not bounce the state back at once.
    * ``unknown_shed_after`` 4: a reader that worked and then fails 4 polls in
      a row (1 s) is treated as pressure; one failed read is noise, a second
      of blindness is not. ``None`` never sheds on unknown readings.
    * ``abort_step_mib`` 64: in CRITICAL, one running request is aborted per
      poll whenever free memory is another 64 MiB below where it was when the
      state was entered or the last abort was asked for (NVML's free value
      moves by a few MiB between polls on an idle card).
    """

    gpu_shed_free_mib: int = 1024
    gpu_leave_free_mib: int = 2048
    gpu_critical_free_mib: int = 512

    kv_storm_usage: float = 0.90
    kv_critical_usage: float = 0.98
    preempt_window: float = 5.0  # seconds
    preempt_shed: int = 20
    preempt_leave: int = 5
    preempt_critical: int = 100

    host_shed_available_mib: int = 1024
    host_leave_available_mib: int = 2048
    host_critical_available_mib: int = 512

    min_dwell: float = 2.0  # seconds
    unknown_shed_after: int | None = 4  # consecutive unknown polls
    abort_step_mib: int = 64
    # Aborting our requests frees KV blocks and host buffers, but vLLM keeps its
    # VRAM in its own pools, so aborts rarely give VRAM back to the driver:
    # off by default, so falling VRAM sheds and stops new work but does not
    # kill running requests (KV preemptions and host memory still abort).
    abort_on_gpu: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.gpu_critical_free_mib < self.gpu_shed_free_mib < self.gpu_leave_free_mib:
            raise ValueError("need 0 <= gpu critical < gpu shed < gpu leave (free MiB)")
        if not (
            0
            <= self.host_critical_available_mib
            < self.host_shed_available_mib
            < self.host_leave_available_mib
        ):
            raise ValueError("need 0 <= host critical < host shed < host leave (available MiB)")
        if not 0.0 <= self.kv_storm_usage <= self.kv_critical_usage <= 1.0:
            raise ValueError("need 0 <= kv storm <= kv critical <= 1 (usage)")
        if not (self.preempt_window > 0 and math.isfinite(self.preempt_window)):
            raise ValueError("preempt_window must be a finite number of seconds > 0")
        if not 1 <= self.preempt_leave <= self.preempt_shed <= self.preempt_critical:
            raise ValueError("need 1 <= preempt leave <= preempt shed <= preempt critical")
        if not (self.min_dwell >= 0.0 and math.isfinite(self.min_dwell)):
            raise ValueError("min_dwell must be a finite number of seconds >= 0")
        if self.unknown_shed_after is not None and self.unknown_shed_after < 1:
            raise ValueError("unknown_shed_after must be >= 1 or None")
        if self.abort_step_mib < 0:
            raise ValueError("abort_step_mib must be >= 0")


# --------------------------------------------------------------------------
# Outputs.


@dataclass(frozen=True, slots=True)
class Reason:
    """Which signal decided, and the reading, for one log line."""

    signal: str  # "gpu" | "kv" | "host" | "none"
    detail: str

    def __str__(self) -> str:
        return f"{self.signal}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Transition:
    old: State
    new: State
    at: float  # the ``now`` passed to update()
    reason: Reason

    def __str__(self) -> str:
        return f"admission {self.old.name} -> {self.new.name} ({self.reason})"


@dataclass(frozen=True, slots=True)
class Decision:
    """What one poll means. ``transition`` is set only when the state changed."""

    state: State
    reason: Reason
    transition: Transition | None = None
    # Running requests to abort now (the server picks the newest, lowest-priority).
    abort_newest: int = 0


# --------------------------------------------------------------------------
# The state machine.


@dataclass(slots=True)
class _Signal:
    """One signal's private state: its own hysteresis level and unknown count."""

    name: str
    level: State = State.OK
    ever_known: bool = False
    unknown_streak: int = 0
    detail: str = "no reading yet"
    # Worst value seen since CRITICAL or the last abort (bytes free, for gpu/host).
    abort_ref: int | None = None


@dataclass(slots=True)
class _Storm:
    """One scheduler's preemption window (the engine's, or one DP rank's)."""

    last: int | None = None  # the cumulative count at the previous poll
    # (time, preemptions) of polls that counted towards a storm, oldest first.
    counted: deque[tuple[float, int]] = field(default_factory=deque)
    count: int = 0

    def add(self, total: int, usage: float, now: float, cfg: PressureConfig) -> int:
        """Take this poll's counter; the preemptions new since the last poll."""
        # A counter that went down means the engine restarted: rebase, not "rising".
        new = 0 if self.last is None else max(0, total - self.last)
        self.last = total
        if new and usage >= cfg.kv_storm_usage:
            self.counted.append((now, new))
            self.count += new
        while self.counted and self.counted[0][0] <= now - cfg.preempt_window:
            self.count -= self.counted.popleft()[1]
        return new


def _schedulers(reading: EngineStats) -> tuple[tuple[str, float, int], ...]:
    """(name, KV use, cumulative preemptions) per scheduler the storm is judged on."""
    if not reading.ranks:
        return (("", reading.kv_cache_usage, reading.preemptions_total),)
    return tuple(
        (r.name or f"rank {i}", r.kv_cache_usage, r.preemptions_total)
        for i, r in enumerate(reading.ranks)
    )


def _storm_level(count: int, usage: float, prev: State, cfg: PressureConfig) -> State:
    """One scheduler's storm level, given the kv signal's previous level."""
    # Enter CRITICAL on a big storm with a full cache; stay while it goes on.
    critical = count >= cfg.preempt_critical and usage >= cfg.kv_critical_usage
    critical |= prev is State.CRITICAL and count >= cfg.preempt_shed
    critical &= usage >= cfg.kv_storm_usage
    if critical:
        return State.CRITICAL
    if count >= (cfg.preempt_leave if prev is not State.OK else cfg.preempt_shed):
        return State.SHEDDING
    return State.OK


def _low_is_bad(value_mib: float, prev: State, crit: float, enter: float, leave: float) -> State:
    """Hysteresis for "free memory": enter below ``enter``, leave above ``leave``.

    CRITICAL is left only once the value is back above the shedding level, so a
    value hovering around the critical line does not flip the state each poll.
    """
    if value_mib < crit:
        return State.CRITICAL
    if value_mib < enter:
        return State.CRITICAL if prev is State.CRITICAL else State.SHEDDING
    if value_mib <= leave:
        return min(prev, State.SHEDDING)
    return State.OK


class PressurePolicy:
    """Feed it one :class:`Readings` per poll with a monotonic ``now``.

    >>> p = PressurePolicy()
    >>> p.update(Readings(gpus=(GpuMemory(0, 800 * MIB, 0, 0),)), now=0.0).state
    <State.SHEDDING: 1>
    """

    def __init__(self, config: PressureConfig | None = None) -> None:
        self.config = config if config is not None else PressureConfig()
        self._state = State.OK
        # Last time a signal demanded at least the current state; relaxing waits
        # until ``min_dwell`` after this (so also at least min_dwell after entry).
        self._demanded_at = -math.inf
        self._gpu = _Signal("gpu")
        self._kv = _Signal("kv")
        self._host = _Signal("host")
        # Preemption windows by scheduler name ("" for one, "rank N" with DP).
        self._storms: dict[str, _Storm] = {}

    @property
    def state(self) -> State:
        return self._state

    def update(self, readings: Readings, now: float) -> Decision:
        cfg = self.config
        worsening = self._update_gpu(readings.gpus)
        worsening |= self._update_kv(readings.engine, now)
        worsening |= self._update_host(readings.host)
        signals = (self._gpu, self._kv, self._host)

        # The strongest signal decides; ties go to the first (gpu, kv, host).
        top = max(signals, key=lambda s: s.level)
        demanded = top.level
        old = self._state
        transition: Transition | None = None

        if demanded >= old:
            self._demanded_at = now
            if demanded > old:
                self._state = demanded
        elif now - self._demanded_at >= cfg.min_dwell:
            self._state = demanded
            self._demanded_at = now

        if self._state is not old:
            if self._state is State.OK:
                reason = Reason("none", self._summary())
            else:
                reason = Reason(top.name, top.detail)
            transition = Transition(old, self._state, now, reason)
            if self._state is State.CRITICAL:
                # Abort references start at the readings that made us critical.
                self._reset_abort_refs(readings)
        else:
            reason = Reason(top.name, top.detail) if demanded else Reason("none", self._summary())

        abort = 0
        if self._state is State.CRITICAL and transition is None and worsening:
            abort = 1
        return Decision(self._state, reason, transition, abort)

    # -- signals ---------------------------------------------------------

    def _unknown(self, sig: _Signal, reading: Unknown) -> None:
        """A failed read: keep the last level, and after N in a row demand SHEDDING."""
        if not sig.ever_known:
            sig.detail = f"not watched ({reading.reason})"
            return
        sig.unknown_streak += 1
        n = self.config.unknown_shed_after
        sig.detail = f"unknown for {sig.unknown_streak} polls ({reading.reason})"
        if n is not None and sig.unknown_streak >= n:
            sig.level = max(sig.level, State.SHEDDING)

    def _known(self, sig: _Signal) -> None:
        sig.ever_known = True
        sig.unknown_streak = 0

    def _falling(self, sig: _Signal, value: int, allowed: bool) -> bool:
        """True when ``value`` (bytes free) is a full abort step below the reference.

        The reference follows the value up (memory given back) and moves down
        only when an abort is asked for, so a slow leak is caught too.
        """
        if sig.abort_ref is None or value > sig.abort_ref:
            sig.abort_ref = value
            return False
        step = self.config.abort_step_mib * MIB
        if sig.level is State.CRITICAL and allowed and sig.abort_ref - value >= step:
            sig.abort_ref = value
            return True
        return False

    def _reset_abort_refs(self, readings: Readings) -> None:
        if isinstance(readings.gpus, tuple) and readings.gpus:
            self._gpu.abort_ref = min(g.free for g in readings.gpus)
        if isinstance(readings.host, HostMemory):
            self._host.abort_ref = readings.host.available

    def _update_gpu(self, reading: GpuReading) -> bool:
        sig, cfg = self._gpu, self.config
        if isinstance(reading, Unknown):
            self._unknown(sig, reading)
            return False
        self._known(sig)
        if not reading:
            sig.level, sig.detail = State.OK, "no GPU in use"
            return False
        worst = min(reading, key=lambda g: g.free)
        free_mib = worst.free / MIB
        sig.level = _low_is_bad(
            free_mib,
            sig.level,
            cfg.gpu_critical_free_mib,
            cfg.gpu_shed_free_mib,
            cfg.gpu_leave_free_mib,
        )
        sig.detail = (
            f"device {worst.index} free {free_mib:.0f} MiB of {worst.total / MIB:.0f} MiB "
            f"(shed < {cfg.gpu_shed_free_mib}, leave > {cfg.gpu_leave_free_mib}, "
            f"critical < {cfg.gpu_critical_free_mib})"
        )
        return self._falling(sig, worst.free, cfg.abort_on_gpu)

    def _update_host(self, reading: HostReading) -> bool:
        sig, cfg = self._host, self.config
        if isinstance(reading, Unknown):
            self._unknown(sig, reading)
            return False
        self._known(sig)
        avail_mib = reading.available / MIB
        sig.level = _low_is_bad(
            avail_mib,
            sig.level,
            cfg.host_critical_available_mib,
            cfg.host_shed_available_mib,
            cfg.host_leave_available_mib,
        )
        sig.detail = (
            f"available {avail_mib:.0f} MiB of {reading.total / MIB:.0f} MiB "
            f"(shed < {cfg.host_shed_available_mib}, leave > {cfg.host_leave_available_mib}, "
            f"critical < {cfg.host_critical_available_mib})"
        )
        return self._falling(sig, reading.available, True)

    def _update_kv(self, reading: EngineReading, now: float) -> bool:
        sig, cfg = self._kv, self.config
        if isinstance(reading, Unknown):
            self._unknown(sig, reading)
            return False
        self._known(sig)
        schedulers = _schedulers(reading)
        for gone in self._storms.keys() - {name for name, _, _ in schedulers}:
            del self._storms[gone]  # the rank layout changed (start-up): start afresh
        prev = sig.level
        worst: tuple[State, int, str, float] | None = None
        evicting = False  # a critical scheduler still evicting running requests
        for name, usage, total in schedulers:
            storm = self._storms.setdefault(name, _Storm())
            new = storm.add(total, usage, now, cfg)
            level = _storm_level(storm.count, usage, prev, cfg)
            evicting |= level is State.CRITICAL and new > 0
            if worst is None or (level, storm.count) > worst[:2]:
                worst = (level, storm.count, name, usage)
        assert worst is not None  # _schedulers gives at least one
        sig.level, count, name, usage = worst
        sig.detail = (
            f"{name + ' ' if name else ''}kv cache {usage:.1%} used, {count} preemptions in "
            f"{cfg.preempt_window:g} s at >= {cfg.kv_storm_usage:.0%} use, {reading.running} "
            f"running, {reading.waiting} waiting (storm: shed >= {cfg.preempt_shed}, leave < "
            f"{cfg.preempt_leave}, critical >= {cfg.preempt_critical} at >= "
            f"{cfg.kv_critical_usage:.0%} use)"
        )
        # vLLM still evicting running requests: aborting the newest frees blocks.
        return sig.level is State.CRITICAL and evicting

    def _summary(self) -> str:
        return "; ".join(f"{s.name} {s.detail}" for s in (self._gpu, self._kv, self._host))


__all__ = [
    "ENGINE_IDLE",
    "MIB",
    "Decision",
    "EngineReading",
    "EngineStats",
    "GpuMemory",
    "GpuReading",
    "HostMemory",
    "HostReading",
    "PressureConfig",
    "PressurePolicy",
    "RankStats",
    "Readings",
    "Reason",
    "State",
    "Transition",
    "Unknown",
]
