"""server/engines/vllm_adapter.py against vLLM's own input path, without an engine core.

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

import copy
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.inputs import TokensPrompt
from vllm.renderers import renderer_from_config
from vllm.renderers.params import ChatParams
from vllm.v1.engine import input_processor
from vllm.v1.engine.input_processor import InputProcessor

from server.api.openai_chat.parse import parse_chat
from server.cli import parse_serve_args
from server.engines import vllm_adapter as engine_mod
from server.engines.board import ENV as BOARD_ENV
from server.engines.board import Board
from server.engines.vllm_adapter import EngineAdapter
from server.errors import SluiceError
from server.settings import engine_capacity
from server.wire.request import Constraint, Limits, Message, Sampling

GPU_BLOCKS = 1000  # what the engine core's handshake would report


class _NoCore:
    """The engine core's client, absent: no step ever comes."""

    async def get_output_async(self) -> Any:
        raise AssertionError("no engine core in this test")


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
        self.engine_core = _NoCore()  # the adapter reads each step from it (watch_outputs)
        # What the engine core reports for the model (its runner and pooler).
        mc = config.model_config
        self.tasks: tuple[str, ...] = (
            ("generate",)
            if mc.runner_type == "generate"
            else ("classify", "token_classify")
            if mc.score_type == "cross-encoder"
            else ("embed", "token_embed")
        )

    def get_tokenizer(self) -> Any:
        return self.renderer.get_tokenizer()

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return self.tasks

    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        priority: int,
        lora_request: Any = None,
        reasoning_ended: bool | None = None,
        data_parallel_rank: int | None = None,
    ) -> Any:
        # As AsyncLLM.add_request routes a rendered input (a dict with "type").
        assert isinstance(prompt, dict) and "type" in prompt
        req = self.input_processor.process_inputs(
            request_id,
            prompt,
            params,
            supported_tasks=self.tasks,
            priority=priority,
            lora_request=lora_request,
            data_parallel_rank=data_parallel_rank,
        )
        if reasoning_ended is not None:  # as AsyncLLM.add_request sets it
            req.reasoning_ended = reasoning_ended
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


async def test_a_stopped_engine_holds_no_other_models_work(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine shut down (dead and discarded, or unloaded) takes back its
    schedulers' last word on the board: a turn that was in prefill there no longer
    holds the other models' background work (it did until the flag went stale, 10 s)."""
    board = Board.create()
    monkeypatch.setenv(BOARD_ENV, str(board.path))
    monkeypatch.setattr(
        engine_mod.AsyncLLM, "from_vllm_config", lambda config, **_: FrontHalf(config)
    )
    a = EngineAdapter(parse_serve_args(["--model", str(demo_model_dir)], {}).engine_args, "m")
    try:
        await a.start()
        slot = a._slot
        assert slot is not None
        board.set_pending(slot, True)  # its scheduler's last step: a turn in prefill
        assert board.elsewhere(slot + 1, time.monotonic_ns())[0]
        a.shutdown()
        assert not board.elsewhere(slot + 1, time.monotonic_ns())[0]
    finally:
        a.shutdown()
        board.close()


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


TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g", "description": "d", "strict": True}},
]
HISTORY: list[Any] = [
    {"role": "user", "content": "call f"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "done"},
]


@pytest.mark.parametrize("thinking", [True, False])
async def test_tools_and_their_history_render_as_vllms_server(
    adapter: EngineAdapter, thinking: bool
) -> None:
    body = {
        "model": "m",
        "messages": HISTORY,
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": thinking},
    }
    req = parse_chat(orjson.dumps(body), Limits())
    (ids,) = await adapter.tokenize_chat([(req.messages, req.template_kwargs())])
    # vLLM's server: the client's messages, the tools' model_dump() as a template kwarg
    # (copies: vLLM's renderer parses tool-call arguments in place).
    vreq = ChatCompletionRequest(model="m", messages=copy.deepcopy(HISTORY), tools=TOOLS)
    tools = [t.model_dump() for t in vreq.tools or ()]
    kwargs = {"enable_thinking": thinking, "add_generation_prompt": True, "tools": tools}
    params = ChatParams(chat_template_kwargs=kwargs)
    _, (want,) = _renderer(adapter).render_chat([copy.deepcopy(HISTORY)], params)
    assert ids == want["prompt_token_ids"]
    assert "<tool_response>\ndone\n</tool_response>" in adapter.detokenize(ids)


