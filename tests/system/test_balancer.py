"""System test: two Sluice instances behind HAProxy, with docs/haproxy.cfg as shipped.

Two instances on loopback, each on its own demo engine, behind Debian's
HAProxy running the example config itself (its addresses come from the
environment, so nothing is copied or edited). One test, in order, since two
engine starts on two cores cost a minute or more:

1. Traffic spreads: sequential requests land on both instances.
   A conversation stays on one (issue 43): requests keyed by X-Session-Id, or
   by a caller's key, land where their key's first did, and keys spread; a
   key's streams past its instance's bound spill to the other (the bounded
   load, hash-balance-factor 125).
2. A shedding instance's 503 is retried elsewhere: instance `a` runs with
   --max-pending-requests 2 and holds two streams; it refuses more with a 503
   and Retry-After (asked directly, it says so), yet every request through the
   balancer succeeds, served by `b`, while `a` counts the refusals.
3. SIGTERM drains `a`: its two streams finish, new requests go to `b`, none fails.
4. `a` restarted on its port gets nothing until its warm-up is done (its
   access log has no request; a refused one would be retried and hide it),
   then serves again.

X-Sluice-Instance (set by the config) says which instance answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import ROOT, SluiceProcess, cancel_all, free_port, metric

pytestmark = [pytest.mark.engine, pytest.mark.system, pytest.mark.timeout(1500)]

CONFIG = ROOT / "docs" / "haproxy.cfg"
MODEL = "sluice-demo"
# Long enough to outlast the shedding step and still run at SIGTERM, and no
# longer: the drain waits for them. Two streams on each of two eager engines ran
# 21-27 tokens/s each here (1,000 tokens: a 47 s drain), and steps 1-2 took 3-5 s:
# 600 tokens last 22-29 s at that pace.
LONG = 600
A_ARGS = ["--max-pending-requests", "2", "--drain-timeout", "240"]
B_ARGS = ["--drain-timeout", "240"]
# An engine start here took over 240 s with two starting at once on these
# shared cores (one vLLM start alone: 20-45 s on an idle machine).
START_S = 600.0
# vLLM's CPU backend binds each engine's OpenMP threads to core 0 by default
# (VLLM_CPU_OMP_THREADS_BIND=auto, the last core reserved): two engines, and
# every other engine on a shared machine, would queue on one core (an engine
# pinned there took over 240 s to start while its twin on core 1 took 96 s).
# Unbound, the kernel places them.
A_ENV = B_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _chat(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


class HAProxy:
    """haproxy -db on the shipped config, ports from the environment."""

    def __init__(self, a: int, b: int, log_path: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {
            **os.environ,
            "SLUICE_LB_BIND": f"127.0.0.1:{self.port}",
            "SLUICE_A": f"127.0.0.1:{a}",
            "SLUICE_B": f"127.0.0.1:{b}",
        }
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["haproxy", "-db", "-f", str(CONFIG)],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def _rejections(base: str, reason: str) -> float:
    text = httpx.get(base + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f'sluice_rejections_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _short(
    client: httpx.AsyncClient, base: str, headers: dict[str, str] | None = None
) -> str:
    """One short request through the balancer: 'STATUS INSTANCE'."""
    try:
        r = await client.post(base + "/v1/chat/completions", json=_chat(4, False), headers=headers)
    except httpx.HTTPError as exc:
        return f"transport error {exc!r}"
    return f"{r.status_code} {r.headers.get('x-sluice-instance')}"


async def _stream(
    client: httpx.AsyncClient,
    base: str,
    served: asyncio.Future[str],
    headers: dict[str, str] | None = None,
) -> list[str]:
    lines: list[str] = []
    try:
        async with client.stream(
            "POST", base + "/v1/chat/completions", json=_chat(LONG, True), headers=headers
        ) as r:
            served.set_result(f"{r.status_code} {r.headers.get('x-sluice-instance')}")
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
    except httpx.HTTPError as exc:
        lines.append(f"transport error: {exc!r}")
    if not served.done():
        served.set_result("no response")
    return lines


def _finished(lines: list[str]) -> bool:
    """Ended by finishing (finish_reason length, then [DONE]), no error event."""
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    reasons = [c.get("finish_reason") for e in events for c in e.get("choices", ())]
    return (
        lines[-1:] == ["data: [DONE]"]
        and "length" in reasons
        and not any("error" in e for e in events)
    )


async def _ready(client: httpx.AsyncClient, base: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return (await client.get(base + "/ready")).status_code == 200
    return False


async def _affinity(
    client: httpx.AsyncClient, base: str, a: SluiceProcess, b: SluiceProcess
) -> None:
    """Step 1's keyed half: each key's requests stay on one instance, keys spread,
    and a key's instance busy with its streams past the bound sends the next on."""
    homes: dict[str, str] = {}
    for n in range(8):
        key = {"X-Session-Id": f"conversation-{n}"}
        got = {await _short(client, base, key) for _ in range(3)}
        assert len(got) == 1, (key, got)
        homes[key["X-Session-Id"]] = got.pop()
    assert set(homes.values()) == {"200 a", "200 b"}, homes
    caller = {"Authorization": "Bearer sk-some-caller"}
    assert len({await _short(client, base, caller) for _ in range(3)}) == 1
    # Streams of a conversation whose home is b (no admission limit there) stay
    # there until b has more than its bound (1.25x the backend's average in
    # flight, rounded up: one or two streams, by the servers' order); the next
    # one goes to a.
    session = {"X-Session-Id": next(k for k, v in homes.items() if v == "200 b")}
    streams: list[asyncio.Task[list[str]]] = []
    placed: list[str] = []
    try:
        while len(placed) < 3 and "200 a" not in placed:
            served: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            streams.append(asyncio.create_task(_stream(client, base, served, session)))
            placed.append(await asyncio.wait_for(asyncio.shield(served), 120))
        assert placed[0] == "200 b" and placed[-1] == "200 a", placed
    finally:
        await cancel_all(streams)
    # Their engine requests end when the connections close (step 2 counts a's and b's).
    for proc in (a, b):
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(metric, proc.base, "sluice_pending_requests") != 0:
            assert time.monotonic() < deadline, proc.tail()
            await asyncio.sleep(0.1)
    assert await _short(client, base, session) == "200 b"


