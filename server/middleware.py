"""The two middlewares every request passes: errors outermost, then the API key.

Why this module exists: a refusal is made in one place (`SluiceError`, raised
anywhere) and turned into an OpenAI-shaped JSON body in one place (here);
authentication is checked once for every protected path rather than by each
handler remembering to.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from server import logs
from server.errors import SluiceError
from server.state import METRICS, SETTINGS

__all__ = ["PROTECTED_PREFIXES", "auth_middleware", "error_middleware"]

log = logging.getLogger("sluice")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Paths behind the API key (when one is set). The probes and /metrics stay
# open: systemd, load balancers and Prometheus read them without a key. The
# status page itself (/, /static/) holds no data; what it shows, /status.json,
# is behind the key.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/status.json")


def _json_error(err: SluiceError) -> web.Response:
    return web.Response(
        body=orjson.dumps(err.body()),
        status=err.status,
        content_type="application/json",
        headers=err.headers(),
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
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


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """401 for a protected path without the right bearer key.

    The compare is constant-time and the key never reaches a log line; a
    refusal is counted and logged (path and status only) like any request.
    """
    key = request.app[SETTINGS].api_key
    if key is None or not request.path.startswith(PROTECTED_PREFIXES):
        return await handler(request)
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
        return await handler(request)
    request.app[METRICS].rejections.labels("auth").inc()
    logs.access({"endpoint": request.path, "status": 401, "error": "invalid_api_key"})
    raise SluiceError("invalid or missing API key", status=401, code="invalid_api_key")
