"""Issue 30's two-models point: a chat caller on one model beside an embedding
flood on another, in one Sluice.

Why this module exists: each model has its own engine and its own core, so a
flood on the embedding model must not reach the chat caller through Sluice's
queues; what is left between them is the hardware they share (on a GPU the
card, on CPU the two cores). The issue's target: the chat caller's TTFT p95
beside the flood <= 1.5x its value alone. One Sluice serves the demo chat
model (`chat`) and the demo model under the pooling runner (`embed`) from one
models file. Per repetition, alternating: the chat caller alone, then beside a
closed-loop flood of one-string embedding requests at `--concurrency`. The
chat caller sends `--turns` streamed turns one after another; TTFT is taken at
the first chunk that carries a token (content or reasoning), never at the
role-only first frame. Reported: TTFT p50/p95 alone and beside (medians
[min-max] over repetitions), the flood's req/s, and CPU seconds per phase of
the front and of each engine core (on CPU, what the cores went to).

    python -m bench.points.two_models_point [--repeat 3] [--turns 40] [--concurrency 64]
        [--out bench/results/two-models-cpu.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from bench.report.cells import percentile, runs_cell, write_lines
from bench.report.systems import SLUICE
from bench.run.servers import Server, free_port, server_command

MODELS = """
[models.chat]
kv-cache-memory-bytes = 67108864
max-model-len = 4096
enforce-eager = true

[models.embed]
runner = "pooling"
convert = "embed"
enforce-eager = true
"""

JSON = {"content-type": "application/json"}
CHAT_BODY = {
    "model": "chat",
    "max_tokens": 8,
    "stream": True,
    "chat_template_kwargs": {"enable_thinking": False},
}


# With --background-flood: the callers file's keys (the flood's caller is background).
CALLERS = """[callers.chat]
key = "sk-chat"

