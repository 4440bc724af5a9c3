"""Issues 17 and 31's benchmark point: chat, Responses, Anthropic Messages and
Ollama's chat on the same prompts.

Why this module exists: the translation to and from the Responses and the
Messages API must cost under 5% of chat's throughput, and Ollama's chat
under 5% of its req/s and 10% of its front CPU. One server at a time
(Sluice, then vLLM's own server, which serves all but Ollama's API, with the
same engine flags: the demo model unless given), the same random prompts (128
in, 64 out, `ignore_eos`) at concurrency 32 through `vllm bench serve`
(backends `openai-chat`, `openai-responses`, bench/run/messages_backend.py's
`anthropic-messages` and bench/run/ollama_backend.py's `ollama-chat`), the APIs
in a rotated order each of the `--repeat` rounds. Reported per API: req/s,
TTFT p50 and p99 (every client times the first token: chat's role frame goes
out with it on both servers), output tokens per request, and front CPU per
request: the CPU seconds of the server's own process (not its engine-core
child) over the run, divided by the requests. Thinking is off in every body
(`chat_template_kwargs` / `reasoning.effort` / `thinking.type` / `think`).

    python -m bench.points.api_point [--repeat 3] [--prompts 256] [--out bench/results/apis-cpu.md]
    ./scripts/bench apis [--apis chat,ollama --systems sluice ...]   # the same
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.report.cells import median, runs_cell, write_lines
from bench.report.systems import SLUICE, VLLM
from bench.run.engine_flags import demo_flags
from bench.run.servers import Server, free_port, server_command
from bench.run.vllm_client import main as bench_serve

APIS = {
    "chat": (
        "openai-chat",
        "/v1/chat/completions",
        {"chat_template_kwargs": {"enable_thinking": False}},
    ),
    "responses": ("openai-responses", "/v1/responses", {"reasoning": {"effort": "none"}}),
    "messages": ("anthropic-messages", "/v1/messages", {"thinking": {"type": "disabled"}}),
    "ollama": ("ollama-chat", "/api/chat", {"think": False}),
}
# The APIs whose translation is priced against chat (issue 17: under 5% of its
# req/s; issue 31: Ollama's also within 10% of its front CPU per request).
TRANSLATED = ("responses", "messages", "ollama")
CPU_BUDGET = {"ollama": 0.10}
# What a server does not speak: vLLM's has no Ollama API.
UNSPOKEN = {VLLM: frozenset({"ollama"})}


def result_args(seed: int, metric: str, out: Path) -> list[str]:
    """`vllm bench serve`'s flags for one seeded run whose `metric` percentiles
    (p50, p99) are saved as JSON to `out`, quietly, on a server already ready."""
    return [
        "--seed",
        str(seed),
        "--percentile-metrics",
        metric,
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


def _run(server: Server, api: str, tokenizer: str, prompts: int, seed: int, out: Path) -> Any:
    backend, endpoint, body = APIS[api]
    cpu0 = server.cpu_seconds()
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
            *result_args(seed, "ttft", out),
        ]
    )
    cpu = server.cpu_seconds() - cpu0
    result = json.loads(out.read_text())
    done = result["completed"]
    return {
        "req_s": result["request_throughput"],
        "ttft_p50": result["p50_ttft_ms"],
        "ttft_p99": result["p99_ttft_ms"],
        "cpu_ms": 1000 * cpu / max(done, 1),
        # vLLM's own /v1/messages drops `ignore_eos`: this column shows whether
        # an API's answers ran to the 64 tokens asked for.
        "out_tok": result["total_output_tokens"] / max(done, 1),
        "failed": result.get("failed", prompts - done),
    }


def _row(name: str, runs: list[dict[str, Any]]) -> str:
    def cell(key: str, fmt: str) -> str:
        return runs_cell(runs, key, fmt)

    return (
        f"| {name} | {cell('req_s', '.1f')} | {cell('ttft_p50', '.0f')} | "
        f"{cell('ttft_p99', '.0f')} | {cell('out_tok', '.1f')} | {cell('cpu_ms', '.2f')} | "
        f"{sum(r['failed'] for r in runs)} |"
    )


def translation_cost(results: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    """One line per translated API and server: its median req/s over chat's,
    and its front CPU per request against chat's (the 5% budget is on req/s)."""
    lines = []
    for system in dict.fromkeys(s for s, _ in results):
        chat = results.get((system, "chat"))
        for api in TRANSLATED:
            runs = results.get((system, api))
            if not chat or not runs:
                continue
            ratio = median(runs, "req_s") / median(chat, "req_s")
            cpu, cpu_chat = median(runs, "cpu_ms"), median(chat, "cpu_ms")
            extra = cpu / cpu_chat - 1
            budget = CPU_BUDGET.get(api)
            cpu_verdict = (
                ""
                if budget is None
                else f", {'within' if extra <= budget else 'over'} the {budget:.0%} budget"
            )
            lines.append(
                f"* {system} {api} / chat: req/s {ratio:.3f}x "
                f"({'within' if ratio >= 0.95 else 'over'} the 5% budget); front CPU "
                f"{cpu:.2f} against {cpu_chat:.2f} ms/req ({100 * extra:+.1f}%{cpu_verdict})."
            )
    return lines


