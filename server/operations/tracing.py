"""OpenTelemetry traces: one span per request, exported over OTLP/HTTP (--otlp-traces-endpoint).

Why this module exists: the metrics say where requests spend their time in
aggregate; a team's tracing system wants it per request, in the trace its
own service began (W3C `traceparent`). This is the one module that touches
OpenTelemetry (the `otel` extra: opentelemetry-sdk and the OTLP/HTTP
exporter), imported only when an endpoint is given, so the default install
and a server without the flag pay nothing (the pipeline tests one key).

A request's span is made once, as it ends, from the times the pipeline
already keeps for its access line (`RequestSpan`): no span object lives
through the request and no context is switched on its path. The spans follow
OpenTelemetry's GenAI semantic conventions (`gen_ai.operation.name`,
`gen_ai.request.model`, `gen_ai.usage.*`, `gen_ai.response.finish_reasons`)
and add Sluice's own `sluice.*` attributes (caller, class, adapter, the waits, the
batch). Its children, as far as the request got:

    sluice.prepare   parse, render and tokenize, up to the coalescing window
    sluice.window    in the coalescing window
    sluice.backlog   held in Sluice's backlog until the engine had room
    sluice.engine    in the engine, with a `first_token` event, to the end

The core measures a request's wait from its arrival to its release (window
and backlog together) and the reason its batch was released; `queue_split`
divides it: a batch released from the backlog (reason `backlog`) spent at most
the configured window in the window and the rest in the backlog; any other
release ended in the window. Which room rule held it (batching/room.py) is
counted per rule in aggregate, not per request, so the span names the
release reason only.

Spans leave on the SDK's batch processor thread (its queue drops spans
rather than grow when the receiver is down); `shutdown` flushes at exit.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

__all__ = ["TRACER", "RequestSpan", "Tracer", "endpoint_url", "missing", "queue_split"]

# Sluice's endpoint names -> the GenAI operation (gen_ai.operation.name).
_OPERATIONS = {
    "chat": "chat",
    "responses": "chat",
    "messages": "chat",
    "ollama_chat": "chat",
    "completions": "text_completion",
    "ollama_generate": "text_completion",
    "embeddings": "embeddings",
    "ollama_embed": "embeddings",
    "ollama_embeddings": "embeddings",
}

_NEEDED = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")


def missing() -> str | None:
    """The first OpenTelemetry module this install lacks, or None."""
    for name in _NEEDED:
        try:
            if importlib.util.find_spec(name) is None:
                return name.split(".trace")[0]
        except ModuleNotFoundError:
            return name.split(".trace")[0]
    return None


def endpoint_url(value: str) -> str:
    """The OTLP/HTTP traces URL for the flag's value: an http(s) URL; a URL
    without a path gets OTLP's /v1/traces. ValueError otherwise."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            "--otlp-traces-endpoint must be the http(s) URL of an OTLP/HTTP receiver "
            f"(http://collector:4318/v1/traces), got {value!r}"
        )
    if parts.path in ("", "/"):
        return parts._replace(path="/v1/traces").geturl()
    return parts.geturl()


def queue_split(queue_wait: float, window: float, release: str | None) -> tuple[float, float]:
    """(window, backlog) seconds of a request's wait in the core (see above)."""
    if release == "backlog":
        in_window = min(queue_wait, window)
        return in_window, queue_wait - in_window
    return queue_wait, 0.0


@dataclass(frozen=True, slots=True)
class RequestSpan:
    """What one request's span says. Times are the monotonic clock's seconds;
    `arrival`, `queue_wait` and `release` are None for a request that never
    reached the core (refused, answered from the result cache)."""

    endpoint: str
    method: str
    path: str
    headers: Mapping[str, str]  # the request's: its traceparent and tracestate
    request_id: str
    status: int
    t0: float
    end: float
    model: str | None = None
    adapter: str | None = None
    caller: str | None = None
    request_class: str | None = None  # interactive or background (batching/classes.py)
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: tuple[str, ...] = ()
    ttft: float | None = None  # from t0
    arrival: float | None = None
    queue_wait: float | None = None
    window: float = 0.0  # the configured coalescing window
    release: str | None = None  # why its batch left the core (batching/types.py ReleaseReason)
    batch_id: int | None = None
    batch_size: int | None = None
    deduped: bool = False
    error: str | None = None


