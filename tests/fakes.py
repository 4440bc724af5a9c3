"""Test doubles for unit tests and fault injection: a fake engine.

`FakeEngine` has the EngineAdapter's surface (server/engine.py) and produces
vLLM-shaped outputs (RequestOutput deltas with CompletionOutputs) on a timer,
so the handlers, the driver and the streaming path run for real without vLLM.
It is never used outside tests/; integration tests run the real engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from server.engine_api import ModelInfo
from server.errors import SluiceError
from server.protocol import ChatRequest, Constraint, Message, Sampling
from server.watchdog import ENGINE_IDLE, EngineStats

if TYPE_CHECKING:
    from server.engine_api import Engine


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


class FakeCollector:
    """vLLM's RequestOutputCollector contract: put never blocks, get merges."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.ready = asyncio.Event()

    def put(self, item: Any) -> None:
        self.items.append(item)
        self.ready.set()

    async def get(self) -> Any:
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class FakeEngine:
    max_model_len: int = 256
    step: float = 0.002  # seconds per generated token
    start_delay: float = 0.0
    fail_start: bool = False
    max_num_seqs: int = 64  # reported in ModelInfo: the core's engine slots
    added: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    _producers: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _dead: bool = False
    stats_value: EngineStats = ENGINE_IDLE
    peak_running: int = 0  # most requests producing at once
    priorities: dict[str, int] = field(default_factory=dict)  # engine priority per request
    # Set: every choice says these pieces, one per step, then stops (else the
    # fake repeats a thinking pattern until max_tokens).
    script: tuple[str, ...] | None = None
    # A real tokenizer (the demo model's) for tests of tool calls: the script's
    # token ids come from it, and chat_parser gives vLLM's real parsers on it
    # (they read the tags by token id). None: chat_parser refuses.
    tokenizer: Any = None
    _parsers: Any = None
    constraints: list[Constraint] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.info = ModelInfo(
            name="fake",
            max_model_len=self.max_model_len,
            eos_token_id=0,
            created=0,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=2048,
        )
        self.started = False
        self.shut_down = False

    async def start(self) -> None:
        await asyncio.sleep(self.start_delay)
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

    def stats(self) -> EngineStats:
        return self.stats_value

    @property
    def unfinished(self) -> set[str]:
        return set(self._producers)

    async def tokenize_chat(
        self, conversations: Sequence[tuple[Sequence[Message], dict[str, Any]]]
    ) -> list[list[int]]:
        out = []
        for messages, kwargs in conversations:
            text = "".join(f"<{m.role}>{m.content}" for m in messages)
            if not kwargs.get("enable_thinking", True):
                text += "<nothink>"
            out.append([b % 200 + 1 for b in text.encode()])
        return out

    async def tokenize_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        return [[b % 200 + 1 for b in t.encode()] for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        return "".join(chr(96 + i % 26) for i in ids)

    def chat_parser(self, req: ChatRequest) -> Any:
        if self.tokenizer is None:
            raise SluiceError("no parsers in this fake", param="tools", code="unsupported")
        if self._parsers is None:
            from server.vllm_parsers import OutputParsers

            self._parsers = OutputParsers(self.tokenizer)
        return self._parsers.for_request(req)

    async def check_constraint(self, constraint: Constraint) -> None:
        if constraint.kind == "regex" and constraint.value == "(":
            raise SluiceError("bad regex", param=constraint.param, code="invalid_value")
        self.constraints.append(constraint)

    @staticmethod
    def sampling_params(s: Sampling, max_tokens: int) -> Any:
        return SimpleNamespace(sampling=s, n=s.n, max_tokens=max_tokens)

    async def add(
        self, request_id: str, prompt: Sequence[int], params: Any, priority: int
    ) -> FakeCollector:
        if self._dead:
            raise SluiceError("the engine died; retry shortly", status=503, retry_after=5)
        collector = FakeCollector()
        self.added.append(request_id)
        self.priorities[request_id] = priority
        self._producers[request_id] = asyncio.create_task(
            self._produce(request_id, params, collector)
        )
        self.peak_running = max(self.peak_running, len(self._producers))
        return collector

    async def _produce(self, rid: str, params: Any, collector: FakeCollector) -> None:
        s = params.sampling
        words = self.script or ("<think>", "hmm", "</think>", "Hello", " world")
        steps = params.max_tokens if self.script is None else min(len(words), params.max_tokens)
        try:
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
                collector.put(FakeOutput(rid, outs, last))
        finally:
            self._producers.pop(rid, None)

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.aborted.append(rid)
            task = self._producers.pop(rid, None)
            if task is not None:
                task.cancel()

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
