"""Issue 41's fault point: one model's engine is killed and restarts while a chat
caller streams on another model of the same Sluice.

Why this module exists: a death must stay its model's (server/engines/supervisor.py).
What a caller of the other model can still feel is the hardware the restart
shares with it (on CPU the two cores: the dead engine's start competes with
the live one's steps). The issue's targets: the chat caller's TTFT p95 during
the fault <= 1.5x its value without it, 0 failed requests on it; and the time
from the death to the killed model's first token again, beside a cold
`sluice serve` start and a cold `vllm serve` start of the same model.

One Sluice serves the demo model twice from one models file (`chat`, the
caller's, and `other`, the one killed), both eager. Per repetition: the chat
caller alone for `--calm` seconds (closed loop, streamed turns, TTFT at the
first token-carrying chunk, never the role-only frame); then again while
`other`'s engine core is killed with SIGKILL (its pids from Sluice's log) and
a prober asks `other` for a token until it answers, the death-to-first-token
time. The chat turns that started between the kill and that first token are
the fault's. Then, alternating, a cold `sluice serve` of the demo model and a
cold `vllm serve` with the same flags: start to first token.

    ./scripts/bench faults [--repeat 3] [--calm 15] [--out bench/results/faults-cpu.md]
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.report.cells import percentile, runs_cell, spread_cell, write_lines
from bench.report.systems import SLUICE, VLLM
from bench.run.chat_turn import Caller, first_token
from bench.run.engine_flags import DEMO_NAME, demo_flags, drop_flags
from bench.run.servers import HOST, Server, free_port, kill_group, server_command

# Both models' engine flags, as the cold starts get them (eager: an engine start
# is ~12 s on CPU against ~18-40 s compiled, and all three starts are alike).
ENGINE = {"max-model-len": 8192, "kv-cache-memory-bytes": 64 * 2**20}
MODELS = "".join(
    f"\n[models.{name}]\nenforce-eager = true\nmax-model-len = {ENGINE['max-model-len']}\n"
    f"kv-cache-memory-bytes = {ENGINE['kv-cache-memory-bytes']}\n"
    for name in ("chat", "other")
)


def _core_pids(log: Path, model: str) -> list[int]:
    """The engine core pids Sluice's log gave last for `model`."""
    found: list[int] = []
    for line in log.read_text(errors="replace").splitlines():
        said = "model loaded" in line or "engine restarted" in line
        if f"model={model} " in line and said and (m := re.search(r"pids=(\[[0-9, ]*\])", line)):
            found = list(ast.literal_eval(m.group(1)))
    if not found:
        raise RuntimeError(f"no engine pids for {model} in {log}")
    return found


def _until_token(base: str, model: str, deadline: float) -> float:
    """Ask `model` for a token until one comes; the monotonic time it came."""

    async def probe() -> float:
        async with aiohttp.ClientSession() as s:
            i = 0
            while time.monotonic() < deadline:
                try:
                    await first_token(s, base, model, i)
                    return time.monotonic()
                except (aiohttp.ClientError, RuntimeError):
                    i += 1
                    await asyncio.sleep(0.2)  # a refused request: ask again shortly
        raise RuntimeError(f"{model} gave no token before the deadline")

    return asyncio.run(probe())


def _ttfts(caller: Caller, since: float, until: float) -> list[float]:
    return [1000 * ttft for t, ttft in caller.turns if since <= t <= until]


def fault_runs(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    models = workdir / "models.toml"
    models.write_text(MODELS)
    port = free_port()
    log = workdir / "sluice.log"
    cmd = server_command(SLUICE, port, [], ["--models", str(models)])
    runs: list[dict[str, Any]] = []
    with Server(SLUICE, port, cmd, log) as server:
        server.start(dict(os.environ))
        base = server.base_url
        asyncio.run(_warm(base))
        for _ in range(args.repeat):
            with Caller(base, "chat") as calm:
                time.sleep(args.calm)  # the caller runs this long: the calm phase's length
            with Caller(base, "chat") as hit:
                hit.wait_turns(3)  # the caller is in its loop before the kill
                pids = _core_pids(log, "other")
                killed = time.monotonic()
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                back = _until_token(base, "other", killed + 300)
            during = _ttfts(hit, killed, back)
            runs.append(
                {
                    "calm_p50": percentile(_ttfts(calm, 0, float("inf")), 50),
                    "calm_p95": percentile(_ttfts(calm, 0, float("inf")), 95),
                    "fault_p50": percentile(during, 50),
                    "fault_p95": percentile(during, 95),
                    "fault_turns": len(during),
                    "failed": len(calm.failed) + len(hit.failed),
                    "failures": calm.failed + hit.failed,
                    "back_s": back - killed,
                }
            )
            print(f"fault repetition: {runs[-1]}", flush=True)
    return runs


async def _warm(base: str) -> None:
    async with aiohttp.ClientSession() as s:
        for model in ("chat", "other"):
            await first_token(s, base, model, 0)


def cold_start(system: str, workdir: Path) -> float:
    """Seconds from a server's exec to its first token, for the demo model with
    the models file's flags."""
    flags, _ = demo_flags()
    flags = [*drop_flags(flags, "--max-model-len", "--kv-cache-memory-bytes"), "--enforce-eager"]
    flags += [f"--{k}={v}" for k, v in ENGINE.items()]
    port = free_port()
    engine_flags = flags if system == VLLM else drop_flags(flags, "--model", "--served-model-name")
    cmd = server_command(system, port, engine_flags)
    base = f"http://{HOST}:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=(workdir / f"{system}-cold.log").open("ab"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        process_group=0,
    )
    try:
        return _until_token(base, DEMO_NAME, t0 + 600) - t0
    finally:
        kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid, signal.SIGKILL)
            proc.wait(10)


