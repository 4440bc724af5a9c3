"""The aiohttp application and its life cycle, from socket open to exit code.

Start-up and teardown are ordered here and nowhere else. One `cleanup_ctx`
enters an `asyncio.TaskGroup` that owns every background task:

    boot      build the engine (on a thread), run a warm-up generation, then
              mark the app ready and tell systemd READY=1;
    driver    the coalescer's I/O shell (server/engines/driver.py);
    watchdog  memory polling (server/operations/watchdog.py) -> admission state;
    monitor   engine liveness: a dead engine fails every caller at once, turns
              /health to 503 and, a second later, stops the process with a
              non-zero code; while alive, it pings the systemd watchdog and
              updates STATUS=;
    status    one sample a second for the status page (server/operations/status_samples.py).

A background task that crashes stops the server with exit code 1 (systemd
restarts it) instead of leaving it half alive. Leaving the context cancels
the group; the engine shutdown and the "stopped" line run in a `finally`,
whatever happened. `serve()` owns the signal-driven drain in a task group of
its own: the first SIGTERM/SIGINT drains (new requests get 503, queued and
running ones finish up to --drain-timeout, then the rest get a 503), a second
one stops at once. SIGHUP reloads the callers file (`reload_callers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from aiohttp import web

from batching import AdmissionState, Coalescer, ResultCache
from batching.pressure import Decision, State, Transition
from server.api.lora_admin.endpoint import add_admin_routes
from server.api.openai_responses.store import ResponseStore
from server.engines.driver import Driver, order_priority, request_priority
from server.engines.interface import Engine, EngineParams
from server.engines.lora import AdapterRegistry
from server.errors import SluiceError
from server.http.callers import CallerDirectory, CallersError, load_callers, world_readable
from server.http.middleware import install as install_middlewares
from server.http.middleware import server_options
from server.http.routes import add_routes
from server.operations.metrics import Metrics
from server.operations.sdnotify import SdNotify
from server.operations.status_page import add_status_routes, make_sampler
from server.operations.watchdog import EngineReader, HostMemoryReader, NvmlReader, Watchdog
from server.settings import Settings
from server.state import (
    ADAPTERS,
    CALLERS,
    DRIVER,
    ENGINE,
    METRICS,
    NOTIFIER,
    RESPONSES,
    RESULTS,
    RUNTIME,
    SETTINGS,
    STATUS,
    WATCHDOG,
    Phase,
    Runtime,
)
from server.wire.request import Limits, Sampling

log = logging.getLogger("sluice")

__all__ = ["build_app", "drain", "reload_callers", "serve", "warmup", "watchdog_factory"]

WatchdogFactory = Callable[[web.Application], Watchdog]

# How long handlers get to write their 503s after the engine died, before the
# process stops for a restart.
_DEAD_EXIT_DELAY = 1.0


async def _boot(app: web.Application) -> None:
    engine = app[ENGINE]
    rt = app[RUNTIME]
    settings = app[SETTINGS]
    t0 = time.monotonic()
    log.info("engine starting", extra={"fields": {"model": settings.model_path}})
    try:
        await engine.start()
        if settings.warmup:
            await warmup(engine)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("engine failed to start")
        rt.engine_error = str(exc)
        rt.phase = Phase.DEAD
        rt.exit_code = 1
        rt.stop.set()
        return
    # As vLLM's own server does after start-up: move what start-up built (the
    # tokenizer, vLLM's config, imported modules) into the permanent
    # generation, so the cyclic collector stops rescanning it while serving.
    gc.collect()
    gc.freeze()
    info = engine.info
    # The batch caps and the backlog's engine capacity follow the engine's
    # resolved limits; nothing was admitted yet (the phase is STARTING), so the
    # core takes it as is, keeping the callers a SIGHUP may have loaded since.
    core = app[DRIVER].core
    core.config = dataclasses.replace(settings.core_for(info), callers=core.config.callers)
    rt.limits = Limits(
        max_n=settings.max_n,
        max_logprobs=settings.max_logprobs,
        default_enable_thinking=settings.default_thinking,
        sampling_defaults=info.sampling_defaults,
        default_max_tokens=info.default_max_tokens,
    )
    if rt.phase is Phase.STARTING:
        rt.phase = Phase.READY
    took = round(time.monotonic() - t0, 1)
    log.info(
        "ready",
        extra={
            "fields": {
                "model": settings.model_name,
                "startup_s": took,
                "url": f"http://{settings.host}:{settings.port}/v1",
                # Each data-parallel rank's; Sluice counts dp_ranks x these slots.
                "max_num_seqs": info.max_num_seqs,
                "max_num_batched_tokens": info.max_num_batched_tokens,
                "dp_ranks": info.dp_ranks,
            }
        },
    )
    app[NOTIFIER].ready()


async def warmup(engine: Engine) -> None:
    """One short request through the whole engine path before READY: a
    generation, or for a pooling model one input of what it serves."""
    kind = engine.info.kind
    params: EngineParams
    if kind == "generate":
        ids = await engine.tokenize_prompts(["Hello"])
        params = engine.sampling_params(Sampling(max_tokens=2), 2)
    elif kind in ("embed", "rerank"):
        ids = await engine.tokenize_pooling(["Hello"])
        params = engine.pooling_params("embed" if kind == "embed" else "classify")
    else:
        return  # a pooling task no endpoint here serves: nothing to warm
    collector = await engine.add(f"warmup-{time.monotonic_ns()}", ids[0] or [0], params, 0)
    while not (await collector.get()).finished:
        pass


async def _monitor(app: web.Application) -> None:
    """Engine liveness, the systemd watchdog and STATUS= lines."""
    engine = app[ENGINE]
    rt = app[RUNTIME]
    notifier = app[NOTIFIER]
    driver = app[DRIVER]
    interval = 0.5
    if notifier.watchdog_interval is not None:
        interval = min(interval, notifier.watchdog_interval)
    last_status = 0.0
    last_tokens, last_t = 0, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        if rt.phase in (Phase.STARTING, Phase.STOPPED):
            continue
        if rt.phase is Phase.DEAD:
            return
        why = None
        if engine.errored:
            why = "engine core process died"
        else:
            try:
                await asyncio.wait_for(engine.check_health(), timeout=5)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                why = f"engine health check failed: {exc}"
        if why is not None:
            _engine_died(app, why)
            # Give the handlers a moment to write their 503s, then stop.
            await asyncio.sleep(_DEAD_EXIT_DELAY)
            rt.stop.set()
            return
        notifier.watchdog()
        now = time.monotonic()
        if now - last_status >= 5:
            rate = (rt.tokens_out - last_tokens) / max(now - last_t, 1e-9)
            last_tokens, last_t, last_status = rt.tokens_out, now, now
            notifier.status(
                f"{rt.phase.value}, admission {rt.admission.name.lower()}, "
                f"queued {driver.core.queued_requests}, running {driver.running}, "
                f"{rate:.0f} tok/s"
            )


def _engine_died(app: web.Application, why: str) -> None:
    rt = app[RUNTIME]
    log.error("engine died; failing all callers and exiting", extra={"fields": {"why": why}})
    rt.phase = Phase.DEAD
    rt.engine_error = why
    rt.exit_code = 1
    app[DRIVER].engine_died(RuntimeError(why))


async def _guarded(rt: Runtime, name: str, coro: Coroutine[Any, Any, None]) -> None:
    """Run a background task; if it crashes, stop the server with exit code 1."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("background task %s crashed; stopping", name)
        rt.exit_code = 1
        rt.stop.set()


