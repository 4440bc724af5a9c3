"""server/engines/vllm_adapter.py resolves the engine configuration as `vllm serve` does.

vLLM picks `max_num_seqs` and `max_num_batched_tokens` by usage context and
device (EngineArgs.get_batch_defaults). Sluice must get what vLLM's OpenAI
server gets for the same flags: both sides here call vLLM's own
`create_engine_config`, Sluice's through `engine_config` with the flags its
CLI parsed, vLLM's server's with the flags vLLM's server parser parsed and the
usage context its engine-client builder uses. No engine starts and no GPU is
needed: for the card cases, vLLM's `get_batch_defaults` runs unchanged but
reads a card's memory and name instead of this machine's CPU (on CPU, the
server and plain engine contexts happen to resolve alike).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.engine import arg_utils
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser

from server.cli import parse_serve_args
from server.engines import vllm_adapter as engine_mod
from server.engines.vllm_adapter import EngineAdapter, engine_config

GiB = 1 << 30
# (total memory, device name) as vLLM's platform reports them.
CARDS = {
    "rtx4090": (24 * GiB, "NVIDIA GeForce RTX 4090"),
    "h100": (80 * GiB, "NVIDIA H100 80GB HBM3"),
    "h200": (141 * GiB, "NVIDIA H200"),
}
# What vLLM 0.32's get_batch_defaults gives the OpenAI server per card.
SERVER_DEFAULTS = {"cpu": (128, 2048), "rtx4090": (256, 2048), "h100": (1024, 8192)}
SERVER_DEFAULTS["h200"] = SERVER_DEFAULTS["h100"]


@pytest.fixture(params=["cpu", *CARDS])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run vLLM's get_batch_defaults as if on this device (the rest stays CPU)."""
    name = request.param
    if name != "cpu":
        memory, device_name = CARDS[name]
        card = SimpleNamespace(
            get_device_total_memory=lambda: memory,
            get_device_name=lambda: device_name,
            is_tpu=lambda: False,
            is_cpu=lambda: False,
        )
        original = EngineArgs.get_batch_defaults.__func__  # type: ignore[attr-defined]

        def on_card(cls: type[EngineArgs], world_size: int) -> Any:
            with monkeypatch.context() as m:
                m.setattr(arg_utils, "current_platform", card)
                return original(cls, world_size)

        monkeypatch.setattr(EngineArgs, "get_batch_defaults", classmethod(on_card))
    yield name


def _flags(model_dir: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "8192",
        "--kv-cache-memory-bytes",
        str(512 << 20),
        "--gpu-memory-utilization",
        "0.2",
        *extra,
    ]


def _sluice(flags: list[str]) -> tuple[int, int]:
    settings = parse_serve_args(flags, {})
    sched = engine_config(settings.engine_args).scheduler_config
    return sched.max_num_seqs, sched.max_num_batched_tokens


def _vllm_server(flags: list[str], usage_context: UsageContext | None = None) -> tuple[int, int]:
    """What `vllm serve` resolves: its parser, its engine-client builder's context."""
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(flags)
    if usage_context is None:
        usage_context = (
            inspect.signature(build_async_engine_client).parameters["usage_context"].default
        )
    sched = AsyncEngineArgs.from_cli_args(ns).create_engine_config(usage_context).scheduler_config
    return sched.max_num_seqs, sched.max_num_batched_tokens


def test_scheduler_config_matches_vllm_server(device: str, demo_model_dir: Path) -> None:
    flags = _flags(demo_model_dir)
    ours = _sluice(flags)
    assert ours == _vllm_server(flags)
    assert ours == SERVER_DEFAULTS[device]
    if device != "cpu":
        # The plain engine context (what AsyncLLM.from_engine_args uses when
        # not told) resolves differently on a card: the test can tell them apart.
        assert _vllm_server(flags, UsageContext.ENGINE_CONTEXT) != ours


def test_explicit_flags_win(device: str, demo_model_dir: Path) -> None:
    flags = _flags(demo_model_dir, "--max-num-seqs", "48", "--max-num-batched-tokens", "4096")
    assert _sluice(flags) == _vllm_server(flags) == (48, 4096)


def test_engine_config_leaves_the_flags_alone(demo_model_dir: Path) -> None:
    args = parse_serve_args(_flags(demo_model_dir), {}).engine_args
    engine_config(args)
    assert args.max_num_seqs is None and args.max_num_batched_tokens is None


async def test_start_builds_the_engine_from_that_config(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start() hands vLLM the server-context config (the engine is not built)."""
    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def from_vllm_config(config: Any, **kwargs: Any) -> Any:
        seen.update(kwargs, config=config)
        raise Stop

    monkeypatch.setattr(engine_mod.AsyncLLM, "from_vllm_config", from_vllm_config)
    flags = _flags(demo_model_dir)
    adapter = EngineAdapter(parse_serve_args(flags, {}).engine_args, "m")
    try:
        with pytest.raises(Stop):
            await adapter.start()
    finally:
        adapter.shutdown()
    assert seen["usage_context"] is UsageContext.OPENAI_API_SERVER
    sched = seen["config"].scheduler_config
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == _vllm_server(flags)
    assert len(seen["stat_loggers"]) == 1  # Sluice's stats feed