@pytest.fixture
def haproxy_bin() -> str:
    found = shutil.which("haproxy")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("haproxy missing in CI (.ci/run installs it)")
        pytest.skip("haproxy not installed (apt-get install haproxy)")
    return found


async def test_two_instances_behind_haproxy(
    haproxy_bin: str, demo_cache_root: Path, tmp_path: Path
) -> None:
    a = SluiceProcess(A_ARGS, cache_dir=demo_cache_root, log_path=tmp_path / "a.log", env=A_ENV)
    b = SluiceProcess(B_ARGS, cache_dir=demo_cache_root, log_path=tmp_path / "b.log", env=B_ENV)
    procs = [a, b]
    lb: HAProxy | None = None
    try:
        # Both engines start at once: one start's wait is the other's.
        await asyncio.gather(
            asyncio.to_thread(a.wait_ready, START_S), asyncio.to_thread(b.wait_ready, START_S)
        )
        lb = HAProxy(a.port, b.port, tmp_path / "haproxy.log")
        async with httpx.AsyncClient(timeout=240) as client:
            deadline = time.monotonic() + 30
            while not await _ready(client, lb.base):
                assert time.monotonic() < deadline, lb.log_path.read_text()
                await asyncio.sleep(0.1)

            # 1. Spread.
            spread = Counter([await _short(client, lb.base) for _ in range(8)])
            assert spread["200 a"] >= 3 and spread["200 b"] >= 3, spread
            await _affinity(client, lb.base, a, b)

            # 2. Two streams on each instance (round robin), which fills a's admission.
            streams: list[tuple[asyncio.Future[str], asyncio.Task[list[str]]]] = []
            for _ in range(4):
                served: asyncio.Future[str] = asyncio.get_running_loop().create_future()
                streams.append((served, asyncio.create_task(_stream(client, lb.base, served))))
                await asyncio.wait_for(asyncio.shield(served), 120)
            where = Counter(s.result() for s, _ in streams)
            assert where == {"200 a": 2, "200 b": 2}, where
            assert await asyncio.to_thread(metric, a.base, "sluice_pending_requests") == 2

            direct = await client.post(a.base + "/v1/chat/completions", json=_chat(4, False))
            assert direct.status_code == 503 and "retry-after" in direct.headers, direct.text
            refused = await asyncio.to_thread(_rejections, a.base, "queue_requests")
            shed = Counter([await _short(client, lb.base) for _ in range(4)])
            assert shed == {"200 b": 4}, shed
            refused_via_lb = await asyncio.to_thread(_rejections, a.base, "queue_requests")
            assert refused_via_lb - refused >= 1, "no request reached the full instance"

            # 3. SIGTERM drains a; the balancer moves new requests to b.
            assert not any(t.done() for _, t in streams), "streams ended before the drain"
            a.signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while "draining" not in (await client.get(a.base + "/ready")).text:
                assert time.monotonic() < deadline, a.tail()
                await asyncio.sleep(0.05)
            during = Counter([await _short(client, lb.base) for _ in range(6)])
            assert during == {"200 b": 6}, during
            # The health check took it out of rotation (the retries alone would
            # hide a check that never notices a drain).
            deadline = time.monotonic() + 15
            while "Server sluice/a is DOWN" not in lb.log_path.read_text():
                assert time.monotonic() < deadline, lb.log_path.read_text()
                await asyncio.sleep(0.1)
            results = await asyncio.wait_for(asyncio.gather(*(t for _, t in streams)), 300)
            for lines in results:
                assert _finished(lines), lines[-3:]
            assert await asyncio.to_thread(a.proc.wait, 30) == 0, a.tail()
            a.stop()

            # 4. Restart a on its port: nothing reaches it before its warm-up ends.
            a = SluiceProcess(
                A_ARGS,
                cache_dir=demo_cache_root,
                log_path=tmp_path / "a2.log",
                env=A_ENV,
                port=a.port,
            )
            procs.append(a)
            warmup: Counter[str] = Counter()
            deadline = time.monotonic() + START_S
            while not await _ready(client, a.base):
                assert a.proc.poll() is None, a.tail()
                assert time.monotonic() < deadline, a.tail()
                warmup[await _short(client, lb.base)] += 1
                await asyncio.sleep(0.2)
            assert set(warmup) <= {"200 b"}, warmup
            # Not even a refused one: the balancer sent it nothing while it warmed up.
            assert '"endpoint":"chat"' not in a.tail(1 << 20), a.tail()
            after: Counter[str] = Counter()
            deadline = time.monotonic() + 30
            while after["200 a"] == 0:
                assert time.monotonic() < deadline, (after, lb.log_path.read_text())
                after[await _short(client, lb.base)] += 1
            assert set(after) <= {"200 a", "200 b"}, after
    finally:
        if lb is not None:
            lb.stop()
        for p in procs:
            p.stop()
