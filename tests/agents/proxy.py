"""A loopback reverse proxy that records every request and response passing through.

Why this exists: the coding-agent tests (tests/integration/test_coding_agents.py)
point a real agent at Sluice through it, so a test can say which request got
which status, and a failing run leaves the exact bodies the agent sent (the
unit tests of tests/unit/test_agent_requests.py are built from such
recordings, tests/agents/recorded/). Streams are passed through as they come,
chunk by chunk, so the agent sees Sluice's own pacing.

It runs its own event loop on a thread: the agents are subprocesses that the
(synchronous) test waits for, and the proxy must answer while it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web

# Hop-by-hop and length headers: aiohttp sets its own on each leg.
_DROP = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}
)
_DROP_BACK = frozenset({"content-length", "transfer-encoding", "connection", "content-encoding"})
# Request headers kept in a recording: what says which API and beta a body was
# sent under. Credentials and per-machine values are left out.
_KEPT = ("anthropic-version", "anthropic-beta", "user-agent", "content-type")


@dataclasses.dataclass(slots=True)
class Exchange:
    """One request and its response, as the proxy saw them."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0
    response: bytes = b""

    def json(self) -> Any:
        return orjson.loads(self.body) if self.body else None

    def summary(self) -> str:
        text = self.response[:300].decode(errors="replace")
        return f"{self.method} {self.path} -> {self.status}: {text}"


class RecordingProxy:
    """``with RecordingProxy(target) as proxy:`` serves ``proxy.base`` until the block ends."""

    def __init__(self, target: str) -> None:
        self._target = target.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.base = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        # A turn that timed out leaves a stream in flight: _stop ends it, so no
        # handler or connection outlives the loop (each would be an unraisable
        # ResourceWarning in whichever test ran next on this worker).
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    def failures(self) -> list[Exchange]:
        """The exchanges that got a 4xx or 5xx (or no answer at all)."""
        return [e for e in self.exchanges if not 200 <= e.status < 400]

    async def _start(self) -> None:
        # No total timeout: an agent's stream lasts as long as the model writes.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        # A stream still open at the end is cut after 1 s (aiohttp waits 60).
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        # Whatever the runner's cleanup left running (a handler still forwarding
        # a stream the agent no longer reads) is cancelled and awaited here.
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        ex = Exchange(
            method=request.method,
            path=request.path_qs,
            headers={k: request.headers[k] for k in _KEPT if k in request.headers},
            body=body,
        )
        self.exchanges.append(ex)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        assert self._session is not None
        chunks: list[bytes] = []
        try:
            async with self._session.request(
                request.method, self._target + request.path_qs, headers=headers, data=body
            ) as up:
                ex.status = up.status
                resp = web.StreamResponse(status=up.status)
                for k, v in up.headers.items():
                    if k.lower() not in _DROP_BACK:
                        resp.headers.add(k, v)
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    chunks.append(chunk)
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        finally:
            ex.response = b"".join(chunks)


@contextlib.contextmanager
def recording(target: str) -> Iterator[RecordingProxy]:
    with RecordingProxy(target) as proxy:
        yield proxy
