"""The aiohttp application: typed state, the one error middleware, lifecycle.

Start-up and teardown are ordered here and nowhere else. One `cleanup_ctx`
enters an `asyncio.TaskGroup` that owns every background task:

    boot      build the engine (on a thread), run a warm-up generation, then
              mark the app ready and tell systemd READY=1;
    driver    the coalescer's I/O shell (server/driver.py);
    watchdog  memory polling (server/watchdog.py) -> admission state;
    monitor   engine liveness: a dead engine fails every caller at once, turns
              /health to 503 and stops the process with a non-zero code; while
              alive, it pings the systemd watchdog and updates STATUS=.

Leaving the context cancels them in that group and shuts the engine down.
`serve()` adds signals: the first SIGTERM/SIGINT drains (new requests get
503, queued and running ones finish up to --drain-timeout, then the rest get
a 503), a second one stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from batching import AdmissionState, Coalescer, CoalescerConfig, ResultCache
from server.driver import Driver
from server.errors import SluiceError
from server.metrics import Metrics
from server.protocol import Limits
from server.sdnotify import SdNotify
from server.settings import Settings

log = logging.getLogger("sluice")


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass(slots=True)
class Runtime:
    """The app's mutable run state, shared by handlers and background tasks."""

    phase: Phase = Phase.STARTING
    admission: AdmissionState = AdmissionState.OK
    started_at: float = field(default_factory=time.monotonic)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int = 0
    engine_error: str | None = None
    tokens_out: int = 0  # completion tokens sent, for STATUS= tokens/s
    limits: Limits = field(default_factory=Limits)  # request bounds, final once booted

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY and self.admission is AdmissionState.OK


SETTINGS = web.AppKey("settings", Settings)
ENGINE = web.AppKey("engine", object)  # server.engine.EngineAdapter or a test double
DRIVER = web.AppKey("driver", Driver)
METRICS = web.AppKey("metrics", Metrics)
RUNTIME = web.AppKey("runtime", Runtime)
NOTIFIER = web.AppKey("notifier", SdNotify)
WATCHDOG = web.AppKey("watchdog", object)
RESULTS = web.AppKey("results", ResultCache)  # --result-cache-ttl; off by default


def _json_error(err: SluiceError) -> web.Response:
    return web.Response(
        body=orjson.dumps(err.body()),
        status=err.status,
        content_type="application/json",
        headers=err.headers(),
    )


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every refusal leaves as an OpenAI-shaped JSON error; nothing else does."""
    try:
        return await handler(request)
    except SluiceError as err:
        resp = _json_error(err)
        rid = request.headers.get("x-request-id")
        if rid and len(rid) <= 128 and rid.isprintable():
            resp.headers["x-request-id"] = rid
        return resp
    except web.HTTPRequestEntityTooLarge as exc:
        return _json_error(SluiceError(f"request body too large: {exc.text}", status=413))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _json_error(SluiceError(exc.reason, status=exc.status))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return _json_error(SluiceError("internal server error", status=500))


def coalescer_config(s: Settings) -> CoalescerConfig:
    return CoalescerConfig(
        window=s.window,
        max_batch_seqs=s.max_batch_seqs,
        max_batch_tokens=s.max_batch_tokens,
        max_pending_requests=s.max_pending_requests,
        max_pending_tokens=s.max_pending_tokens,
        adaptive=s.adaptive_window,
        release_lone=s.adaptive_window,
        dedupe=s.dedupe,
        prefix_block=s.prefix_block if s.prefix_leader else 0,
    )


async def _boot(app: web.Application) -> None:
    engine: Any = app[ENGINE]
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
    rt.limits = Limits(
        max_n=settings.max_n,
        max_logprobs=settings.max_logprobs,
        default_enable_thinking=settings.default_thinking,
        sampling_defaults=getattr(engine.info, "sampling_defaults", ()),
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
            }
        },
    )
    app[NOTIFIER].ready()


async def warmup(engine: Any) -> None:
    """One short generation through the whole engine path before READY."""
    from server.protocol import Sampling

    ids = await engine.tokenize_prompts(["Hello"])
    params = engine.sampling_params(Sampling(max_tokens=2), 2)
    collector = await engine.add(f"warmup-{time.monotonic_ns()}", ids[0] or [0], params, 0)
    while not (await collector.get()).finished:
        pass


async def _monitor(app: web.Application) -> None:
    """Engine liveness, the systemd watchdog and STATUS= lines."""
    engine: Any = app[ENGINE]
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
        if engine.errored and rt.phase is not Phase.DEAD:
            _engine_died(app, "engine core process died")
            continue
        if rt.phase is Phase.DEAD:
            continue
        try:
            await asyncio.wait_for(engine.check_health(), timeout=5)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _engine_died(app, f"engine health check failed: {exc}")
            continue
        notifier.watchdog()
        now = time.monotonic()
        if now - last_status >= 5:
            rate = (rt.tokens_out - last_tokens) / max(now - last_t, 1e-9)
            last_tokens, last_t, last_status = rt.tokens_out, now, now
            running = len(driver.running_generations())
            notifier.status(
                f"{rt.phase.value}, admission {rt.admission.name.lower()}, "
                f"queued {driver.core.queued_requests}, running {running}, {rate:.0f} tok/s"
            )


def _engine_died(app: web.Application, why: str) -> None:
    rt = app[RUNTIME]
    log.error("engine died; failing all callers and exiting", extra={"fields": {"why": why}})
    rt.phase = Phase.DEAD
    rt.engine_error = why
    app[DRIVER].engine_died(RuntimeError(why))
    rt.exit_code = 1
    # Give the handlers a moment to write their 503s, then stop for a restart.
    asyncio.get_running_loop().call_later(1.0, rt.stop.set)


async def _lifespan(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    metrics = app[METRICS]
    rt = app[RUNTIME]
    core = Coalescer(coalescer_config(settings))
    async with asyncio.TaskGroup() as tg:
        driver = Driver(core, app[ENGINE], on_events=metrics.on_core_events)
        app[DRIVER] = driver
        metrics.watch(lambda: _live(app))
        tasks = [
            tg.create_task(driver.run(tg), name="driver"),
            tg.create_task(_boot(app), name="boot"),
            tg.create_task(_monitor(app), name="monitor"),
        ]
        watchdog: Any = app.get(WATCHDOG)
        if watchdog is not None:
            tasks.append(tg.create_task(watchdog.run(), name="watchdog"))
        try:
            yield
        finally:
            rt.phase = Phase.STOPPED
            for task in tasks:
                task.cancel()
    with contextlib.suppress(Exception):
        await asyncio.to_thread(app[ENGINE].shutdown)  # type: ignore[attr-defined]
    log.info("stopped", extra={"fields": {"exit_code": rt.exit_code}})


def _live(app: web.Application) -> dict[str, Any]:
    engine: Any = app[ENGINE]
    driver = app[DRIVER]
    stats = engine.stats()
    return {
        "queue_requests": driver.core.queued_requests,
        "queue_tokens": driver.core.queued_tokens,
        "pending_requests": driver.core.pending_requests,
        "engine_running": stats.running,
        "engine_waiting": stats.waiting,
        "kv_cache_usage": stats.kv_cache_usage,
        "preemptions": stats.preemptions_total,
        "prefix_queries": stats.prefix_cache_queries_total,
        "prefix_hits": stats.prefix_cache_hits_total,
        "ready": 1 if app[RUNTIME].ready else 0,
    }


def on_admission(app: web.Application, state: AdmissionState) -> None:
    """The watchdog's state change callback."""
    app[RUNTIME].admission = state
    app[DRIVER].set_state(state)


