"""The two middlewares every request passes: errors outermost, then the API key.

Why this module exists: a refusal is made in one place (`SluiceError`, raised
anywhere) and turned into an OpenAI-shaped JSON body in one place (here);
authentication is checked once for every protected path rather than by each
handler remembering to. The error's shape follows the API of the path:
Anthropic's on /v1/messages*, OpenAI's everywhere else; the key arrives as
`Authorization: Bearer` or as Anthropic's `x-api-key`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from server import logs
from server.errors import SluiceError
from server.state import CALLER, CALLERS, METRICS

__all__ = ["ANTHROPIC_PREFIX", "PROTECTED_PREFIXES", "auth_middleware", "error_middleware"]

log = logging.getLogger("sluice")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Paths behind the API key (when one is set). The probes and /metrics stay
# open: systemd, load balancers and Prometheus read them without a key. The
# status page itself (/, /static/) holds no data; what it shows, /status.json,
# is behind the key.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/status.json")
# Paths whose clients read Anthropic's error shape and statuses.
ANTHROPIC_PREFIX = "/v1/messages"


def _json_error(err: SluiceError, path: str = "") -> web.Response:
    anthropic = path.startswith(ANTHROPIC_PREFIX)
    return web.Response(
        body=orjson.dumps(err.anthropic_body() if anthropic else err.body()),
        status=err.anthropic_status if anthropic else err.status,
        content_type="application/json",
        headers=err.headers(),
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every refusal leaves as a JSON error in its API's shape; nothing else does."""
    try:
        return await handler(request)
    except SluiceError as err:
        resp = _json_error(err, request.path)
        rid = request.headers.get("x-request-id")
        if rid and len(rid) <= 128 and rid.isprintable():
            resp.headers["x-request-id"] = rid
        return resp
    except web.HTTPRequestEntityTooLarge as exc:
        return _json_error(
            SluiceError(f"request body too large: {exc.text}", status=413), request.path
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _json_error(SluiceError(exc.reason, status=exc.status), request.path)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return _json_error(SluiceError("internal server error", status=500), request.path)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """401 for a protected path without a known key; else name its caller.

    The key is Anthropic's `x-api-key` when that header is present, else the
    `Authorization: Bearer` token; either names the same caller.

    The compare is constant-time and keys never reach a log line (see
    server/callers.py); a refusal is counted and logged (path and status only)
    like any request. Without any keys everything is open and the pipeline
    names the caller from the `user` field.
    """
    directory = request.app[CALLERS]
    if directory.open or not request.path.startswith(PROTECTED_PREFIXES):
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
    request.app[METRICS].rejections.labels("auth").inc()
    logs.access({"endpoint": request.path, "status": 401, "error": "invalid_api_key"})
    raise SluiceError("invalid or missing API key", status=401, code="invalid_api_key")