def report(
    results: dict[tuple[str, str], list[dict[str, Any]]],
    repeat: int,
    prompts: int,
    apis: Sequence[str] = tuple(APIS),
    systems: Sequence[str] = (SLUICE, VLLM),
) -> list[str]:
    """The Markdown result: the table over servers x APIs, then the translation cost."""
    lines = [
        "# Chat, Responses, Anthropic Messages and Ollama's chat, on Sluice and vLLM's "
        "own server (issues 17 and 31)",
        "",
        f"`python -m bench.points.api_point --repeat {repeat} --prompts {prompts} --apis "
        f"{','.join(apis)} --systems {','.join(systems)}`: the demo "
        "model on CPU, random prompts of 128 tokens in and 64 out (`ignore_eos`), "
        "concurrency 32, `vllm bench serve` with the `openai-chat`, `openai-responses`, "
        "`anthropic-messages` (bench/run/messages_backend.py) and `ollama-chat` "
        "(bench/run/ollama_backend.py; Sluice only) backends, the APIs in a "
        "rotated order each round; medians [min-max] over the repetitions. TTFT is the "
        "first token on every API (chat's role frame goes out with it, Responses' first "
        "text delta, Messages' first text or thinking `content_block_delta`, Ollama's "
        "first line with content or thinking), so it "
        "compares across APIs. Front CPU: the server process's own CPU time per request "
        "(engine core excluded). Output tok/req: vLLM's own /v1/messages drops "
        "`ignore_eos`, so its answers may stop early at EOS.",
        "",
        "| server / API | req/s | TTFT p50 ms | TTFT p99 ms | output tok/req "
        "| front CPU ms/req | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_row(f"{s} {a}", runs) for (s, a), runs in results.items()]
    cost = translation_cost(results)
    if cost:
        lines += ["", "Translation cost against chat (medians):", "", *cost]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("bench/results/apis-cpu.md"))
    ap.add_argument("--systems", default=f"{SLUICE},{VLLM}")
    ap.add_argument("--apis", default=",".join(APIS), help="a subset of " + ",".join(APIS))
    ns = ap.parse_args(argv)
    chosen = [a for a in ns.apis.split(",") if a]
    if set(chosen) - set(APIS):
        ap.error(f"--apis takes {','.join(APIS)}")
    flags, tokenizer = demo_flags()
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="apis-"))
    for system in ns.systems.split(","):
        extra = ["--no-default-thinking"] if system == SLUICE else []
        cmd = server_command(system, free_port(), flags, extra)
        with Server(system, int(cmd[cmd.index("--port") + 1]), cmd, tmp / f"{system}.log") as srv:
            srv.start(dict(os.environ))
            apis = [a for a in chosen if a not in UNSPOKEN.get(system, ())]
            for rep in range(ns.repeat):
                # Rotated so each API runs first, second and third once in 3 rounds.
                for api in apis[rep % len(apis) :] + apis[: rep % len(apis)]:
                    out = tmp / f"{system}-{api}-{rep}.json"
                    results.setdefault((system, api), []).append(
                        _run(srv, api, tokenizer, ns.prompts, rep, out)
                    )
    lines = report(results, ns.repeat, ns.prompts, chosen, ns.systems.split(","))
    write_lines(ns.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
