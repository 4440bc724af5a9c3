"""Test doubles for unit tests and fault injection: a fake engine.

`FakeEngine` has the EngineAdapter's surface (server/engines/vllm_adapter.py) and produces
vLLM-shaped outputs (RequestOutput deltas with CompletionOutputs) on a timer,
so the handlers, the driver and the streaming path run for real without vLLM.
It is never used outside tests/; integration tests run the real engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from batching import Charge, EngineStep
from batching.pressure import ENGINE_IDLE, EngineStats
from batching.step_share import StepCounters
from server.engines.interface import Kind, ModelInfo, Pooled
from server.engines.lora import Adapter
from server.errors import SluiceError
from server.wire.request import ChatRequest, Constraint, Message, Sampling

if TYPE_CHECKING:
    from server.engines.interface import Engine


@dataclass(frozen=True)
class FakeLogprob:
    """vLLM's Logprob: a candidate token's logprob, rank and text (None: detokenize)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FakeCompletion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: Any = None
    stop_reason: int | str | None = None


@dataclass
class FakeOutput:
    request_id: str
    outputs: list[FakeCompletion]
    finished: bool
    num_cached_tokens: int | None = None
    prompt_logprobs: Any = None

    def add(self, later: FakeOutput) -> None:
        """Merge a later delta into this one (vLLM's ``RequestOutput.add``)."""
        self.finished |= later.finished
        for nxt in later.outputs:
            for mine in self.outputs:
                if mine.index == nxt.index:
                    mine.text += nxt.text
                    mine.token_ids = [*mine.token_ids, *nxt.token_ids]
                    if nxt.logprobs:
                        mine.logprobs = [*(mine.logprobs or ()), *nxt.logprobs]
                    mine.finish_reason = nxt.finish_reason
                    break
            else:
                self.outputs.append(nxt)


