"""Issue 43's prefix point: multi-turn conversations on two data-parallel ranks, with
and without prefix placement, against vLLM's own server with the same flags.

Why this module exists: with data parallelism each rank has its own prefix cache;
a conversation's next turn that lands on the other rank prefills its whole
history again. The issue's targets on a multi-turn agent trace: the prefix hit
rate >= 0.9x that of one engine with the same total cache, TTFT p50 and p95
<= 0.7x vLLM's server, req/s >= 1.0x; and with no shared system prompt, >= 0.98x
Sluice with --no-prefix-placement.

The trace: `--conversations` conversations of `--turns` turns, closed loop per
conversation (a turn is sent when the previous one's answer is whole, the
answer appended to the history); a shared system prompt of about
`--system-words` words (none with --no-shared), each turn adding a user message
of `--user-words` words and an answer of `--max-tokens` tokens (`ignore_eos`).
Each repetition's conversations are new (the repetition's number opens the
system prompt), so no run reads another's cache. Systems, all up at once and
run in turn: Sluice with prefix placement, Sluice with --no-prefix-placement,
vLLM's server, all `--data-parallel-size 2`, and (for the hit rate only)
Sluice on one engine with twice the KV cache. The hit rate is the engines' own
(prefix-cache hits over queries, from /metrics). TTFT at the first
token-carrying chunk.

    ./scripts/bench prefix [--repeat 3] [--conversations 32] [--turns 6] [--no-shared]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.report.cells import percentile, runs_cell, write_lines
from bench.report.systems import SLUICE, VLLM
from bench.run.chat_turn import stream_chat
from bench.run.engine_flags import DEMO_NAME, demo_flags, drop_flags
from bench.run.servers import Server, free_port, http_get, server_command

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "field",
    "light",
    "forest",
    "ocean",
    "paper",
    "signal",
    "window",
    "garden",
    "planet",
    "engine",
    "market",
    "silver",
    "winter",
    "bridge",
    "castle",
]
# name -> (server kind, sluice flags, data-parallel size, KV-cache factor)
SYSTEMS: dict[str, tuple[str, list[str], int, int]] = {
    "sluice": (SLUICE, [], 2, 1),
    "no-placement": (SLUICE, ["--no-prefix-placement"], 2, 1),
    "vllm": (VLLM, [], 2, 1),
    "one-engine": (SLUICE, [], 1, 2),
}


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 13) % len(WORDS)] for i in range(n))


async def conversation(
    session: aiohttp.ClientSession, base: str, c: int, args: argparse.Namespace, rep: int
) -> list[tuple[float, float]]:
    """One conversation's turns: (TTFT, the turn's seconds) of each."""
    system = f"Run {rep}. " + (text(args.system_words, 0) if not args.no_shared else "")
    if args.no_shared:
        system += text(args.system_words, 1000 + rep * 1000 + c)  # its own, not shared
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    out: list[tuple[float, float]] = []
    for t in range(args.turns):
        messages.append({"role": "user", "content": text(args.user_words, c * 100 + t)})
        body = {
            "model": DEMO_NAME,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        t0 = time.perf_counter()
        first, answer = await stream_chat(session, base, body)
        out.append((first, time.perf_counter() - t0))
        messages.append({"role": "assistant", "content": answer})
    return out


def prefix_counters(base: str) -> tuple[float, float]:
    """(queries, hits) of the engines' prefix caches, summed over engines."""
    status, body = http_get(base + "/metrics", timeout=10)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    got = {"queries": 0.0, "hits": 0.0}
    names = {
        "sluice_engine_prefix_cache_queries": "queries",
        "sluice_engine_prefix_cache_hits": "hits",
        "vllm:prefix_cache_queries": "queries",
        "vllm:prefix_cache_hits": "hits",
    }
    for family in text_string_to_metric_families(body):
        if family.name in names:
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    got[names[family.name]] += sample.value
    return got["queries"], got["hits"]