async def _lifespan(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    metrics = app[METRICS]
    rt = app[RUNTIME]
    engine = app[ENGINE]
    try:
        async with asyncio.TaskGroup() as tg:
            driver = Driver(
                Coalescer(settings.core),
                engine,
                on_events=metrics.on_core_events,
                engine_priority=(
                    order_priority if settings.engine_priority == "order" else request_priority
                ),
            )
            app[DRIVER] = driver
            metrics.watch(lambda: _live(app))
            jobs: dict[str, Coroutine[Any, Any, None]] = {
                "driver": driver.run(),
                "boot": _boot(app),
                "monitor": _monitor(app),
            }
            if WATCHDOG in app:
                jobs["watchdog"] = app[WATCHDOG].run()
            jobs["status"] = app[STATUS].run()
            tasks = [tg.create_task(_guarded(rt, n, c), name=n) for n, c in jobs.items()]
            try:
                yield
            finally:
                rt.phase = Phase.STOPPED
                for task in tasks:
                    task.cancel()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(engine.shutdown)
        log.info("stopped", extra={"fields": {"exit_code": rt.exit_code}})


def _live(app: web.Application) -> dict[str, Any]:
    driver = app[DRIVER]
    stats = app[ENGINE].stats()
    return {
        "queue_requests": driver.core.queued_requests,
        "queue_tokens": driver.core.queued_tokens,
        "pending_requests": driver.core.pending_requests,
        "engine_running": stats.running,
        "engine_waiting": stats.waiting,
        "kv_cache_usage": stats.kv_cache_usage,
        "ranks": stats.ranks,
        "preemptions": stats.preemptions_total,
        "prefix_queries": stats.prefix_cache_queries_total,
        "prefix_hits": stats.prefix_cache_hits_total,
        "adapter_wait_steps": stats.adapter_wait_steps_total,
        "engine_steps": stats.steps_total,
        "ready": 1 if app[RUNTIME].ready else 0,
        "backlog": driver.core.backlog_generations,
        "unstarted": driver.core.engine_waiting,
        "callers": driver.core.callers(),
    }


def on_admission(app: web.Application, state: AdmissionState) -> None:
    """The watchdog's state change, applied to the app and the core."""
    app[RUNTIME].admission = state
    app[DRIVER].set_state(state)


_PRESSURE_TO_ADMISSION = {
    State.OK: AdmissionState.OK,
    State.SHEDDING: AdmissionState.SHEDDING,
    State.CRITICAL: AdmissionState.CRITICAL,
}


def abort_for_memory(app: web.Application, n: int) -> None:
    """Critical memory: fail the `n` newest lowest-priority running generations."""
    gens = sorted(
        app[DRIVER].running_generations(),
        key=lambda g: (g.priority, g.started),  # lowest priority = highest value
    )
    err = SluiceError(
        "aborted: server memory critical; retry shortly",
        status=503,
        retry_after=10,
        code="memory",
    )
    for gen in gens[::-1][:n]:
        app[METRICS].rejections.labels("memory_abort").inc()
        gen.fail(err)


def watchdog_factory(settings: Settings) -> WatchdogFactory:
    """The memory watchdog wired to this app: its state gates admission, its
    abort requests fail the newest lowest-priority running generations."""

    def make(app: web.Application) -> Watchdog:
        def on_state(state: State, transition: Transition) -> None:
            on_admission(app, _PRESSURE_TO_ADMISSION[state])

        def on_abort(n: int, decision: Decision) -> None:
            abort_for_memory(app, n)

        return Watchdog(
            gpu=NvmlReader(settings.env.cuda_visible_devices),
            host=HostMemoryReader(),
            engine=EngineReader(app[ENGINE].stats),
            config=settings.pressure,
            interval=settings.watchdog_interval,
            on_state=on_state,
            on_abort=on_abort,
            registry=app[METRICS].registry,
        )

    return make


def build_app(
    settings: Settings,
    engine: Engine,
    *,
    notifier: SdNotify | None = None,
    watchdog_factory: WatchdogFactory | None = None,
) -> web.Application:
    app = web.Application(client_max_size=settings.max_body_bytes)
    install_middlewares(app)
    app[SETTINGS] = settings
    app[ENGINE] = engine
    app[CALLERS] = CallerDirectory(
        settings.caller_table, settings.api_key, shared_cache=settings.shared_prefix_cache
    )
    app[METRICS] = Metrics(caller_label=app[CALLERS].label)
    app[RUNTIME] = Runtime()
    app[RESULTS] = ResultCache(
        ttl=settings.result_cache_ttl,
        max_entries=1024 if settings.result_cache_ttl > 0 else 0,
    )
    app[RESPONSES] = ResponseStore()  # /v1/responses' stored responses, lost on restart
    app[NOTIFIER] = notifier or SdNotify(None)
    app[ADAPTERS] = AdapterRegistry(
        settings.model_name, settings.adapters, base_path=settings.model_path
    )
    if watchdog_factory is not None:
        app[WATCHDOG] = watchdog_factory(app)
    app[STATUS] = make_sampler(app)
    add_routes(app)
    add_admin_routes(app)  # only with --allow-runtime-lora
    add_status_routes(app)
    app.cleanup_ctx.append(_lifespan)
    return app


async def drain(app: web.Application, timeout: float) -> None:
    """Stop taking work, let queued and running work finish, then fail the rest."""
    rt = app[RUNTIME]
    driver = app[DRIVER]
    if rt.phase in (Phase.READY, Phase.STARTING):
        rt.phase = Phase.DRAINING
    driver.set_state(AdmissionState.DRAINING)
    app[NOTIFIER].stopping()
    log.info(
        "draining",
        extra={
            "fields": {
                "queued": driver.core.queued_requests,
                "running": driver.running,
                "timeout_s": timeout,
            }
        },
    )
    try:
        await asyncio.wait_for(driver.idle.wait(), timeout)
    except TimeoutError:
        err = SluiceError("server shutting down; retry elsewhere", status=503, retry_after=5)
        n = driver.fail_queued(err) + driver.fail_running(err)
        log.warning("drain deadline reached", extra={"fields": {"aborted": n}})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(driver.idle.wait(), 2.0)


async def reload_callers(app: web.Application) -> bool:
    """SIGHUP: read the callers file again. A bad file keeps the old callers and
    logs why; queued work keeps going under the new limits (batching/callers.py)."""
    path = app[SETTINGS].callers_file
    if path is None:
        log.info("SIGHUP: no --callers file to reload")
        return False
    try:
        table = await asyncio.to_thread(
            functools.partial(
                load_callers,
                path,
                adapters=app[ADAPTERS].names,
                base=app[SETTINGS].model_name,
            )
        )
    except CallersError as exc:
        log.error(
            "callers reload failed; keeping the old callers", extra={"fields": {"why": str(exc)}}
        )
        return False
    if await asyncio.to_thread(world_readable, path):
        log.warning(
            "the callers file is readable by other users; it holds API keys",
            extra={"fields": {"path": str(path)}},
        )
    app[CALLERS].table = table
    app[DRIVER].core.set_callers(table.policies)
    log.info("callers reloaded", extra={"fields": {"callers": list(table.names)}})
    return True


async def serve(
    settings: Settings,
    engine: Engine,
    notifier: SdNotify,
    watchdog_factory: WatchdogFactory | None = None,
) -> int:
    """Run until a signal or engine death; return the process exit code."""
    app = build_app(settings, engine, notifier=notifier, watchdog_factory=watchdog_factory)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that goes away cancels its handler
        shutdown_timeout=5.0,
        # One structured line per request comes from server/http/middleware.py, which
        # also routes aiohttp's own lines (parser refusals) into Sluice's log.
        **server_options(),
    )
    await runner.setup()
    rt = app[RUNTIME]
    loop = asyncio.get_running_loop()
    try:
        site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
        await site.start()
        log.info(
            "listening",
            extra={
                "fields": {
                    "host": settings.host,
                    "port": settings.port,
                    "model": settings.model_name,
                    "demo_model": settings.demo_model,
                }
            },
        )
        async with asyncio.TaskGroup() as tg:
            drains: list[asyncio.Task[None]] = []

            async def drain_then_stop() -> None:
                await drain(app, settings.drain_timeout)
                rt.stop.set()

            def on_signal(signum: int) -> None:
                if not drains and rt.phase is not Phase.DEAD:
                    log.info(
                        "signal received, draining",
                        extra={"fields": {"signal": signal.Signals(signum).name}},
                    )
                    drains.append(tg.create_task(drain_then_stop(), name="drain"))
                    return
                log.warning("second signal, stopping now")
                err = SluiceError("server stopping", status=503, retry_after=5)
                app[DRIVER].fail_queued(err)
                app[DRIVER].fail_running(err)
                rt.stop.set()

            def on_hangup() -> None:
                tg.create_task(reload_callers(app), name="reload-callers")

            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, on_signal, sig)
            loop.add_signal_handler(signal.SIGHUP, on_hangup)
            await rt.stop.wait()
            for task in drains:
                task.cancel()  # a second signal or engine death ends the drain
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
    return rt.exit_code
