"""A real OTLP/HTTP trace receiver on loopback, for the tests of Sluice's traces.

Why this module exists: a trace that reaches a collector is the check, not a
span object in memory; this receiver takes what the OpenTelemetry exporter
posts to /v1/traces, decodes each `ExportTraceServiceRequest` with
`opentelemetry-proto` (the collector's own message types) and keeps the spans
as plain dicts: name, ids, parent, times, attributes, events.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.support import free_port


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[dict[str, Any]]:
    """Every span of one export request, as a dict."""
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    spans = []
    for rs in req.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(
                    {
                        "name": s.name,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "kind": s.kind,
                        "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano,
                        "status": s.status.code,
                        "attributes": {a.key: _value(a.value) for a in s.attributes},
                        "events": {e.name: e.time_unix_nano for e in s.events},
                        "resource": resource,
                    }
                )
    return spans


class Receiver:
    """Spans posted to http://127.0.0.1:PORT/v1/traces, decoded (thread-safe list)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        spans = decode(body)
        with self._lock:
            self.spans.extend(spans)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/traces", self.handle)
        return app

    def of(self, request_id: str) -> list[dict[str, Any]]:
        """The spans of one request's trace (its server span names it)."""
        with self._lock:
            spans = list(self.spans)
        roots = [s for s in spans if s["attributes"].get("sluice.request_id") == request_id]
        ids = {s["trace_id"] for s in roots}
        return [s for s in spans if s["trace_id"] in ids]


@contextmanager
def receiver_thread() -> Iterator[Receiver]:
    """A receiver on its own event loop in a thread (for a subprocess server)."""
    rec = Receiver()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    runner = web.AppRunner(rec.app())

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", rec.port).start()
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield rec
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
