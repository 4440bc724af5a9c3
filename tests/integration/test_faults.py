"""Faults stay where they happen (issue 41), on real engines killed by their pids.

One Sluice for the module with two demo chat models from one models file
(`chat`, and `other` on a copy of the demo model's directory, so that its
weights can be taken away), serving the checks in sequence: kill -9 of
`other`'s engine core while both stream, a SIGSTOP (a hung engine), and a
restart that cannot succeed (its weights removed). Then one `--model` whose
engine keeps dying: it restarts once, and its second death, with four streams
running, fails each of them within seconds and the process exits 1.

Which engine core is which model's: Sluice's own log line names the pids
(`model loaded ... pids=[...]`, `engine restarted ... pids=[...]`), which
an operator reads too; the test ends them by those pids.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from server.engines.procs import alive
from tests.support import SluiceProcess

pytestmark = pytest.mark.engine

KV = 67108864
MODELS = f"""
[models.chat]                     # no `model`: the offline demo model
kv-cache-memory-bytes = {KV}
max-model-len = 4096
enforce-eager = true

[models.other]
model = "{{copy}}"
kv-cache-memory-bytes = {KV}
max-model-len = 4096
enforce-eager = true
"""


def _until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def two(
    demo_model_dir: Path, demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SluiceProcess, Path]]:
    tmp = tmp_path_factory.mktemp("faults")
    copy = tmp / "other-model"
    shutil.copytree(demo_model_dir, copy)
    path = tmp / "models.toml"
    path.write_text(MODELS.format(copy=copy))
    with SluiceProcess(
        [
            "--models",
            str(path),
            "--log-format",
            "plain",
            "--load-timeout",
            "200",
            # The default: a CI run's 3 s saw a busy core (four streams, another
            # worker's engine on the same 2 cores) answer late and called it hung.
            "--engine-health-timeout",
            "10",
            "--engine-restarts",
            "3",
        ],
        cache_dir=demo_cache_root,
        log_path=tmp / "sluice.log",
    ).running() as proc:
        yield proc, copy


def _states(server: SluiceProcess) -> dict[str, str]:
    r = httpx.get(server.base + "/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    return {c["id"]: c["state"] for c in r.json()["data"]}


def _pids(server: SluiceProcess, model: str) -> list[int]:
    """The engine core pids Sluice's log gave last for `model`."""
    found: list[int] = []
    for line in server.tail(2_000_000).splitlines():
        if f"model={model} " in line and ("model loaded" in line or "engine restarted" in line):
            m = re.search(r"pids=(\[[0-9, ]*\])", line)
            if m:
                found = list(ast.literal_eval(m.group(1)))
    assert found, f"no pids logged for {model}"
    return found