[callers.flood]
key = "sk-flood"
background = true
"""


def _headers(args: argparse.Namespace, caller: str) -> dict[str, str]:
    if not args.background_flood:
        return JSON
    return {**JSON, "authorization": f"Bearer sk-{caller}"}


async def _turn(session: aiohttp.ClientSession, url: str, i: int, headers: dict[str, str]) -> float:
    """One streamed chat turn; seconds to its first token."""
    question = {"role": "user", "content": f"Question {i}: why is the sky blue?"}
    data = orjson.dumps({**CHAT_BODY, "messages": [question]})
    t0 = time.perf_counter()
    first = 0.0
    async with session.post(url, data=data, headers=headers) as r:
        r.raise_for_status()
        async for line in r.content:
            if first or not line.startswith(b"data: {"):
                continue
            delta = orjson.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                first = time.perf_counter() - t0
    assert first, "a turn without a token"
    return first


async def _chat(base: str, turns: int, headers: dict[str, str]) -> list[float]:
    async with aiohttp.ClientSession() as s:
        return [await _turn(s, base + "/v1/chat/completions", i, headers) for i in range(turns)]


async def _flood(
    base: str, concurrency: int, stop: Any, done: Any, headers: dict[str, str]
) -> None:
    url = base + "/v1/embeddings"
    conn = aiohttp.TCPConnector(limit=concurrency)

    async def worker(w: int) -> None:
        i = 0
        while not stop.is_set():
            body = orjson.dumps({"model": "embed", "input": f"document {w}-{i} about rivers"})
            async with s.post(url, data=body, headers=headers) as r:
                await r.read()
                if r.status == 200:
                    with done.get_lock():
                        done.value += 1
            i += 1

    async with aiohttp.ClientSession(connector=conn) as s, asyncio.TaskGroup() as tg:
        for w in range(concurrency):
            tg.create_task(worker(w))


def _flood_process(
    base: str, concurrency: int, stop: Any, done: Any, headers: dict[str, str]
) -> None:
    asyncio.run(_flood(base, concurrency, stop, done, headers))


@contextlib.contextmanager
def flood(base: str, concurrency: int, headers: dict[str, str]) -> Iterator[Any]:
    """A closed-loop embedding flood in a process of its own while the block runs
    (another caller: in a thread of the chat caller's process it took the GIL from
    the chat caller's reads, up to the 5 ms switch interval a first token); yields
    the count of requests completed (`.value`), final once the block has left."""
    ctx = multiprocessing.get_context("spawn")
    stop, done = ctx.Event(), ctx.Value("q", 0)
    p = ctx.Process(target=_flood_process, args=(base, concurrency, stop, done, headers))
    p.start()
    try:
        while done.value < concurrency:  # the flood is running before the chat starts
            if not p.is_alive():
                raise RuntimeError(f"the flood ended first (exit {p.exitcode})")
            time.sleep(0.01)
        yield done
    finally:
        stop.set()
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()


def _cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of the front and its children (engine cores and their
    workers), by process title, numbered in start order (the engines start in
    the models file's order: chat's first)."""
    proc = psutil.Process(pid)
    out = {"front": sum(proc.cpu_times()[:2])}
    seen: dict[str, int] = {}
    for child in sorted(proc.children(recursive=True), key=lambda c: c.create_time()):
        with contextlib.suppress(psutil.NoSuchProcess):
            title = " ".join(child.cmdline()[:1]) or child.name()
            seen[title] = seen.get(title, 0) + 1
            out[f"{title}#{seen[title]}"] = sum(child.cpu_times()[:2])
    return out


def run(args: argparse.Namespace, workdir: Path) -> dict[str, list[dict[str, Any]]]:
    models = workdir / "models.toml"
    models.write_text(MODELS)
    port = free_port()
    flags = ["--models", str(models), *args.sluice_flags.split()]
    if args.background_flood:
        callers = workdir / "callers.toml"
        callers.write_text(CALLERS)
        callers.chmod(0o600)
        flags += ["--callers", str(callers)]
    chat_h, flood_h = _headers(args, "chat"), _headers(args, "flood")
    cmd = server_command(SLUICE, port, [], flags)
    results: dict[str, list[dict[str, Any]]] = {"alone": [], "beside": []}
    with Server(SLUICE, port, cmd, workdir / "sluice.log") as server:
        server.start(dict(os.environ))
        assert server.proc is not None
        base = server.base_url
        asyncio.run(_chat(base, 4, chat_h))  # warm both paths once
        with flood(base, args.concurrency, flood_h):
            pass
        for _ in range(args.repeat):
            for phase in ("alone", "beside"):
                cpu0, t0 = _cpu(server.proc.pid), time.monotonic()
                if phase == "alone":
                    ttft, flooded = asyncio.run(_chat(base, args.turns, chat_h)), 0
                else:
                    with flood(base, args.concurrency, flood_h) as done:
                        start = done.value
                        ttft = asyncio.run(_chat(base, args.turns, chat_h))
                        flooded = done.value - start
                dt = time.monotonic() - t0
                cpu1 = _cpu(server.proc.pid)
                results[phase].append(
                    {
                        "p50": 1000 * percentile(ttft, 50),
                        "p95": 1000 * percentile(ttft, 95),
                        "flood_rps": flooded / dt,
                        "cpu": {k: round(v - cpu0.get(k, 0.0), 1) for k, v in cpu1.items()},
                        "seconds": round(dt, 1),
                    }
                )
    return results


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    def cell(runs: list[dict[str, Any]], key: str) -> str:
        return runs_cell(runs, key, ".1f")

    lines = [
        "# A chat caller beside an embedding flood on another model (issue 30)",
        "",
        f"`python -m bench.points.two_models_point --repeat {args.repeat} --turns {args.turns} "
        f"--concurrency {args.concurrency}"
        + (f" --sluice-flags '{args.sluice_flags}'" if args.sluice_flags else "")
        + (" --background-flood" if args.background_flood else "")
        + "`: one Sluice, the demo chat model and the demo model under the pooling "
        "runner from one models file (both eager), on this machine's CPU. Per "
        "repetition the chat caller runs alone, then beside a closed-loop flood of "
        "one-string embedding requests; TTFT at the first token, medians [min-max] "
        "over the repetitions.",
        "",
        "| phase | chat TTFT p50 ms | chat TTFT p95 ms | flood req/s |",
        "|---|---|---|---|",
    ]
    for phase, runs in results.items():
        lines.append(
            f"| {phase} | {cell(runs, 'p50')} | {cell(runs, 'p95')} | {cell(runs, 'flood_rps')} |"
        )
    alone = statistics.median(r["p95"] for r in results["alone"])
    beside = statistics.median(r["p95"] for r in results["beside"])
    lines += [
        "",
        f"* chat TTFT p95 beside the flood: {beside / alone:.2f}x alone (target <= 1.5x).",
        "",
        "CPU seconds per phase, by process, last repetition (front: the Sluice process; "
        "#1 is the chat model's engine core and worker, #2 the embedding model's: they "
        "start in the models file's order; the plain python one is multiprocessing's "
        "resource tracker):",
        "",
    ]
    for phase, runs in results.items():
        lines.append(f"* {phase} ({runs[-1]['seconds']} s): {runs[-1]['cpu']}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--sluice-flags", default="", help="Sluice's own flags (one string)")
    ap.add_argument(
        "--background-flood",
        action="store_true",
        help="the flood's caller is background work (a callers file; issue 49)",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/two-models-cpu.md"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-two-models-") as tmp:
        results = run(args, Path(tmp))
    lines = report(results, args)
    write_lines(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