class Tracer:
    """The OpenTelemetry SDK, set up for one endpoint; `record` one span tree per request."""

    def __init__(self, endpoint: str, *, service: str = "sluice", version: str = "") -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": service, "service.version": version})
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("sluice", version)
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER
        self._status, self._code = Status, StatusCode
        self._child = set_span_in_context

    def record(self, r: RequestSpan) -> None:
        """The request's span and its children, with their times as measured."""
        offset = time.time_ns() - time.monotonic_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        operation = _OPERATIONS.get(r.endpoint, r.endpoint)
        parent = self._propagator.extract(r.headers)
        span = self._tracer.start_span(
            f"{operation} {r.model}" if r.model else operation,
            context=parent,
            kind=self._server,
            start_time=ns(r.t0),
            attributes=_attributes(r, operation),
        )
        if r.status >= 400:
            span.set_status(self._status(self._code.ERROR, r.error or str(r.status)))
        inner = self._child(span)
        end = r.end
        if r.arrival is not None and r.queue_wait is not None:
            arrival = max(r.arrival, r.t0)
            in_window, in_backlog = queue_split(r.queue_wait, r.window, r.release)
            released = arrival + r.queue_wait
            steps: list[tuple[str, float, float, dict[str, Any]]] = [
                ("sluice.prepare", r.t0, arrival, {}),
                ("sluice.window", arrival, arrival + in_window, {}),
            ]
            if in_backlog > 0:
                held = {"sluice.release_reason": "backlog"}
                steps.append(("sluice.backlog", arrival + in_window, released, held))
            steps.append(("sluice.engine", released, end, {}))
            for name, start, stop, attrs in steps:
                child = self._tracer.start_span(
                    name, context=inner, start_time=ns(start), attributes=attrs
                )
                if name == "sluice.engine" and r.ttft is not None:
                    child.add_event("first_token", timestamp=ns(r.t0 + r.ttft))
                child.end(end_time=ns(max(stop, start)))
        if r.ttft is not None:
            span.add_event("first_token", timestamp=ns(r.t0 + r.ttft))
        span.end(end_time=ns(end))

    def shutdown(self) -> None:
        """Send what is queued and stop the exporter (blocks: run it on a thread)."""
        self._provider.shutdown()


def _attributes(r: RequestSpan, operation: str) -> dict[str, Any]:
    a: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.usage.input_tokens": r.prompt_tokens,
        "gen_ai.usage.output_tokens": r.completion_tokens,
        "http.request.method": r.method,
        "http.route": r.path,
        "http.response.status_code": r.status,
        "sluice.request_id": r.request_id,
        "sluice.endpoint": r.endpoint,
        "sluice.stream": r.stream,
    }
    if r.model is not None:
        a["gen_ai.request.model"] = r.model
        a["gen_ai.response.model"] = r.adapter or r.model
    if r.finish_reasons:
        a["gen_ai.response.finish_reasons"] = list(r.finish_reasons)
    if r.caller is not None:
        a["sluice.caller"] = r.caller
    if r.request_class is not None:
        a["sluice.class"] = r.request_class
    if r.adapter is not None:
        a["sluice.adapter"] = r.adapter
    if r.ttft is not None:
        a["sluice.ttft_s"] = r.ttft
    if r.queue_wait is not None:
        in_window, in_backlog = queue_split(r.queue_wait, r.window, r.release)
        a["sluice.queue_wait_s"] = r.queue_wait
        a["sluice.window_wait_s"] = in_window
        a["sluice.backlog_wait_s"] = in_backlog
    if r.release is not None:
        a["sluice.release_reason"] = r.release
    if r.batch_id is not None and r.batch_id >= 0:
        a["sluice.batch.id"] = r.batch_id
        a["sluice.batch.size"] = r.batch_size or 0
        a["sluice.deduped"] = r.deduped
    if r.status >= 400:
        a["error.type"] = r.error or str(r.status)
    return a


# The app's tracer when --otlp-traces-endpoint is given (absent otherwise).
TRACER = web.AppKey("tracer", Tracer)