async def test_parsers_and_constraints_from_the_engine(adapter: EngineAdapter) -> None:
    body = {"model": "m", "messages": HISTORY[:1], "tools": TOOLS, "tool_choice": "required"}
    parser = adapter.chat_parser(parse_chat(orjson.dumps(body), Limits()))
    assert parser.constraint is not None and parser.constraint.param == "tools"
    await adapter.check_constraint(parser.constraint)  # compiles with the engine's backend
    with pytest.raises(SluiceError) as info:
        await adapter.check_constraint(Constraint("regex", "a(b", param="guided_regex"))
    assert (info.value.status, info.value.param) == (400, "guided_regex")


@pytest.mark.parametrize("from_start", [True, False])
async def test_a_raw_completions_constraint_skips_the_reasoning_gate(
    adapter: EngineAdapter, from_start: bool
) -> None:
    (ids,) = await adapter.tokenize_prompts(["Yes or no?"])
    constraint = Constraint("choice", choices=("yes", "no"), from_start=from_start)
    params = adapter.sampling_params(Sampling(max_tokens=3, constraint=constraint), 3)
    req = await adapter.add("c1", ids, params, priority=0)
    assert req.sampling_params.structured_outputs is not None
    assert req.reasoning_ended is (True if from_start else None)


def test_info_carries_the_resolved_capacity(adapter: EngineAdapter) -> None:
    config = adapter._llm.vllm_config  # type: ignore[union-attr]
    info = adapter.info
    assert (info.max_num_seqs, info.max_num_batched_tokens) == (128, 2048)  # CPU, server context
    assert info.kv_cache_tokens == GPU_BLOCKS * config.cache_config.block_size
    assert info.max_model_len == 40960
    # The prefill cap Sluice set (server/engines/step_flags.py) reaches room rule 3.
    assert info.prefill_chunk == 512 == config.scheduler_config.long_prefill_token_threshold
    assert engine_capacity(info).prefill_chunk == 512


async def test_the_tool_call_parser_flag_reaches_the_parsers(demo_model_dir: Path) -> None:
    """--tool-call-parser qwen3_coder: the adapter reads that parser's calls (hermes would not)."""
    from server.api.openai_chat.parse import parse_chat
    from server.wire.request import Limits

    settings = parse_serve_args(
        ["--model", str(demo_model_dir), "--tool-call-parser", "qwen3_coder"], {}
    )
    mp = pytest.MonkeyPatch()
    mp.setattr(engine_mod.AsyncLLM, "from_vllm_config", lambda config, **_: FrontHalf(config))
    a = EngineAdapter.from_spec(settings.specs()[0])
    try:
        await a.start()
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "clock"}}],
        }
        parser = a.chat_parser(parse_chat(orjson.dumps(body), Limits()))
        text = "<tool_call>\n<function=clock>\n</function>\n</tool_call>"
        assert [c.name for c in parser.parse(text).tool_calls] == ["clock"]
        assert a.info.qwen3_split  # the reasoning parser is still qwen3
    finally:
        a.shutdown()
        mp.undo()


def test_lora_request_from_an_adapter() -> None:
    """The one place a LoRARequest is made: name, id, path and parent travel."""
    from server.engines.lora import Adapter

    req = engine_mod.lora_request(Adapter("beta", "/adapters/beta", 2, "fake"))
    assert (req.lora_name, req.lora_int_id, req.lora_path, req.base_model_name) == (
        "beta",
        2,
        "/adapters/beta",
        "fake",
    )


def test_a_later_system_message_renders_in_place_or_merged(adapter: EngineAdapter) -> None:
    """Claude Code sends a system message after the user's turn: Qwen3's
    template renders it in place (the start-up probe says so); for a template
    that refuses one, the messages are merged into the first, as vLLM does."""
    msgs = [Message("system", "Alpha."), Message("user", "hi"), Message("system", "Beta.")]
    kwargs = {"enable_thinking": False}
    assert adapter._inline_system
    inline = adapter._render_chat(msgs, kwargs)
    assert inline.index("hi") < inline.index("<|im_start|>system\nBeta.")
    adapter._inline_system = False
    try:
        merged = adapter._render_chat(msgs, kwargs)
    finally:
        adapter._inline_system = True
    assert merged.startswith("<|im_start|>system\nAlpha.Beta.<|im_end|>\n<|im_start|>user\nhi")
