"""Issue 62's point: what the prefix-warm release order buys where the system prompts
in use do not all fit in the KV cache, and what it costs where nothing is shared.

Why this module exists: Sluice's release order is the engine's admission order
(batching/warm.py). Released in arrival order, requests under many long system
prompts interleave them, each is evicted before its next sibling, and every
request prefills its whole prompt again. This point measures the seeds' mix
under shared system prompts against vLLM's own server with the same flags
(`--enable-prefix-caching`) and against Sluice with `--no-prefix-order`, on
one engine each.

The load: `--streams` callers closed loop for `--seconds`, all at once, each
request one of three kinds, 70/20/10: a short turn (`--short-words` of user
text, `--short-tokens` answered), a summary (`--summary-words`,
`--summary-tokens`) and an analysis (`--analysis-words`, `--analysis-tokens`),
every answer to its max_tokens (`ignore_eos`). Each request carries one of
`--prompts` system prompts of 600-1,000 tokens (evenly spread lengths), chosen
with Zipf popularity (weight 1 / rank^`--zipf`), each caller from its own
seeded stream, so every system sees the same requests in the same order per
caller. With `--distinct` every request's system prompt is its own (the
control: nothing to share). Each repetition's prompts are new (the repetition's
number opens them), so no run reads another's cache.

The KV cache is the same flag on every system (`--kv-mib`, 1 KiB a token for the
demo model): by default 12 MiB, 12,288 tokens, about nine of the running
requests (about 1,100 tokens each) and a quarter of the 24 system prompts'
19,200 tokens beside them.

Reported per system, medians [min-max] over the repetitions: req/s (answers
over the time from the start to the last answer), prefill tokens computed (the
engine's prefix-cache queries less its hits, from /metrics:
sluice_engine_prefix_cache_* or vllm:prefix_cache_*), the hit rate, short
turns' TTFT p50/p95 (at the first token-carrying chunk) and failed requests.
The systems run in turn, alternated per repetition (both see the same noise).

    ./scripts/bench prefix-order [--repeat 3] [--seconds 45] [--streams 24]
    ./scripts/bench prefix-order --distinct    # the control: nothing shared
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.points.prefix_point import WORDS, prefix_counters
from bench.report.cells import median, percentile, runs_cell, write_lines
from bench.report.systems import SLUICE, VLLM
from bench.run.chat_turn import stream_chat
from bench.run.engine_flags import DEMO_NAME, demo_flags, drop_flags
from bench.run.servers import Server, free_port, http_get, server_command

# name -> (server kind, Sluice's own flags)
SYSTEMS: dict[str, tuple[str, list[str]]] = {
    "sluice": (SLUICE, ["--prefix-order"]),
    "sluice-off": (SLUICE, ["--no-prefix-order"]),
    "vllm": (VLLM, []),
}
DEFAULT_SYSTEMS = ",".join(SYSTEMS)
KINDS = ("short", "summary", "analysis")
MIX = (70, 20, 10)
TOKENS_PER_WORD = 2.05  # the demo model's tokenizer on these words
ERRORS = (aiohttp.ClientError, RuntimeError, ValueError, TimeoutError)


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_lengths(n: int) -> list[int]:
    """Words of each of the `n` system prompts: 600 to 1,000 tokens, evenly spread."""
    lo, hi = 600 / TOKENS_PER_WORD, 1000 / TOKENS_PER_WORD
    return [round(lo + (hi - lo) * i / max(1, n - 1)) for i in range(n)]


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


@dataclass(frozen=True)
class Shape:
    """The load's sizes (from the command line)."""

    prompts: int
    zipf: float
    distinct: bool
    words: tuple[int, int, int]  # user words by kind
    tokens: tuple[int, int, int]  # max_tokens by kind


