"""The middlewares every request passes: its id and access line outermost, then
errors, then the API key.

Why this module exists: a request's id is assigned, echoed and logged in one
place for every route (probes, /metrics and the page included); a refusal is
made in one place (`SluiceError`, raised anywhere) and turned into a JSON
error body in one place (here), in the shape of the path's API: Anthropic's
on /v1/messages*, Ollama's on /api/*, OpenAI's everywhere else; authentication is checked once
for every protected path rather than by each handler remembering to (the key
arrives as `Authorization: Bearer` or as Anthropic's `x-api-key`).
`install` wires all of it into an app, in that order.

A request that aiohttp's HTTP parser refuses (a bare CR in a header, a bad
request line) never reaches the app: aiohttp answers its 400 itself. So that
it still leaves one access line and one log line in Sluice's log, the server
is run with `server_options()`: aiohttp's access logger hook writes the line
for a request no middleware saw, and aiohttp's own error log goes through
Sluice's logging as one line without a traceback (`_ParserRefusals`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError

from server.callers import bearer_token, same_key
from server.errors import SluiceError
from server.http.door import BATCH_HEADER, BATCH_LINE, CALLER_HEADER, DOOR, DOOR_HEADER
from server.http.models import release_model
from server.operations import logs
from server.state import (
    ACCESS,
    ADMIN,
    CALLER,
    CALLERS,
    METRICS,
    MODEL,
    REQUEST_ID,
    SETTINGS,
    Access,
)

__all__ = [
    "ADMIN_PATHS",
    "ANTHROPIC_PREFIX",
    "JOB_PREFIXES",
    "LOAD_PATH",
    "METRICS_PATH",
    "OLLAMA_PREFIX",
    "OPEN_PATHS",
    "PROTECTED_PREFIXES",
    "STATUS_PATH",
    "UNLOAD_PATH",
    "USAGE_PREFIX",
    "auth_middleware",
    "error_middleware",
    "install",
    "request_middleware",
    "server_options",
]

log = logging.getLogger("sluice")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Paths behind the API key (when one is set). The probes stay open: systemd
# and load balancers read them without a key; /metrics too, for Prometheus on
# loopback, unless --metrics-key-file gives it a key of its own. The status
# page itself (/, /static/) holds no data; what it shows, /status.json, is
# behind the key: a caller's key gets its own view, the admin key the whole.
PROTECTED_PREFIXES = ("/v1/", "/api/", "/tokenize", "/detokenize", "/status.json")
# Under those prefixes, the probes that carry no data: Claude Code's preconnect
# and Ollama's version, which its clients read before they send a key.
OPEN_PATHS = frozenset({"/api/hello", "/api/version"})
STATUS_PATH = "/status.json"
# The Batch APIs' routes (OpenAI's, Anthropic's Message Batches): a caller's
# own files and batches, or all with the admin key (Bearer or x-api-key).
JOB_PREFIXES = ("/v1/files", "/v1/batches", "/v1/messages/batches")
# Creating a file or a batch is a caller's: its bytes count in that caller's
# quota and a batch's lines run as that caller. The admin key, no caller's, is
# refused there as on the generation routes (issue 50): it reads, cancels and
# deletes the others.
JOB_CREATE_PATHS = frozenset({"/v1/files", "/v1/batches", "/v1/messages/batches"})
METRICS_PATH = "/metrics"
# Runtime LoRA's routes: the admin key's, checked by their handler
# (server/api/lora_admin/endpoint.py rule 2), not a caller's.
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
ADMIN_PATHS = frozenset({LOAD_PATH, UNLOAD_PATH})
# OpenAI's Usage API (server/api/usage/): a caller's key sees its own usage,
# the admin key every caller's.
USAGE_PREFIX = "/v1/organization/usage/"
# Paths whose clients read Anthropic's error shape and statuses.
ANTHROPIC_PREFIX = "/v1/messages"
# Paths whose clients read Ollama's error shape (server/api/ollama/).
OLLAMA_PREFIX = "/api/"

# Paths read by machines every few seconds (probes, scrapes, the page's
# once-a-second poll): their access lines are at debug level while they
# succeed, so that an idle server's log is not one line a second. A refusal
# on them (a 401, a 503 probe) stays at info.
_QUIET_PATHS = frozenset(
    {"/health", "/ready", "/metrics", "/", "/status.json", "/api/hello", "/api/version"}
)
_QUIET_PREFIX = "/static/"


def request_id(header: str | None) -> str:
    """The caller's x-request-id when usable (printable, at most 128 characters:
    it goes into log lines and response ids), else a fresh one."""
    if header and len(header) <= 128 and header.isprintable():
        return header
    return uuid.uuid4().hex


def _quiet(path: str, status: int) -> bool:
    return status < 400 and (path in _QUIET_PATHS or path.startswith(_QUIET_PREFIX))


@web.middleware
async def request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Assign the request's id and write its one access line, whatever happens;
    give back its hold on a model (server/http/models.py) as it ends.

    The id reaches the response headers in `_echo_request_id`, as every
    response (a stream's included) is prepared; the generation pipeline hands
    its richer fields over in `request[ACCESS]` rather than writing a line.
    """
    rid = request_id(request.headers.get("x-request-id"))
    request[REQUEST_ID] = rid
    access = request[ACCESS] = Access(time.monotonic())
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except asyncio.CancelledError:
        status = 499  # the client went away (handler_cancellation)
        raise
    except web.HTTPException as exc:  # a redirect or a bare 304 (error_middleware keeps them)
        status = exc.status
        raise
    finally:
        model = request.get(MODEL)
        release_model(request)
        _write_access(request, rid, access, access.status or status, model and model.name)


