"""The raw engine ceiling: the benchmark's prompts through an in-process AsyncLLM.

Why it exists: it says how fast the engine goes with no HTTP and no front end at
all, so a server's figure can be read as a fraction of what is possible. Same
engine flags as the servers (parsed by vLLM's own engine-argument parser), same
prompts (drawn by the benchmark client's own dataset code from the same client
flags and seed), same concurrency (an asyncio semaphore), streaming outputs in
DELTA mode, `ignore_eos` and the model's default sampling parameters, as the
servers apply them to requests that set none.

Run as a subprocess (vLLM spawns engine processes, hence the main guard):

    python bench/run/raw_engine.py --jobs jobs.json --out out.json -- <engine flags>

jobs.json: a list of {"point", "rep", "concurrency", "client_args": [...]}, the
client flags exactly as given to `vllm bench serve` for that point and rep.
out.json: a list of {"point", "rep", "metrics": {req_s, out_tok_s, ttft_p50,
ttft_p95, ttft_p99, completed, failed, duration_s}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any


def _percentile(values: list[float], p: float) -> float:
    import numpy as np

    return float(np.percentile(values, p)) if values else float("nan")


def _samples(client_args: list[str]) -> tuple[list[Any], Any]:
    import random

    import numpy as np
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(client_args)
    # As vllm.benchmarks.serve.main_async does before sampling.
    random.seed(args.seed)
    np.random.seed(args.seed)
    tokenizer = get_tokenizer(
        args.tokenizer or args.model,
        tokenizer_mode=args.tokenizer_mode,
        trust_remote_code=args.trust_remote_code,
    )
    return get_samples(args, tokenizer), args


async def _run_point(llm: Any, job: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    samples, args = _samples(list(job["client_args"]))
    conc = int(job["concurrency"])
    sem = asyncio.Semaphore(conc)
    ttfts: list[float] = []
    out_tokens = 0
    failed = 0

    async def one(i: int, sample: Any) -> None:
        nonlocal out_tokens, failed
        params = SamplingParams(
            **{
                **defaults,
                "max_tokens": int(sample.expected_output_len),
                "ignore_eos": bool(args.ignore_eos),
                "output_kind": RequestOutputKind.DELTA,
            }
        )
        async with sem:
            t0 = time.perf_counter()
            first = True
            n = 0
            try:
                # The prompt as the servers get it (text, tokenized by the engine).
                async for out in llm.generate(sample.prompt, params, f"raw-{job['rep']}-{i}"):
                    if first and out.outputs and out.outputs[0].token_ids:
                        ttfts.append(time.perf_counter() - t0)
                        first = False
                    if out.outputs:
                        n += len(out.outputs[0].token_ids)
            except Exception:
                failed += 1
                return
            out_tokens += n

    t_start = time.perf_counter()
    await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
    duration = time.perf_counter() - t_start
    completed = len(samples) - failed
    ms = [t * 1000 for t in ttfts]
    return {
        "point": job["point"],
        "rep": job["rep"],
        "metrics": {
            "req_s": completed / duration,
            "out_tok_s": out_tokens / duration,
            "ttft_p50": _percentile(ms, 50),
            "ttft_p95": _percentile(ms, 95),
            "ttft_p99": _percentile(ms, 99),
            "completed": float(completed),
            "failed": float(failed),
            "duration_s": duration,
        },
    }


async def _main(jobs: list[dict[str, Any]], engine_flags: list[str]) -> list[dict[str, Any]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    parser = FlexibleArgumentParser()
    parser = AsyncEngineArgs.add_cli_args(parser)
    engine_args = AsyncEngineArgs.from_cli_args(parser.parse_args(engine_flags))
    t0 = time.monotonic()
    llm = AsyncLLM.from_engine_args(engine_args)
    print(f"raw engine ready in {time.monotonic() - t0:.1f} s", flush=True)
    try:
        defaults = llm.model_config.get_diff_sampling_param()
        # Warm-up: one short request, as both servers get one before being timed.
        from vllm import SamplingParams

        async for _ in llm.generate("warm up", SamplingParams(max_tokens=4), "raw-warmup"):
            pass
        results = []
        for job in jobs:
            res = await _run_point(llm, job, defaults)
            print(json.dumps(res), flush=True)
            results.append(res)
        return results
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_flags: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine_flags = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--jobs", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ns = ap.parse_args(argv)
    jobs = json.loads(ns.jobs.read_text())
    results = asyncio.run(_main(jobs, engine_flags))
    ns.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
