"""System tests: how a drain ends when it cannot finish, on the demo model.

* A second SIGTERM during a drain stops at once: the process exits within
  seconds of it (the drain had 120 s), and every caller still in flight gets
  an error, none a clean end of an unfinished generation.
* The drain deadline passing fails what is left with 503 (a JSON error with
  Retry-After for a caller still waiting for its response, an error event
  for a stream) and the process exits 0.

Each generation asks for 8,000 tokens: tens of seconds on these machines, so
nothing finishes by itself while a test watches.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import SluiceProcess, metric

pytestmark = [pytest.mark.engine, pytest.mark.system]

MODEL = "sluice-demo"
LONG = 8000


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


async def test_second_sigterm_during_drain_stops_at_once(
    demo_cache_root: Path, tmp_path: Path
) -> None:
    proc = SluiceProcess(
        ["--drain-timeout", "120"], cache_dir=demo_cache_root, log_path=tmp_path / "sluice.log"
    )
    try:
        await asyncio.to_thread(proc.wait_ready)
        async with httpx.AsyncClient(timeout=120) as client:
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
    finally:
        proc.stop()


async def test_drain_deadline_fails_the_rest_with_503_and_exits(
    demo_cache_root: Path, tmp_path: Path
) -> None:
    drain_s = 2.0
    proc = SluiceProcess(
        ["--drain-timeout", str(drain_s)],
        cache_dir=demo_cache_root,
        log_path=tmp_path / "sluice.log",
    )
    try:
        await asyncio.to_thread(proc.wait_ready)
        async with httpx.AsyncClient(timeout=120) as client:
            streams = [asyncio.create_task(_stream(client, proc.base)) for _ in range(2)]
            waiting = [
                asyncio.create_task(
                    client.post(proc.base + "/v1/chat/completions", json=_body(False))
                )
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
    finally:
        proc.stop()
