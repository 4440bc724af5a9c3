"""Issue 17's benchmark point for /v1/responses: chat and Responses on the same prompts.

Why this module exists: the translation to and from the Responses API must
cost under 5% of chat's throughput. One server at a time (Sluice, then vLLM's
own server, with the same engine flags: the demo model unless given), the
same random prompts (128 in, 64 out, `--ignore-eos`) at concurrency 32
through `vllm bench serve` (backends `openai-chat` and `openai-responses`),
alternating the two APIs `--repeat` times. Reported per API: req/s, TTFT p50
and p99, and front CPU per request: the CPU seconds of the server's own
process (not its engine-core child) over the run, divided by the requests.
Thinking is off in both bodies (`chat_template_kwargs` / `reasoning.effort`).

    python -m bench.api_point [--repeat 3] [--prompts 256] [--out bench/results/apis-cpu.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.__main__ import _demo_flags
from bench.report import SLUICE, VLLM
from bench.servers import Server, free_port, server_command
from bench.vllm_client import main as bench_serve

APIS = {
    "chat": (
        "openai-chat",
        "/v1/chat/completions",
        {"chat_template_kwargs": {"enable_thinking": False}},
    ),
    "responses": ("openai-responses", "/v1/responses", {"reasoning": {"effort": "none"}}),
}


def _cpu_seconds(pid: int) -> float:
    """utime + stime of one process (its children, the engine core, excluded)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(server: Server, api: str, tokenizer: str, prompts: int, seed: int, out: Path) -> Any:
    backend, endpoint, body = APIS[api]
    assert server.proc is not None
    cpu0 = _cpu_seconds(server.proc.pid)
    bench_serve(
        [
            "--backend",
            backend,
            "--endpoint",
            endpoint,
            "--base-url",
            server.base_url,
            "--model",
            "sluice-demo",
            "--tokenizer",
            tokenizer,
            "--dataset-name",
            "random",
            "--random-input-len",
            "128",
            "--random-output-len",
            "64",
            "--ignore-eos",
            "--num-prompts",
            str(prompts),
            "--max-concurrency",
            "32",
            "--extra-body",
            json.dumps(body),
            "--seed",
            str(seed),
            "--percentile-metrics",
            "ttft",
            "--metric-percentiles",
            "50,99",
            "--disable-tqdm",
            "--ready-check-timeout-sec",
            "0",
            "--save-result",
            "--result-dir",
            str(out.parent),
            "--result-filename",
            out.name,
        ]
    )
    cpu = _cpu_seconds(server.proc.pid) - cpu0
    result = json.loads(out.read_text())
    done = result["completed"]
    return {
        "req_s": result["request_throughput"],
        "ttft_p50": result["p50_ttft_ms"],
        "ttft_p99": result["p99_ttft_ms"],
        "cpu_ms": 1000 * cpu / max(done, 1),
        "failed": result.get("failed", prompts - done),
    }


def _row(name: str, runs: list[dict[str, Any]]) -> str:
    def cell(key: str, fmt: str) -> str:
        vals = [r[key] for r in runs]
        return f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}-{max(vals):{fmt}}]"

    return (
        f"| {name} | {cell('req_s', '.1f')} | {cell('ttft_p50', '.0f')} | "
        f"{cell('ttft_p99', '.0f')} | {cell('cpu_ms', '.2f')} | {sum(r['failed'] for r in runs)} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("bench/results/apis-cpu.md"))
    ap.add_argument("--systems", default=f"{SLUICE},{VLLM}")
    ns = ap.parse_args()
    flags, tokenizer = _demo_flags()
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="apis-"))
    for system in ns.systems.split(","):
        extra = ["--no-default-thinking"] if system == SLUICE else []
        cmd = server_command(system, free_port(), flags, extra)
        with Server(system, int(cmd[cmd.index("--port") + 1]), cmd, tmp / f"{system}.log") as srv:
            srv.start(dict(os.environ))
            for rep in range(ns.repeat):
                order = list(APIS) if rep % 2 == 0 else list(reversed(APIS))
                for api in order:
                    out = tmp / f"{system}-{api}-{rep}.json"
                    results.setdefault((system, api), []).append(
                        _run(srv, api, tokenizer, ns.prompts, rep, out)
                    )
    lines = [
        "# /v1/responses against chat, and against vLLM's own server (issue 17)",
        "",
        f"`python -m bench.api_point --repeat {ns.repeat} --prompts {ns.prompts}`: the demo "
        "model on CPU, random prompts of 128 tokens in and 64 out (`--ignore-eos`), "
        "concurrency 32, `vllm bench serve` with the `openai-chat` and `openai-responses` "
        "backends, the two APIs alternating; medians [min-max] over the repetitions. "
        "Front CPU: the server process's own CPU time per request (engine core excluded).",
        "",
        "| server / API | req/s | TTFT p50 ms | TTFT p99 ms | front CPU ms/req | failed |",
        "|---|---|---|---|---|---|",
    ]
    lines += [_row(f"{s} {a}", runs) for (s, a), runs in results.items()]
    if (SLUICE, "chat") in results and (SLUICE, "responses") in results:
        chat = statistics.median(r["req_s"] for r in results[(SLUICE, "chat")])
        resp = statistics.median(r["req_s"] for r in results[(SLUICE, "responses")])
        lines += ["", f"Sluice Responses / chat throughput: {resp / chat:.3f}."]
    ns.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
