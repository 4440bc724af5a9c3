"""Issue 30's embeddings point: one short string per request, closed loop, on
Sluice and on vLLM's own server.

Why this module exists: embeddings are the textbook case for the coalescing
window (many tiny requests, cheap alone, efficient together); the issue's
target is req/s >= 1.2x vLLM's server at concurrency 64 with p99 latency no
worse. One server at a time (Sluice, then vLLM's server, with the same engine
flags: the demo model under `--runner pooling`), `vllm bench serve` with its
`openai-embeddings` backend (random prompts of `--input-len` tokens, one per
request), `--repeat` rounds per server. Reported per server: req/s, latency
p50 and p99 (the whole request: an embedding has no first token), and front
CPU per request (the server process, its engine core excluded).

    python -m bench.points.embed_point [--repeat 3] [--prompts 2048] \
        [--out bench/results/embed-cpu.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.points.api_point import result_args
from bench.report.cells import median, runs_cell, write_lines
from bench.report.systems import SLUICE, VLLM
from bench.run.engine_flags import demo_flags
from bench.run.servers import Server, free_port, process_cpu_seconds, server_command
from bench.run.vllm_client import main as bench_serve

MODEL = "sluice-demo-embed"
POOLING = ["--runner", "pooling", "--convert", "embed"]


def _run(server: Server, args: argparse.Namespace, tokenizer: str, seed: int, out: Path) -> Any:
    assert server.proc is not None
    cpu0 = process_cpu_seconds(server.proc.pid)
    bench_serve(
        [
            "--backend",
            "openai-embeddings",
            "--endpoint",
            "/v1/embeddings",
            "--base-url",
            server.base_url,
            "--model",
            MODEL,
            "--tokenizer",
            tokenizer,
            "--dataset-name",
            "random",
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            "1",
            "--num-prompts",
            str(args.prompts),
            "--max-concurrency",
            str(args.concurrency),
            *result_args(seed, "e2el", out),
        ]
    )
    cpu = process_cpu_seconds(server.proc.pid) - cpu0
    result = json.loads(out.read_text())
    done = result["completed"]
    return {
        "req_s": result["request_throughput"],
        "p50": result["p50_e2el_ms"],
        "p99": result["p99_e2el_ms"],
        "cpu_ms": 1000 * cpu / max(done, 1),
        "failed": result.get("failed", args.prompts - done),
    }


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    lines = [
        "# Embeddings, one short string per request, on Sluice and vLLM's own server (issue 30)",
        "",
        f"`python -m bench.points.embed_point --repeat {args.repeat} --prompts {args.prompts} "
        f"--concurrency {args.concurrency} --input-len {args.input_len}"
        + (f" --sluice-flags '{args.sluice_flags}'" if args.sluice_flags else "")
        + "`: the demo model "
        "under `--runner pooling --convert embed` on CPU, `vllm bench serve` with the "
        "`openai-embeddings` backend, closed loop; medians [min-max] over the repetitions. "
        "Latency is the whole request. Front CPU: the server process's own CPU time per "
        "request (engine core excluded).",
        "",
        "| server | req/s | latency p50 ms | latency p99 ms | front CPU ms/req | failed |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {system} | {runs_cell(runs, 'req_s', '.1f')} | {runs_cell(runs, 'p50', '.0f')} | "
        f"{runs_cell(runs, 'p99', '.0f')} | {runs_cell(runs, 'cpu_ms', '.2f')} | "
        f"{sum(r['failed'] for r in runs)} |"
        for system, runs in results.items()
    ]
    ours, theirs = results.get(SLUICE), results.get(VLLM)
    if ours and theirs:
        rps = median(ours, "req_s") / median(theirs, "req_s")
        p99 = median(ours, "p99") / median(theirs, "p99")
        lines += [
            "",
            f"* req/s {rps:.2f}x vLLM's server (target >= 1.2x); p99 {p99:.2f}x (target <= 1.0x).",
        ]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("bench/results/embed-cpu.md"))
    ap.add_argument("--systems", default=f"{SLUICE},{VLLM}")
    ap.add_argument(
        "--sluice-flags", default="", help="Sluice's own flags, e.g. '--window-ms 0' (one string)"
    )
    args = ap.parse_args()
    flags, tokenizer = demo_flags()
    flags[flags.index("--served-model-name") + 1] = MODEL
    flags += POOLING
    results: dict[str, list[dict[str, Any]]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="embed-"))
    for system in args.systems.split(","):
        own = args.sluice_flags.split() if system == SLUICE else []
        cmd = server_command(system, free_port(), flags, own)
        with Server(system, int(cmd[cmd.index("--port") + 1]), cmd, tmp / f"{system}.log") as srv:
            srv.start(dict(os.environ))
            for rep in range(args.repeat):
                out = tmp / f"{system}-{rep}.json"
                results.setdefault(system, []).append(_run(srv, args, tokenizer, rep, out))
    lines = report(results, args)
    write_lines(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
