"""--root-path: serving under a path prefix behind a reverse proxy (vLLM's flag).

Why this module exists: a proxy that routes `https://host/llm/...` to Sluice
may pass the path on with its prefix or without it. As vLLM's server does
(Starlette's `root_path`), a request whose path starts with the root path is
served as if it had come without it, and any other path is served as it is;
so `/llm/v1/models` and `/v1/models` are the same route.

The prefix comes off before aiohttp routes the request, so every path rule
downstream (the API key's protected prefixes, the error shape per API, the
quiet probes) sees the path it knows, and a prefixed path can never slip past
authentication. aiohttp resolves the route before any middleware runs; the
one place ahead of that is the request factory, wrapped here (the same
rewrite `Request.clone(rel_url=...)` makes).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from yarl import URL

__all__ = ["install", "normalize", "strip"]


def normalize(value: str) -> str:
    """The flag's value as a prefix: a leading slash, no trailing one ("" for "/");
    ValueError for a value that cannot be a path prefix."""
    root = "/" + value.strip().strip("/")
    if root == "/":
        return ""
    if any(c in root for c in "?#") or not root.isprintable():
        raise ValueError(f"--root-path must be a path such as /llm, got {value!r}")
    return root


def strip(path: str, root: str) -> str | None:
    """`path` without the prefix `root`, or None when it does not start with it
    (a path segment boundary: /llmx is not under /llm)."""
    if not root or not path.startswith(root):
        return None
    rest = path[len(root) :]
    if rest == "":
        return "/"
    if rest.startswith("/"):
        return rest
    return None


def install(app: web.Application, root: str) -> None:
    """Serve `app` under `root` as well as at its own paths."""
    if not root:
        return
    make = app._make_request  # aiohttp's request factory (see the module's docstring)

    def make_request(message: Any, *args: Any, **kwargs: Any) -> web.Request:
        url: URL = message.url
        inner = strip(url.raw_path, root)
        if inner is not None:
            new = URL.build(path=inner, query_string=url.raw_query_string, encoded=True)
            message = message._replace(url=new, path=str(new))
        return make(message, *args, **kwargs)

    app._make_request = make_request  # type: ignore[method-assign]
