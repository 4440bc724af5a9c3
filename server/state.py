"""The app's typed state: its life-cycle phase, run state and app keys.

Why this module exists: the app (server/app.py), the router, the shell
(server/http/) and the APIs all read the same state; keeping it here, below all
of them, means none of them imports another to get at it (no import cycle).
It stands above what it holds (the settings, the engines' registry and loader,
the callers, operations' metrics, watchdog, systemd notifier and status
samples), so every import here points down. A key whose value belongs to one
API lives in that API (`RESPONSES`, server/api/openai_responses/endpoint.py).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from batching import AdmissionState, Budgets, ResultCache
from server.callers import CallerDirectory
from server.engines.loader import ModelLoader
from server.engines.registry import ModelEntry, ModelRegistry
from server.operations.metrics import Metrics
from server.operations.sdnotify import SdNotify
from server.operations.status_samples import StatusSampler
from server.operations.usage import UsageBook
from server.operations.watchdog import Watchdog
from server.settings import Settings
from server.wire.output import ChatChoice, CompletionChoice
from server.wire.request import Limits

__all__ = [
    "ACCESS",
    "ADMIN",
    "BUDGETS",
    "CALLER",
    "CALLERS",
    "LOADER",
    "METRICS",
    "MODEL",
    "MODELS",
    "NOTIFIER",
    "REQUEST_ID",
    "RESULTS",
    "RUNTIME",
    "SETTINGS",
    "STATUS",
    "USAGE",
    "WATCHDOG",
    "Access",
    "CachedResult",
    "Phase",
    "Runtime",
]


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass(slots=True)
class Runtime:
    """The app's mutable run state, shared by routes and background tasks."""

    phase: Phase = Phase.STARTING
    admission: AdmissionState = AdmissionState.OK
    started_at: float = field(default_factory=time.monotonic)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int = 0
    engine_error: str | None = None
    tokens_out: int = 0  # completion tokens sent, for STATUS= tokens/s
    batches_running: int = 0  # the Batch API's runner's (server/api/openai_batches/runner.py)
    limits: Limits = field(default_factory=Limits)  # request bounds, final once booted

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY and self.admission is AdmissionState.OK


@dataclass(slots=True)
class Access:
    """One request's access line, written by the request middleware as it ends.

    A handler adds to it: the generation pipeline hands over its own fields
    (queue wait, TTFT, batch; they replace the plain ones), the error
    middleware the refusal's code, and `status` when the outcome differs from
    the status on the wire (a stream that failed after its headers went out).
    `started` is the response whose headers went out (server/http/middleware.py).
    """

    t0: float
    fields: dict[str, Any] | None = None
    error: str | None = None
    status: int | None = None
    started: web.StreamResponse | None = None


# A deterministic result kept by --result-cache-ttl: the choices and the
# completion tokens they cost.
CachedResult = tuple[tuple[ChatChoice, ...] | tuple[CompletionChoice, ...], int]

SETTINGS = web.AppKey("settings", Settings)
# The served models: per model its engine, driver (core) and state
# (server/engines/registry.py); every handler finds its engine there, by the
# request's model. With --model, a registry of one.
MODELS = web.AppKey("models", ModelRegistry)
LOADER = web.AppKey("loader", ModelLoader)  # on-demand loads and unloads (server/engines/loader.py)
METRICS = web.AppKey("metrics", Metrics)
RUNTIME = web.AppKey("runtime", Runtime)
NOTIFIER = web.AppKey("notifier", SdNotify)
WATCHDOG = web.AppKey("watchdog", Watchdog)
RESULTS = web.AppKey[ResultCache[CachedResult]]("results")  # --result-cache-ttl
STATUS = web.AppKey("status", StatusSampler)  # the status page's ring buffer
CALLERS = web.AppKey("callers", CallerDirectory)  # who is asking (server/callers.py)
# Each caller's usage, counted per finished request (server/operations/usage.py).
USAGE = web.AppKey("usage", UsageBook)
# Each caller's budget and spend across every model (batching/budgets.py):
# checked at admission (server/http/pipeline.py), spent as requests end.
BUDGETS = web.AppKey("budgets", Budgets)
CALLER = web.RequestKey("caller", str)  # set by the auth middleware when keys name callers
ADMIN = web.RequestKey("admin", bool)  # /status.json with the admin key: the full view
REQUEST_ID = web.RequestKey("request_id", str)  # set by the request middleware, every route
ACCESS = web.RequestKey("access", Access)  # the request's access line (server/http/middleware.py)
# The model a request holds a lease on (server/http/models.py); the request
# middleware gives it back when the request ends, whatever happens.
MODEL = web.RequestKey("model", ModelEntry)
