"""System tests: Sluice as a subprocess on the demo model, as systemd runs it.

* SIGTERM with ten streams in flight: all ten end with [DONE], a request sent
  during the drain gets 503 with Retry-After, the process exits 0; a test
  NOTIFY_SOCKET sees READY=1 after warm-up, WATCHDOG=1 pings and STOPPING=1.

SIGKILL of the engine core while streams run, with no restart left (every
caller gets an error within seconds, none hangs, the process exits non-zero)
is checked at the end of tests/integration/test_faults.py's crash loop, on its
server (issue 64: one engine start fewer).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.support import SluiceProcess, metric

pytestmark = [pytest.mark.engine, pytest.mark.system]

MODEL = "sluice-demo"


def _stream_body(max_tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


async def _stream(client: httpx.AsyncClient, base: str, max_tokens: int) -> list[str]:
    lines = []
    async with client.stream(
        "POST", base + "/v1/chat/completions", json=_stream_body(max_tokens)
    ) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
    return lines


async def _all_started(base: str, n: int) -> None:
    """Until the server has `n` requests admitted (queued or running).

    Asked of the server, not seen from the client: on two busy cores a
    Python client can read its streams behind the server, and the point is
    that the server holds all ten when the signal comes.
    """
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(metric, base, "sluice_pending_requests") < n:
        assert time.monotonic() < deadline, "requests never started"
        await asyncio.sleep(0.1)


def _is_error(line: str) -> bool:
    """An SSE event carrying an OpenAI error object (not text that says "error")."""
    if not line.startswith("data: {"):
        return False
    return "error" in json.loads(line[6:])


def _notify_socket(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    return sock, path


def _drain_datagrams(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


async def _until_notified(sock: socket.socket, word: str, seen: list[str]) -> None:
    """Until a datagram holding ``word`` arrived; every datagram read goes into ``seen``."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(60):
        while not any(word in d for d in seen):
            seen.append((await loop.sock_recv(sock, 4096)).decode())


async def test_sigterm_drains_streams_and_notifies(demo_cache_root: Path, tmp_path: Path) -> None:
    sock, path = _notify_socket(tmp_path)
    proc = SluiceProcess(
        ["--drain-timeout", "60"],
        cache_dir=demo_cache_root,
        log_path=tmp_path / "sluice.log",
        # WATCHDOG_PID is left out: the watchdog then belongs to whoever reads it.
        env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"},
    )
    try:
        await asyncio.to_thread(proc.wait_ready)
        seen: list[str] = []
        await _until_notified(sock, "WATCHDOG=1", seen)  # a ping (every 1 s)
        assert any("READY=1" in d for d in seen)

        async with httpx.AsyncClient(timeout=120) as client:
            streams = [asyncio.create_task(_stream(client, proc.base, 600)) for _ in range(10)]
            # Once all ten are admitted, ask for a drain. 600 tokens each take
            # 10 s or more on two cores, where what follows the signal takes
            # well under one; 2,000 made the drain 50 s of the suite's time.
            await _all_started(proc.base, 10)
            proc.signal(signal.SIGTERM)
            # STOPPING=1 goes out once the server is draining (server/app.py drain).
            await _until_notified(sock, "STOPPING=1", seen)
            late = await client.post(
                proc.base + "/v1/chat/completions",
                json={**_stream_body(4), "stream": False},
            )
            assert late.status_code == 503, late.text
            assert int(late.headers["Retry-After"]) >= 1
            assert late.json()["error"]["code"] == "draining", late.text
            assert await asyncio.to_thread(metric, proc.base, "sluice_pending_requests") > 0
            results = await asyncio.wait_for(asyncio.gather(*streams), 120)
        for lines in results:
            assert lines[-1] == "data: [DONE]"
            assert not any(_is_error(line) for line in lines)
        code = await asyncio.to_thread(proc.proc.wait, 60)
        assert code == 0, proc.tail()
        assert not any("READY=1" in d for d in _drain_datagrams(sock))  # no second start
    finally:
        proc.stop()
        sock.close()
