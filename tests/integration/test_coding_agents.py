"""Claude Code, Codex CLI and Qwen Code, as shipped, each complete one turn on Sluice.

Issue 26: each agent release that sent something new turned Sluice's strict
parser into an outage. Here each agent, installed from the npm registry at its
pinned version (tests/agents/install.py; ``--agents-latest`` or
``SLUICE_AGENTS_LATEST=1`` for the newest), runs one non-interactive turn with
its default settings (tests/agents/turn.py) against one Sluice on the demo
model, through a loopback proxy that records every exchange
(tests/agents/proxy.py). A turn passes when the agent exits 0, no request got a
4xx or 5xx, and what the agent printed is the text of an answer the model gave.
A failing turn leaves its recorded exchanges under the test's tmp folder: the
bodies a unit test in tests/unit/test_agent_requests.py is made of.

The three share one Sluice, started for this module with the demo model and
one engine flag, vLLM's own ``--generation-config``: a copy of the demo model's
generation config in which 1 in 8 token ids also ends an answer, sampling is
plain (temperature 1, no top-k), and a request without ``max_tokens`` gets 256
(Codex has no setting of its own for its answers' length). The demo model's
random weights otherwise write its end-of-turn token about once in a few
thousand tokens, so an answer runs until the context is full, and Claude Code
reads an answer cut by its cap as an error. With it an answer ends after a few
tokens (sometimes none), as a real model's answer ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.agents.install import AGENTS, Agent, cache_dir, install, latest_version
from tests.agents.proxy import Exchange, RecordingProxy
from tests.agents.turn import OUTPUT_CAP, run_turn
from tests.support import SluiceProcess

pytestmark = pytest.mark.engine

MODEL = "sluice-demo"
# Every 8th token id ends an answer too (from id 5; the special tokens keep
# their own roles): per sampled token about 1 in 8, whatever the context.
STOP_EVERY = 8
# An agent's turn: its start, a prompt of 20-30k tokens to prefill on two busy
# cores, and a short answer; Claude Code and Qwen Code make a second request.
# Qwen Code's two prompts (22.6k and 17.3k tokens, no prefix in common) took
# 57 s and 36 s of prefill alone on this machine, 240 s and more beside the
# suite's other worker; an empty answer (1 in 8) is retried by the agent.
TURN_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def agent_commands(request: pytest.FixtureRequest) -> dict[str, tuple[str, Path]]:
    """Each agent's version and installed command (installed on first use)."""
    if shutil.which("npm") is None:
        if os.environ.get("CI"):
            pytest.fail("npm is missing: .ci/run installs Node.js and npm on a fresh machine")
        pytest.skip("npm is not installed: the coding-agent tests need Node.js and npm")
    latest = bool(request.config.getoption("--agents-latest")) or (
        os.environ.get("SLUICE_AGENTS_LATEST", "") not in ("", "0")
    )
    root = cache_dir(os.environ)
    out = {}
    for agent in AGENTS:
        version = latest_version(agent) if latest else agent.pinned
        try:
            out[agent.name] = (version, install(agent, version, root))
        except subprocess.CalledProcessError as exc:
            pytest.fail(f"npm could not install {agent.package}@{version}: {exc.stderr[-2000:]}")
    return out


def _generation_config(demo_model_dir: Path, folder: Path) -> Path:
    """The demo model's generation config with more stop tokens (see the docstring)."""
    config = orjson.loads((demo_model_dir / "generation_config.json").read_bytes())
    special = min(config["eos_token_id"] + [config["bos_token_id"]])
    config["eos_token_id"] = sorted(
        set(config["eos_token_id"]) | set(range(5, special, STOP_EVERY))
    )
    config.update(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=256)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_bytes(orjson.dumps(config))
    return folder


@pytest.fixture(scope="module")
def agents_server(
    demo_cache_root: Path, demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SluiceProcess]:
    tmp = tmp_path_factory.mktemp("agents-server")
    gen = _generation_config(demo_model_dir, tmp / "generation")
    args = ["--log-format", "plain", "--generation-config", str(gen)]
    # Started, not waited for: its engine loads while agent_commands installs the
    # agents (npm: about 25 s on a fresh machine, mostly waiting on the registry).
    # test_one_turn asks for it first and waits for it to be ready.
    proc = SluiceProcess(args, cache_dir=demo_cache_root, log_path=tmp / "sluice.log")
    try:
        yield proc
    finally:
        proc.stop()


def _sse(body: bytes) -> list[Any]:
    return [orjson.loads(line[6:]) for line in body.splitlines() if line.startswith(b"data: {")]


def answer_text(ex: Exchange) -> str | None:
    """The text of the answer one exchange carried (None: not a generation)."""
    if ex.status != 200 or not ex.response:
        return None
    path = ex.path.split("?")[0]
    streamed = ex.response.startswith((b"event:", b"data:"))
    if path.endswith("/v1/messages"):
        if streamed:
            return "".join(
                e["delta"].get("text", "")
                for e in _sse(ex.response)
                if e.get("type") == "content_block_delta"
            )
        return "".join(b.get("text", "") for b in orjson.loads(ex.response)["content"])
    if path.endswith("/v1/responses"):
        if streamed:
            return "".join(
                e["delta"]
                for e in _sse(ex.response)
                if e.get("type") == "response.output_text.delta"
            )
        out = orjson.loads(ex.response)["output"]
        return "".join(p["text"] for i in out if i["type"] == "message" for p in i["content"])
    if path.endswith("/v1/chat/completions"):
        if streamed:
            return "".join(
                c["choices"][0]["delta"].get("content") or ""
                for c in _sse(ex.response)
                if c.get("choices")
            )
        return str(orjson.loads(ex.response)["choices"][0]["message"]["content"] or "")
    return None


def _keep(exchanges: list[Exchange], folder: Path) -> Path:
    """The exchanges as files: the recordings a new unit test is made of."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, ex in enumerate(exchanges):
        rec = {"method": ex.method, "path": ex.path, "headers": ex.headers, "status": ex.status}
        body = ex.json() if ex.body else None
        (folder / f"{i:02d}.json").write_bytes(
            orjson.dumps({**rec, "body": body}, option=orjson.OPT_INDENT_2)
        )
        (folder / f"{i:02d}.response").write_bytes(ex.response)
    return folder


@pytest.mark.timeout(TURN_TIMEOUT_S + 60)
@pytest.mark.parametrize("agent", AGENTS, ids=[a.name for a in AGENTS])
def test_one_turn(
    agent: Agent,
    agents_server: SluiceProcess,
    agent_commands: dict[str, tuple[str, Path]],
    tmp_path: Path,
) -> None:
    version, exe = agent_commands[agent.name]
    agents_server.wait_ready()
    with RecordingProxy(agents_server.base) as proxy:
        turn = run_turn(
            agent, exe, proxy.base, MODEL, tmp_path / "home", tmp_path / "work", TURN_TIMEOUT_S
        )
    answers = [a for a in map(answer_text, proxy.exchanges) if a is not None]
    said = turn.stdout.strip()
    ok = turn.returncode == 0 and not proxy.failures() and said in {a.strip() for a in answers}
    if not ok:
        kept = _keep(proxy.exchanges, tmp_path / "recorded")
        pytest.fail(
            f"{agent.package}@{version} (output cap {OUTPUT_CAP}) exited {turn.returncode}; "
            f"exchanges kept in {kept}:\n"
            + "\n".join(e.summary() for e in proxy.exchanges)
            + f"\nstdout: {turn.stdout[-1500:]}\nstderr: {turn.stderr[-1500:]}"
        )