def request(shape: Shape, rng: random.Random, rep: int, stream: int, n: int) -> tuple[str, Any]:
    """The `n`th request of `stream` in repetition `rep`: (its kind, its body)."""
    kind = rng.choices(range(3), weights=MIX)[0]
    lengths = system_lengths(shape.prompts)
    which = rng.choices(range(shape.prompts), weights=zipf_weights(shape.prompts, shape.zipf))[0]
    if shape.distinct:  # its own system prompt, of the length the shared one would have
        system = f"Run {rep}, request {stream}-{n}. " + words(
            lengths[which], rng.randrange(1 << 30)
        )
    else:
        system = f"Run {rep}, application {which}. " + words(lengths[which], 7919 * which + 1)
    user = words(shape.words[kind], rng.randrange(1 << 30))
    body = {
        "model": DEMO_NAME,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": shape.tokens[kind],
        "ignore_eos": True,
        "stream": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    return KINDS[kind], body


@dataclass
class Tally:
    ttft: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    failed: list[str] = field(default_factory=list)
    last: float = 0.0


def warm_counters(base: str) -> dict[str, float]:
    """Sluice's prefix-warm order counters (zeros from vLLM's server): releases for
    warmth, and its record's predicted cached tokens against the engine's."""
    status, body = http_get(base + "/metrics", timeout=10)
    got = {"warm": 0.0, "predicted": 0.0, "cached": 0.0, "overbelief": 0.0}
    if status != 200:
        return got
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == "sluice_prefix_order_releases_total":
                got["warm"] += sample.value
            elif sample.name == "sluice_prefix_order_record_tokens_total":
                got[sample.labels["kind"]] += sample.value
    return got


def one_run(base: str, args: argparse.Namespace, shape: Shape, rep: int) -> dict[str, float]:
    async def caller(s: aiohttp.ClientSession, i: int, t0: float, tally: Tally) -> None:
        rng = random.Random(rep * 100_003 + i)
        n = 0
        while time.monotonic() - t0 < args.seconds:
            kind, body = request(shape, rng, rep, i, n)
            n += 1
            try:
                first, _ = await stream_chat(s, base, body)
            except ERRORS as exc:
                tally.failed.append(f"{kind}: {exc!r}")
                continue
            tally.ttft[kind].append(first)
            tally.last = time.monotonic()

    async def go() -> tuple[Tally, float]:
        tally = Tally()
        conn = aiohttp.TCPConnector(limit=args.streams)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
            t0 = time.monotonic()
            async with asyncio.TaskGroup() as tg:
                for i in range(args.streams):
                    tg.create_task(caller(s, i, t0, tally))
        return tally, tally.last - t0

    q0, h0 = prefix_counters(base)
    w0 = warm_counters(base)
    tally, took = asyncio.run(go())
    q1, h1 = prefix_counters(base)
    w1 = warm_counters(base)
    w = {k: w1[k] - w0[k] for k in w0}
    for failure in tally.failed[:3]:
        print(f"failed: {failure}", flush=True)
    short = [1000 * f for f in tally.ttft["short"]]
    answered = sum(len(v) for v in tally.ttft.values())
    return {
        "req_s": answered / took if took > 0 else math.nan,
        "prefill": q1 - q0 - (h1 - h0),
        "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "short_p50": percentile(short, 50) if short else math.nan,
        "short_p95": percentile(short, 95) if short else math.nan,
        "answered": float(answered),
        "prefill_req": (q1 - q0 - (h1 - h0)) / answered if answered else math.nan,
        "failed": float(len(tally.failed)),
        "warm": w["warm"],
        # The record's error (batching/warm.py W6): tokens it predicted cached that
        # the engine had not, over those it predicted.
        "overbelief": w["overbelief"] / w["predicted"] if w["predicted"] else 0.0,
        "record_cached": w["cached"] / w["predicted"] if w["predicted"] else 0.0,
    }


def command(name: str, port: int, kv_mib: int) -> list[str]:
    kind, sluice_flags = SYSTEMS[name]
    flags, _ = demo_flags()
    flags = drop_flags(flags, "--kv-cache-memory-bytes")
    flags += ["--kv-cache-memory-bytes", str(kv_mib * 2**20), "--enforce-eager"]
    flags += ["--enable-prefix-caching"]
    return server_command(kind, port, flags, sluice_flags)


def command_line(args: argparse.Namespace) -> str:
    words_ = [
        "./scripts/bench prefix-order",
        f"--repeat {args.repeat}",
        f"--seconds {args.seconds:g}",
        f"--streams {args.streams}",
        f"--prompts {args.prompts}",
        f"--zipf {args.zipf:g}",
        f"--kv-mib {args.kv_mib}",
    ]
    if args.distinct:
        words_.append("--distinct")
    if args.systems != DEFAULT_SYSTEMS:
        words_.append(f"--systems {args.systems}")
    words_.append(f"--out {args.out}")
    return " ".join(words_)


def report(
    runs: dict[str, list[dict[str, float]]], args: argparse.Namespace, when: str
) -> list[str]:
    def ratio(a: str, b: str, key: str) -> str:
        if not runs.get(a) or not runs.get(b) or not median(runs[b], key):
            return "n/a"
        return f"{median(runs[a], key) / median(runs[b], key):.2f}x"

    shape = (
        "every request under a system prompt of its own (nothing to share)"
        if args.distinct
        else f"each request under one of {args.prompts} system prompts of 600-1,000 tokens, "
        f"Zipf popularity (s = {args.zipf:g})"
    )
    lines = [
        "# The prefix-warm release order (issue 62)"
        + (": the control, nothing shared" if args.distinct else ""),
        "",
        f"`{command_line(args)}`: the demo model (eager) on this machine's CPU (2 cores, "
        f"shared), one engine each, `--kv-cache-memory-bytes` {args.kv_mib} MiB "
        f"({args.kv_mib * 1024:,} tokens) and `--enable-prefix-caching` on every system; "
        f"{args.streams} callers closed loop for {args.seconds:g} s, a 70/20/10 mix of short "
        f"turns ({args.short_words} words, {args.short_tokens} tokens answered), summaries "
        f"({args.summary_words} words, {args.summary_tokens}) and analyses "
        f"({args.analysis_words} words, {args.analysis_tokens}), {shape}. The systems "
        f"in turn, alternated per repetition; runs at {when}. Prefill: the engine's "
        "prefix-cache queries less its hits (tokens it computed), over the requests "
        "answered (a fixed time, so each system answers its own number). Record: of the prompt "
        "tokens Sluice's record predicted cached at release, the share the engine had "
        "cached and the share it had not (batching/warm.py W6). Medians [min-max] over "
        "the repetitions.",
        "",
        "| system | req/s | prefill tokens a request | hit rate | short TTFT p50 ms "
        "| short TTFT p95 ms "
        "| answered | failed | released for warmth | record: predicted cached / not cached |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        lines.append(
            f"| {name} | {runs_cell(rs, 'req_s', '.2f')} | {runs_cell(rs, 'prefill_req', ',.0f')} "
            f"| {runs_cell(rs, 'hit_rate', '.3f')} | {runs_cell(rs, 'short_p50', '.0f')} "
            f"| {runs_cell(rs, 'short_p95', '.0f')} | {runs_cell(rs, 'answered', '.0f')} "
            f"| {runs_cell(rs, 'failed', '.0f')} | {runs_cell(rs, 'warm', '.0f')} "
            f"| {runs_cell(rs, 'record_cached', '.2f')} / {runs_cell(rs, 'overbelief', '.2f')} |"
        )
    s, off, v = "sluice", "sluice-off", "vllm"
    lines += [
        "",
        f"* against vLLM's server: req/s {ratio(s, v, 'req_s')} (target >= 1.1x), prefill "
        f"tokens a request {ratio(s, v, 'prefill_req')} (target <= 0.7x), short TTFT p95 "
        f"{ratio(s, v, 'short_p95')} (target <= 1.0x).",
        f"* against --no-prefix-order: req/s {ratio(s, off, 'req_s')}, prefill tokens a "
        f"request {ratio(s, off, 'prefill_req')}, short TTFT p95 {ratio(s, off, 'short_p95')}.",
    ]
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench prefix-order", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--streams", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--kv-mib", type=int, default=12)
    ap.add_argument("--distinct", action="store_true", help="every system prompt its own")
    ap.add_argument("--short-words", type=int, default=20)
    ap.add_argument("--summary-words", type=int, default=240)
    ap.add_argument("--analysis-words", type=int, default=600)
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--summary-tokens", type=int, default=48)
    ap.add_argument("--analysis-tokens", type=int, default=64)
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--raw", type=Path, help="keep the servers' logs here")
    ap.add_argument(
        "--report-from",
        type=Path,
        help="write the report from a run's printed repetitions (its stdout), running nothing",
    )
    ap.add_argument("--when", default="", help="with --report-from: the runs' time of day")
    args = ap.parse_args(argv)
    unknown = [n for n in args.systems.split(",") if n and n not in SYSTEMS]
    if unknown:
        ap.error(f"unknown systems: {','.join(unknown)}")
    if args.out is None:
        name = "prefix-order-distinct-cpu.md" if args.distinct else "prefix-order-cpu.md"
        args.out = Path("bench/results") / name
    return args


def from_log(path: Path) -> dict[str, list[dict[str, float]]]:
    """The repetitions a run printed (`NAME repetition N: {...}`), by system."""
    runs: dict[str, list[dict[str, float]]] = {}
    for line in path.read_text().splitlines():
        name, sep, rest = line.partition(" repetition ")
        if sep and name in SYSTEMS:
            got = ast.literal_eval(rest.split(": ", 1)[1])
            if "prefill_req" not in got:  # a run from before the column
                got["prefill_req"] = got["prefill"] / got["answered"]
            runs.setdefault(name, []).append(got)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_from is not None:
        write_lines(args.out, report(from_log(args.report_from), args, args.when))
        return 0
    shape = Shape(
        args.prompts,
        args.zipf,
        args.distinct,
        (args.short_words, args.summary_words, args.analysis_words),
        (args.short_tokens, args.summary_tokens, args.analysis_tokens),
    )
    names = [n for n in args.systems.split(",") if n]
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    started = time.strftime("%H:%M", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="sluice-prefix-order-") as tmp:
        workdir = Path(tmp) if args.raw is None else args.raw
        workdir.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            bases = {}
            for name in names:
                port = free_port()
                cmd = command(name, port, args.kv_mib)
                server = Server(SYSTEMS[name][0], port, cmd, workdir / f"{name}.log")
                stack.callback(server.stop)
                server.start(dict(os.environ), timeout=600)
                bases[name] = server.base_url
            for rep in range(args.repeat):
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    runs[name].append(one_run(bases[name], args, shape, rep))
                    print(f"{name} repetition {rep}: {runs[name][-1]}", flush=True)
    when = f"{started}-{time.strftime('%H:%M', time.gmtime())} UTC"
    write_lines(args.out, report(runs, args, when))
    return 0


if __name__ == "__main__":
    sys.exit(main())
