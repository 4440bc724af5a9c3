"""The engine seam: what the rest of Sluice may ask of an engine, as types.

Why this module exists: the driver, the pipeline and the app talk to the engine
only through the `Engine` Protocol below. `server/engines/vllm_adapter.py` (the vLLM adapter)
implements it for production and `tests/fakes.py` for unit tests; mypy checks
both against it, so a drift in either is a type error, not a `getattr`
workaround. Nothing here imports vLLM.

The output types describe the part of vLLM's `RequestOutput` / `CompletionOutput`
Sluice reads (structurally: vLLM's own classes satisfy them unchanged).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from batching import Charge, EngineStep
from batching.pressure import EngineStats
from batching.step_share import StepCounters
from server.engines.lora import Adapter
from server.errors import SluiceError
from server.wire.output import FinishReason, Parsed, ParsedDelta
from server.wire.request import ChatRequest, Constraint, Message, Sampling

__all__ = [
    "KIND_SERVES",
    "ChatParser",
    "ChoiceParser",
    "CompletionDelta",
    "Engine",
    "EngineOutput",
    "EngineParams",
    "Kind",
    "ModelInfo",
    "OutputStream",
    "PoolTask",
    "Pooled",
    "PoolingParamsLike",
    "SamplingParamsLike",
    "Service",
    "refuse_kind",
]

# What the served model does, read from vLLM's model config at start
# (server/engines/vllm_pooling.py, model_kind): "generate" (vLLM's generate
# runner: chat, completions, Responses, Messages), "embed" (the pooling runner
# with the embed task: /v1/embeddings, and /v1/rerank by cosine similarity, a
# bi-encoder), "rerank" (the classify task with one label: a cross-encoder,
# /v1/rerank), "pooling" (another pooling task, which no endpoint here serves).
Kind = Literal["generate", "embed", "rerank", "pooling"]
# What a request asks of the model: generation, embeddings or reranking.
Service = Literal["generate", "embed", "rerank"]
# The pooling task an engine request runs (vLLM's PoolingParams.task).
PoolTask = Literal["embed", "classify"]

KIND_SERVES: dict[Kind, tuple[Service, ...]] = {
    "generate": ("generate",),
    "embed": ("embed", "rerank"),
    "rerank": ("rerank",),
    "pooling": (),
}
_KIND_WORDS: dict[Kind, str] = {
    "generate": "a generative model (it serves chat, completions, Responses and Messages)",
    "embed": "an embedding model (it serves /v1/embeddings and /v1/rerank)",
    "rerank": "a reranker (it serves /v1/rerank)",
    "pooling": "a pooling model for a task no endpoint here serves",
}
_SERVICE_WORDS: dict[Service, str] = {
    "generate": "generation needs a generative model",
    "embed": "/v1/embeddings needs an embedding model",
    "rerank": "/v1/rerank needs an embedding model or a reranker",
}


def refuse_kind(model: str, kind: Kind, want: Service) -> SluiceError | None:
    """The 400 for a request the model cannot serve (a chat request to an
    embedding model, an embeddings request to a chat model), naming the model
    and what it serves; None when it serves `want`."""
    if want in KIND_SERVES[kind]:
        return None
    return SluiceError(
        f"model {model!r} is {_KIND_WORDS[kind]}; {_SERVICE_WORDS[want]}",
        param="model",
        code="wrong_model_kind",
    )


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engine resolved at start: the model and the scheduler's capacity."""

    name: str
    max_model_len: int
    eos_token_id: int | None
    created: int
    # The model's generation_config defaults (Qwen3: temperature 0.6, top_p
    # 0.95, top_k 20), applied where a request leaves a field out, as vLLM's
    # own server does.
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    # The generation config's max_new_tokens (or --override-generation-config's):
    # the max_tokens of a request that gives none, as vLLM's server takes it
    # (its get_max_tokens); None: the rest of the context.
    default_max_tokens: int | None = None
    # The engine scheduler's resolved limits (0: not known yet).
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    kv_cache_tokens: int = 0  # num_gpu_blocks x block_size, summed over DP ranks
    # The block size of the engine's prefix cache, the blocks `prefix_hashes`
    # hashes; 0: its prefix cache is off (no prefix-warm order, batching/warm.py).
    prefix_block: int = 0
    # Data-parallel ranks this engine client feeds (server/engines/vllm_adapter.py, dp_ranks):
    # max_num_seqs and max_num_batched_tokens are each rank's.
    dp_ranks: int = 1
    # LoRA adapters one engine step may batch (vLLM's max_loras); 0: LoRA off.
    max_loras: int = 0
    # vLLM's per-prompt prefill chunk per step (long_prefill_token_threshold,
    # server/engines/step_flags.py); 0: no cap.
    prefill_chunk: int = 0
    # The engine runs Sluice's scheduler (server/engines/vllm_scheduler.py): it puts
    # interactive work first in its steps (batching/room.py rule 8 relies on it).
    interactive_first: bool = False
    # True: the reasoning parser is qwen3 (or there are no parsers), so
    # requests without tools take server/engines/reasoning_split.py's copy of its split;
    # False: vLLM's parsers (chat_parser) read every chat request.
    qwen3_split: bool = True
    # What the model serves (see Kind); one engine serves one kind.
    kind: Kind = "generate"