def _write_access(
    request: web.Request, rid: str, access: Access, status: int, model: str | None
) -> None:
    if access.fields is not None:
        logs.access(access.fields)
        return
    fields: dict[str, Any] = {
        "request_id": rid,
        "method": request.method,
        "endpoint": request.path,
        "status": status,
        "total_ms": round((time.monotonic() - access.t0) * 1000, 2),
    }
    if caller := request.get(CALLER):
        fields["caller"] = caller
    if model:
        fields["model"] = model
    if access.error:
        fields["error"] = access.error
    logs.access(fields, logging.DEBUG if _quiet(request.path, status) else logging.INFO)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response carries the id, and the request
    notes that its headers went out (see error_middleware)."""
    if rid := request.get(REQUEST_ID):
        response.headers["x-request-id"] = rid
    if access := request.get(ACCESS):
        access.started = access.started or response


def _json_error(err: SluiceError, path: str = "") -> web.Response:
    if path.startswith(ANTHROPIC_PREFIX):
        body, status = err.anthropic_body(), err.anthropic_status
    elif path.startswith(OLLAMA_PREFIX):
        body, status = err.ollama_body(), err.status
    else:
        body, status = err.body(), err.status
    return web.Response(
        body=orjson.dumps(body),
        status=status,
        content_type="application/json",
        headers=err.headers(),
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every refusal leaves as a JSON error in its API's shape; nothing else does.

    A response whose headers already went out gets no second answer: the
    failure is logged and the started response is ended as it stands (the
    pipeline ends its own streams with an error frame; this is the net under
    any other handler that streams).
    """
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if isinstance(exc, web.HTTPException) and exc.status < 400:
            raise  # a redirect: not an error
        access: Access | None = request.get(ACCESS)
        if access is not None and access.started is not None:
            log.exception("error after the response started: %s %s", request.method, request.path)
            access.status, access.error = 500, "internal server error"
            return access.started
        err = _error(request, exc)
        if access is not None:
            access.error = err.code or err.message[:80]
        return _json_error(err, request.path)


