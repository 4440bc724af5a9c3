"""The engine flags a benchmark gives every system it compares: the offline demo
model's, and the engine-step flags `sluice serve` would set.

Why it exists: `python -m bench` and the benchmark points (bench/points/api_point.py,
bench/points/embed_point.py, ...) all start servers with these flags; here, below all of
them, none of them imports another's command line for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

DEMO_NAME = "sluice-demo"


# The demo model's context in benchmarks: 8,192, as every recorded result was
# measured with (the model has Qwen3's 40,960 since issue 26, and the mixed
# load scales its prompts with the context: 1/2 of it for a long document).
BENCH_CONTEXT = 8192


def demo_flags() -> tuple[list[str], str]:
    from server.cli import DEFAULT_REASONING_PARSER, DEMO_STRUCTURED_OUTPUTS
    from server.engines.demo.model import build_demo_model, default_cache_root, default_demo_dir

    env = dict(os.environ)
    model_dir = build_demo_model(default_demo_dir(default_cache_root(env)))
    from server.engines.demo.model import demo_engine_kwargs

    kw = demo_engine_kwargs(model_dir)
    flags = [
        "--model",
        str(kw["model"]),
        "--served-model-name",
        DEMO_NAME,
        "--dtype",
        str(kw["dtype"]),
        "--max-model-len",
        str(BENCH_CONTEXT),
        "--kv-cache-memory-bytes",
        str(kw["kv_cache_memory_bytes"]),
        # What `sluice serve` sets for the demo model by default (server/cli.py),
        # spelt out so vLLM's server runs the same engine configuration.
        "--reasoning-parser",
        DEFAULT_REASONING_PARSER,
        "--structured-outputs-config",
        json.dumps(DEMO_STRUCTURED_OUTPUTS),
    ]
    return flags, str(model_dir)


def step_flags(engine_flags: Sequence[str]) -> list[str]:
    """The engine-step flags `sluice serve` sets when none is given
    (server/engines/step_flags.py), resolved by Sluice's own parser for these flags and
    spelt out, so that vLLM's server and the raw engine run the same engine step
    as Sluice. None when the flags already set either."""
    if any(f.lstrip("-").removeprefix("no-").startswith(_STEP_FLAG) for f in engine_flags):
        return []
    from server.cli import parse_serve_args
    from server.engines.step_flags import StepFlags

    args = parse_serve_args(list(engine_flags), {}).engine_args
    flags = StepFlags(args.long_prefill_token_threshold, args.long_prefill_token_threshold_adaptive)
    return list(flags.argv())


_STEP_FLAG = "long-prefill-token-threshold"


def drop_flags(flags: list[str], *names: str) -> list[str]:
    """`flags` without the named flags and their values."""
    out: list[str] = []
    skip = False
    for f in flags:
        if skip:
            skip = False
        elif f in names:
            skip = True
        else:
            out.append(f)
    return out