class CompletionDelta(Protocol):
    """One choice's new tokens in one engine output (vLLM's CompletionOutput)."""

    @property
    def index(self) -> int: ...
    @property
    def text(self) -> str: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def logprobs(self) -> Any: ...  # vLLM: list of {token_id: Logprob} per token, or None
    @property
    def stop_reason(self) -> int | str | None: ...  # the stop string or token that ended it


class EngineOutput(Protocol):
    """One engine output of one request (vLLM's RequestOutput in DELTA mode)."""

    @property
    def outputs(self) -> Sequence[CompletionDelta]: ...
    @property
    def finished(self) -> bool: ...
    @property
    def num_cached_tokens(self) -> int | None: ...  # prompt tokens the prefix cache held
    @property
    def prompt_logprobs(self) -> Any: ...  # vLLM: {token_id: Logprob} | None per prompt token


@dataclass(frozen=True, slots=True)
class Pooled:
    """A pooling request's one output (vLLM's PoolingRequestOutput, read once by
    the adapter): `data` is a 1-D float32 NumPy array, an embedding or a
    cross-encoder's one score. It satisfies `EngineOutput` with no choices, so the
    driver counts no generated tokens and ends the request at this, its first
    and last output."""

    data: Any  # numpy.ndarray, float32, 1-D
    prompt_tokens: int
    num_cached_tokens: int | None = None
    finished: bool = True
    outputs: tuple[CompletionDelta, ...] = ()
    prompt_logprobs: None = None


class OutputStream(Protocol):
    """A request's outputs as they come (vLLM's RequestOutputCollector).

    `put` never blocks and merges into an unread output; an exception put there
    is raised by the next `get`.
    """

    def put(self, item: Any) -> None: ...
    async def get(self) -> EngineOutput: ...


class SamplingParamsLike(Protocol):
    """Opaque engine sampling parameters, built by `Engine.sampling_params`."""

    @property
    def n(self) -> int: ...


class PoolingParamsLike(Protocol):
    """Opaque engine pooling parameters, built by `Engine.pooling_params`."""

    @property
    def task(self) -> str | None: ...


# What `Engine.add` runs: a generation, or a pooling request.
EngineParams = SamplingParamsLike | PoolingParamsLike


class ChoiceParser(Protocol):
    """One streamed chat choice's parsing state (server/vllm_parsers.StreamParser)."""

    @property
    def called(self) -> bool: ...
    def start(self, prompt_token_ids: Sequence[int]) -> None: ...
    def feed(
        self, text: str, token_ids: Sequence[int] = (), *, finished: bool = False
    ) -> ParsedDelta: ...


class ChatParser(Protocol):
    """One chat request's output parsing with the engine's parsers: tool calls
    and the reasoning split (server/vllm_parsers.RequestParsing)."""

    @property
    def constraint(self) -> Constraint | None: ...  # what holds a forced call
    def parse(self, text: str, token_ids: Sequence[int] = ()) -> Parsed: ...
    def stream(self) -> ChoiceParser: ...
    def finish_reason(self, engine_reason: str | None, called: bool) -> FinishReason: ...