def one_run(base: str, args: argparse.Namespace, rep: int) -> dict[str, float]:
    async def go() -> tuple[list[tuple[float, float]], float]:
        conn = aiohttp.TCPConnector(limit=args.conversations)
        async with aiohttp.ClientSession(connector=conn) as s:
            t0 = time.monotonic()
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(conversation(s, base, c, args, rep))
                    for c in range(args.conversations)
                ]
            took = time.monotonic() - t0
        return [x for t in tasks for x in t.result()], took

    q0, h0 = prefix_counters(base)
    turns, took = asyncio.run(go())
    q1, h1 = prefix_counters(base)
    ttft = [1000 * f for f, _ in turns]
    return {
        "ttft_p50": percentile(ttft, 50),
        "ttft_p95": percentile(ttft, 95),
        "req_s": len(turns) / took,
        "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
    }


def command(name: str, port: int) -> list[str]:
    kind, sluice_flags, dp, kv_factor = SYSTEMS[name]
    flags, _ = demo_flags()
    kv = int(flags[flags.index("--kv-cache-memory-bytes") + 1]) * kv_factor
    flags = drop_flags(flags, "--kv-cache-memory-bytes")
    flags += ["--kv-cache-memory-bytes", str(kv), "--enforce-eager"]
    if dp > 1:
        flags += ["--data-parallel-size", str(dp)]
    return server_command(kind, port, flags, sluice_flags)


def report(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> list[str]:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    lines = [
        "# Multi-turn conversations on two data-parallel ranks: prefix placement (issue 43)",
        "",
        f"`./scripts/bench prefix --repeat {args.repeat} --conversations {args.conversations} "
        f"--turns {args.turns} --system-words {args.system_words} --user-words "
        f"{args.user_words} --max-tokens {args.max_tokens}"
        + (" --no-shared" if args.no_shared else "")
        + "`: the demo model (eager) on this machine's CPU, each system "
        "`--data-parallel-size 2` but `one-engine` (one engine, twice the KV cache: "
        "the hit rate's reference); every conversation closed loop, all at once; "
        "each repetition's conversations new. Hit rate: the engines' prefix-cache "
        "hits over queries (/metrics). Medians [min-max] over the repetitions.",
        "",
        "| system | TTFT p50 ms | TTFT p95 ms | req/s | prefix hit rate |",
        "|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        lines.append(
            f"| {name} | {runs_cell(rs, 'ttft_p50', '.0f')} | {runs_cell(rs, 'ttft_p95', '.0f')} "
            f"| {runs_cell(rs, 'req_s', '.2f')} | {runs_cell(rs, 'hit_rate', '.3f')} |"
        )

    def ratio(a: str, b: str, key: str) -> str:
        if not runs.get(a) or not runs.get(b) or not med(b, key):
            return "n/a"
        return f"{med(a, key) / med(b, key):.2f}x"

    s, v, n, one = "sluice", "vllm", "no-placement", "one-engine"
    lines += [
        "",
        f"* hit rate: {ratio(s, one, 'hit_rate')} one engine's (target >= 0.9x), "
        f"{ratio(s, n, 'hit_rate')} without placement's, {ratio(s, v, 'hit_rate')} vLLM's.",
        f"* against vLLM's server: TTFT p50 {ratio(s, v, 'ttft_p50')}, p95 "
        f"{ratio(s, v, 'ttft_p95')} (target <= 0.7x); req/s {ratio(s, v, 'req_s')} "
        "(target >= 1.0x).",
        f"* against --no-prefix-placement: req/s {ratio(s, n, 'req_s')}, TTFT p95 "
        f"{ratio(s, n, 'ttft_p95')}.",
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench prefix", description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=1600, help="about 2,000 tokens")
    ap.add_argument("--user-words", type=int, default=180)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-shared", action="store_true", help="no shared system prompt")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefix-cpu.md"))
    ap.add_argument("--raw", type=Path, help="keep the servers' logs here")
    args = ap.parse_args(argv)
    names = [n for n in args.systems.split(",") if n]
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="sluice-prefix-") as tmp:
        workdir = Path(tmp) if args.raw is None else args.raw
        workdir.mkdir(parents=True, exist_ok=True)
        servers = {}
        try:
            for name in names:
                port = free_port()
                kind = SYSTEMS[name][0]
                servers[name] = Server(kind, port, command(name, port), workdir / f"{name}.log")
                servers[name].start(dict(os.environ), timeout=600)
            for rep in range(args.repeat):
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    runs[name].append(one_run(servers[name].base_url, args, rep))
                    print(f"{name} repetition {rep}: {runs[name][-1]}", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    write_lines(args.out, report(runs, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
