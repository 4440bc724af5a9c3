"""Issue 43's prefix point: what prefix placement and a balancer's affinity buy, and cost.

Measured: multi-turn conversations on two data-parallel ranks, with and without
prefix placement, against vLLM's own server with the same flags; the same
conversations on two Sluice instances behind HAProxy, with and without
affinity; and (--spread) unrelated prompts, where there is nothing to reuse.

Why this module exists: with data parallelism each rank has its own prefix cache;
a conversation's next turn that lands on the other rank prefills its whole
history again. The issue's targets on a multi-turn agent trace: the prefix hit
rate >= 0.9x that of one engine with the same total cache, TTFT p50 and p95
<= 0.7x vLLM's server, req/s >= 1.0x; with no shared system prompt, and on the
13-order spread of unrelated prompts, >= 0.98x Sluice with --no-prefix-placement
(placement costs nothing where there is nothing to reuse). Item 4: with several
Sluice instances behind HAProxy, a balancer configuration that keeps a
conversation on one instance, and what that buys in the same benchmark.

The trace: `--conversations` conversations of `--turns` turns, closed loop per
conversation (a turn is sent when the previous one's answer is whole, the
answer appended to the history); a shared system prompt of about
`--system-words` words (none with --no-shared), each turn adding a user message
of `--user-words` words and an answer of `--max-tokens` tokens (`ignore_eos`).
Every turn carries `X-Session-Id: <repetition>-<conversation>` (the balancer's
key; Sluice and vLLM's server ignore the header). Each repetition's
conversations are new (the repetition's number opens the system prompt), so no
run reads another's cache. A turn that fails (an error status, an error event,
a broken connection) is counted in the `failed` column and left out of the
history; its conversation goes on.

With --spread, each of `--conversations` callers sends `--turns` single-turn
requests instead, closed loop, each an unrelated prompt (random words, no system
prompt) of one of 13 lengths geometric from 16 to 2,000 tokens, each caller
going through them in its own shuffled order (bench/run/spread_prompts.py); its
X-Session-Id is the request's own.

Systems, all up at once and run in turn (`--systems`): `sluice` (prefix
placement), `no-placement` (--no-prefix-placement), `vllm` (vLLM's server),
all `--data-parallel-size 2`, and (for the hit rate only) `one-engine`: Sluice
on one engine with twice the KV cache; those four by default. Chosen with
--systems: `lb-affinity`, two Sluice instances of one engine each (each with
one rank's KV cache, VLLM_CPU_OMP_THREADS_BIND=nobind so the two engines are
not both bound to core 0) behind `haproxy -db -f docs/haproxy.cfg` as shipped,
and `lb-roundrobin`, the same behind that file without its `use_backend
affinity` line (every request round robin; bench/run/balancer.py). The
hit rate is the engines' own (prefix-cache hits over queries, from /metrics;
both instances' summed, each asked directly). TTFT at the first token-carrying
chunk.

    ./scripts/bench prefix [--repeat 3] [--conversations 32] [--turns 6] [--no-shared]
    ./scripts/bench prefix --systems sluice,lb-affinity,lb-roundrobin
    ./scripts/bench prefix --spread [--turns 13]    # bench/results/prefix-spread-cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.report.cells import median, percentile, runs_cell, write_lines
from bench.report.systems import SLUICE, VLLM
from bench.run.balancer import CONFIG, Balancer, round_robin_config
from bench.run.chat_turn import stream_chat
from bench.run.engine_flags import DEMO_NAME, demo_flags, drop_flags
from bench.run.servers import Server, free_port, http_get, server_command
from bench.run.spread_prompts import LENGTHS, spread_prompt

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
DEFAULT_SYSTEMS = ",".join(SYSTEMS)
# Two instances behind HAProxy (issue 43 item 4): name -> whether the balancer
# keeps a conversation on one instance (docs/haproxy.cfg as shipped) or not (the
# same file without its use_backend line: round robin).
BALANCED: dict[str, bool] = {"lb-affinity": True, "lb-roundrobin": False}
# Each instance: Sluice on one engine with one rank's KV cache.
INSTANCE: tuple[str, list[str], int, int] = (SLUICE, [], 1, 1)
# vLLM's CPU backend binds each engine's OpenMP threads to core 0 by default
# (tests/system/test_balancer.py): two instances' engines would queue on one
# core. Unbound, the kernel places them. (The DP systems keep vLLM's default:
# one process places its own ranks.)
INSTANCE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
SESSION_HEADER = "X-Session-Id"
# What a failed turn raises: an error status or a broken connection, an error
# event or no token, a garbled event, a timeout.
TURN_ERRORS = (aiohttp.ClientError, RuntimeError, ValueError, TimeoutError)
SHOWN_FAILURES = 3


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 13) % len(WORDS)] for i in range(n))


@dataclass
class Tally:
    """A run's turns as they finish: (TTFT, the turn's seconds) of each that
    answered, what each failed one raised, and the largest request body."""

    turns: list[tuple[float, float]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    largest_body: int = 0


async def timed_turn(
    session: aiohttp.ClientSession,
    base: str,
    messages: list[dict[str, str]],
    args: argparse.Namespace,
    key: str,
    tally: Tally,
) -> str | None:
    """One streamed turn under session `key`, recorded in `tally`: its answer,
    or None if it failed."""
    body = {
        "model": DEMO_NAME,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    tally.largest_body = max(tally.largest_body, len(orjson.dumps(body)))
    t0 = time.perf_counter()
    try:
        first, answer = await stream_chat(session, base, body, {SESSION_HEADER: key})
    except TURN_ERRORS as exc:
        tally.failed.append(f"{key}: {exc!r}")
        return None
    tally.turns.append((first, time.perf_counter() - t0))
    return answer


async def conversation(
    session: aiohttp.ClientSession,
    base: str,
    c: int,
    args: argparse.Namespace,
    rep: int,
    tally: Tally,
) -> None:
    """One conversation's turns, closed loop; a failed turn leaves the history."""
    system = f"Run {rep}. " + (text(args.system_words, 0) if not args.no_shared else "")
    if args.no_shared:
        system += text(args.system_words, 1000 + rep * 1000 + c)  # its own, not shared
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for t in range(args.turns):
        messages.append({"role": "user", "content": text(args.user_words, c * 100 + t)})
        answer = await timed_turn(session, base, messages, args, f"{rep}-{c}", tally)
        if answer is None:
            messages.pop()
        else:
            messages.append({"role": "assistant", "content": answer})