_PRESSURE_TO_ADMISSION = {
    0: AdmissionState.OK,
    1: AdmissionState.SHEDDING,
    2: AdmissionState.CRITICAL,
}


def watchdog_factory(settings: Settings) -> Callable[[web.Application], Any]:
    """The memory watchdog wired to this app: its state gates admission, its
    abort requests fail the newest lowest-priority running generations."""
    from server.watchdog import EngineReader, HostMemoryReader, NvmlReader, Watchdog

    def make(app: web.Application) -> Any:
        engine: Any = app[ENGINE]

        def on_state(state: Any, transition: Any) -> None:
            on_admission(app, _PRESSURE_TO_ADMISSION[int(state)])

        def on_abort(n: int, decision: Any) -> None:
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

        return Watchdog(
            gpu=NvmlReader(settings.env.cuda_visible_devices),
            host=HostMemoryReader(),
            engine=EngineReader(engine.stats),
            config=settings.pressure,
            interval=settings.watchdog_interval,
            on_state=on_state,
            on_abort=on_abort,
            registry=app[METRICS].registry,
        )

    return make


def build_app(
    settings: Settings,
    engine: Any,
    *,
    notifier: SdNotify | None = None,
    watchdog_factory: Callable[[web.Application], Any] | None = None,
) -> web.Application:
    from server import handlers

    app = web.Application(
        middlewares=[error_middleware],
        client_max_size=settings.max_body_bytes,
    )
    app[SETTINGS] = settings
    app[ENGINE] = engine
    app[METRICS] = Metrics()
    app[RUNTIME] = Runtime()
    app[RESULTS] = ResultCache(
        ttl=settings.result_cache_ttl,
        max_entries=1024 if settings.result_cache_ttl > 0 else 0,
    )
    app[NOTIFIER] = notifier or SdNotify(None)
    if watchdog_factory is not None:
        app[WATCHDOG] = watchdog_factory(app)
    handlers.add_routes(app)
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
                "running": len(driver.running_generations()),
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


async def serve(
    settings: Settings,
    engine: Any,
    notifier: SdNotify,
    watchdog_factory: Callable[[web.Application], Any] | None = None,
) -> int:
    """Run until a signal or engine death; return the process exit code."""
    app = build_app(settings, engine, notifier=notifier, watchdog_factory=watchdog_factory)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that goes away cancels its handler
        access_log=None,  # one structured line per request comes from the handlers
        shutdown_timeout=5.0,
    )
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
    await site.start()
    rt = app[RUNTIME]
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
    loop = asyncio.get_running_loop()
    signals_seen = 0
    drain_task: asyncio.Task[None] | None = None

    async def _drain_then_stop() -> None:
        await drain(app, settings.drain_timeout)
        rt.stop.set()

    def on_signal(signum: int) -> None:
        nonlocal signals_seen, drain_task
        signals_seen += 1
        if signals_seen == 1 and rt.phase is not Phase.DEAD:
            log.info(
                "signal received, draining",
                extra={"fields": {"signal": signal.Signals(signum).name}},
            )
            drain_task = loop.create_task(_drain_then_stop())  # awaited below
        else:
            log.warning("second signal, stopping now")
            err = SluiceError("server stopping", status=503, retry_after=5)
            app[DRIVER].fail_queued(err)
            app[DRIVER].fail_running(err)
            rt.stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await rt.stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if drain_task is not None and not drain_task.done():
            drain_task.cancel()
        if drain_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await drain_task
        await runner.cleanup()
    return rt.exit_code