class FakeCollector:
    """vLLM's RequestOutputCollector contract (vllm/v1/engine/output_processor.py):
    put never blocks, and outputs a lagging reader has not taken are merged
    into one, as ``RequestOutput.add(aggregate=True)`` merges deltas: per
    choice index the text and token ids are joined, the finish reason is the
    latest; an exception replaces whatever was waiting."""

    def __init__(self) -> None:
        self.output: Any = None
        self.ready = asyncio.Event()
        self.merged = 0  # outputs folded into an earlier one (a lagging reader)

    def put(self, item: Any) -> None:
        if self.output is None or isinstance(item, BaseException):
            self.output = item
            self.ready.set()
        elif isinstance(self.output, FakeOutput):
            self.output.add(item)
            self.merged += 1

    async def get(self) -> Any:
        while (item := self.output) is None:
            await self.ready.wait()
        self.output = None
        self.ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class FakeEngine:
    max_model_len: int = 256
    step: float = 0.002  # seconds per generated token
    start_delay: float = 0.0
    fail_start: bool = False
    # Set: start() waits for this event (an engine start a test lets finish).
    start_gate: asyncio.Event | None = None
    max_num_seqs: int = 64  # reported in ModelInfo: the core's engine slots
    # Data-parallel ranks reported in ModelInfo (the core places each release on
    # one: batching/room.py rule 6), and the prefix cache's block size
    # (`prefix_hashes`: every full block of the prompt, chained, salted).
    dp_ranks: int = 1
    block_size: int = 16
    # Reported in ModelInfo: the prefix cache on (its block size), for the core's
    # prefix-warm order (batching/warm.py); off by default, as the tests before it.
    prefix_cache: bool = False
    default_max_tokens: int | None = None  # reported in ModelInfo: the generation config's
    added: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    _producers: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _dead: bool = False
    stats_value: EngineStats = ENGINE_IDLE
    peak_running: int = 0  # most requests producing at once
    priorities: dict[str, int] = field(default_factory=dict)  # engine priority per request
    background: dict[str, bool] = field(default_factory=dict)  # the class add() was told
    share: StepCounters | None = None  # what step_share() reports
    # set_unshown's word: (rank, count, outputs produced so far), in order.
    unshown: list[tuple[int, int, int]] = field(default_factory=list)
    outputs_put: int = 0  # generation outputs produced, all requests
    adapters: dict[str, str | None] = field(default_factory=dict)  # LoRA adapter per request
    salts: dict[str, str | None] = field(default_factory=dict)  # prefix-cache salt per request
    ranks: dict[str, int | None] = field(default_factory=dict)  # data-parallel rank per request
    loaded: list[Adapter] = field(default_factory=list)  # load_adapter's, in order
    # Fault injection: load_adapter fails with this message, as the engine's load would.
    load_error: str | None = None
    # Set: every choice says these pieces, one per step, then stops (else the
    # fake repeats a thinking pattern until max_tokens).
    script: tuple[str, ...] | None = None
    # A real tokenizer (the demo model's) for tests of tool calls: the script's
    # token ids come from it, and chat_parser gives vLLM's real parsers on it
    # (they read the tags by token id). None: chat_parser refuses.
    tokenizer: Any = None
    _parsers: Any = None
    reasoning_parser: str = "qwen3"  # another: every chat request goes through chat_parser
    constraints: list[Constraint] = field(default_factory=list)
    # Every conversation rendered (messages, template kwargs), in order: what
    # the real engine would turn into token ids.
    rendered: list[tuple[tuple[Message, ...], dict[str, Any]]] = field(default_factory=list)
    # Set: each request's first output waits for this event (a prefill that
    # has not finished); `held` names the requests waiting on it.
    first_output: asyncio.Event | None = None
    held: set[str] = field(default_factory=set)
    # Engine steps reported and not yet taken (`report_steps`), and the
    # callback the driver watches them with.
    steps: list[EngineStep] = field(default_factory=list)
    on_step: Callable[[], None] | None = None
    # Each generation's share of the engine's steps (batching/ledger.py), as
    # the real adapter's ledger would charge it: `charges` by request id, else
    # `charge_each`.
    charges: dict[str, Charge] = field(default_factory=dict)
    charge_each: Charge = field(default_factory=Charge)
    # What the fake model serves (interface.py Kind): a pooling kind answers
    # pooling requests with a vector of `embed_dims` derived from the prompt's
    # ids (a unit vector, the same for the same ids), or a cross-encoder's
    # score; `matryoshka` lets `dimensions` cut it.
    kind: Kind = "generate"
    embed_dims: int = 8
    matryoshka: bool = False
    # Every pooling request added: its id, prompt ids and parameters.
    pooled: list[tuple[str, tuple[int, ...], Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.info = ModelInfo(
            name="fake",
            max_model_len=self.max_model_len,
            eos_token_id=0,
            created=0,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=2048,
            qwen3_split=self.reasoning_parser == "qwen3",
            default_max_tokens=self.default_max_tokens,
            kind=self.kind,
            dp_ranks=self.dp_ranks,
            prefix_block=self.block_size if self.prefix_cache else 0,
        )
        self.started = False
        self.hashed = 0  # prefix_hashes calls
        self.hashed_tokens: list[int] = []  # the prompt tokens each call hashed
        self.shut_down = False
        self.sleeps = 0  # sleep() calls (vLLM's sleep mode, on a GPU)
        self.asleep = False

    async def start(self) -> None:
        await asyncio.sleep(self.start_delay)
        if self.start_gate is not None:
            await self.start_gate.wait()
        if self.fail_start:
            raise RuntimeError("fake engine failed to start")
        self.started = True

    def shutdown(self) -> None:
        self.shut_down = True
        for task in self._producers.values():
            task.cancel()

    @property
    def errored(self) -> bool:
        return self._dead

    async def check_health(self) -> None:
        if self._dead:
            raise RuntimeError("dead")

    def processes(self) -> tuple[tuple[int, int | None], ...]:
        return ()

    def stats(self) -> EngineStats:
        return self.stats_value

    def take_steps(self) -> list[EngineStep]:
        steps, self.steps = self.steps, []
        return steps

    def watch_steps(self, callback: Callable[[], None] | None) -> None:
        self.on_step = callback

    def step_share(self) -> StepCounters | None:
        return self.share

    def set_unshown(self, rank: int, count: int) -> None:
        """Record the front's word per rank, as the board would carry it."""
        self.unshown.append((rank, count, self.outputs_put))

    def charge(self, request_id: str) -> Charge:
        """What a test set for the request, taken once."""
        return self.charges.pop(request_id, self.charge_each)

    def report_steps(self, *steps: EngineStep) -> None:
        """Report engine steps, as vLLM's stat logger would after each."""
        self.steps.extend(steps)
        if self.on_step is not None:
            self.on_step()

    @property
    def unfinished(self) -> set[str]:
        return set(self._producers)

    async def tokenize_chat(
        self, conversations: Sequence[tuple[Sequence[Message], dict[str, Any]]]
    ) -> list[list[int]]:
        out = []
        for messages, kwargs in conversations:
            self.rendered.append((tuple(messages), dict(kwargs)))
            text = "".join(f"<{m.role}>{m.content}" for m in messages)
            if not kwargs.get("enable_thinking", True):
                text += "<nothink>"
            out.append([b % 200 + 1 for b in text.encode()])
        return out

    async def tokenize_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        return [[b % 200 + 1 for b in t.encode()] for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        return "".join(chr(96 + i % 26) for i in ids)

    def tokenizer_info(self) -> dict[str, Any]:
        return {"eos_token": "<eos>", "tokenizer_class": "FakeTokenizer"}

    def count_tokens(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        return len(text.encode())

    def chat_parser(self, req: ChatRequest) -> Any:
        if self.tokenizer is None:
            raise SluiceError("no parsers in this fake", param="tools", code="unsupported")
        if self._parsers is None:
            from server.engines.vllm_parsers import OutputParsers

            self._parsers = OutputParsers(self.tokenizer, reasoning_parser=self.reasoning_parser)
        return self._parsers.for_request(req)

    async def check_constraint(self, constraint: Constraint) -> None:
        if constraint.kind == "regex" and constraint.value == "(":
            raise SluiceError("bad regex", param=constraint.param, code="invalid_value")
        self.constraints.append(constraint)

    @staticmethod
    def sampling_params(s: Sampling, max_tokens: int) -> Any:
        return SimpleNamespace(sampling=s, n=s.n, max_tokens=max_tokens)

    def pooling_params(
        self,
        task: Literal["embed", "classify"],
        dimensions: int | None = None,
        use_activation: bool | None = None,
    ) -> Any:
        if dimensions is not None and (
            not self.matryoshka or not 1 <= dimensions <= self.embed_dims
        ):
            raise SluiceError(
                f"Model 'fake' does not support Matryoshka embeddings (dimensions={dimensions})",
                param="dimensions",
            )
        return SimpleNamespace(task=task, dimensions=dimensions, use_activation=use_activation)

    def _checked(self, ids: list[int], truncate: int | None, param: str) -> list[int]:
        if truncate is not None:
            ids = ids[: self.max_model_len if truncate < 0 else truncate]
        if len(ids) > self.max_model_len:
            raise SluiceError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(ids)} input tokens",
                param=param,
            )
        return ids

    async def tokenize_pooling(
        self,
        inputs: Sequence[str | Sequence[int]],
        *,
        add_special_tokens: bool = True,
        truncate_prompt_tokens: int | None = None,
        truncation_side: Literal["left", "right"] | None = None,
        param: str = "input",
    ) -> list[list[int]]:
        out = []
        for item in inputs:
            ids = [b % 200 + 1 for b in item.encode()] if isinstance(item, str) else list(item)
            out.append(self._checked(ids, truncate_prompt_tokens, param))
        return out

    async def tokenize_pairs(
        self,
        query: str,
        documents: Sequence[str],
        params: Any,
        *,
        truncate_prompt_tokens: int | None = None,
        truncation_side: Literal["left", "right"] | None = None,
    ) -> list[tuple[list[int], Any]]:
        return [
            (
                self._checked(
                    [b % 200 + 1 for b in (query + d).encode()], truncate_prompt_tokens, "documents"
                ),
                params,
            )
            for d in documents
        ]

    def vector(self, ids: Sequence[int], dimensions: int | None = None) -> Any:
        """The fake model's embedding of `ids`: a unit vector seeded by them."""
        seed = int.from_bytes(hashlib.sha256(bytes(i % 256 for i in ids)).digest()[:4], "little")
        v = np.random.RandomState(seed).standard_normal(dimensions or self.embed_dims)
        return (v / np.linalg.norm(v)).astype(np.float32)

    async def _hold(self, rid: str) -> None:
        """Wait for `first_output`, if set, named in `held` meanwhile."""
        if self.first_output is not None:
            self.held.add(rid)
            try:
                await self.first_output.wait()
            finally:
                self.held.discard(rid)

    async def _pool(self, rid: str, ids: tuple[int, ...], params: Any, collector: Any) -> None:
        try:
            await self._hold(rid)
            await asyncio.sleep(self.step)
            if params.task == "classify":
                data = np.array([1.0 / (1.0 + sum(ids) % 97)], dtype=np.float32)
            else:
                data = self.vector(ids, params.dimensions)
            collector.put(Pooled(data=data, prompt_tokens=len(ids), num_cached_tokens=0))
        finally:
            self._producers.pop(rid, None)

    def prefix_hashes(
        self, prompt_tokens: Sequence[int], cache_salt: str | None, adapter: Adapter | None = None
    ) -> tuple[int, ...]:
        """As vLLM chains them (server/engines/vllm_prefix.py): each full block's
        hash covers its parent's, the first block's the salt and the adapter."""
        self.hashed += 1
        self.hashed_tokens.append(len(prompt_tokens))
        out: list[int] = []
        parent = f"{cache_salt or ''}|{adapter.name if adapter else ''}".encode()
        size = self.block_size
        for start in range(0, len(prompt_tokens) - size + 1, size):
            block = ",".join(map(str, prompt_tokens[start : start + size])).encode()
            parent = hashlib.sha256(parent + b"|" + block).digest()
            out.append(int.from_bytes(parent[:8], "big"))
        return tuple(out)

    async def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: Any,
        priority: int,
        adapter: Adapter | None = None,
        cache_salt: str | None = None,
        rank: int | None = None,
        background: bool = False,
    ) -> FakeCollector:
        if self._dead:
            raise SluiceError("the engine died; retry shortly", status=503, retry_after=5)
        collector = FakeCollector()
        self.background[request_id] = background
        if hasattr(params, "task"):
            self.added.append(request_id)
            self.priorities[request_id] = priority
            self.salts[request_id] = cache_salt
            self.pooled.append((request_id, tuple(prompt), params))
            self._producers[request_id] = asyncio.create_task(
                self._pool(request_id, tuple(prompt), params, collector)
            )
            self.peak_running = max(self.peak_running, len(self._producers))
            return collector
        self.added.append(request_id)
        self.priorities[request_id] = priority
        self.adapters[request_id] = adapter.name if adapter is not None else None
        self.salts[request_id] = cache_salt
        self.ranks[request_id] = rank
        self._producers[request_id] = asyncio.create_task(
            self._produce(request_id, params, collector, tuple(prompt))
        )
        self.peak_running = max(self.peak_running, len(self._producers))
        return collector

    async def _produce(
        self, rid: str, params: Any, collector: FakeCollector, prompt: tuple[int, ...]
    ) -> None:
        s = params.sampling
        # Asked for, the prompt's logprobs come with the first output, as vLLM's do:
        # None for the first token, then each token as the only (rank 1) candidate.
        prompt_lps = (
            None
            if s.prompt_logprobs is None
            else [None, *({t: FakeLogprob(-1.0, 1)} for t in prompt[1:])]
        )
        words = self.script or ("<think>", "hmm", "</think>", "Hello", " world")
        steps = params.max_tokens if self.script is None else min(len(words), params.max_tokens)
        try:
            await self._hold(rid)
            for i in range(steps):
                await asyncio.sleep(self.step)
                last = i == steps - 1
                reason = "length" if steps == params.max_tokens else "stop"
                outs = []
                for j in range(params.n):
                    text = words[i % len(words)] if not s.stop or i < 3 else ""
                    ids = (
                        [i + 1]
                        if self.tokenizer is None
                        else self.tokenizer.encode(text, add_special_tokens=False)
                    )
                    outs.append(
                        FakeCompletion(
                            index=j,
                            text=text,
                            token_ids=ids,
                            finish_reason=reason if last else None,
                        )
                    )
                collector.put(
                    FakeOutput(rid, outs, last, prompt_logprobs=prompt_lps if i == 0 else None)
                )
                self.outputs_put += 1
        finally:
            self._producers.pop(rid, None)

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.aborted.append(rid)
            task = self._producers.pop(rid, None)
            if task is not None:
                task.cancel()

    async def load_adapter(self, adapter: Adapter) -> None:
        if self.load_error is not None:
            raise SluiceError(
                f"LoRA adapter {adapter.name!r} failed to load: {self.load_error}",
                code="adapter_load_failed",
            )
        self.loaded.append(adapter)

    async def sleep(self) -> None:
        self.sleeps += 1
        self.asleep = True

    async def wake_up(self) -> None:
        self.asleep = False

    def kill(self) -> None:
        """Fault injection: the engine dies; every collector gets an error."""
        self._dead = True
        for task in list(self._producers.values()):
            task.cancel()


def now() -> float:
    return time.monotonic()


if TYPE_CHECKING:
    # The fake must keep up with the engine seam: drift is a type error here.
    _check: Engine = FakeEngine()
