"""`python -m bench` (and `./scripts/bench`): Sluice vs vLLM's server vs the raw engine.

Usage:

    python -m bench [--quick] [--repeat N] [--scenarios a,b,...] [--model M] [-- ENGINE FLAGS]
    python -m bench apis [--apis chat,ollama] [--systems sluice] ...  # bench/points/api_point.py
    python -m bench network [--configs plain,tls,traces] ...  # bench/points/network_point.py
    python -m bench faults [--repeat 3] [--calm 15]           # bench/points/fault_point.py
    python -m bench batches [--repeat 3] [--lines 500]        # bench/points/batch_point.py
    python -m bench prefix [--repeat 3] [--no-shared]         # bench/points/prefix_point.py
    python -m bench prefix-order [--repeat 3] [--distinct]    # bench/points/prefix_order_point.py

With no --model on a machine without a GPU the offline demo model is built and
served with its measured CPU flags (bfloat16, max_model_len 8192 rather than
the model's 40,960, so the mixed load and the recorded results keep their
sizes, 512 MiB KV cache); everything after `--` is passed unchanged to both servers and the raw
engine. The KV-bound scenarios (noisy_neighbour, mixed_past_capacity) append
their own flags (a KV cache of 16,384 tokens, a 4,096 context), sized with the
model's KV bytes per token (from its config.json, or --kv-bytes-per-token).
Results: bench/results/<name>.md and .png; raw logs and the records
(JSON) under bench/results/raw/<name>/ (git-ignored). `--report-only` re-renders
the Markdown and plot from saved records; `--plot-from-md` only the plot, from
the tables of a committed report (for a run whose raw/ is gone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.log import log
from bench.points import (
    api_point,
    batch_point,
    fault_point,
    network_point,
    prefix_order_point,
    prefix_point,
)
from bench.report.systems import NOHOLD, SLUICE, VLLM
from bench.report.tables import Record
from bench.run.engine_flags import DEMO_NAME, demo_flags, step_flags
from bench.scenarios import (
    DATA_PARALLEL,
    DEFAULT_SCENARIOS,
    FULL,
    KV_BOUND_SCENARIOS,
    QUICK,
    SCENARIOS,
    build_plan,
    kv_bytes_per_token,
)

# The points `python -m bench NAME ...` runs, by name (the rest of the line is theirs).
POINTS: dict[str, Callable[[Sequence[str]], int]] = {
    "apis": api_point.main,  # the APIs against chat
    "network": network_point.main,  # issue 44: TLS and traces against plain
    "faults": fault_point.main,  # issue 41: one model's engine killed beside another
    "batches": batch_point.main,  # issue 42: a batch beside a chat caller
    "prefix": prefix_point.main,  # issue 43: conversations on two ranks, placed by prefix
    "prefix-order": prefix_order_point.main,  # issue 62: shared system prompts, warm order
}


def _flag(flags: Sequence[str], name: str) -> str | None:
    val = None
    for i, a in enumerate(flags):
        if a == name and i + 1 < len(flags):
            val = flags[i + 1]
        elif a.startswith(name + "="):
            val = a.split("=", 1)[1]
    return val


def _model_config(model: str) -> dict[str, object]:
    """A local model's config.json (empty for a hub id: nothing is downloaded here)."""
    cfg = Path(model) / "config.json"
    if cfg.is_file():
        data = json.loads(cfg.read_text())
        if isinstance(data, dict):
            return data
    return {}


def _model_context(model: str) -> int | None:
    v = _model_config(model).get("max_position_embeddings")
    return int(v) if isinstance(v, int | str) and v else None


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    engine: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark Sluice against vLLM's own OpenAI server and the raw engine.",
        epilog="Everything after `--` is passed unchanged to both servers and the raw engine.",
    )
    ap.add_argument("--model", help="model path or hub id (default: the offline demo model)")
    ap.add_argument("--name", help="results name (default: demo-cpu, or the model's name)")
    ap.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)} (default: all but {DATA_PARALLEL})",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny counts, 1 repetition")
    ap.add_argument("--repeat", type=int, help="repetitions per point (default 3; 1 with --quick)")
    ap.add_argument("--input-len", type=int, default=128, help="random prompt length (default 128)")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens (default 64)")
    ap.add_argument(
        "--max-model-len",
        type=int,
        help="context used to scale the mixed load (default: from the flags/model)",
    )
    ap.add_argument(
        "--kv-bytes-per-token",
        type=int,
        help="KV-cache bytes per token, to size the KV-bound scenarios "
        "(default: from the model's config.json, bf16)",
    )
    ap.add_argument(
        "--systems",
        default=f"{SLUICE},{VLLM}",
        help="servers to run, comma-separated (default: sluice,vllm; `sluice` alone "
        "for an A/B of Sluice flags under --name; `nohold` adds Sluice with "
        "--no-hold-backlog)",
    )
    ap.add_argument(
        "--sluice-args",
        default="",
        help="extra `sluice serve` flags for Sluice only (quoted string)",
    )
    ap.add_argument(
        "--background-callers",
        default="",
        help="callers that Sluice's callers file marks background, comma-separated "
        "(e.g. `batch`: the noisy point's flood; issue 49)",
    )
    ap.add_argument("--results-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument(
        "--server-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for a server to become ready",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="re-render <name>.md/.png from raw/<name>/records.json",
    )
    ap.add_argument(
        "--plot-from-md",
        action="store_true",
        help="re-draw <name>.png from the tables of <name>.md (when raw/ is gone)",
    )
    ns = ap.parse_args(argv)
    return ns, engine


