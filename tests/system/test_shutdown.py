"""System tests: how a drain ends when it cannot finish, on the demo model.

* A second SIGTERM during a drain stops at once: the process exits within
  seconds of it (the drain had 120 s), and every caller still in flight gets
  an error, none a clean end of an unfinished generation.
* The drain deadline passing fails what is left with 503 (a JSON error with
  Retry-After for a caller still waiting for its response, an error event
  for a stream) and the process exits 0.

Each generation asks for 8,000 tokens: tens of seconds on these machines, so
nothing finishes by itself while a test watches.

Each test ends one of the suite's shared servers (tests/shared_servers.py) as
the last test of its group, instead of starting a server of its own (issue 64:
two engine starts fewer): the second SIGTERM the callers server, whose drain
may last 120 s, and the drain deadline the shared server, whose drain lasts 2 s.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import httpx
import pytest

from tests.shared_servers import CALLER_KEYS, SHARED_DRAIN_S
from tests.support import SluiceProcess, metric

pytestmark = [pytest.mark.engine, pytest.mark.system]

MODEL = "sluice-demo"
LONG = 8000
CHAT = {"Authorization": f"Bearer {CALLER_KEYS['chat']}"}  # the callers server's


def _body(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": stream,
    }


async def _stream(client: httpx.AsyncClient, base: str) -> list[str]:
    """The stream's SSE lines; a dropped connection ends it with a marker line."""
    lines: list[str] = []
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=_body(True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
    except httpx.HTTPError as exc:
        lines.append(f"transport error: {exc!r}")
    return lines


def _error(line: str) -> dict[str, Any] | None:
    """The OpenAI error object an SSE event carries, if it carries one."""
    if not line.startswith("data: {"):
        return None
    obj = json.loads(line[6:])
    return obj.get("error") if isinstance(obj, dict) else None


def _failed(lines: list[str]) -> bool:
    """Ended by an error event or a dropped connection, not by finishing."""
    finished = any('"finish_reason":"length"' in line.replace(" ", "") for line in lines)
    errored = any(_error(line) or line.startswith("transport error") for line in lines)
    return errored and not finished


async def _admitted(base: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(metric, base, "sluice_pending_requests") < n:
        assert time.monotonic() < deadline, "requests never started"
        await asyncio.sleep(0.1)


async def _draining(base: str) -> None:
    """Until /ready says the server is draining."""
    deadline = time.monotonic() + 10
    async with httpx.AsyncClient(timeout=5) as c:
        while "draining" not in (await c.get(base + "/ready")).text:
            assert time.monotonic() < deadline, "no drain started"
            await asyncio.sleep(0.05)


@pytest.mark.ends_shared_server
async def test_second_sigterm_during_drain_stops_at_once(callers_server: SluiceProcess) -> None:
    """On the suite's server with a callers file and a 120 s drain
    (tests/shared_servers.py): the last test of its group, since it ends it."""
    proc = callers_server
    async with httpx.AsyncClient(timeout=120, headers=CHAT) as client:
        streams = [asyncio.create_task(_stream(client, proc.base)) for _ in range(3)]
        await _admitted(proc.base, 3)
        proc.signal(signal.SIGTERM)
        await _draining(proc.base)
        assert proc.proc.poll() is None  # draining, not stopped
        assert not any(s.done() for s in streams)
        t0 = time.monotonic()
        proc.signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.proc.wait, 30)
        took = time.monotonic() - t0
        results = await asyncio.wait_for(asyncio.gather(*streams), 15)
    assert took < 10, f"exit took {took:.1f}s after the second signal:\n{proc.tail()}"
    assert code == 0, proc.tail()
    for lines in results:
        assert _failed(lines), lines[-3:]


@pytest.mark.ends_shared_server
async def test_drain_deadline_fails_the_rest_with_503_and_exits(
    sluice_server: SluiceProcess,
) -> None:
    """On the suite's shared server, whose drain lasts SHARED_DRAIN_S
    (tests/shared_servers.py): the last test of its group, since it ends it."""
    proc = sluice_server
    drain_s = SHARED_DRAIN_S
    async with httpx.AsyncClient(timeout=120) as client:
        streams = [asyncio.create_task(_stream(client, proc.base)) for _ in range(2)]
        waiting = [
            asyncio.create_task(client.post(proc.base + "/v1/chat/completions", json=_body(False)))
            for _ in range(2)
        ]
        await _admitted(proc.base, 4)
        t0 = time.monotonic()
        proc.signal(signal.SIGTERM)
        responses = await asyncio.wait_for(asyncio.gather(*waiting), 30)
        failed_after = time.monotonic() - t0
        results = await asyncio.wait_for(asyncio.gather(*streams), 30)
        code = await asyncio.to_thread(proc.proc.wait, 30)
        exited_after = time.monotonic() - t0
    # The deadline was waited for, then what was left failed at once.
    assert drain_s - 0.5 <= failed_after < drain_s + 5, failed_after
    for r in responses:
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "service_unavailable_error"
    for lines in results:
        errors = [e for e in map(_error, lines) if e]
        assert errors and errors[-1]["type"] == "service_unavailable_error", lines[-3:]
        assert _failed(lines), lines[-3:]
    assert code == 0, proc.tail()
    assert exited_after < drain_s + 10, exited_after
