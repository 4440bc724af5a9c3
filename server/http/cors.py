"""CORS for browser clients: which cross-origin requests a page may make (vLLM's flags).

Why this module exists: a browser page on another origin (a team's chat UI)
can call the API only if the server says so, and its preflight (`OPTIONS`
with `Access-Control-Request-Method`) carries no API key, so it must be
answered before authentication. Off by default (no `--allowed-origins`: no
CORS headers at all, as vLLM's server). The decisions are pure functions of a
frozen policy (`CorsPolicy`); `install` wires them into the app: a middleware
that answers preflights ahead of the API key, and an `on_response_prepare`
hook that adds the headers to every other answer (errors and streams too, so
a page can read a 401's or a 429's body).

Rules (those of Starlette's CORSMiddleware, which vLLM's server runs):

1. An origin is allowed if it is listed, or `*` is listed.
2. A preflight from an allowed origin, for an allowed method, asking only for
   allowed headers, gets 200 with the allowed methods, the headers asked for
   (when `*` or all listed) and a max age of 600 s; otherwise 400 naming what
   was refused, and no `Access-Control-Allow-Origin` (the browser then blocks).
3. Any other request from an allowed origin gets `Access-Control-Allow-Origin`:
   `*` when every origin is allowed and credentials are not, else the origin
   itself with `Vary: Origin`; with `--allow-credentials`, also
   `Access-Control-Allow-Credentials: true`. A request from another origin gets
   no CORS header (served as it would be without CORS: the browser hides it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from server.settings import CorsPolicy

__all__ = ["CorsPolicy", "install", "parse_list", "preflight", "response_headers"]

_ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
_MAX_AGE = "600"


def preflight(
    policy: CorsPolicy, origin: str, method: str, asked: str
) -> tuple[int, dict[str, str]]:
    """Rule 2: the status and headers answering a preflight (`asked`: its
    Access-Control-Request-Headers, comma-separated)."""
    methods = _ALL_METHODS if "*" in policy.methods else tuple(m.upper() for m in policy.methods)
    headers = {
        "Access-Control-Allow-Methods": ", ".join(methods),
        "Access-Control-Max-Age": _MAX_AGE,
        "Vary": "Origin",
    }
    wanted = [h.strip() for h in asked.split(",") if h.strip()]
    allowed = {h.lower() for h in policy.headers}
    refused: list[str] = []
    if not policy.allows(origin):
        refused.append("origin")
    if method.upper() not in methods:
        refused.append("method")
    if "*" not in allowed and any(h.lower() not in allowed for h in wanted):
        refused.append("headers")
    if refused:
        headers["X-Cors-Refused"] = ", ".join(refused)
        return 400, headers
    headers.update(_origin_headers(policy, origin))
    if wanted:
        headers["Access-Control-Allow-Headers"] = ", ".join(wanted)
    return 200, headers


def response_headers(policy: CorsPolicy, origin: str | None) -> dict[str, str]:
    """Rule 3: the headers of a non-preflight answer to a request with `origin`."""
    if origin is None or not policy.allows(origin):
        return {}
    return _origin_headers(policy, origin)


def _origin_headers(policy: CorsPolicy, origin: str) -> dict[str, str]:
    if "*" in policy.origins and not policy.credentials:
        return {"Access-Control-Allow-Origin": "*"}
    out = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if policy.credentials:
        out["Access-Control-Allow-Credentials"] = "true"
    return out


def _is_preflight(request: web.BaseRequest) -> bool:
    return (
        request.method == "OPTIONS"
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def install(app: web.Application, policy: CorsPolicy, *, before: int) -> None:
    """The preflight middleware at index `before` of the app's middlewares (ahead
    of errors and the API key) and the headers on every other response."""

    @web.middleware
    async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not _is_preflight(request):
            return await handler(request)
        h = request.headers
        status, headers = preflight(
            policy,
            h["Origin"],
            h["Access-Control-Request-Method"],
            h.get("Access-Control-Request-Headers", ""),
        )
        text = "OK" if status == 200 else f"Disallowed CORS {headers['X-Cors-Refused']}"
        return web.Response(status=status, text=text, headers=headers)

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        if _is_preflight(request):
            return
        origin = request.headers.get("Origin")
        for name, value in response_headers(policy, origin).items():
            given = response.headers.get(name) if name == "Vary" else None
            response.headers[name] = f"{given}, {value}" if given else value

    app.middlewares.insert(before, cors_middleware)
    app.on_response_prepare.append(add_headers)


def parse_list(value: str, flag: str) -> tuple[str, ...]:
    """A list flag's value: vLLM's JSON list (`'["https://a"]'`) or comma-separated."""
    import orjson

    text = value.strip()
    if text.startswith("["):
        try:
            items = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{flag}: not a JSON list: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"{flag}: a JSON list of strings, got {text}")
        return tuple(items)
    return tuple(i.strip() for i in text.split(",") if i.strip())
