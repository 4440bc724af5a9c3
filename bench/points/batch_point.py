"""Issue 42's batch point: a chat batch through /v1/batches, alone and beside a chat
caller, against the same lines sent closed loop and against `vllm run-batch`.

Why this module exists: a batch should run in the room interactive callers
leave, at the engine's pace. The issue's targets: the chat caller's TTFT p95
beside the batch <= 1.5x alone; the batch's lines per second >= 0.95x the
same lines sent to Sluice closed loop at saturation by a client, and >= 0.9x
`vllm run-batch` on the same file with the same engine flags (the offline
limit: no HTTP, every line submitted at once).

One Sluice (the demo model, eager) serves all Sluice phases; per repetition,
in turn: the chat caller alone (`--turns` streamed turns, TTFT at the first
token-carrying chunk); the batch alone, once the caller's turns no longer cap the
engine's steps (their linger), from upload and create, polled every 0.1 s until
completed (lines per second from create to completed); the batch beside the
chat caller; the same lines' bodies sent directly, `--concurrency` at a time
(closed loop). Then `vllm run-batch` on the same file, timed from its
"Reading batch" line to its "Writing outputs" line (its engine start not
counted). With `--vllm-priority`, each repetition also runs vLLM's own server with
`--scheduling-policy priority` and the same engine flags: the chat caller alone,
then beside the same lines sent closed loop at a lower priority (`"priority": 1`
in each body; the chat's 0 goes first), the nearest vLLM comes to a batch that
yields to chat (issue 49's comparison).

    ./scripts/bench batches [--repeat 3] [--lines 500] [--max-tokens 16] [--concurrency 256]
        [--vllm-priority]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from batching.step_share import LINGER_S
from bench.report.cells import percentile, runs_cell, spread_cell, write_lines
from bench.report.systems import SLUICE, VLLM
from bench.run.chat_turn import Caller
from bench.run.engine_flags import DEMO_NAME, demo_flags, drop_flags, step_flags
from bench.run.servers import Server, free_port, server_command

CHAT = "/v1/chat/completions"
# Past the linger: the last turn's end reaches the engine a step or two late.
_SETTLE_S = 0.5


def lines(n: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"l{i}",
            "method": "POST",
            "url": CHAT,
            "body": {
                "model": DEMO_NAME,
                "messages": [{"role": "user", "content": f"Summarize item {i} in a line."}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        }
        for i in range(n)
    ]


def run_batch_api(base: str, data: bytes, n: int) -> float:
    """Lines per second of one batch through /v1/files and /v1/batches."""

    async def go() -> float:
        async with aiohttp.ClientSession(base) as s:
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", data, filename="in.jsonl")
            async with s.post("/v1/files", data=form) as r:
                file_id = (await r.json())["id"]
            t0 = time.monotonic()
            body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
            async with s.post("/v1/batches", json=body) as r:
                batch_id = (await r.json())["id"]
            while True:
                async with s.get(f"/v1/batches/{batch_id}") as r:
                    batch = await r.json()
                if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                    break
                await asyncio.sleep(0.1)
            took = time.monotonic() - t0
            counts = batch["request_counts"]
            if batch["status"] != "completed" or counts["completed"] != n:
                raise RuntimeError(f"the batch ended {batch['status']}: {counts}")
            return n / took

    return asyncio.run(go())


def run_closed_loop(base: str, bodies: list[bytes], concurrency: int) -> float:
    """Lines per second of the same bodies sent directly, `concurrency` at a time."""

    async def go() -> float:
        todo = iter(bodies)
        conn = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(base, connector=conn) as s:

            async def worker() -> None:
                for body in todo:
                    headers = {"content-type": "application/json"}
                    async with s.post(CHAT, data=body, headers=headers) as r:
                        await r.read()
                        if r.status != 200:
                            raise RuntimeError(f"a line answered {r.status}")

            t0 = time.monotonic()
            async with asyncio.TaskGroup() as tg:
                for _ in range(concurrency):
                    tg.create_task(worker())
            return len(bodies) / (time.monotonic() - t0)

    return asyncio.run(go())


def run_vllm_batch(path: Path, workdir: Path, n: int) -> float:
    """Lines per second of `vllm run-batch` on the file, engine start excluded."""
    flags, _ = demo_flags()
    flags = drop_flags(flags, "--reasoning-parser", "--structured-outputs-config")
    out = workdir / "run-batch-out.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.run_batch",
        "-i",
        str(path),
        "-o",
        str(out),
        *flags,
        "--enforce-eager",
    ]
    marks: dict[str, float] = {}
    with (workdir / "run-batch.log").open("ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0
        )
        assert proc.stdout is not None
        for raw in proc.stdout:
            log.write(raw)
            text = raw.decode(errors="replace")
            if "Reading batch from" in text:
                marks.setdefault("read", time.monotonic())
            if "Writing outputs" in text:
                marks.setdefault("written", time.monotonic())
        proc.wait(60)
    done = sum(1 for x in out.read_text().splitlines() if json.loads(x)["error"] is None)
    if proc.returncode != 0 or done != n or len(marks) != 2:
        raise RuntimeError(f"vllm run-batch: rc {proc.returncode}, {done}/{n} lines; see log")
    return n / (marks["written"] - marks["read"])


def one_repetition(base: str, args: argparse.Namespace, data: bytes, bodies: list[bytes]) -> Any:
    n = args.lines
    with Caller(base, DEMO_NAME) as alone:
        alone.wait_turns(args.turns)
    # Alone means past the chat caller's linger too: for LINGER_S after a turn the
    # engine still caps background steps for its next one (batching/step_share.py
    # rule 1). Measured right after the caller, the batch paid that second of
    # capped steps (2026-12-06: 0.82-0.91x the closed loop against 0.94-0.99x
    # after the wait, bench/results/interactive-first-cpu.md).
    time.sleep(LINGER_S + _SETTLE_S)
    batch_alone = run_batch_api(base, data, n)
    with Caller(base, DEMO_NAME) as beside:
        batch_beside = run_batch_api(base, data, n)
    closed = run_closed_loop(base, bodies, args.concurrency)
    ttft = {
        "alone": [1000 * t for _, t in alone.turns],
        "beside": [1000 * t for _, t in beside.turns],
    }
    return {
        "chat_alone_p95": percentile(ttft["alone"], 95),
        "chat_beside_p95": percentile(ttft["beside"], 95),
        "chat_beside_turns": len(ttft["beside"]),
        "chat_failed": len(alone.failed) + len(beside.failed),
        "batch_alone": batch_alone,
        "batch_beside": batch_beside,
        "closed_loop": closed,
    }


def vllm_priority_repetition(
    port: int, workdir: Path, args: argparse.Namespace, bodies: list[bytes]
) -> dict[str, Any]:
    """vLLM's server with `--scheduling-policy priority`: the chat caller alone, then
    beside the lines closed loop at priority 1 (vLLM runs lower values first)."""
    flags, _ = demo_flags()
    flags += step_flags(flags)
    cmd = server_command(VLLM, port, [*flags, "--enforce-eager", "--scheduling-policy", "priority"])
    low = [orjson.dumps({**orjson.loads(b), "priority": 1}) for b in bodies]
    with Server(VLLM, port, cmd, workdir / "vllm-priority.log") as server:
        server.start(dict(os.environ))
        run_closed_loop(server.base_url, low[:64], 64)  # warm
        with Caller(server.base_url, DEMO_NAME) as alone:
            alone.wait_turns(args.turns)
        with Caller(server.base_url, DEMO_NAME) as beside:
            lines_s = run_closed_loop(server.base_url, low, args.concurrency)
    a = [1000 * t for _, t in alone.turns]
    b = [1000 * t for _, t in beside.turns]
    return {
        "chat_alone_p95": percentile(a, 95),
        "chat_beside_p95": percentile(b, 95) if b else float("nan"),
        "chat_beside_turns": len(b),
        "chat_failed": len(alone.failed) + len(beside.failed),
        "lines_beside": lines_s,
    }


def vllm_table(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    ratio = [r["chat_beside_p95"] / r["chat_alone_p95"] for r in runs]
    return [
        "| | lines/s | chat TTFT p95 ms | chat turns beside |",
        "|---|---|---|---|",
        f"| chat caller alone | | {runs_cell(runs, 'chat_alone_p95', '.0f')} | |",
        f"| the lines at priority 1, closed loop c={args.concurrency}, beside the chat "
        f"caller | {runs_cell(runs, 'lines_beside', '.1f')} "
        f"| {runs_cell(runs, 'chat_beside_p95', '.0f')} "
        f"| {', '.join(str(r['chat_beside_turns']) for r in runs)} |",
        "",
        f"* chat TTFT p95 beside the lines: {spread_cell(ratio, '.2f')}x alone; "
        f"{sum(int(r['chat_failed']) for r in runs)} failed chat turns. A turn that had "
        "not begun when the lines ended is not counted.",
    ]


def report(
    runs: list[dict[str, Any]],
    raw: list[float],
    args: argparse.Namespace,
    against: list[dict[str, Any]] | None = None,
    vllm: list[dict[str, Any]] | None = None,
) -> list[str]:
    against_note = (
        f" Each repetition also ran a second Sluice with `{args.against_args}` in place of "
        "the first's own flags, right after the first (the same machine, the same minutes): "
        "its table follows."
        if against is not None
        else ""
    )
    lines_ = [
        "# A chat batch through /v1/batches, beside a chat caller (issue 42)",
        "",
        f"`./scripts/bench batches --repeat {args.repeat} --lines {args.lines} --max-tokens "
        f"{args.max_tokens} --concurrency {args.concurrency}"
        + (f" --in-flight {args.in_flight}" if args.in_flight else "")
        + (f" --sluice-args '{args.sluice_args}'" if args.sluice_args else "")
        + (f" --against-args '{args.against_args}'" if args.against_args else "")
        + (" --vllm-priority" if args.vllm_priority else "")
        + "`: one Sluice on the demo model "
        "(eager) on this machine's CPU; each line a chat request of "
        f"{args.max_tokens} tokens (`ignore_eos`). Per repetition: the chat caller alone, "
        "the batch alone, the batch beside the chat caller, the same lines sent closed "
        f"loop at c={args.concurrency}; then `vllm run-batch` on the same file and engine "
        "flags (its engine start not counted). Medians [min-max] over the repetitions."
        + against_note,
        "",
        *table(runs, raw, args),
    ]
    if against is not None:
        lines_ += ["", f"## With `{args.against_args}`", "", *table(against, raw, args)]
    if vllm:
        lines_ += [
            "",
            "## vLLM's server, `--scheduling-policy priority`",
            "",
            "The same engine flags; per repetition, after Sluice's: the chat caller alone, "
            'then beside the same lines sent closed loop with `"priority": 1` (the '
            "chat's 0 goes first in vLLM's waiting queue).",
            "",
            *vllm_table(vllm, args),
        ]
    return lines_


def table(runs: list[dict[str, Any]], raw: list[float], args: argparse.Namespace) -> list[str]:
    def col(key: str) -> list[float]:
        return [float(r[key]) for r in runs]

    beside_ratio = [r["chat_beside_p95"] / r["chat_alone_p95"] for r in runs]
    vs_closed = [r["batch_alone"] / r["closed_loop"] for r in runs]
    vs_alone = [r["batch_beside"] / r["batch_alone"] for r in runs]
    vs_raw = statistics.median(col("batch_alone")) / statistics.median(raw)
    return [
        "| | lines/s | chat TTFT p95 ms |",
        "|---|---|---|",
        f"| chat caller alone | | {runs_cell(runs, 'chat_alone_p95', '.0f')} |",
        f"| the batch alone | {runs_cell(runs, 'batch_alone', '.1f')} | |",
        f"| the batch beside the chat caller | {runs_cell(runs, 'batch_beside', '.1f')} "
        f"| {runs_cell(runs, 'chat_beside_p95', '.0f')} |",
        f"| the same lines closed loop, c={args.concurrency} "
        f"| {runs_cell(runs, 'closed_loop', '.1f')} | |",
        f"| `vllm run-batch` | {spread_cell(raw, '.1f')} | |",
        "",
        f"* chat TTFT p95 beside the batch: {spread_cell(beside_ratio, '.2f')}x alone "
        "(target <= 1.5x); "
        f"{sum(int(r['chat_failed']) for r in runs)} failed chat turns.",
        f"* the batch's lines/s beside the chat caller: {spread_cell(vs_alone, '.2f')}x alone "
        "(target >= 0.85x).",
        f"* the batch's lines/s: {spread_cell(vs_closed, '.2f')}x the same lines closed loop "
        f"(target >= 0.95x), {vs_raw:.2f}x `vllm run-batch` (target >= 0.9x).",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench batches", description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lines", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=256, help="the closed loop's")
    ap.add_argument(
        "--in-flight", type=int, help="the batch's --batch-lines-in-flight (default: --concurrency)"
    )
    ap.add_argument("--turns", type=int, default=40, help="the chat caller's turns alone")
    ap.add_argument("--out", type=Path, default=Path("bench/results/batches-cpu.md"))
    ap.add_argument("--raw", type=Path, help="keep the servers' logs here")
    ap.add_argument(
        "--sluice-args",
        default="",
        help="more `sluice serve` flags (one string), e.g. '--scheduling-policy priority'",
    )
    ap.add_argument(
        "--against-args",
        help="a second Sluice's flags in place of --sluice-args, run after the first in "
        "each repetition (an A/B in one run), e.g. '--no-interactive-first'",
    )
    ap.add_argument(
        "--vllm-priority",
        action="store_true",
        help="each repetition also runs vLLM's server with --scheduling-policy priority, "
        "the lines at a lower priority beside the chat caller",
    )
    args = ap.parse_args(argv)
    batch = lines(args.lines, args.max_tokens)
    data = b"".join(orjson.dumps(x) + b"\n" for x in batch)
    bodies = [orjson.dumps(x["body"]) for x in batch]
    with tempfile.TemporaryDirectory(prefix="sluice-batches-") as tmp:
        workdir = Path(tmp) if args.raw is None else args.raw
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "in.jsonl").write_bytes(data)
        port = free_port()

        def command(flags: str) -> list[str]:
            return server_command(
                SLUICE,
                port,
                ["--enforce-eager"],
                [
                    "--state-dir",
                    str(workdir / "state"),
                    "--batch-lines-in-flight",
                    str(args.in_flight or args.concurrency),
                    *flags.split(),
                ],
            )

        configs: list[tuple[str, str, list[dict[str, Any]]]] = [("sluice", args.sluice_args, [])]
        against: list[dict[str, Any]] = []
        if args.against_args is not None:
            configs.append(("against", args.against_args, against))
        runs: list[dict[str, Any]] = configs[0][2]
        raw: list[float] = []
        vllm: list[dict[str, Any]] = []
        for _ in range(args.repeat):
            for name, flags, kept in configs:
                with Server(SLUICE, port, command(flags), workdir / f"{name}.log") as server:
                    server.start(dict(os.environ))
                    run_closed_loop(server.base_url, bodies[:64], 64)  # warm
                    kept.append(one_repetition(server.base_url, args, data, bodies))
                    print(f"{name} repetition: {kept[-1]}", flush=True)
            raw.append(run_vllm_batch(workdir / "in.jsonl", workdir, args.lines))
            print(f"vllm run-batch: {raw[-1]:.1f} lines/s", flush=True)
            if args.vllm_priority:
                vllm.append(vllm_priority_repetition(port, workdir, args, bodies))
                print(f"vllm priority repetition: {vllm[-1]}", flush=True)
    kept_against = against if args.against_args else None
    write_lines(args.out, report(runs, raw, args, kept_against, vllm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