def main(argv: Sequence[str] | None = None) -> int:
    import shlex

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] and args[0] in POINTS:
        return POINTS[args[0]](args[1:])
    ns, passthrough = parse_args(args)
    scenarios = [s.strip() for s in ns.scenarios.split(",") if s.strip()]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        print(f"unknown scenarios: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    systems = tuple(s.strip() for s in ns.systems.split(",") if s.strip())
    if not systems or set(systems) - {SLUICE, VLLM, NOHOLD}:
        print(
            f"--systems takes {SLUICE}, {VLLM} and/or {NOHOLD} (Sluice with --no-hold-backlog)",
            file=sys.stderr,
        )
        return 2
    demo = ns.model is None
    name = ns.name or ("demo-cpu" if demo else Path(ns.model.rstrip("/")).name.lower())
    if ns.quick and not ns.name:
        name += "-quick"
    repeat = ns.repeat or (1 if ns.quick else 3)

    from bench.report import markdown as page
    from bench.run import runner as rn

    if ns.plot_from_md:
        print(page.replot_from_markdown(name, ns.results_dir))
        return 0
    if ns.report_only:
        rec_path = ns.results_dir / "raw" / name / "records.json"
        records = [Record.from_json(d) for d in json.loads(rec_path.read_text())]
        path = page.write_report(None, name, ns.results_dir, ns.quick, repeat, records)
        print(path)
        return 0

    env = dict(os.environ)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    if demo:
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        base, tokenizer = demo_flags()
        served = DEMO_NAME
    else:
        base, tokenizer = ["--model", ns.model], ns.model
        served = ns.model
    engine_flags = base + passthrough
    step = step_flags(engine_flags)
    if step:
        log(f"engine step flags Sluice would set, given to every system: {' '.join(step)}")
    engine_flags += step
    served = _flag(engine_flags, "--served-model-name") or served
    tokenizer = _flag(engine_flags, "--tokenizer") or tokenizer
    mml = _flag(engine_flags, "--max-model-len")
    max_model_len = ns.max_model_len or (int(mml) if mml else None) or _model_context(tokenizer)
    if not max_model_len:
        max_model_len = 8192
        log("context length unknown: scaling the mixed load for 8192 (set --max-model-len)")
    bpt = ns.kv_bytes_per_token or kv_bytes_per_token(_model_config(tokenizer))
    if bpt is None and KV_BOUND_SCENARIOS & set(scenarios):
        print(
            "the KV-bound scenarios need the model's KV bytes per token: no local "
            "config.json gives it; pass --kv-bytes-per-token",
            file=sys.stderr,
        )
        return 2
    plan = build_plan(
        scenarios,
        QUICK if ns.quick else FULL,
        max_model_len=max_model_len,
        input_len=ns.input_len,
        output_len=ns.output_len,
        kv_bytes_per_token=bpt,
    )
    cfg = rn.RunConfig(
        name=name,
        results_dir=ns.results_dir,
        engine_flags=engine_flags,
        served_name=served,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        plan=plan,
        repeat=repeat,
        quick=ns.quick,
        sluice_flags=shlex.split(ns.sluice_args),
        background_callers=tuple(c for c in ns.background_callers.split(",") if c),
        systems=systems,
        env=env,
        server_timeout=ns.server_timeout,
    )
    log(
        f"run {name}: {len(plan.points)} comparison points, {len(plan.raw_points)} raw points, "
        f"{len(plan.window_configs)} window configs x {len(plan.window_points)} points, "
        f"{repeat} repetition(s); engine flags: {' '.join(engine_flags)}"
    )
    runner = rn.Runner(cfg)
    try:
        runner.run()
    except KeyboardInterrupt:
        log("interrupted: writing the report from what was measured")
    finally:
        path = page.write_report(runner, name, ns.results_dir, ns.quick, repeat)
        log(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