class Engine(Protocol):
    """The engine, as Sluice uses it."""

    @property
    def info(self) -> ModelInfo: ...
    @property
    def errored(self) -> bool: ...

    async def start(self) -> None: ...
    def shutdown(self) -> None: ...
    async def check_health(self) -> None: ...
    # (pid, exit code or None while it runs) of each engine core process it
    # started; () without processes of its own (server/engines/supervisor.py).
    def processes(self) -> tuple[tuple[int, int | None], ...]: ...
    def stats(self) -> EngineStats: ...
    # The engine steps reported since the previous call, oldest first, and the
    # callback called after each (server/engines/driver.py: the release follows the steps).
    def take_steps(self) -> list[EngineStep]: ...
    def watch_steps(self, callback: Callable[[], None] | None) -> None: ...
    # A request's share of the engine's steps, once it is done; forgets it
    # (batching/ledger.py). Zero for a request the engine never ran.
    def charge(self, request_id: str) -> Charge: ...
    # What Sluice's scheduler did with background work in this engine's steps,
    # summed over its ranks (batching/step_share.py); None without it.
    def step_share(self) -> StepCounters | None: ...
    # How many streamed interactive turns on a rank have shown their client no token
    # yet, for Sluice's scheduler there (batching/step_share.py rule 2); a no-op
    # without it.
    def set_unshown(self, rank: int, count: int) -> None: ...

    async def tokenize_chat(
        self, conversations: Sequence[tuple[Sequence[Message], dict[str, Any]]]
    ) -> list[list[int]]: ...
    async def tokenize_prompts(self, texts: Sequence[str]) -> list[list[int]]: ...
    def detokenize(self, ids: Sequence[int]) -> str: ...
    def tokenizer_info(self) -> dict[str, Any]: ...
    def count_tokens(self, text: str) -> int: ...  # plain text, no special tokens

    def chat_parser(self, req: ChatRequest) -> ChatParser: ...
    async def check_constraint(self, constraint: Constraint) -> None: ...
    def sampling_params(self, s: Sampling, max_tokens: int) -> SamplingParamsLike: ...

    # Pooling models (info.kind "embed" or "rerank"; server/engines/vllm_pooling.py).
    # Each raises a SluiceError (400) naming the field for input the model refuses.
    def pooling_params(
        self, task: PoolTask, dimensions: int | None = None, use_activation: bool | None = None
    ) -> PoolingParamsLike: ...
    async def tokenize_pooling(
        self,
        inputs: Sequence[str | Sequence[int]],
        *,
        add_special_tokens: bool = True,
        truncate_prompt_tokens: int | None = None,
        truncation_side: Literal["left", "right"] | None = None,
        param: str = "input",
    ) -> list[list[int]]: ...
    async def tokenize_pairs(
        self,
        query: str,
        documents: Sequence[str],
        params: PoolingParamsLike,
        *,
        truncate_prompt_tokens: int | None = None,
        truncation_side: Literal["left", "right"] | None = None,
    ) -> list[tuple[list[int], PoolingParamsLike]]: ...

    # The prompt's prefix block hashes as the engine's prefix cache chains them
    # (its block size and hash, `cache_salt` in the first block), each as an
    # int, for prefix placement across data-parallel ranks (batching/prefix.py);
    # () where the engine's prefix cache is off or Sluice names no rank.
    def prefix_hashes(
        self, prompt_tokens: Sequence[int], cache_salt: str | None, adapter: Adapter | None = None
    ) -> tuple[int, ...]: ...

    async def add(
        self,
        request_id: str,
        prompt_tokens: Sequence[int],
        params: EngineParams,
        priority: int,
        adapter: Adapter | None = None,  # a LoRA adapter, None: the base weights
        # The prefix-cache salt (vLLM's cache_salt): requests with different
        # salts never share cached blocks; None: the shared cache.
        cache_salt: str | None = None,
        # The data-parallel rank to run it on (batching/room.py `place`); None:
        # the engine's own choice.
        rank: int | None = None,
        # Background work (batching/classes.py): the engine's scheduler puts
        # interactive work first in its steps (server/engines/vllm_scheduler.py).
        background: bool = False,
    ) -> OutputStream: ...
    async def abort(self, request_ids: Sequence[str]) -> None: ...
    # Load a LoRA adapter into the engine now; SluiceError (400) naming the cause.
    async def load_adapter(self, adapter: Adapter) -> None: ...
    # vLLM's sleep mode (an engine started with --enable-sleep-mode; CUDA, ROCm
    # and XPU only): `sleep` moves the weights to host memory and drops the KV
    # cache, freeing the card; `wake_up` brings them back, in seconds rather
    # than an engine start (server/engines/loader.py swaps on-demand models so).
    async def sleep(self) -> None: ...
    async def wake_up(self) -> None: ...
