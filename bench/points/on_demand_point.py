"""Issue 30's on-demand point: from a request for an unloaded model to its first
token, against a cold `vllm serve` start of the same model.

Why this module exists: an on-demand model (`load = "on-demand"` in the models
file) starts its engine when its first request arrives, and that request waits
in Sluice's backlog meanwhile (server/engines/loader.py). What a caller waits
is the engine's start plus one turn; the alternative on a workstation is to
start `vllm serve` for the model when it is needed, which waits for a process
start, the same engine start and its API server. Per repetition, alternating:

- Sluice: one Sluice serves `chat` at start and `spare` on demand (the demo
  model, eager, a 64 MiB KV cache); a streamed turn to `spare` from the
  moment it is sent to its first token (then the Sluice stops, so the next
  repetition's `spare` is cold again);
- vLLM's server with the same engine flags: from `Popen` to its first answer
  on /health (polled every 0.5 s), plus the first streamed turn's first token.

    python -m bench.points.on_demand_point [--repeat 3] [--out bench/results/on-demand-cpu.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from bench.points.models_point import MODELS  # chat at start, spare on demand
from bench.report.cells import spread_cell, write_lines
from bench.report.systems import SLUICE, VLLM
from bench.run.engine_flags import demo_flags
from bench.run.servers import Server, free_port, server_command


def first_token(base: str, model: str) -> float:
    """Seconds from sending one streamed chat turn to its first token."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "stream": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    t0 = time.monotonic()
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = orjson.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    return time.monotonic() - t0
    raise RuntimeError("a turn without a token")


def sluice_on_demand(workdir: Path) -> float:
    models = workdir / "models.toml"
    models.write_text(MODELS)
    port = free_port()
    cmd = server_command(SLUICE, port, [], ["--models", str(models), "--load-timeout", "900"])
    with Server(SLUICE, port, cmd, workdir / "sluice.log") as server:
        server.start(dict(os.environ), timeout=900)
        return first_token(server.base_url, "spare")


def vllm_cold(workdir: Path) -> float:
    flags, _ = demo_flags()
    flags[flags.index("--served-model-name") + 1] = "spare"
    flags[flags.index("--max-model-len") + 1] = "4096"
    flags[flags.index("--kv-cache-memory-bytes") + 1] = "67108864"
    flags.append("--enforce-eager")
    port = free_port()
    with Server(VLLM, port, server_command(VLLM, port, flags), workdir / "vllm.log") as server:
        server.start(dict(os.environ), timeout=900)
        return server.start_seconds + first_token(server.base_url, "spare")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/on-demand-cpu.md"))
    args = ap.parse_args()
    runs: dict[str, list[float]] = {SLUICE: [], VLLM: []}
    with tempfile.TemporaryDirectory(prefix="sluice-on-demand-") as tmp:
        for rep in range(args.repeat):
            order = (SLUICE, VLLM) if rep % 2 == 0 else (VLLM, SLUICE)
            for system in order:
                work = Path(tmp) / f"{system}-{rep}"
                work.mkdir()
                run = sluice_on_demand if system == SLUICE else vllm_cold
                runs[system].append(run(work))

    def cell(v: list[float]) -> str:
        return spread_cell(v, ".1f")

    ratio = statistics.median(runs[SLUICE]) / statistics.median(runs[VLLM])
    lines = [
        "# First token of an on-demand model against a cold `vllm serve` (issue 30)",
        "",
        f"`python -m bench.points.on_demand_point --repeat {args.repeat}`: the demo model, eager, "
        "64 MiB of KV cache, on this machine's CPU; systems alternate per repetition; "
        "seconds, median [min-max].",
        "",
        "| path | seconds to the first token |",
        "|---|---|",
        f"| Sluice: a request to an unloaded on-demand model | {cell(runs[SLUICE])} |",
        f"| `vllm serve` started cold, then the same request | {cell(runs[VLLM])} |",
        "",
        f"* Sluice's on-demand first token: {ratio:.2f}x a cold `vllm serve`.",
    ]
    write_lines(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