async def spread_caller(
    session: aiohttp.ClientSession,
    base: str,
    c: int,
    args: argparse.Namespace,
    rep: int,
    tally: Tally,
) -> None:
    """One caller of the spread: `--turns` unrelated single-turn prompts, closed loop."""
    for t in range(args.turns):
        messages = [{"role": "user", "content": spread_prompt(rep, c, t)}]
        await timed_turn(session, base, messages, args, f"{rep}-{c}-{t}", tally)


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


def summed_counters(bases: Sequence[str]) -> tuple[float, float]:
    """prefix_counters summed over servers (each instance behind a balancer)."""
    counts = [prefix_counters(b) for b in bases]
    return sum(q for q, _ in counts), sum(h for _, h in counts)


def one_run(
    base: str, metrics_bases: Sequence[str], args: argparse.Namespace, rep: int
) -> dict[str, float]:
    caller: Callable[..., Coroutine[Any, Any, None]] = (
        spread_caller if args.spread else conversation
    )

    async def go() -> tuple[Tally, float]:
        tally = Tally()
        conn = aiohttp.TCPConnector(limit=args.conversations)
        async with aiohttp.ClientSession(connector=conn) as s:
            t0 = time.monotonic()
            async with asyncio.TaskGroup() as tg:
                for c in range(args.conversations):
                    tg.create_task(caller(s, base, c, args, rep, tally))
            took = time.monotonic() - t0
        return tally, took

    q0, h0 = summed_counters(metrics_bases)
    tally, took = asyncio.run(go())
    q1, h1 = summed_counters(metrics_bases)
    for failure in tally.failed[:SHOWN_FAILURES]:
        print(f"failed turn {failure}", flush=True)
    ttft = [1000 * f for f, _ in tally.turns]
    return {
        "ttft_p50": percentile(ttft, 50) if ttft else math.nan,
        "ttft_p95": percentile(ttft, 95) if ttft else math.nan,
        "req_s": len(tally.turns) / took,
        "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "failed": float(len(tally.failed)),
        "largest_body_kib": tally.largest_body / 1024,
    }


def engine_command(system: tuple[str, list[str], int, int], port: int) -> list[str]:
    kind, sluice_flags, dp, kv_factor = system
    flags, _ = demo_flags()
    kv = int(flags[flags.index("--kv-cache-memory-bytes") + 1]) * kv_factor
    flags = drop_flags(flags, "--kv-cache-memory-bytes")
    flags += ["--kv-cache-memory-bytes", str(kv), "--enforce-eager"]
    if dp > 1:
        flags += ["--data-parallel-size", str(dp)]
    return server_command(kind, port, flags, sluice_flags)


def command(name: str, port: int) -> list[str]:
    return engine_command(SYSTEMS[name], port)


