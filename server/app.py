"""The aiohttp application and its life cycle, from socket open to exit code.

Start-up and teardown are ordered here and nowhere else. One `cleanup_ctx`
enters an `asyncio.TaskGroup` that owns every background task:

    boot      build the engine of every `load = "start"` model (on a thread, one
              at a time), run a warm-up generation on each, then mark the app
              ready and tell systemd READY=1;
    driver    per model, its coalescer's I/O shell (server/engines/driver.py);
    models    with on-demand models: their loads and idle unloads
              (server/engines/loader.py; each load is a task of the group too);
    watchdog  memory polling (server/operations/watchdog.py) -> admission state;
    supervisor  engine liveness, per model (server/engines/supervisor.py): a
              dead or hung engine fails its own model's requests and starts
              again with back-off, within its restart budget; an essential
              model (the one --model) that is failed stops the process with
              exit code 1 (systemd restarts it), after the others drain;
    monitor   pings the systemd watchdog and updates STATUS=;
    status    one sample a second for the status page (server/operations/status_samples.py);
    usage     writes the callers' usage every 2 s (server/operations/usage.py).

A background task that crashes stops the server with exit code 1 (systemd
restarts it) instead of leaving it half alive. Leaving the context cancels
the group; the engine shutdown and the "stopped" line run in a `finally`,
whatever happened. `serve()` owns the signal-driven drain in a task group of
its own: the first SIGTERM/SIGINT drains (new requests get 503, queued and
running ones finish up to --drain-timeout, then the rest get a 503), a second
one stops at once. SIGHUP reloads the callers file (`reload_callers`); the
models file is read once (a change of engine flags is an engine restart, and
a model that comes or goes changes the metric labels and the room every other
model was checked against: a restart, which drains, is the honest way).

The served models are the registry (server/engines/registry.py, the `MODELS`
app key): one entry per model with its engine, its driver and its state.
`--model` is a registry of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import logging
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web

from batching import (
    DEFAULT_CALLER,
    AdmissionState,
    Budgets,
    Clock,
    Coalescer,
    ResultCache,
    Spend,
)
from batching.pressure import ENGINE_IDLE, Decision, EngineStats, RankStats, State, Transition
from server.api.lora_admin.endpoint import add_admin_routes
from server.api.openai_batches.runner import BATCHES, Batches
from server.api.openai_responses.endpoint import RESPONSES, StoredResponses
from server.api.openai_responses.store import ResponseStore
from server.api.usage.endpoint import add_usage_routes
from server.callers import CallerDirectory, CallersError, load_callers, world_readable
from server.engines.driver import Driver, Generation, order_priority, request_priority
from server.engines.interface import Engine, EngineParams, ModelInfo
from server.engines.loader import ModelLoader
from server.engines.registry import Load, ModelEntry, ModelRegistry, ModelSpec
from server.engines.registry import State as ModelState
from server.engines.restarts import RestartPolicy
from server.engines.supervisor import Supervisor
from server.errors import SluiceError
from server.http import cors, root_path, tls
from server.http.door import DOOR, Door
from server.http.middleware import install as install_middlewares
from server.http.middleware import server_options
from server.http.status_page import add_status_routes, make_sampler
from server.listen import BindError, bind
from server.operations.metrics import Metrics
from server.operations.sdnotify import SdNotify
from server.operations.state_db import StateDB
from server.operations.usage import UsageBook
from server.operations.watchdog import (
    EngineReader,
    HostMemoryReader,
    NvmlReader,
    Watchdog,
)
from server.router import add_routes
from server.settings import Settings
from server.state import (
    BUDGETS,
    CALLERS,
    LOADER,
    METRICS,
    MODELS,
    NOTIFIER,
    RESULTS,
    RUNTIME,
    SETTINGS,
    STATUS,
    USAGE,
    WATCHDOG,
    Phase,
    Runtime,
)
from server.wire.request import Limits, Sampling

log = logging.getLogger("sluice")

__all__ = [
    "WatchdogFactory",
    "build_app",
    "drain",
    "engines_stats",
    "model_limits",
    "reload_callers",
    "serve",
    "warmup",
    "watchdog_factory",
]

WatchdogFactory = Callable[[web.Application], Watchdog]
EngineFactory = Callable[[ModelSpec], Engine]

# How long handlers get to write their 503s after the engine died, before the
# process stops for a restart.
_DEAD_EXIT_DELAY = 1.0


async def _boot(app: web.Application) -> None:
    rt = app[RUNTIME]
    settings = app[SETTINGS]
    registry = app[MODELS]
    t0 = time.monotonic()
    for entry in registry:
        if entry.spec.load is not Load.START:
            continue
        log.info(
            "engine starting", extra={"fields": {"model": entry.spec.path, "name": entry.name}}
        )
        try:
            await app[LOADER].start_now(entry)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("engine failed to start")
            rt.engine_error = f"{entry.name}: {exc}" if settings.several else str(exc)
            rt.phase = Phase.DEAD
            rt.exit_code = 1
            rt.stop.set()
            return
    # As vLLM's own server does after start-up: move what start-up built (the
    # tokenizer, vLLM's config, imported modules) into the permanent
    # generation, so the cyclic collector stops rescanning it while serving.
    gc.collect()
    gc.freeze()
    fields: dict[str, Any]
    if settings.several:
        fields = {"models": [e.name for e in registry]}
    else:
        info = registry.default.engine.info
        rt.limits = model_limits(settings, registry.default.spec, info)
        fields = {
            "model": settings.model_name,
            # Each data-parallel rank's; Sluice counts dp_ranks x these slots.
            "max_num_seqs": info.max_num_seqs,
            "max_num_batched_tokens": info.max_num_batched_tokens,
            "dp_ranks": info.dp_ranks,
        }
    if rt.phase is Phase.STARTING:
        rt.phase = Phase.READY
    fields["startup_s"] = round(time.monotonic() - t0, 1)
    fields["url"] = settings.url
    log.info("ready", extra={"fields": fields})
    app[NOTIFIER].ready()


def _engine_up(app: web.Application, entry: ModelEntry) -> None:
    """A model's engine started (at boot or on demand): its core's batch caps and
    the backlog's engine capacity follow the engine's resolved limits. Nothing
    is admitted to a core before its model is loaded (requests wait for the
    load before they tokenize: server/http/models.py), so the core takes the
    config as is, keeping the callers a SIGHUP may have loaded since."""
    core = entry.driver.core
    settings = app[SETTINGS]
    core.config = dataclasses.replace(
        settings.core_for(entry.engine.info), callers=core.config.callers
    )
    entry.driver.revive()  # after a restart: its driver takes work again


def model_limits(settings: Settings, spec: ModelSpec, info: ModelInfo | None = None) -> Limits:
    """Request parsing's bounds and defaults for one model: its generation
    config's defaults, from its running engine or, before it runs, from its
    config as the CLI resolved it (an on-demand model's requests are parsed
    before its load)."""
    return Limits(
        max_n=settings.max_n,
        max_logprobs=spec.max_logprobs,
        default_enable_thinking=spec.default_thinking,
        sampling_defaults=info.sampling_defaults if info else spec.sampling_defaults,
        default_max_tokens=info.default_max_tokens if info else spec.default_max_tokens,
    )


def _limits(settings: Settings, registry: ModelRegistry) -> Limits:
    """The app's parsing limits: the default model's, and with --models each
    model's by its name and its adapters' names (`Limits.for_model`)."""
    default = model_limits(settings, registry.default.spec)
    if not settings.several:
        return default
    table = tuple(
        (name, model_limits(settings, e.spec))
        for e in registry
        for name in (e.name, *(a.name for a in e.spec.adapters))
    )
    return dataclasses.replace(default, models=table)


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
    """The systemd watchdog and STATUS= lines (engine liveness is the
    supervisor's, per model: server/engines/supervisor.py)."""
    rt = app[RUNTIME]
    notifier = app[NOTIFIER]
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
        notifier.watchdog()
        now = time.monotonic()
        if now - last_status >= 5:
            rate = (rt.tokens_out - last_tokens) / max(now - last_t, 1e-9)
            last_tokens, last_t, last_status = rt.tokens_out, now, now
            drivers = _drivers(app)
            notifier.status(
                f"{rt.phase.value}, admission {rt.admission.name.lower()}, "
                f"queued {sum(d.core.queued_requests for d in drivers)}, "
                f"running {sum(d.running for d in drivers)}, {rate:.0f} tok/s"
            )


def _drivers(app: web.Application) -> list[Driver]:
    return [e.driver for e in app[MODELS] if e.attached]


async def _give_up(app: web.Application, why: str) -> None:
    """An essential model is failed (server/engines/restarts.py rule 5): the
    process stops with exit code 1 (systemd restarts it), after the other
    models' work drains; /health is 503 from now on."""
    rt = app[RUNTIME]
    log.error("an essential model failed; stopping", extra={"fields": {"why": why}})
    rt.phase = Phase.DEAD
    rt.engine_error = why
    rt.exit_code = 1
    await drain(app, app[SETTINGS].drain_timeout)
    # Give the handlers a moment to write their 503s, then stop.
    await asyncio.sleep(_DEAD_EXIT_DELAY)
    rt.stop.set()


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


async def _seed_budgets(app: web.Application) -> None:
    """Each caller's spend of this day and month, from the durable usage
    (server/operations/usage.py): a restart keeps what a budget has used."""
    budgets, at = app[BUDGETS], time.time()
    day, month = [await app[USAGE].totals_since(t) for t in budgets.periods(at)]
    budgets.load(
        at,
        day={caller: Spend(*spent) for caller, spent in day.items()},
        month={caller: Spend(*spent) for caller, spent in month.items()},
    )


async def _lifespan(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    metrics = app[METRICS]
    rt = app[RUNTIME]
    registry = app[MODELS]
    await app[RESPONSES].open(time.time())  # the state database: before any engine starts
    await _seed_budgets(app)
    try:
        async with asyncio.TaskGroup() as tg:

            def spawn(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
                return tg.create_task(_guarded(rt, name, coro), name=name)

            died = asyncio.Event()  # a driver met its engine's death: the supervisor looks
            for entry in registry:
                entry.attach(
                    Driver(
                        Coalescer(settings.core),
                        entry.engine,
                        on_events=metrics.core_events(entry.name),
                        engine_priority=(
                            order_priority
                            if settings.engine_priority == "order"
                            else request_priority
                        ),
                        on_dead=died.set,
                    )
                )
            app[LOADER] = ModelLoader(
                registry,
                app[_ENGINES],
                spawn=spawn,
                budget=settings.memory_budget,
                load_timeout=settings.load_timeout,
                on_loaded=functools.partial(_engine_up, app),
                warmup=warmup if settings.warmup else None,
            )
            metrics.watch(lambda: _live(app))
            supervisor = Supervisor(
                registry,
                app[LOADER],
                # One engine object for the process (a test's): it cannot start again.
                settings.restarts if app[_RESTARTABLE] else RestartPolicy(restarts=0),
                health_timeout=settings.health_timeout,
                give_up=functools.partial(_give_up, app),
                counted=metrics.engine_event,
                wake=died,
                gpu_pids=app[WATCHDOG].gpu_pids if WATCHDOG in app else lambda: None,
            )
            jobs: dict[str, Coroutine[Any, Any, None]] = {}
            for entry in registry:
                name = f"driver-{entry.name}" if settings.several else "driver"
                jobs[name] = entry.driver.run()
            jobs["boot"] = _boot(app)
            jobs["monitor"] = _monitor(app)
            jobs["supervisor"] = supervisor.run()
            if any(e.spec.load is Load.ON_DEMAND for e in registry):
                jobs["models"] = app[LOADER].run()
            if WATCHDOG in app:
                jobs["watchdog"] = app[WATCHDOG].run()
            jobs["status"] = app[STATUS].run()
            jobs["responses-retention"] = _sweep_responses(app)
            jobs["batches"] = app[BATCHES].run()
            jobs["usage"] = app[USAGE].run()  # flushes once more when cancelled
            tasks = [spawn(c, n) for n, c in jobs.items()]
            try:
                yield
            finally:
                rt.phase = Phase.STOPPED
                for task in tasks:
                    task.cancel()
    finally:
        for entry in registry:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(entry.engine.shutdown)
        with contextlib.suppress(Exception):
            await app[USAGE].flush()  # what the engines' last requests recorded
        await app[RESPONSES].close()
        app[DOOR].close()
        log.info("stopped", extra={"fields": {"exit_code": rt.exit_code}})


def _batches_running(rt: Runtime, n: int) -> None:
    """The status page's count of batches being run (server/http/status_page.py)."""
    rt.batches_running = n


def _over_budget(budgets: Budgets, owner: str | None) -> float | None:
    """Seconds until a batch owner's budget resets, when it is spent now (its
    batch pauses: server/api/openai_batches/runner.py); None: it may spend."""
    overdraft = budgets.over(owner or DEFAULT_CALLER, time.time())
    return None if overdraft is None else overdraft.retry_after


def _files_dir(app: web.Application, state_dir: Path | None) -> Path:
    """Where the Batch API's files live: `files/` in the state directory; without
    one (an app built without the CLI: tests), a private directory removed at exit."""
    if state_dir is not None:
        path = state_dir / "files"
        path.mkdir(mode=0o700, exist_ok=True)
        return path
    path = Path(tempfile.mkdtemp(prefix="sluice-files-"))

    async def remove(app: web.Application) -> None:
        await asyncio.to_thread(shutil.rmtree, path, True)

    app.on_cleanup.append(remove)
    return path


async def _sweep_responses(app: web.Application) -> None:
    """Delete stored responses past --responses-retention (already invisible
    to reads), and files and ended batches past --batch-retention: every
    minute, or a quarter of the shorter retention."""
    store = app[RESPONSES]
    batches = app[BATCHES]
    keep = app[SETTINGS].batch_retention
    every = min(60.0, store.policy.retention / 4, keep / 4)
    while True:
        await asyncio.sleep(every)
        await store.sweep(time.time())
        await batches.sweep(time.time(), keep)


def _live(app: web.Application) -> list[tuple[str | None, dict[str, Any]]]:
    """The live gauges per model: (its `model` label, None with --model; values)."""
    several = app[SETTINGS].several
    ready = 1 if app[RUNTIME].ready else 0
    out: list[tuple[str | None, dict[str, Any]]] = []
    for entry in app[MODELS]:
        if not entry.attached:
            continue
        core = entry.driver.core
        stats = entry.engine.stats()
        out.append(
            (
                entry.name if several else None,
                {
                    "queue_requests": core.queued_requests,
                    "queue_tokens": core.queued_tokens,
                    "pending_requests": core.pending_requests,
                    "engine_running": stats.running,
                    "engine_waiting": stats.waiting,
                    "kv_cache_usage": stats.kv_cache_usage,
                    "ranks": stats.ranks,
                    "preemptions": stats.preemptions_total,
                    "prefix_queries": stats.prefix_cache_queries_total,
                    "prefix_hits": stats.prefix_cache_hits_total,
                    "adapter_wait_steps": stats.adapter_wait_steps_total,
                    "engine_steps": stats.steps_total,
                    "prefill_tokens": stats.prefill_tokens_total,
                    "decode_tokens": stats.decode_tokens_total,
                    "step_seconds": stats.step_seconds_total,
                    "step_share": entry.engine.step_share(),
                    "room": core.room_counters,
                    "placements": core.placements,
                    "warm": core.warm_counters,
                    "ready": ready,
                    "backlog": core.backlog_generations,
                    "unstarted": core.engine_waiting,
                    "callers": core.callers(),
                    "entry": entry,
                },
            )
        )
    return out


def engines_stats(registry: ModelRegistry) -> EngineStats:
    """Every loaded engine's stats as one reading for the watchdog (one watchdog
    watches the card for all engines): running and waiting summed, KV use the
    fullest engine's, and each engine's scheduler (each data-parallel rank of
    it) as a rank of its own, so that a preemption storm is judged per
    scheduler (batching/pressure.py) and named by its model. One engine: its
    own stats, unchanged. Runs on the watchdog's thread: it reads each
    engine's latest immutable snapshot only."""
    loaded = [(e.name, e.engine.stats()) for e in registry if e.state is ModelState.LOADED]
    if len(registry) == 1:
        return registry.default.engine.stats()
    if not loaded:
        return ENGINE_IDLE
    ranks: list[RankStats] = []
    for name, s in loaded:
        own = s.ranks or (RankStats(s.kv_cache_usage, s.running, s.waiting, s.preemptions_total),)
        ranks += [
            dataclasses.replace(r, name=f"{name}" if len(own) == 1 else f"{name} rank {i}")
            for i, r in enumerate(own)
        ]
    return EngineStats(
        kv_cache_usage=max(s.kv_cache_usage for _, s in loaded),
        running=sum(s.running for _, s in loaded),
        waiting=sum(s.waiting for _, s in loaded),
        preemptions_total=sum(s.preemptions_total for _, s in loaded),
        prefix_cache_queries_total=sum(s.prefix_cache_queries_total for _, s in loaded),
        prefix_cache_hits_total=sum(s.prefix_cache_hits_total for _, s in loaded),
        ranks=tuple(ranks),
        adapter_wait_steps_total=sum(s.adapter_wait_steps_total for _, s in loaded),
        steps_total=sum(s.steps_total for _, s in loaded),
        prefill_tokens_total=sum(s.prefill_tokens_total for _, s in loaded),
        decode_tokens_total=sum(s.decode_tokens_total for _, s in loaded),
        step_seconds_total=sum(s.step_seconds_total for _, s in loaded),
    )


def on_admission(app: web.Application, state: AdmissionState) -> None:
    """The watchdog's state change, applied to the app and every model's core."""
    app[RUNTIME].admission = state
    for driver in _drivers(app):
        driver.set_state(state)


_PRESSURE_TO_ADMISSION = {
    State.OK: AdmissionState.OK,
    State.SHEDDING: AdmissionState.SHEDDING,
    State.CRITICAL: AdmissionState.CRITICAL,
}


def abort_for_memory(app: web.Application, n: int) -> None:
    """Critical memory: fail the `n` newest lowest-priority running generations,
    of every model (the card is one)."""
    running: list[Generation] = [g for d in _drivers(app) for g in d.running_generations()]
    gens = sorted(running, key=lambda g: (g.priority, g.started))  # lowest priority: highest
    err = SluiceError(
        "aborted: server memory critical; retry shortly",
        status=503,
        retry_after=10,
        code="memory",
    )
    models = {id(e.driver): e.name for e in app[MODELS] if e.attached}
    for gen in gens[::-1][:n]:
        app[METRICS].reject("memory_abort", models.get(id(gen.driver)))
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
            engine=EngineReader(functools.partial(engines_stats, app[MODELS])),
            config=settings.pressure,
            interval=settings.watchdog_interval,
            on_state=on_state,
            on_abort=on_abort,
            registry=app[METRICS].registry,
        )

    return make


# What makes each model's engine object (build_app's `engines`): the loader
# makes a fresh one after every unload.
_ENGINES = web.AppKey[EngineFactory]("engines")
# Whether that factory makes a fresh engine each time (a dead one can restart).
_RESTARTABLE = web.AppKey("restartable", bool)


def build_app(
    settings: Settings,
    engine: Engine | None = None,
    *,
    engines: EngineFactory | None = None,
    notifier: SdNotify | None = None,
    watchdog_factory: WatchdogFactory | None = None,
) -> web.Application:
    """The app for `settings`' models: `engine` serves the one model of
    `--model` (a test's fake), or `engines` makes each model's engine object
    (`sluice serve`: server/engines/vllm_adapter.py `EngineAdapter.from_spec`), again
    after every unload."""
    if engines is None:
        if engine is None:
            raise ValueError("build_app needs an engine or an engine factory")
        given = engine
        engines = lambda spec: given  # noqa: E731 (one model, never unloaded)
    app = web.Application(client_max_size=settings.max_body_bytes)
    install_middlewares(app)
    app[SETTINGS] = settings
    _install_network(app, settings)
    registry = ModelRegistry.build(settings.specs(), engines, path_names=not settings.several)
    app[MODELS] = registry
    app[_ENGINES] = engines
    app[_RESTARTABLE] = engine is None
    app[CALLERS] = CallerDirectory(
        settings.caller_table, settings.api_key, shared_cache=settings.shared_prefix_cache
    )
    # Budgets are per caller across every model (batching/budgets.py); the
    # callers file gives them, SIGHUP swaps them and keeps the spend.
    table = settings.caller_table
    app[BUDGETS] = Budgets(
        table.budget_table() if table is not None else {}, Clock(settings.env.budget_day)
    )
    app[METRICS] = Metrics(
        caller_label=app[CALLERS].label, models=registry.names if settings.several else None
    )
    app[RUNTIME] = Runtime(limits=_limits(settings, registry))
    app[RESULTS] = ResultCache(
        ttl=settings.result_cache_ttl,
        max_entries=1024 if settings.result_cache_ttl > 0 else 0,
    )
    # /v1/responses' stored responses and the Batch API's files and batches, in
    # the state database (opened by _lifespan); the files' bytes beside it.
    db = StateDB(settings.state_dir)
    app[RESPONSES] = StoredResponses(db, ResponseStore(retention=settings.responses_retention))
    app[USAGE] = UsageBook(db)  # who used the card: written beside them
    app[METRICS].usage_totals = lambda: app[USAGE].engine_seconds
    app[DOOR] = Door.make()
    app[BATCHES] = Batches(
        db,
        _files_dir(app, settings.state_dir),
        app[DOOR],
        limits=lambda: app[RUNTIME].limits,
        accepting=lambda: app[RUNTIME].phase in (Phase.STARTING, Phase.READY),
        in_flight=settings.batch_lines_in_flight,
        disk_per_caller=settings.batch_disk_per_caller,
        counted=app[METRICS].batch_event,
        running=functools.partial(_batches_running, app[RUNTIME]),
        over_budget=functools.partial(_over_budget, app[BUDGETS]),
    )
    app[NOTIFIER] = notifier or SdNotify(None)
    if watchdog_factory is not None:
        app[WATCHDOG] = watchdog_factory(app)
    app[STATUS] = make_sampler(app)
    add_routes(app)
    add_admin_routes(app)  # only with --allow-runtime-lora
    add_status_routes(app)
    add_usage_routes(app)
    app.cleanup_ctx.append(_lifespan)
    return app


def _install_network(app: web.Application, settings: Settings) -> None:
    """Issue 44's pieces that change how requests arrive: CORS ahead of the
    API key (after the request id, so a preflight has its access line), the
    root path, and the tracer (flushed at exit)."""
    if settings.cors is not None:
        cors.install(app, settings.cors, before=1)
    root_path.install(app, settings.root_path)
    if settings.otlp_traces_endpoint is not None:
        from server import __version__
        from server.operations.tracing import TRACER, Tracer

        tracer = Tracer(settings.otlp_traces_endpoint, version=__version__)
        app[TRACER] = tracer

        async def flush(app: web.Application) -> None:
            await asyncio.to_thread(tracer.shutdown)

        app.on_cleanup.append(flush)


async def drain(app: web.Application, timeout: float) -> None:
    """Stop taking work, let queued and running work finish, then fail the rest."""
    rt = app[RUNTIME]
    drivers = _drivers(app)
    if rt.phase in (Phase.READY, Phase.STARTING):
        rt.phase = Phase.DRAINING
    for driver in drivers:
        driver.set_state(AdmissionState.DRAINING)
    if LOADER in app:
        app[LOADER].stop()  # a restart in its back-off stops there
    app[NOTIFIER].stopping()
    log.info(
        "draining",
        extra={
            "fields": {
                "queued": sum(d.core.queued_requests for d in drivers),
                "running": sum(d.running for d in drivers),
                "timeout_s": timeout,
            }
        },
    )

    async def idle() -> None:
        for driver in drivers:
            await driver.idle.wait()
        if LOADER in app:  # and no request waits for a model's load
            await app[LOADER].all_idle()

    try:
        await asyncio.wait_for(idle(), timeout)
    except TimeoutError:
        err = SluiceError("server shutting down; retry elsewhere", status=503, retry_after=5)
        n = sum(d.fail_queued(err) + d.fail_running(err) for d in drivers)
        log.warning("drain deadline reached", extra={"fields": {"aborted": n}})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(d.idle.wait() for d in drivers)), 2.0)


