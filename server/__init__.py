"""Sluice: an asyncio-native micro-batching server for LLM inference on vLLM.

`server` holds everything that does I/O; the policy it applies lives in the pure
`batching` package. Its rooms (docs/DESIGN.md, "The house"):

    __main__, cli, settings  the process: the command line, settings read once
    app, state, errors       the app's life cycle, its typed state, the one error type
    http/                    the shell every API shares: middlewares, callers, routes, pipeline
    api/                     one package per API: pure translation beside its aiohttp half
    wire/                    pure pieces the APIs' translations share
    engines/                 the engine seam, the vLLM adapter, the driver, parsers, LoRA, demo
    operations/              watchdog, systemd notify, logs, metrics, the status page
"""

__version__ = "0.1.0"