def balancer_config(name: str, workdir: Path) -> Path:
    """docs/haproxy.cfg itself for an affine system, else its round-robin copy."""
    if BALANCED[name]:
        return CONFIG
    out = workdir / f"{name}-haproxy.cfg"
    out.write_text(round_robin_config(CONFIG.read_text()))
    return out


@dataclass(frozen=True)
class Up:
    """A started system: where the callers go, and whose /metrics count."""

    base_url: str
    metrics: tuple[str, ...]


def start_system(name: str, workdir: Path, stack: contextlib.ExitStack) -> Up:
    """Start one system (its stop registered on `stack` before it starts)."""
    if name in SYSTEMS:
        port = free_port()
        server = Server(SYSTEMS[name][0], port, command(name, port), workdir / f"{name}.log")
        stack.callback(server.stop)
        server.start(dict(os.environ), timeout=600)
        return Up(server.base_url, (server.base_url,))
    instances = []
    for which in ("a", "b"):
        port = free_port()
        log = workdir / f"{name}-{which}.log"
        instance = Server(INSTANCE[0], port, engine_command(INSTANCE, port), log)
        stack.callback(instance.stop)
        instance.start({**os.environ, **INSTANCE_ENV}, timeout=600)
        instances.append(instance)
    lb = Balancer(
        balancer_config(name, workdir),
        free_port(),
        instances[0].port,
        instances[1].port,
        workdir / f"{name}-haproxy.log",
    )
    stack.callback(lb.stop)
    lb.start()
    return Up(lb.base_url, tuple(i.base_url for i in instances))


def default_out(spread: bool) -> Path:
    return Path("bench/results/prefix-spread-cpu.md" if spread else "bench/results/prefix-cpu.md")


def command_line(args: argparse.Namespace) -> str:
    """The command that runs this report again."""
    words = [
        "./scripts/bench prefix",
        f"--repeat {args.repeat}",
        f"--conversations {args.conversations}",
        f"--turns {args.turns}",
    ]
    if args.spread:
        words.append("--spread")
    else:
        words += [f"--system-words {args.system_words}", f"--user-words {args.user_words}"]
    words.append(f"--max-tokens {args.max_tokens}")
    if args.no_shared:
        words.append("--no-shared")
    if args.systems != DEFAULT_SYSTEMS:
        words.append(f"--systems {args.systems}")
    if args.out != default_out(args.spread):
        words.append(f"--out {args.out}")
    return " ".join(words)


