"""vLLM's in-process output path: CPU per request, with and without what Sluice trims.

Why it exists (issue 27, item 3): in Sluice's process, as in vLLM's own server's,
vLLM's engine client turns every engine step's outputs into per-request
`RequestOutput`s (decode, detokenize, statistics, the hand-off to each
request's collector). server/engines/vllm_adapter.py's `lighten_output_path` takes out of
that path what Sluice never uses (uncached environment reads, vLLM's
Prometheus logger). This prices the path with a consumer that only reads its
outputs, no HTTP: an in-process `AsyncLLM` on the benchmark's engine flags (the
demo model unless `-- FLAGS` say otherwise), closed-loop streams of random
token-id prompts with `ignore_eos`, one engine per variant and repetition, the
variants alternated. Reported: this process's CPU time (all threads; the engine
cores are child processes and are not counted) per completed request.

    python -m bench.points.output_path_bench [--points 128x128x64,512x64x32] [--repeat 3] [-- FLAGS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

VARIANTS = ("vllm", "lightened")


async def _point(llm: Any, vocab: int, concurrency: int, prompt: int, output: int, n: int) -> float:
    """`n` closed-loop requests, `concurrency` at a time; this process's CPU seconds."""
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind

    rnd = random.Random(concurrency)
    sem = asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=output, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def one(i: int) -> None:
        ids = [rnd.randrange(100, vocab) for _ in range(prompt)]
        async with sem:
            async for _ in llm.generate(tokens_input(ids), params, f"c{concurrency}-{i}"):
                pass

    cpu0 = time.process_time()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.process_time() - cpu0


async def _variant(variant: str, flags: list[str], points: list[tuple[int, int, int, int]]) -> Any:
    """One engine built as Sluice builds it (its stat logger included), lightened
    or not, through every point."""
    from vllm import SamplingParams, envs
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from server.engines.vllm_adapter import (
        _build_engine,
        _stat_logger_factory,
        _StatsBox,
        lighten_output_path,
    )

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(flags))
    llm = _build_engine(args, _stat_logger_factory(_StatsBox()), None)
    try:
        if variant == "lightened":
            lighten_output_path(llm)
        else:
            envs.disable_envs_cache()  # an earlier lightened engine's, in this process
        vocab = min(int(llm.model_config.get_vocab_size()), 30_000)
        async for _ in llm.generate("warm up", SamplingParams(max_tokens=4), "warm-up"):
            pass
        out = []
        for concurrency, prompt, output, n in points:
            cpu = await _point(llm, vocab, concurrency, prompt, output, n)
            out.append(
                {
                    "variant": variant,
                    "point": f"c={concurrency} ({prompt} in, {output} out)",
                    "cpu_ms_per_request": 1000 * cpu / n,
                }
            )
            print(json.dumps(out[-1]), flush=True)
        return out
    finally:
        llm.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument(
        "--points",
        default="128x128x64,512x64x32",
        help="CONCURRENCYxPROMPTxOUTPUT,... (the sweep's c=128 and the c=512 point)",
    )
    ap.add_argument("--requests", default="512,1536", help="requests per point, in order")
    ap.add_argument("--repeat", type=int, default=3)
    ns = ap.parse_args(argv)
    dims = [tuple(int(x) for x in p.split("x")) for p in ns.points.split(",")]
    counts = [int(x) for x in ns.requests.split(",")]
    if len(counts) != len(dims) or any(len(d) != 3 for d in dims):
        ap.error("--points takes CxPxO triples and --requests one count per point")
    points = [(c, p, o, n) for (c, p, o), n in zip(dims, counts, strict=True)]
    if not engine:
        from bench.run.engine_flags import demo_flags, step_flags

        engine, _ = demo_flags()
        engine += step_flags(engine)

    import uvloop

    rows: list[dict[str, Any]] = []
    for rep in range(ns.repeat):
        # Alternated, so that the machine's drift falls on both variants.
        for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            rows += uvloop.run(_variant(variant, engine, points))
    for point in dict.fromkeys(r["point"] for r in rows):
        for variant in VARIANTS:
            vals = [
                r["cpu_ms_per_request"]
                for r in rows
                if (r["point"], r["variant"]) == (point, variant)
            ]
            print(
                f"{point} {variant}: {statistics.median(vals):.2f} "
                f"[{min(vals):.2f}-{max(vals):.2f}] ms CPU per request"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
