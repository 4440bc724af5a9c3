"""Engines started, stopped and swapped as requests ask for their models.

Why this module exists: a workstation card holds a few models at once, not
every model a team uses. Ollama loads a model on its first request and unloads
it after `keep_alive`; issue 30 asks the same of Sluice, without stalling the
models that are serving. The registry (server/engines/registry.py) holds the
states and decides (which models make room, when an idle one is due); this
module does the I/O, in tasks of the app's task group:

* `acquire(entry)`, from a request's model check: a lease on the model (it is
  not unloaded while any request holds one), and, when it is not loaded, a
  wait for its load, bounded by `--load-timeout`: then a 503 with Retry-After,
  never a hang. The first waiter starts the load (`_load`, a task of its own,
  `spawn`); later ones wait for the same task. A load that fails is a 503
  naming the cause, for every waiter, and is not tried again for
  `RETRY_FAILED` seconds (a bad path would otherwise cost a start per request).
* Loads and room-making unloads run one at a time (`_card`): two engines
  profiling the card's free memory at once would each count the other's as
  free. When the card cannot hold the model, the least recently used idle
  on-demand models are unloaded first (registry.py rule 6); when none can
  go (work in flight), the load waits for one, within its load timeout.
* `run()` unloads on-demand models idle past their `unload-after`.
* Unloading stops the engine (vLLM's shutdown ends its engine-core process,
  and its memory with it) and puts a fresh, unstarted engine object in its
  place, or, for a model started with vLLM's `--enable-sleep-mode` (CUDA,
  ROCm, XPU), puts the engine to sleep: the weights go to host memory and the
  card is free; its next load is a wake-up, seconds instead of a start. The
  choice is the model's own flag: vLLM refuses it at start where the platform
  has no sleep mode, so a CPU models file cannot ask for it.

Work on the models that are serving goes on meanwhile: an engine start runs
on a worker thread (server/engines/vllm_adapter.py `start`), and the loop keeps
streaming (bench/points/models_point.py measures a chat stream's inter-token latency
on one model while another loads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from server.engines.interface import Engine
from server.engines.registry import (
    ModelEntry,
    ModelRegistry,
    ModelSpec,
    State,
    idle_deadline,
    plan_room,
)
from server.errors import SluiceError

__all__ = ["RETRY_FAILED", "ModelLoader"]

log = logging.getLogger("sluice.models")

# Seconds a failed load is not retried: its waiters and the requests in that
# time get its error at once. A bad path fails in about a second, an engine
# that runs out of memory after tens of seconds: retried per request, either
# would keep the card busy starting engines that fail.
RETRY_FAILED = 30.0
# The longest the room-making wait sleeps between looks: a model becomes idle
# when its last request gives its lease back (which wakes the wait at once);
# this bounds the wait for a core that empties without one.
_ROOM_RECHECK = 1.0

Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]


class _Signal:
    """Wake every waiter on the next change (an Event replaced on each notify)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float | None) -> None:
        event = self._event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)