def table(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = [
        "| system | TTFT p50 ms | TTFT p95 ms | req/s | prefix hit rate | failed turns |",
        "|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        lines.append(
            f"| {name} | {runs_cell(rs, 'ttft_p50', '.0f')} | {runs_cell(rs, 'ttft_p95', '.0f')} "
            f"| {runs_cell(rs, 'req_s', '.2f')} | {runs_cell(rs, 'hit_rate', '.3f')} "
            f"| {runs_cell(rs, 'failed', '.0f')} |"
        )
    return lines


def report(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> list[str]:
    def med(name: str, key: str) -> float:
        return median(runs[name], key)

    def ratio(a: str, b: str, key: str) -> str:
        if not runs.get(a) or not runs.get(b) or not med(b, key):
            return "n/a"
        return f"{med(a, key) / med(b, key):.2f}x"

    def rate(name: str) -> str:
        return f"{med(name, 'hit_rate'):.3f}" if runs.get(name) else "n/a"

    if args.spread:
        title = (
            "# Unrelated prompts of 13 lengths on two data-parallel ranks: "
            "what prefix placement costs (issue 43)"
        )
        load = (
            "each caller closed loop, all at once, sending single-turn prompts with "
            "nothing shared (random words, a repetition's own; "
            f"{len(LENGTHS)} lengths geometric from {LENGTHS[0]} to {LENGTHS[-1]:,} tokens, "
            "each caller's in a shuffled order of its own)"
        )
    else:
        title = "# Multi-turn conversations on two data-parallel ranks: prefix placement (issue 43)"
        load = "every conversation closed loop, all at once; each repetition's conversations new"
    pairs = " and the balanced pairs below" if any(n in BALANCED for n in runs) else ""
    lines = [
        title,
        "",
        f"`{command_line(args)}`: the demo model (eager) on this machine's CPU, each system "
        "`--data-parallel-size 2` but `one-engine` (one engine, twice the KV cache: "
        f"the hit rate's reference){pairs}; {load}. Hit rate: the "
        "engines' prefix-cache hits over queries (/metrics). Failed turns: those that "
        "raised (counted, not retried, left out of the times). Medians [min-max] over "
        "the repetitions.",
    ]
    single = {n: rs for n, rs in runs.items() if n in SYSTEMS}
    s, v, n, one = "sluice", "vllm", "no-placement", "one-engine"
    if single:
        lines += ["", *table(single), ""]
        if args.spread:
            lines.append(
                f"* against --no-prefix-placement: req/s {ratio(s, n, 'req_s')} (target "
                f">= 0.98x), TTFT p50 {ratio(s, n, 'ttft_p50')}, p95 {ratio(s, n, 'ttft_p95')}; "
                f"hit rate {rate(s)} against {rate(n)}."
            )
        else:
            lines += [
                f"* hit rate: {ratio(s, one, 'hit_rate')} one engine's (target >= 0.9x), "
                f"{ratio(s, n, 'hit_rate')} without placement's, {ratio(s, v, 'hit_rate')} "
                "vLLM's.",
                f"* against vLLM's server: TTFT p50 {ratio(s, v, 'ttft_p50')}, p95 "
                f"{ratio(s, v, 'ttft_p95')} (target <= 0.7x); req/s {ratio(s, v, 'req_s')} "
                "(target >= 1.0x).",
                f"* against --no-prefix-placement: req/s {ratio(s, n, 'req_s')}, TTFT p95 "
                f"{ratio(s, n, 'ttft_p95')}.",
            ]
    balanced = {name: rs for name, rs in runs.items() if name in BALANCED}
    if balanced:
        aff, rr = "lb-affinity", "lb-roundrobin"
        lines += [
            "",
            "## Two instances behind HAProxy (issue 43 item 4)",
            "",
            "Two Sluice instances, each one engine with one rank's KV cache, behind "
            "`haproxy -db -f docs/haproxy.cfg`: `lb-affinity` the file as shipped (every "
            "request carries X-Session-Id, so its consistent-hash backend bounded by load "
            "keeps a conversation on one instance), `lb-roundrobin` the same file without "
            "its `use_backend affinity` line (every request round robin). Hit rate: "
            "both instances' engines summed, each asked directly.",
            "",
            *table(balanced),
            "",
            f"* {aff} against {rr}: hit rate {ratio(aff, rr, 'hit_rate')}, req/s "
            f"{ratio(aff, rr, 'req_s')}, TTFT p95 {ratio(aff, rr, 'ttft_p95')}.",
        ]
        if runs.get(aff) and runs.get(s):
            lines.append(
                f"* {aff} against `sluice` (one process, `--data-parallel-size 2`, prefix "
                f"placement): hit rate {ratio(aff, s, 'hit_rate')}, req/s "
                f"{ratio(aff, s, 'req_s')}, TTFT p95 {ratio(aff, s, 'ttft_p95')}."
            )
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench prefix", description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=32, help="callers, with --spread")
    ap.add_argument("--turns", type=int, default=6, help="requests per caller, with --spread")
    ap.add_argument(
        "--system-words",
        type=int,
        default=975,
        help="about 2,000 tokens of the demo model (2.05 tokens a word)",
    )
    ap.add_argument(
        "--user-words",
        type=int,
        default=115,
        help="about 236 tokens: with a 64-token answer, about 300 tokens of history a turn",
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--no-shared", action="store_true", help="no shared system prompt")
    mode.add_argument(
        "--spread",
        action="store_true",
        help="unrelated single-turn prompts, 13 lengths from 16 to 2,000 tokens",
    )
    ap.add_argument(
        "--systems",
        default=DEFAULT_SYSTEMS,
        help=f"comma-separated, of {','.join([*SYSTEMS, *BALANCED])} (default: {DEFAULT_SYSTEMS})",
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="the report (default bench/results/prefix-cpu.md; prefix-spread-cpu.md with --spread)",
    )
    ap.add_argument("--raw", type=Path, help="keep the servers' logs here")
    args = ap.parse_args(argv)
    unknown = [n for n in args.systems.split(",") if n and n not in SYSTEMS and n not in BALANCED]
    if unknown:
        ap.error(f"unknown systems: {','.join(unknown)}")
    if args.out is None:
        args.out = default_out(args.spread)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n for n in args.systems.split(",") if n]
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="sluice-prefix-") as tmp:
        workdir = Path(tmp) if args.raw is None else args.raw
        workdir.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            up = {name: start_system(name, workdir, stack) for name in names}
            for rep in range(args.repeat):
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    runs[name].append(one_run(up[name].base_url, up[name].metrics, args, rep))
                    print(f"{name} repetition {rep}: {runs[name][-1]}", flush=True)
    write_lines(args.out, report(runs, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