async def reload_callers(app: web.Application) -> bool:
    """SIGHUP: read the callers file again. A bad file keeps the old callers and
    logs why; queued work keeps going under the new limits (batching/callers.py)."""
    settings = app[SETTINGS]
    path = settings.callers_file
    if path is None:
        log.info("SIGHUP: no --callers file to reload")
        return False
    registry = app[MODELS]
    try:
        table = await asyncio.to_thread(
            functools.partial(
                load_callers,
                path,
                adapters=[n for e in registry for n in e.adapters.names],
                base=settings.model_name,
                models=registry.names if settings.several else (),
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
    for driver in _drivers(app):
        driver.core.set_callers(table.policies)
    app[BUDGETS].set_budgets(table.budget_table())  # what was spent stays
    app[BATCHES].look()  # a paused batch whose budget grew goes on
    log.info("callers reloaded", extra={"fields": {"callers": list(table.names)}})
    return True


async def serve(
    settings: Settings,
    engines: EngineFactory,
    notifier: SdNotify,
    watchdog_factory: WatchdogFactory | None = None,
    *,
    sock: socket.socket | None = None,
) -> int:
    """Run until a signal or an essential model's failure; return the process
    exit code. `sock`: the listening socket, bound before the settings were
    read (server/listen.py); else bound here, still before any engine starts
    (a taken port: exit code 2, with one line naming it)."""
    if sock is None:
        try:
            sock = bind(settings.host, settings.port)
        except BindError as exc:
            sys.stderr.write(f"sluice serve: error: {exc}\n")
            return 2
    app = build_app(settings, engines=engines, notifier=notifier, watchdog_factory=watchdog_factory)
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
        ssl_context = tls.server_context(settings.tls) if settings.tls else None
        site = web.SockSite(runner, sock, ssl_context=ssl_context)
        await site.start()
        await app[DOOR].open(runner)  # the batch lines' way in (server/http/door.py)
        log.info(
            "listening",
            extra={
                "fields": {
                    "host": settings.host,
                    "port": settings.port,
                    "tls": settings.tls is not None,
                    "model": settings.model_name,
                    **({"models": list(app[MODELS].names)} if settings.several else {}),
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
                for driver in _drivers(app):
                    driver.fail_queued(err)
                    driver.fail_running(err)
                rt.stop.set()

            def on_hangup() -> None:
                tg.create_task(reload_callers(app), name="reload-callers")
                if ssl_context is not None and settings.tls is not None:
                    tg.create_task(tls.reload(ssl_context, settings.tls), name="reload-tls")

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
