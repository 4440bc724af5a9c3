"""Entry point of the `sluice` command (and `python -m server`).

The only place that reads the process environment: `os.environ` goes into the
frozen Settings once, here, and is passed down. vLLM starts its engine
processes with spawn, which re-imports the main module, hence the
`if __name__ == "__main__"` guard at the bottom.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path


def _serve(argv: Sequence[str]) -> int:
    if not any(a == "--model" or a.startswith("--model=") for a in argv):
        # The demo model is built offline and nothing may reach a model hub
        # for it. Set before vLLM (and huggingface_hub) is imported: they read
        # it at import. A real --model may still download, as with vLLM.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    from server.operations.logs import setup_logging

    fmt = (
        "plain"
        if "--log-format=plain" in argv or _flag_value(argv, "--log-format") == "plain"
        else "json"
    )
    listener = setup_logging(fmt)
    try:
        return _run(argv)
    finally:
        listener.stop()


def _run(argv: Sequence[str]) -> int:
    import logging

    from server.cli import parse_serve_args
    from server.listen import BindError, address, bind
    from server.settings import Settings

    log = logging.getLogger("sluice")
    # Bind first (issue 41): a taken port fails here, before vLLM is even imported.
    defaults = Settings()
    given = address(argv, defaults.host, defaults.port)
    try:
        sock = bind(*given) if given is not None else None
    except BindError as exc:
        sys.stderr.write(f"sluice serve: error: {exc}\n")
        return 2
    settings = parse_serve_args(argv, os.environ)
    # systemd's notify socket is for this process alone: vLLM's engine
    # processes inherit the environment and must not speak for the service.
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(var, None)
    from vllm.platforms import current_platform

    from server.engines.cpu_threads import engine_env

    # Several models on CPU: unbound workers, each with the cores less one as
    # OpenMP threads (server/engines/cpu_threads.py). The engine processes
    # inherit the environment; an operator's value wins.
    cores = len(os.sched_getaffinity(0))
    os.environ.update(
        engine_env(len(settings.specs()), current_platform.is_cpu(), cores, os.environ)
    )
    if settings.demo_model:
        log.info(
            "no --model given and no GPU: serving the offline demo model (random weights, "
            "gibberish text)",
            extra={"fields": {"path": settings.model_path, "name": settings.model_name}},
        )

    import uvloop

    from server.app import serve, watchdog_factory
    from server.engines.vllm_adapter import EngineAdapter
    from server.operations.sdnotify import SdNotify

    board = None
    if settings.interactive_first:
        # The engines' shared page (server/engines/board.py), named to the engine
        # processes through their environment.
        from server.engines.board import ENV, Board

        board = Board.create()
        os.environ[ENV] = str(board.path)

    async def main() -> int:
        notifier = SdNotify(
            settings.env.notify_socket,
            settings.env.watchdog_usec,
            watchdog_pid=settings.env.watchdog_pid,
        )
        return await serve(
            settings, EngineAdapter.from_spec, notifier, watchdog_factory(settings), sock=sock
        )

    try:
        return uvloop.run(main())
    finally:
        if board is not None:
            board.close()


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(argv[:-1]):
        if a == flag:
            return argv[i + 1]
    return None


def _make_demo_model(argv: Sequence[str]) -> int:
    reranker = "--reranker" in argv
    rest = [a for a in argv if a != "--reranker"]
    if len(rest) != 1 or rest[0].startswith("-"):
        print("usage: sluice make-demo-model [--reranker] DIR", file=sys.stderr)
        return 2
    from server.engines.demo.model import build_demo_model

    path = build_demo_model(Path(rest[0]), reranker=reranker)
    print(path)
    return 0


def _make_demo_adapter(argv: Sequence[str]) -> int:
    import argparse

    from server.engines.demo.lora_adapter import DEFAULT_RANK, write_demo_adapter
    from server.engines.demo.model import DEMO_MODEL_NAME

    parser = argparse.ArgumentParser(
        prog="sluice make-demo-adapter",
        description="Write a random PEFT LoRA adapter for the demo model into DIR "
        "(the same bytes for the same seed and rank).",
    )
    parser.add_argument("dir", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--rank", type=int, default=DEFAULT_RANK, help="(default: %(default)s)")
    parser.add_argument(
        "--base",
        default=DEMO_MODEL_NAME,
        help="the base model's name for its adapter_config.json (default: %(default)s, the "
        "name `sluice serve` serves the demo model as); a runtime load warns when it "
        "differs from the served names, the tensor shapes decide",
    )
    ns = parser.parse_args(list(argv))
    if ns.rank < 1:
        parser.error(f"--rank must be >= 1, got {ns.rank}")
    print(write_demo_adapter(ns.dir, seed=ns.seed, rank=ns.rank, base=ns.base))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from server.cli import USAGE

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from server import __version__

        print(f"sluice {__version__}")
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "serve":
        return _serve(rest)
    if cmd == "make-demo-model":
        return _make_demo_model(rest)
    if cmd == "make-demo-adapter":
        return _make_demo_adapter(rest)
    print(f"sluice: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
