"""One model's engine dies; that model's requests end, it starts again, the others go on.

Why this module exists: issue 41. Before it, the first engine core of any
model that died or stopped answering failed every caller of every model and
ended the process. The supervisor watches each loaded model's engine on its
own, and a death is its model's alone (server/engines/restarts.py holds the
rules; this is their I/O):

* Every `interval` it reads each loaded engine's liveness (vLLM's `errored`,
  set by its own monitor of the core processes), at once when a driver met
  the death (`wake`, set by server/engines/driver.py) or a request found its
  model's engine errored (`check`, from the loader: that request then waits
  for the restart instead of meeting the dead engine), and every `probe_every` it
  sends each one a health check through its cores (`Engine.check_health`),
  each in a task of its own, so that one hung engine does not delay the look
  at another. No answer within `health_timeout` beyond the engine's longest
  recent steps (`answer_within`): hung, a death (rule 1).
* A death fails that model's queued and running requests with a 503 (the
  error middleware gives each API its own shape: Anthropic's overloaded 529,
  a stream's error event), ends the engine's processes by their pids (vLLM's
  process handles and their children in /proc, never by name: a hung core
  would not heed vLLM's SIGTERM), and, within the budget, starts it again
  after the back-off (server/engines/loader.py `restart`; requests meanwhile
  wait for it as for a load). Otherwise, or when the restart fails, the
  model is `failed`, and for a model marked essential `give_up` ends the
  process (rule 5).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable

from server.engines.interface import Engine
from server.engines.loader import ModelLoader
from server.engines.procs import alive, process_tree
from server.engines.registry import ModelEntry, ModelRegistry, State
from server.engines.restarts import Death, RestartPolicy, answer_within, decide, exits, recent
from server.errors import SluiceError

__all__ = ["Supervisor", "process_tree"]

log = logging.getLogger("sluice.engines")

# How long the ended processes get to be gone before the restart goes on anyway.
_GONE_TIMEOUT = 15.0


class Supervisor:
    """Watches every loaded model's engine; see the module docstring."""

    def __init__(
        self,
        registry: ModelRegistry,
        loader: ModelLoader,
        policy: RestartPolicy,
        *,
        health_timeout: float,
        give_up: Callable[[str], Awaitable[None]],
        counted: Callable[[str, str, str], None] = lambda kind, model, label: None,
        interval: float = 0.5,
        probe_every: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        wake: asyncio.Event | None = None,
        gpu_pids: Callable[[], frozenset[int] | None] = lambda: None,
    ) -> None:
        self.registry = registry
        self.loader = loader
        self.policy = policy
        self.health_timeout = health_timeout
        self._give_up = give_up
        self._counted = counted  # ("death" | "restart", model, cause | outcome)
        self.interval = interval
        self.probe_every = probe_every
        self._clock = clock
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._tg: asyncio.TaskGroup | None = None
        self.wake = wake or asyncio.Event()
        self._gpu_pids = gpu_pids  # blocking (NVML): called in a thread
        loader.on_errored = self.check

    async def run(self) -> None:
        """Until cancelled; a task of the app's task group."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            last_probe = self._clock()
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), self.interval)
                self.wake.clear()
                probe = self._clock() - last_probe >= self.probe_every
                if probe:
                    last_probe = self._clock()
                for entry in self.registry:
                    if entry.state is not State.LOADED:
                        continue
                    if entry.engine.errored:
                        self.died(entry, _exit_death(entry.engine))
                    elif probe and entry.name not in self._probes:
                        self._probes[entry.name] = tg.create_task(
                            self._probe(entry, entry.engine), name=f"health-{entry.name}"
                        )

    async def _probe(self, entry: ModelEntry, engine: Engine) -> None:
        try:
            within = answer_within(self.health_timeout, engine.stats().longest_step_s)
            await asyncio.wait_for(engine.check_health(), within)
        except TimeoutError:
            if entry.state is State.LOADED and entry.engine is engine:
                self.died(entry, _unanswered(engine))
        except asyncio.CancelledError:
            raise
        except Exception:
            if entry.state is State.LOADED and entry.engine is engine:
                self.died(entry, _exit_death(engine))
        finally:
            self._probes.pop(entry.name, None)

    def check(self, entry: ModelEntry) -> None:
        """A request's look at its model before it is served: a loaded model
        whose engine errored is dead now (its restart begins, and the request
        waits for it), not at the next look."""
        if self._tg is not None and entry.state is State.LOADED and entry.engine.errored:
            self.died(entry, _exit_death(entry.engine))

    def died(self, entry: ModelEntry, death: Death) -> None:
        """A loaded model's engine is dead: fail its requests, end its
        processes, restart it or give up (restarts.py rules 2-5)."""
        now = self._clock()
        engine = entry.engine
        # The cores that have not exited (an exited one is reaped: its pid is free)
        # and their children; and for NVML, every core's pid.
        cores = [core for core, _ in engine.processes()]
        pids = [
            pid for core, code in engine.processes() if code is None for pid in process_tree(core)
        ]
        verdict = decide(self.policy, entry.restart_times, now)
        entry.deaths += 1
        entry.last_death = (time.time(), death.describe)
        self._counted("death", entry.name, death.label)
        fields: dict[str, object] = {
            "model": entry.name,
            "pids": pids,
            "cause": death.label,
            "why": death.describe,
            "deaths": entry.deaths,
        }
        if verdict.restart:
            fields["restart_in_s"] = verdict.delay
            log.error("engine died; restarting it", extra={"fields": fields})
            retry = verdict.delay + (entry.load_seconds or 5.0)
            err = SluiceError(
                f"the model `{entry.name}` is restarting: {death.describe}; retry shortly",
                status=503,
                retry_after=retry,
                code="engine_restarting",
            )
        else:
            fields["restarts"] = verdict.used
            fields["window_s"] = self.policy.window
            log.error("engine died; its restart budget is spent", extra={"fields": fields})
            why = (
                f"{death.describe}, and it has been restarted {verdict.used} times in "
                f"{self.policy.window:g} s (--engine-restarts)"
            )
            err = SluiceError(
                f"the model `{entry.name}` failed: {why}",
                status=503,
                retry_after=self.policy.window,
                code="model_failed",
            )
        entry.driver.engine_died(RuntimeError(death.describe), err)
        if verdict.restart:
            entry.restart_times = (*recent(entry.restart_times, now, self.policy.window), now)
            self.loader.restart(
                entry,
                verdict.delay,
                end=lambda: self._end(entry, pids, cores),
                done=lambda outcome: self._restarted(entry, now, outcome),
            )
            return
        self._counted("restart", entry.name, "budget_spent")
        entry.error = why
        entry.gave_up = True
        entry.failures += 1
        oldest = min(recent(entry.restart_times, now, self.policy.window), default=now)
        entry.retry_at = oldest + self.policy.window  # the budget's window frees a restart
        entry.set_state(State.FAILED)
        self._spawn(self._end(entry, pids, cores), f"end-{entry.name}")
        self._final(entry, err.message)

    def _restarted(self, entry: ModelEntry, died_at: float, outcome: SluiceError | None) -> None:
        if outcome is None:
            entry.back_in_s = self._clock() - died_at
            self._counted("restart", entry.name, "ok")
            log.info(
                "engine restarted",
                extra={
                    "fields": {
                        "model": entry.name,
                        "back_in_s": round(entry.back_in_s, 2),
                        "pids": [pid for pid, _ in entry.engine.processes()],
                    }
                },
            )
            return
        if outcome.code == "draining":  # a signal stopped it: not the engine's failure
            log.info("engine restart stopped: draining", extra={"fields": {"model": entry.name}})
            return
        self._counted("restart", entry.name, "failed")
        log.error(
            "engine restart failed; the model is failed",
            extra={"fields": {"model": entry.name, "why": outcome.message}},
        )
        if entry.state is State.FAILED:
            self._final(entry, outcome.message)

    def _final(self, entry: ModelEntry, why: str) -> None:
        if exits(entry.spec.essential, entry.state is State.FAILED):
            self._spawn(self._give_up(why), "give-up")

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        async def run() -> None:
            await coro

        if self._tg is None:  # not running (a test calling died() directly)
            raise RuntimeError("the supervisor is not running")
        self._tg.create_task(run(), name=name)

    async def _end(self, entry: ModelEntry, pids: list[int], cores: list[int]) -> None:
        """End the dead engine's processes by their pids, stop what is left of
        it (vLLM's shutdown joins them) and wait until they are gone: from
        /proc, and on a GPU from NVML's list of the processes holding memory
        (the card's memory is free again: issue 41 item 3)."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        await self.loader.discard(entry)
        deadline = self._clock() + _GONE_TIMEOUT
        # A worker of the core is not this process's child: nothing to await but /proc.
        while (left := [p for p in pids if alive(p)]) and self._clock() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if left:
            log.warning(
                "engine processes still there; restarting anyway",
                extra={"fields": {"model": entry.name, "pids": left}},
            )
        ours = {*pids, *cores}
        while (held := await asyncio.to_thread(self._gpu_pids)) and (on_card := held & ours):
            if self._clock() >= deadline:
                log.warning(
                    "the dead engine's GPU memory is still held; restarting anyway",
                    extra={"fields": {"model": entry.name, "pids": sorted(on_card)}},
                )
                break
            await asyncio.sleep(0.1)


def _exit_death(engine: Engine) -> Death:
    """The death of an engine whose core exited: the first exit code its
    process handles report (None when none has one yet)."""
    codes = [code for _, code in engine.processes() if code is not None]
    return Death(code=next((c for c in codes if c != 0), codes[0] if codes else None))


def _unanswered(engine: Engine) -> Death:
    """The death of an engine whose health check got no answer: hung, unless a
    core has exited (killed before vLLM flagged it `errored`: on a loaded machine
    the check's timeout can come first), when it is that exit."""
    death = _exit_death(engine)
    return death if death.code is not None else Death(hung=True)