def _error(request: web.Request, exc: Exception) -> SluiceError:
    """The refusal an exception stands for (an unexpected one is logged, with its
    traceback, and answers a plain 500)."""
    if isinstance(exc, SluiceError):
        return exc
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return SluiceError(f"request body too large: {exc.text}", status=413)
    if isinstance(exc, web.HTTPException):
        return SluiceError(exc.reason, status=exc.status)
    log.exception("internal error on %s %s", request.method, request.path)
    return SluiceError("internal server error", status=500)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """401 for a protected path without a known key; else name its caller.

    The key is Anthropic's `x-api-key` when that header is present, else the
    `Authorization: Bearer` token; either names the same caller.

    The compare is constant-time and keys never reach a log line (see
    server/callers.py); a refusal is counted, and logged (path and status
    only) by the access line like any request. Without any keys everything is
    open and the pipeline names the caller from the `user` field.
    """
    directory = request.app[CALLERS]
    path = request.path
    if DOOR_HEADER in request.headers:
        _through_the_door(request)
        return await handler(request)
    if (
        path.startswith(JOB_PREFIXES)
        and not (request.method == "POST" and path in JOB_CREATE_PATHS)
        and same_key(
            request.headers.get("x-api-key")
            or bearer_token(request.headers.get("Authorization", "")),
            request.app[SETTINGS].admin_key,
        )
    ):
        request[ADMIN] = True  # every caller's files and batches
        return await handler(request)
    if path == METRICS_PATH:
        _check_metrics_key(request)
        return await handler(request)
    if directory.open or not path.startswith(PROTECTED_PREFIXES) or path in OPEN_PATHS:
        return await handler(request)
    if path in ADMIN_PATHS:
        # the admin key's, not a caller's (server/api/lora_admin/endpoint.py)
        return await handler(request)
    if (path == STATUS_PATH or path.startswith(USAGE_PREFIX)) and same_key(
        bearer_token(request.headers.get("Authorization", "")),
        request.app[SETTINGS].admin_key,
    ):
        # the full view (server/http/status_page.py), every caller's usage
        request[ADMIN] = True
        return await handler(request)
    api_key = request.headers.get("x-api-key")
    caller = (
        directory.identify(api_key)
        if api_key is not None
        else directory.authenticate(request.headers.get("Authorization", ""))
    )
    if caller is not None:
        request[CALLER] = caller
        return await handler(request)
    request.app[METRICS].reject("auth")
    raise SluiceError("invalid or missing API key", status=401, code="invalid_api_key")


def _through_the_door(request: web.Request) -> None:
    """A batch line (server/api/openai_batches/runner.py): on the internal socket with its
    secret it is the named caller's, and background work; anything else
    carrying the header is refused as a bad key."""
    on_door = isinstance(request.transport and request.transport.get_extra_info("sockname"), str)
    if not on_door or not request.app[DOOR].admits(request.headers.get(DOOR_HEADER)):
        request.app[METRICS].reject("auth")
        raise SluiceError("invalid or missing API key", status=401, code="invalid_api_key")
    if (caller := request.headers.get(CALLER_HEADER)) is not None:
        request[CALLER] = caller
    request[BATCH_LINE] = request.headers.get(BATCH_HEADER, "")


def _check_metrics_key(request: web.Request) -> None:
    """/metrics with --metrics-key-file: its Bearer key or a 401 (no other key opens it)."""
    key = request.app[SETTINGS].metrics_key
    if key is None or same_key(bearer_token(request.headers.get("Authorization", "")), key):
        return
    request.app[METRICS].reject("auth")
    raise SluiceError("invalid or missing metrics key", status=401, code="invalid_api_key")


def install(app: web.Application) -> None:
    """The middlewares in their order (outermost first) and the id's echo."""
    app.middlewares.extend([request_middleware, error_middleware, auth_middleware])
    app.on_response_prepare.append(_echo_request_id)


class _UnseenRequests(AbstractAccessLogger):
    """aiohttp's access-log hook: the access line of a request that no
    middleware saw (one its parser refused: aiohttp's own error handler
    answered it). Every other request has written its line already."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if REQUEST_ID in request:
            return
        fields = {
            "request_id": uuid.uuid4().hex,
            "method": request.method,  # aiohttp's placeholder: the line was not read
            "endpoint": request.path,
            "status": response.status,
            "total_ms": round(time * 1000, 2),
            "error": "bad_http_request",
        }
        logs.access(fields)


class _ParserRefusals(logging.Filter):
    """On aiohttp's server logger: a refusal by the HTTP parser (a client's
    malformed request, not a fault here) becomes one line naming the cause,
    without the traceback aiohttp attaches; anything else passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            why = " ".join(str(exc.message).split())  # the parser's text spans lines
            record.msg, record.args = "request refused by the HTTP parser: %s", (why,)
            record.exc_info, record.exc_text = None, None
            # INFO (aiohttp says ERROR), or DEBUG where aiohttp chose it (a
            # connection's first line not HTTP at all: port scans, TLS).
            record.levelno = min(record.levelno, logging.INFO)
            record.levelname = logging.getLevelName(record.levelno)
            record.fields = {"status": exc.code}
        return True


_SERVER_LOG = logging.getLogger("sluice.http")
_SERVER_LOG.addFilter(_ParserRefusals())


def server_options() -> dict[str, Any]:
    """aiohttp's server arguments that keep its own output in Sluice's log: the
    access hook above (Sluice writes its other lines itself, so aiohttp's
    format is never used) and its error logger as a child of `sluice`."""
    return {
        "access_log_class": _UnseenRequests,
        "access_log": logs.ACCESS,
        "logger": _SERVER_LOG,
    }