def report(runs: list[dict[str, Any]], cold: dict[str, list[float]], repeat: int) -> list[str]:
    def col(key: str) -> list[float]:
        return [float(r[key]) for r in runs]

    def ms(key: str) -> str:
        return runs_cell(runs, key, ".0f")

    ratio = [r["fault_p95"] / r["calm_p95"] for r in runs]
    back = statistics.median(col("back_s"))
    lines = [
        "# One model's engine killed and restarted beside a chat caller on another (issue 41)",
        "",
        f"`./scripts/bench faults --repeat {repeat}`: one Sluice serving the demo "
        "model twice from one models file (`chat` and `other`, both eager, "
        f"max-model-len {ENGINE['max-model-len']}, a {ENGINE['kv-cache-memory-bytes'] >> 20} "
        "MiB KV cache), on this machine's CPU. Per repetition a closed-loop chat caller "
        "on `chat` runs calm, then again while `other`'s engine core is killed (SIGKILL, "
        "by its pids) and restarts; the fault's turns are those started between the kill "
        "and `other`'s first token again. TTFT at the first token; medians [min-max] "
        "over the repetitions.",
        "",
        "| | chat TTFT p50 ms | chat TTFT p95 ms | chat turns | failed on chat |",
        "|---|---|---|---|---|",
        f"| calm | {ms('calm_p50')} | {ms('calm_p95')} | | |",
        f"| during the fault | {ms('fault_p50')} | {ms('fault_p95')} "
        f"| {ms('fault_turns')} | {sum(int(r['failed']) for r in runs)} |",
        "",
        f"* chat TTFT p95 during the fault: {spread_cell(ratio, '.2f')}x calm (target <= 1.5x); "
        f"{sum(int(r['failed']) for r in runs)} failed chat requests (target 0).",
        "",
        "| from | to a first token, s |",
        "|---|---|",
        f"| `other`'s death, restarted in-process | {runs_cell(runs, 'back_s', '.1f')} |",
    ]
    for system, name in ((SLUICE, "a cold `sluice serve`"), (VLLM, "a cold `vllm serve`")):
        lines.append(f"| {name}'s exec | {spread_cell(cold[system], '.1f')} |")
    lines += [
        "",
        f"* death to first token: {back / statistics.median(cold[SLUICE]):.2f}x a cold "
        f"`sluice serve`, {back / statistics.median(cold[VLLM]):.2f}x a cold `vllm serve` "
        "(the restart's back-off, 1 s after a first death, is in it; the cold starts "
        "import vLLM and torch, which the restart's process already holds).",
    ]
    if failures := [f for r in runs for f in r["failures"]]:
        lines += ["", "Failed chat turns:", "", *(f"* {f}" for f in failures)]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench faults", description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--calm", type=float, default=15.0, help="seconds of the calm phase")
    ap.add_argument("--out", type=Path, default=Path("bench/results/faults-cpu.md"))
    ap.add_argument(
        "--raw", type=Path, help="keep the servers' logs here (e.g. bench/results/raw/faults)"
    )
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sluice-faults-") as tmp:
        workdir = Path(tmp) if args.raw is None else args.raw
        workdir.mkdir(parents=True, exist_ok=True)
        runs = fault_runs(args, workdir)
        cold: dict[str, list[float]] = {SLUICE: [], VLLM: []}
        for i in range(args.repeat):
            for system in (SLUICE, VLLM) if i % 2 == 0 else (VLLM, SLUICE):
                cold[system].append(cold_start(system, workdir))
                print(f"cold {system}: {cold[system][-1]:.1f} s", flush=True)
    write_lines(args.out, report(runs, cold, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
