"""server/engine.py against vLLM's own input path, without an engine core.

`start()` runs for real except that `AsyncLLM.from_vllm_config` returns the
engine's front half: the resolved config, vLLM's renderer and vLLM's
`InputProcessor` (what AsyncLLM.add_request runs before handing a request to
the engine core). So the tests see:

* the token ids the adapter makes equal those of vLLM's server path
  (`Renderer.render_chat` / `render_cmpl`) for the same messages and prompts;
* `add` hands the InputProcessor a rendered engine input (no deprecated
  raw-prompt path) that becomes an EngineCoreRequest with those ids;
* `info` carries the engine's resolved capacity.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from vllm.inputs import TokensPrompt
from vllm.renderers import renderer_from_config
from vllm.renderers.params import ChatParams
from vllm.v1.engine import input_processor
from vllm.v1.engine.input_processor import InputProcessor

from server import engine as engine_mod
from server.cli import parse_serve_args
from server.engine import EngineAdapter
from server.errors import SluiceError
from server.protocol import Message, Sampling

GPU_BLOCKS = 1000  # what the engine core's handshake would report


class FrontHalf:
    """AsyncLLM up to the engine core: config, renderer, input processing."""

    def __init__(self, config: Any) -> None:
        config.cache_config.num_gpu_blocks = GPU_BLOCKS
        self.vllm_config = config
        self.model_config = config.model_config
        self.renderer = renderer_from_config(config)
        self.input_processor = InputProcessor(config, self.renderer)
        self.errored = False
        self.requests: list[Any] = []

    def get_tokenizer(self) -> Any:
        return self.renderer.get_tokenizer()

    async def add_request(self, request_id: str, prompt: Any, params: Any, priority: int) -> Any:
        # As AsyncLLM.add_request routes a rendered input (a dict with "type").
        assert isinstance(prompt, dict) and "type" in prompt
        req = self.input_processor.process_inputs(
            request_id, prompt, params, supported_tasks=("generate",), priority=priority
        )
        self.requests.append(req)
        return req

    def shutdown(self) -> None:
        self.renderer.shutdown()


@pytest.fixture(scope="module")
async def adapter(demo_model_dir: Path) -> AsyncIterator[EngineAdapter]:
    mp = pytest.MonkeyPatch()
    mp.setattr(engine_mod.AsyncLLM, "from_vllm_config", lambda config, **_: FrontHalf(config))
    a = EngineAdapter(parse_serve_args(["--model", str(demo_model_dir)], {}).engine_args, "m")
    try:
        await a.start()
        yield a
    finally:
        a.shutdown()
        mp.undo()


def _renderer(a: EngineAdapter) -> Any:
    return a._llm.renderer  # type: ignore[union-attr]


CHATS = [
    [Message("user", "Hello!")],
    [Message("system", "Be brief."), Message("user", "x" * 3000)],  # goes to the thread
    [Message("developer", "Rules."), Message("user", "Hi", name="ann")],
    [Message("user", "2+2?"), Message("assistant", "4"), Message("user", "and 3+3?")],
]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("chat", CHATS, ids=["turn", "long", "developer", "multi"])
async def test_chat_ids_are_vllm_servers(
    adapter: EngineAdapter, chat: list[Message], thinking: bool
) -> None:
    kwargs = {"enable_thinking": thinking}
    (ids,) = await adapter.tokenize_chat([(chat, kwargs)])
    msgs: Any = [
        {"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})} for m in chat
    ]
    params = ChatParams(chat_template_kwargs={**kwargs, "add_generation_prompt": True})
    _, (want,) = _renderer(adapter).render_chat([msgs], params)
    assert ids == want["prompt_token_ids"]
    text = adapter.detokenize(ids)
    assert ("<think>\n\n</think>" in text) is not thinking  # the kwargs reached the template


async def test_prompt_ids_are_vllm_servers(adapter: EngineAdapter) -> None:
    texts = ["Once upon a time", "y" * 4000, ""]
    got = await adapter.tokenize_prompts(texts)
    for text, ids in zip(texts, got, strict=True):
        (want,) = _renderer(adapter).render_cmpl([{"prompt": text}])
        assert ids == want["prompt_token_ids"]


async def test_a_mixed_batch_keeps_each_kind_and_error_in_place(adapter: EngineAdapter) -> None:
    jobs: list[Any] = [
        ("text", "abc"),
        ("chat", ([Message("user", "hi")], {})),
        ("chat", ([Message("user", "boom")], {"tools": 5})),  # the template fails on it
        ("chat", ([Message("user", "x")], {"chat_template": "{{ 7 * 7 }}"})),
        ("text", "def"),
    ]
    out = adapter._tokenize_batch(jobs)
    assert out[0] == (await adapter.tokenize_prompts(["abc"]))[0]
    assert out[1] == (await adapter.tokenize_chat([([Message("user", "hi")], {})]))[0]
    assert isinstance(out[2], SluiceError) and out[2].param == "messages"
    # A caller's own Jinja template is refused, as by vLLM's server by default.
    assert isinstance(out[3], SluiceError) and out[3].param == "chat_template_kwargs.chat_template"
    assert out[4] == (await adapter.tokenize_prompts(["def"]))[0]


async def test_add_takes_the_rendered_input_path(
    adapter: EngineAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    warned: list[str] = []
    monkeypatch.setattr(
        input_processor.logger, "warning_once", lambda msg, *a, **k: warned.append(msg)
    )
    (ids,) = await adapter.tokenize_prompts(["Hello"])
    params = adapter.sampling_params(Sampling(max_tokens=3, seed=5), 3)
    req = await adapter.add("r1", ids, params, priority=2)
    assert req.prompt_token_ids == ids
    assert (req.priority, req.sampling_params.max_tokens, req.sampling_params.seed) == (2, 3, 5)
    assert warned == []
    # The deprecated path, for contrast: the same ids as a raw prompt dict warn.
    adapter._llm.input_processor.process_inputs(  # type: ignore[union-attr]
        "r2", TokensPrompt(prompt_token_ids=ids), params, supported_tasks=("generate",)
    )
    assert any("raw prompts" in w for w in warned)


def test_info_carries_the_resolved_capacity(adapter: EngineAdapter) -> None:
    config = adapter._llm.vllm_config  # type: ignore[union-attr]
    info = adapter.info
    assert (info.max_num_seqs, info.max_num_batched_tokens) == (128, 2048)  # CPU, server context
    assert info.kv_cache_tokens == GPU_BLOCKS * config.cache_config.block_size
    assert info.max_model_len == 8192