class ModelLoader:
    """Loads and unloads the registry's engines; see the module docstring."""

    def __init__(
        self,
        registry: ModelRegistry,
        make_engine: Callable[[ModelSpec], Engine],
        *,
        spawn: Spawn,
        budget: int,
        load_timeout: float,
        on_loaded: Callable[[ModelEntry], None],
        warmup: Callable[[Engine], Awaitable[None]] | None = None,
        retry_failed: float = RETRY_FAILED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self._make_engine = make_engine
        self._spawn = spawn
        self.budget = budget
        self.load_timeout = load_timeout
        self._on_loaded = on_loaded
        self._warmup = warmup
        self._retry_failed = retry_failed
        self._clock = clock
        self._card = asyncio.Lock()
        self._loads: dict[str, asyncio.Future[SluiceError | None]] = {}
        self._load_started: dict[str, float] = {}
        self._changed = _Signal()
        # Set by the drain: a restart in its back-off does not start its engine.
        self._stopping = asyncio.Event()  # a drain began (`stop`): no engine starts again
        # A request's look at its model's engine before it waits or is served:
        # the supervisor's `check` (server/engines/supervisor.py), once it runs.
        self.on_errored: Callable[[ModelEntry], None] = lambda entry: None

    def stop(self) -> None:
        """A drain began (SIGTERM): a restart in its back-off ends there, at once,
        and the requests that wait for it are refused."""
        self._stopping.set()

    # -- a request's side ---------------------------------------------------

    async def acquire(self, entry: ModelEntry) -> None:
        """Lease `entry` for one request and return once it is loaded; raise a
        SluiceError (503 with Retry-After) when it cannot be, in time or at all.
        The caller gives the lease back with `release`, whatever happens after."""
        entry.leases += 1
        entry.last_used = self._clock()
        try:
            self.on_errored(entry)
            if entry.state is not State.LOADED:
                await self._ready(entry)
        except BaseException:
            self.release(entry)
            raise

    def release(self, entry: ModelEntry) -> None:
        entry.leases -= 1
        entry.last_used = self._clock()
        self._changed.notify()

    async def _ready(self, entry: ModelEntry) -> None:
        deadline = self._clock() + self.load_timeout
        while entry.state is not State.LOADED:
            now = self._clock()
            if entry.state is State.FAILED and now < entry.retry_at:
                raise _load_failed(entry, entry.retry_at - now)
            task = self._loads.get(entry.name) or self._start(entry, "request")
            try:
                err = await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - now))
            except TimeoutError:
                raise SluiceError(
                    f"the model `{entry.name}` is not loaded yet: it waited "
                    f"{self.load_timeout:g} s (--load-timeout); retry shortly",
                    status=503,
                    retry_after=self._eta(entry),
                    code="model_loading",
                ) from None
            if err is not None:
                raise err

    def _eta(self, entry: ModelEntry) -> float:
        """Seconds until a load under way should be done: the last load's time
        less what this one has run, else a guess."""
        started = self._load_started.get(entry.name)
        if started is None or entry.load_seconds is None:
            return 5.0
        return max(1.0, entry.load_seconds - (self._clock() - started))

    # -- loading ------------------------------------------------------------

    def _start(self, entry: ModelEntry, why: str) -> asyncio.Future[SluiceError | None]:
        """Start the load task for `entry` (one per model at a time); its
        outcome, None or the refusal every waiter raises."""
        if entry.state is not State.UNLOADING:  # else the load waits for it first
            self._set(entry, State.WAITING)
        result = self._track(entry)

        async def load() -> None:
            try:
                await self._load(entry, why)
                result.set_result(None)
            except SluiceError as err:
                result.set_result(err)
            finally:
                self._loads.pop(entry.name, None)
                if not result.done():  # cancelled: the app is stopping
                    result.set_result(
                        SluiceError("server stopping", status=503, retry_after=5, code="draining")
                    )

        self._spawn(load(), f"load-{entry.name}")
        return result

    async def start_now(self, entry: ModelEntry) -> None:
        """Load a `load = "start"` model at boot, in the caller's task; raises
        what the engine raised. Requests for it meanwhile (the port is open
        from the start) wait for this load, as for an on-demand one."""
        self._set(entry, State.WAITING)
        result = self._track(entry)
        try:
            await self._load(entry, "start", raise_engine_errors=True)
            result.set_result(None)
        except BaseException:
            result.set_result(
                _load_failed(entry, self._retry_failed)
                if entry.state is State.FAILED
                else SluiceError("server stopping", status=503, retry_after=5, code="draining")
            )
            raise
        finally:
            self._loads.pop(entry.name, None)

    def _track(self, entry: ModelEntry) -> asyncio.Future[SluiceError | None]:
        """The outcome future that requests for `entry` wait on (`_ready`)."""
        result: asyncio.Future[SluiceError | None] = asyncio.get_running_loop().create_future()
        self._loads[entry.name] = result
        return result

    def restart(
        self,
        entry: ModelEntry,
        delay: float,
        end: Callable[[], Awaitable[None]],
        done: Callable[[SluiceError | None], None],
    ) -> None:
        """Start a dead model's engine again (server/engines/supervisor.py): `end`
        ends the dead one's processes and waits until they are gone, then after
        `delay` seconds the model loads again with the same flags. The model is
        `restarting` until then; requests for it wait as for a load (bounded by
        --load-timeout). `done` gets the outcome: None, or the refusal its
        requests now get (the model is `failed`)."""
        self._set(entry, State.RESTARTING)
        result = self._track(entry)

        async def run() -> None:
            try:
                await end()
                with contextlib.suppress(TimeoutError):  # the back-off, or a drain's start
                    await asyncio.wait_for(self._stopping.wait(), delay)
                if self._stopping.is_set():  # a drain began (SIGTERM): no new engine start
                    entry.error = "the server is stopping; not restarted"
                    entry.retry_at = float("inf")
                    self._set(entry, State.FAILED)
                    raise SluiceError(
                        "server shutting down; retry elsewhere",
                        status=503,
                        retry_after=5,
                        code="draining",
                    )
                await self._load(entry, "restart", restarting=True)
                result.set_result(None)
            except SluiceError as err:
                result.set_result(err)
            finally:
                self._loads.pop(entry.name, None)
                if not result.done():  # cancelled: the app is stopping
                    result.set_result(
                        SluiceError("server stopping", status=503, retry_after=5, code="draining")
                    )
            done(result.result())

        self._spawn(run(), f"restart-{entry.name}")

    async def _load(
        self,
        entry: ModelEntry,
        why: str,
        *,
        raise_engine_errors: bool = False,
        restarting: bool = False,
    ) -> None:
        """`restarting`: the model stays `restarting` until it is loaded or failed."""
        async with self._card:
            while entry.state is State.UNLOADING:  # an idle unload still under way
                await entry.changed()
            wake = entry.asleep
            self._set(entry, State.RESTARTING if restarting else State.WAITING)
            try:
                await self._make_room(entry, self._clock() + self.load_timeout)
            except SluiceError:
                if restarting:
                    entry.error = "no room on the card to start it again"
                    entry.failures += 1
                    entry.retry_at = self._clock() + self._retry_failed
                    self._set(entry, State.FAILED)
                else:
                    self._set(entry, State.SLEEPING if wake else State.UNLOADED)
                raise
            self._set(entry, State.RESTARTING if restarting else State.LOADING)
            t0 = self._clock()
            self._load_started[entry.name] = t0
            log.info(
                "model loading",
                extra={
                    "fields": {
                        "model": entry.name,
                        "path": entry.spec.path,
                        "why": why,
                        "wake": wake,
                    }
                },
            )
            try:
                if wake:
                    await entry.engine.wake_up()
                    entry.asleep = False
                else:
                    await entry.engine.start()
                    if self._warmup is not None:
                        await self._warmup(entry.engine)
                self._on_loaded(entry)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                took = self._clock() - t0
                await self.discard(entry)
                entry.error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                entry.failures += 1
                entry.retry_at = self._clock() + self._retry_failed
                self._set(entry, State.FAILED)
                log.error(
                    "model load failed",
                    extra={
                        "fields": {
                            "model": entry.name,
                            "why": entry.error,
                            "load_s": round(took, 2),
                        }
                    },
                )
                if raise_engine_errors:
                    raise
                raise _load_failed(entry, self._retry_failed) from exc
            finally:
                self._load_started.pop(entry.name, None)
            took = self._clock() - t0
            entry.loads += 1
            entry.load_seconds = took
            entry.loaded_at = time.time()
            entry.error = None
            entry.gave_up = False
            entry.last_used = self._clock()
            self._set(entry, State.LOADED)
            log.info(
                "model loaded",
                extra={
                    "fields": {
                        "model": entry.name,
                        "load_s": round(took, 2),
                        "wake": wake,
                        "loads": entry.loads,
                        # its engine core processes: what an operator ends, not a name
                        "pids": [pid for pid, _ in entry.engine.processes()],
                    }
                },
            )

    async def _make_room(self, entry: ModelEntry, deadline: float) -> None:
        """Unload the least recently used idle on-demand models until `entry`
        fits (registry.py rule 6), waiting for busy ones to go idle until
        `deadline`; a 503 when they do not."""
        while True:
            plan = plan_room(self.registry, entry, self.budget)
            if plan is not None:
                for victim in plan:  # marked before any await: no request takes them now
                    self._set(victim, State.UNLOADING)
                for victim in plan:
                    await self._unload(victim, f"room for {entry.name}")
                return
            left = deadline - self._clock()
            if left <= 0:
                busy = [e.name for e in self.registry if e is not entry and e.busy]
                raise SluiceError(
                    f"the model `{entry.name}` does not fit beside the models in use "
                    f"({', '.join(busy) or 'none idle'}); retry shortly",
                    status=503,
                    retry_after=5,
                    code="model_no_room",
                )
            await self._changed.wait(min(left, _ROOM_RECHECK))

    # -- unloading ----------------------------------------------------------

    async def run(self) -> None:
        """Unload on-demand models idle past their unload-after (rule 7), until
        cancelled; a task of the app's task group."""
        while True:
            now = self._clock()
            due = [(d, e) for e in self.registry if (d := idle_deadline(e)) is not None]
            expired = [e for d, e in due if d <= now]
            for e in expired:
                deadline = idle_deadline(e)  # again: the previous unload awaited
                if deadline is not None and deadline <= self._clock():
                    await self._unload(e, "idle")
            if expired:
                continue
            soonest = min((d for d, _ in due), default=None)
            await self._changed.wait(None if soonest is None else soonest - now)

    async def _unload(self, entry: ModelEntry, why: str) -> None:
        idle = self._clock() - entry.last_used
        self._set(entry, State.UNLOADING)
        slept = False
        if entry.spec.sleep:
            try:
                await entry.engine.sleep()
                slept = True
            except Exception:
                log.exception("model sleep failed; stopping its engine instead")
        if not slept:
            await self.discard(entry)
        entry.asleep = slept
        entry.unloads += 1
        self._set(entry, State.SLEEPING if slept else State.UNLOADED)
        log.info(
            "model unloaded",
            extra={
                "fields": {
                    "model": entry.name,
                    "why": why,
                    "idle_s": round(idle, 1),
                    "sleeping": slept,
                }
            },
        )

    async def discard(self, entry: ModelEntry) -> None:
        """Stop the engine (its process and memory go) and put a fresh one in place."""
        try:
            await asyncio.to_thread(entry.engine.shutdown)
        except Exception:
            log.exception("engine shutdown failed", extra={"fields": {"model": entry.name}})
        entry.asleep = False
        entry.use(self._make_engine(entry.spec))

    # -- the app's side -----------------------------------------------------

    def _set(self, entry: ModelEntry, state: State) -> None:
        entry.set_state(state)
        self._changed.notify()

    async def all_idle(self) -> None:
        """Until no request holds a model and no core holds work (the drain)."""
        while any(e.busy for e in self.registry):
            await self._changed.wait(_ROOM_RECHECK)


def _load_failed(entry: ModelEntry, retry_after: float) -> SluiceError:
    if entry.gave_up:  # its engine kept dying (server/engines/restarts.py rule 3)
        return SluiceError(
            f"the model `{entry.name}` failed: {entry.error}",
            status=503,
            retry_after=max(1.0, retry_after),
            code="model_failed",
        )
    return SluiceError(
        f"the model `{entry.name}` failed to load: {entry.error}",
        status=503,
        retry_after=max(1.0, retry_after),
        code="model_load_failed",
    )