@dataclass
class _Stream:
    """One streamed completion, read on a thread: its events and how it ended."""

    server: SluiceProcess
    model: str
    max_tokens: int = 400
    events: list[dict[str, Any]] = field(default_factory=list)
    status: int = 0
    done: bool = False  # the [DONE] line came
    dropped: str | None = None  # the connection broke (the server went away)
    ended_at: float = 0.0
    thread: threading.Thread | None = None

    def start(self) -> _Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        body = {
            "model": self.model,
            "prompt": "Hello there",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST", self.server.base + "/v1/completions", json=body, timeout=300
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(orjson.loads(line[6:]))
        except httpx.HTTPError as exc:
            self.dropped = repr(exc)
        finally:
            self.ended_at = time.monotonic()

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"stream on {self.model} still running"

    @property
    def finish_reason(self) -> str | None:
        for ev in reversed(self.events):
            for c in ev.get("choices", ()):
                if c.get("finish_reason"):
                    return str(c["finish_reason"])
        return None

    @property
    def error(self) -> dict[str, Any] | None:
        return next((e["error"] for e in self.events if "error" in e), None)


def _started(streams: list[_Stream]) -> bool:
    return all(s.events for s in streams)


def _complete(server: SluiceProcess, model: str) -> httpx.Response:
    return httpx.post(
        server.base + "/v1/completions",
        json={"model": model, "prompt": "Hi", "max_tokens": 4},
        timeout=300,
    )


def _metric(server: SluiceProcess, name: str, **labels: str) -> float:
    text = httpx.get(server.base + "/metrics", timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1 : line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_kill_9_of_one_engine_fails_its_streams_the_other_streams_on_and_it_comes_back(
    two: tuple[SluiceProcess, Path],
) -> None:
    server, _ = two
    assert _states(server) == {"chat": "loaded", "other": "loaded"}
    pids = _pids(server, "other")
    # The chat streams outlast the kill and the death's detection (issue 41's
    # scenario: the other model streams on). With 400 tokens they could end as
    # the kill landed, and the next request then fell in the window before the
    # supervisor sees the death (a plain 503: a known gap, see the closing note).
    chat = [_Stream(server, "chat", max_tokens=2000).start() for _ in range(2)]
    other = [_Stream(server, "other", max_tokens=2000).start() for _ in range(2)]
    _until(lambda: _started(chat + other), 120, "all four streams under way")
    killed = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for s in other:
        s.join(60)
        assert s.status == 200 and s.error is not None, s.events[-2:]
        assert s.error["code"] in ("engine_restarting", None), s.error
        assert s.ended_at - killed < 10, "the killed model's stream hung"
    for s in chat:
        s.join(240)
        assert s.error is None and s.done and s.finish_reason == "length", s.events[-2:]
    # It is restarting (requests wait meanwhile), then it answers again.
    r = _complete(server, "other")
    back = time.monotonic() - killed
    assert r.status_code == 200, r.text
    assert _states(server)["other"] == "loaded"
    assert not any(alive(p) for p in pids)
    assert _pids(server, "other") != pids
    log = server.tail(2_000_000)
    assert "engine died; restarting it model=other" in log and "cause=SIGKILL" in log
    assert "engine restarted model=other back_in_s=" in log
    assert _metric(server, "sluice_engine_deaths_total", cause="SIGKILL", model="other") == 1
    assert _metric(server, "sluice_engine_restarts_total", outcome="ok", model="other") == 1
    assert _complete(server, "chat").status_code == 200
    print(f"kill -9 to other's answer: {back:.1f} s")


def test_a_stopped_engine_is_hung_its_processes_are_ended_and_it_restarts(
    two: tuple[SluiceProcess, Path],
) -> None:
    server, _ = two
    _until(lambda: _states(server)["other"] == "loaded", 240, "other loaded")
    pids = _pids(server, "other")
    chat = _Stream(server, "chat").start()
    _until(lambda: _started([chat]), 120, "chat streaming")
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _until(lambda: "cause=health_check" in server.tail(2_000_000), 60, "the hang seen")
        _until(lambda: not any(alive(p) for p in pids), 30, "the stopped core ended")
    finally:
        for pid in pids:  # the test's own stop, if Sluice did not end it
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    chat.join(240)
    assert chat.error is None and chat.done and chat.finish_reason == "length"
    assert _complete(server, "other").status_code == 200
    assert _metric(server, "sluice_engine_deaths_total", cause="health_check", model="other") == 1
    print(f"SIGSTOP to other's answer: {time.monotonic() - stopped:.1f} s")


def test_a_restart_that_cannot_succeed_leaves_the_model_failed_and_the_other_serving(
    two: tuple[SluiceProcess, Path],
) -> None:
    server, copy = two
    _until(lambda: _states(server)["other"] == "loaded", 240, "other loaded")
    pids = _pids(server, "other")
    for weights in copy.glob("*.safetensors"):
        weights.unlink()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _until(lambda: _states(server)["other"] == "failed", 240, "other failed")
    r = _complete(server, "other")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert "other" in err["message"] and err["code"] == "model_load_failed", err
    assert int(r.headers["Retry-After"]) >= 1
    # Anthropic's API: its overloaded error.
    m = httpx.post(
        server.base + "/v1/messages",
        json={"model": "other", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=60,
    )
    assert m.status_code == 529 and m.json()["error"]["type"] == "overloaded_error", m.text
    assert _complete(server, "chat").status_code == 200
    ready = httpx.get(server.base + "/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["models"]["other"] == "failed"
    assert _metric(server, "sluice_engine_restarts_total", outcome="failed", model="other") == 1
    assert server.proc.poll() is None  # `other` is not essential: the server lives


def test_a_crash_loop_of_the_one_model_ends_in_exit_1_after_its_restarts(
    demo_cache_root: Path, tmp_path: Path
) -> None:
    """The second death spends the restart budget while four streams run (this
    was tests/system/test_lifecycle.py's test_engine_core_killed, on a server of
    its own with no restarts): every caller learns of it within seconds, an error
    event or a dropped stream, never a clean end of an unfinished generation, and
    the process exits 1."""
    server = SluiceProcess(
        ["--log-format", "plain", "--engine-restarts", "1", "--engine-restart-backoff-max", "1"],
        cache_dir=demo_cache_root,
        log_path=tmp_path / "sluice.log",
    )
    with server.running():
        first = _pids(server, "sluice-demo")
        for pid in first:
            os.kill(pid, signal.SIGKILL)
        _until(lambda: "engine restarted" in server.tail(400_000), 240, "the restart")
        assert httpx.get(server.base + "/ready", timeout=30).status_code == 200
        streams = [_Stream(server, "sluice-demo", max_tokens=8000).start() for _ in range(4)]
        _until(lambda: _started(streams), 120, "all four streams under way")
        killed = time.monotonic()
        for pid in _pids(server, "sluice-demo"):
            os.kill(pid, signal.SIGKILL)
        for s in streams:
            s.join(30)
            assert s.ended_at - killed < 10, f"a caller waited {s.ended_at - killed:.1f}s"
            assert s.error is not None or s.dropped is not None, s.events[-2:]
            assert not s.done or s.error is not None, s.events[-2:]
        server.proc.wait(120)
        assert server.proc.returncode == 1
        log = server.tail(400_000)
        assert "its restart budget is spent" in log
        assert "an essential model failed; stopping" in log
