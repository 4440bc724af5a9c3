"""The engine adapter: the one module (with server/cli.py) that imports vLLM.

It owns one vLLM `AsyncLLM` built from the CLI's engine flags, resolved as
`vllm serve` resolves them (`engine_config`), and offers the rest of Sluice a
small surface:

* `tokenize_chat` / `tokenize_prompts`: tokenization on our side, so the
  engine gets token ids: small inputs on the loop (cheaper than a thread
  hop), long documents on a worker thread, batched across the requests that
  arrive while the previous batch runs (server/engines/thread_batcher.py). The chat
  template is applied by the engine's own renderer, as vLLM's server does;
* `chat_parser` / `check_constraint`: tool calls, the reasoning split and
  structured outputs through vLLM's own parsers (server/engines/vllm_parsers.py);
* `sampling_params`: our frozen `Sampling` value to vLLM's `SamplingParams`,
  always in DELTA mode, so a lagging reader gets several tokens merged into
  one output instead of a backlog (vLLM's RequestOutputCollector merges them);
* `add`: one request to the engine as a rendered token input (the engine
  input type vLLM's renderer produces; raw prompts are deprecated in vLLM
  0.32). The driver calls it back to back for the entries of a batch, in
  the core's order, with their priorities;
* a pooling model (vLLM's pooling runner: embeddings, rerank): its kind,
  `pooling_params`, `tokenize_pooling` and `tokenize_pairs`, delegated to
  server/engines/vllm_pooling.py, and `add` with pooling parameters;
* `abort`, `stats`, `take_steps`, `watch_steps`, `errored`, `check_health`,
  `shutdown`.

Engine statistics (KV-cache use, running/waiting, prefix-cache hits,
preemptions, and each step's scheduled tokens) arrive through a vLLM stat
logger registered at construction.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from vllm import PoolingParams, SamplingParams
from vllm.config import VllmConfig
from vllm.entrypoints.serve.tokenize.serving import TokenizerInfo
from vllm.envs import enable_envs_cache
from vllm.inputs.engine import tokens_input
from vllm.lora.request import LoRARequest
from vllm.renderers.params import ChatParams
from vllm.sampling_params import RequestOutputKind
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase

from batching import Charge, EngineStep, StepLedger, StepOutput
from batching.pressure import ENGINE_IDLE, EngineStats, RankStats
from batching.step_share import StepCounters
from server.engines import start_priority
from server.engines.board import ENV as BOARD_ENV
from server.engines.board import PRIORITY_KEY, SEAT_KEY, Board, allocate
from server.engines.interface import ModelInfo, PoolTask
from server.engines.lora import Adapter, ModelShapes, check_shapes
from server.engines.procs import process_tree
from server.engines.start_priority import StartPriority
from server.engines.thread_batcher import Batcher
from server.engines.vllm_parsers import (
    OutputParsers,
    RequestParsing,
    check_constraint,
    to_structured_outputs,
)
from server.engines.vllm_pooling import PooledStream, Pooling, Side, model_kind
from server.engines.vllm_prefix import PrefixHasher
from server.engines.vllm_scheduler import mark
from server.errors import SluiceError
from server.wire.request import ChatRequest, Constraint, Message, Sampling, merge_system

if TYPE_CHECKING:
    from server.engines.registry import ModelSpec

log = logging.getLogger("sluice.engine")

__all__ = [
    "USAGE_CONTEXT",
    "EngineAdapter",
    "EngineDeadError",
    "EngineStats",
    "dp_ranks",
    "engine_config",
    "generation_defaults",
]

# The usage context `vllm serve` builds its engine with
# (build_async_engine_client_from_engine_args, vLLM 0.32). vLLM picks its batch
# defaults by it (EngineArgs.get_batch_defaults): on a 24 GB card 256 sequences
# and 2,048 batched tokens, on an H100/H200 1,024 and 8,192, where the plain
# engine context gets 128 and 2,048 everywhere. On CPU both give 128 x 2,048.
USAGE_CONTEXT = UsageContext.OPENAI_API_SERVER

# Inputs up to this many characters (a chat turn, a short prompt: tens of
# microseconds to tokenize) are tokenized on the event loop; larger ones on the
# tokenizer thread, a few per call (see server/engines/thread_batcher.py).
INLINE_TOKENIZE_CHARS = 1024
# SamplingParams.extra_args key carrying Constraint.from_start to `add`.
_FROM_START = "sluice_constraint_from_start"


# Engine steps kept for the driver between two of its looks (it looks after
# each step while the backlog holds work; otherwise at the next request or
# finish). An idle engine runs no steps; the bound only matters if nobody looks.
_STEPS_KEPT = 4096
# The window of EngineStats.longest_step_s, in seconds.
_LONGEST_STEP_WINDOW_S = 60.0


class _StatsBox:
    """Latest engine statistics, written by vLLM's stat logger, read by anyone.

    vLLM calls the logger from its output handler on the event loop; a lock
    keeps the reading consistent should that ever move to a thread.

    Each step that carries vLLM's iteration details (the tokens it scheduled:
    --enable-logging-iteration-details, which Sluice turns on, server/cli.py)
    becomes an `EngineStep` for the core (batching/room.py), kept until the
    driver takes them, and `on_step` is called after it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = ENGINE_IDLE
        self._steps: deque[EngineStep] = deque(maxlen=_STEPS_KEPT)
        self.on_step: Callable[[], None] | None = None
        # Data-parallel ranks' latest scheduler numbers, by engine index: each
        # rank's logger reports only its own (vLLM's PerEngineStatLoggerAdapter).
        self._ranks: dict[int, RankStats] = {}
        # Each rank's own preemptions, cumulative: the watchdog judges a storm per
        # rank (batching/pressure.py says why).
        self._preempted: dict[int, int] = {}
        # Each rank's prefix-cache (queries, hits) in tokens, cumulative.
        self._prefix: dict[int, tuple[int, int]] = {}
        self._longest = _LongestStep(_LONGEST_STEP_WINDOW_S)

    def get(self) -> EngineStats:
        with self._lock:
            return self._stats

    def take_steps(self) -> list[EngineStep]:
        """The steps recorded since the previous call, oldest first."""
        with self._lock:
            steps = list(self._steps)
            self._steps.clear()
        return steps

    def record(self, scheduler_stats: Any, iteration_stats: Any, rank: int = 0) -> None:
        stepped = self._record(scheduler_stats, iteration_stats, rank)
        if stepped and self.on_step is not None:
            self.on_step()

    def _record(self, scheduler_stats: Any, iteration_stats: Any, rank: int) -> bool:
        with self._lock:
            s = self._stats
            preempted = getattr(iteration_stats, "num_preempted_reqs", 0) if iteration_stats else 0
            self._preempted[rank] = self._preempted.get(rank, 0) + preempted
            if scheduler_stats is None:
                if preempted:
                    self._stats = dataclasses.replace(
                        s, preemptions_total=s.preemptions_total + preempted
                    )
                return False
            pc = scheduler_stats.prefix_cache_stats
            q, h = self._prefix.get(rank, (0, 0))
            q, h = self._prefix[rank] = (q + int(pc.queries), h + int(pc.hits))
            rank_stats = self._ranks[rank] = RankStats(
                kv_cache_usage=float(scheduler_stats.kv_cache_usage),
                running=int(scheduler_stats.num_running_reqs),
                waiting=int(scheduler_stats.num_waiting_reqs),
                preemptions_total=self._preempted[rank],
                prefix_cache_queries_total=q,
                prefix_cache_hits_total=h,
            )
            step = engine_step(scheduler_stats, rank_stats, rank)
            if step is not None:
                self._steps.append(step)
            seconds = step_seconds(scheduler_stats)
            ranks = tuple(self._ranks[i] for i in sorted(self._ranks))
            waited = s.adapter_wait_steps_total + adapter_waited(scheduler_stats)
            self._stats = EngineStats(
                kv_cache_usage=sum(r.kv_cache_usage for r in ranks) / len(ranks),
                running=sum(r.running for r in ranks),
                waiting=sum(r.waiting for r in ranks),
                preemptions_total=s.preemptions_total + preempted,
                prefix_cache_queries_total=s.prefix_cache_queries_total + int(pc.queries),
                prefix_cache_hits_total=s.prefix_cache_hits_total + int(pc.hits),
                ranks=ranks if len(ranks) > 1 else (),
                adapter_wait_steps_total=waited,
                steps_total=s.steps_total + 1,
                prefill_tokens_total=s.prefill_tokens_total + (step.prefill_tokens if step else 0),
                decode_tokens_total=s.decode_tokens_total + (step.decode_tokens if step else 0),
                step_seconds_total=s.step_seconds_total + seconds,
                longest_step_s=self._longest.add(time.monotonic(), seconds),
            )
            return step is not None


class _LongestStep:
    """The longest step of a sliding window: (time, seconds) pairs kept in falling
    order of seconds, so the first one is the window's longest."""

    def __init__(self, window: float) -> None:
        self._window = window
        self._kept: deque[tuple[float, float]] = deque()

    def add(self, now: float, seconds: float) -> float:
        """Count one step that ended `now`; the window's longest step after it."""
        kept = self._kept
        while kept and kept[-1][1] <= seconds:
            kept.pop()
        kept.append((now, seconds))
        while kept[0][0] < now - self._window:
            kept.popleft()
        return kept[0][1]


def engine_step(scheduler_stats: Any, rank_stats: RankStats, rank: int) -> EngineStep | None:
    """One rank's step as the core reads it, from vLLM 0.32's SchedulerStats; None
    without iteration details (the flag off, a step that scheduled nothing, or a
    data-parallel rank's dummy step that keeps it in step with the others).

    `iteration_details` (vllm/v1/metrics/stats.py, SchedulerIterationDetails)
    counts a request as "context" while it has no output token yet (a whole
    prompt or a chunk of one) and as "generation" after. Waiting counts the
    requests the scheduler deferred too (num_skipped_waiting_reqs): they are work
    the engine holds and could not schedule.
    """
    d = getattr(scheduler_stats, "iteration_details", None)
    if d is None or d.is_dummy:
        return None
    skipped = int(getattr(scheduler_stats, "num_skipped_waiting_reqs", 0) or 0)
    return EngineStep(
        rank=rank,
        prefill_tokens=int(d.num_ctx_tokens),
        decode_tokens=int(d.num_generation_tokens),
        requests=int(d.num_ctx_requests) + int(d.num_generation_requests),
        running=rank_stats.running,
        waiting=rank_stats.waiting + skipped,
        kv_usage=rank_stats.kv_cache_usage,
    )


def step_seconds(scheduler_stats: Any) -> float:
    """How long the step ran, in seconds: vLLM 0.32's iteration details time the step
    from its scheduled batch to the model's output (EngineCore.capture_iteration_details,
    elapsed_ms); 0 without details or for a dummy step."""
    d = getattr(scheduler_stats, "iteration_details", None)
    if d is None or d.is_dummy:
        return 0.0
    return float(d.elapsed_ms) / 1000.0


def adapter_waited(scheduler_stats: Any) -> bool:
    """Did this step leave an adapter's work waiting with none of it running?

    vLLM 0.32's SchedulerStats carry, per LoRA adapter name, its waiting and running
    requests (vllm/v1/metrics/stats.py, LoRARequestStates; empty with LoRA off). An
    adapter with waiting requests and none running could not be scheduled in this
    step: its slot (max_loras) was taken, or it was loading. A request scheduled in
    the step it arrived reports both events in one output, so it does not count.
    """
    waiting: dict[str, int] = getattr(scheduler_stats, "waiting_lora_adapters", None) or {}
    running: dict[str, int] = getattr(scheduler_stats, "running_lora_adapters", None) or {}
    return any(n > 0 and not running.get(name) for name, n in waiting.items())


def _stat_logger_factory(box: _StatsBox) -> Callable[..., StatLoggerBase]:
    class SluiceStatLogger(StatLoggerBase):  # type: ignore[misc]
        """Feeds the engine's per-step statistics into Sluice's _StatsBox."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            box.record(scheduler_stats, iteration_stats, self.engine_index)

        def log_engine_initialized(self) -> None:
            pass

    return SluiceStatLogger


def engine_config(engine_args: Any) -> VllmConfig:
    """The engine configuration vLLM's OpenAI server resolves for these flags.

    `create_engine_config` writes the defaults it picks back into the args it
    is given, so it works on a copy: the caller's flags stay as typed.
    """
    config: VllmConfig = copy.deepcopy(engine_args).create_engine_config(
        usage_context=USAGE_CONTEXT
    )
    return config


def generation_defaults(model_config: Any) -> tuple[tuple[tuple[str, float], ...], int | None]:
    """The model's generation_config defaults a request leaves out (Qwen3:
    temperature 0.6, top_p 0.95, top_k 20) and its max_new_tokens, as vLLM's
    server applies them (`get_diff_sampling_param`): from a resolved config,
    so known before the engine starts (an on-demand model's requests are
    parsed before its load)."""
    from server.wire.request import DEFAULTABLE

    diff = model_config.get_diff_sampling_param()
    defaults = tuple(sorted((k, float(v)) for k, v in diff.items() if k in DEFAULTABLE))
    return defaults, int(diff["max_tokens"]) if diff.get("max_tokens") else None


def max_logprobs(engine_args: Any) -> int:
    """The most logprobs (and prompt logprobs) one request may ask for: vLLM's
    ``--max-logprobs`` (default 20), so Sluice refuses in the API's shape what
    the engine would refuse. -1 (vLLM: the vocabulary's size) lifts Sluice's
    bound and leaves the check to the engine's own."""
    value = int(engine_args.max_logprobs)
    return value if value >= 0 else 2**31 - 1


def dp_ranks(config: VllmConfig) -> int:
    """How many data-parallel engine cores this process's AsyncLLM feeds.

    vLLM 0.32's engine client (MPClient, core_client.py) manages every rank
    with its internal load balancer (--data-parallel-size N: N cores, its DP
    coordinator balancing), only the local ones in hybrid or external-LB mode
    (`local_engines_only`), and one when the process is pinned to a rank
    (`data_parallel_rank_local` set). Tensor and pipeline parallelism keep
    one scheduler per rank: they do not count here.
    """
    p = config.parallel_config
    if p.data_parallel_rank_local is not None:
        return 1
    return int(p.data_parallel_size_local if p.local_engines_only else p.data_parallel_size)


def names_ranks(config: VllmConfig) -> bool:
    """Does a request's `data_parallel_rank` name one of this client's ranks as the
    core numbers them (0 .. dp_ranks - 1)? Only with vLLM's internal load balancer
    over every rank: in hybrid or external-LB mode the client's engines are a slice
    of the global ranks, and Sluice leaves placement to vLLM there."""
    p = config.parallel_config
    return p.data_parallel_rank_local is None and not p.local_engines_only and dp_ranks(config) > 1


def lora_request(adapter: Adapter) -> LoRARequest:
    """vLLM's LoRARequest for an adapter: the one place that makes one.

    vLLM keys its adapter cache by `lora_int_id` and compares requests by
    name; both come from the registry (server/engines/lora.py rule 1). A msgspec
    struct: about a microsecond to build, so it is made per request rather
    than cached against adapters that runtime loading may replace.
    """
    return LoRARequest(
        lora_name=adapter.name,
        lora_int_id=adapter.id,
        lora_path=adapter.path,
        base_model_name=adapter.parent,
    )


def max_loras(config: VllmConfig) -> int:
    """The adapters one engine step may batch (vLLM's --max-loras); 0 with LoRA off
    (`lora_config` is None), when the backlog's LoRA slots do not apply."""
    lora = config.lora_config
    return int(lora.max_loras) if lora is not None else 0


class _NoIterationLines(logging.Filter):
    """Drops vLLM's own log line per engine step.

    With --enable-logging-iteration-details (which Sluice turns on to read each
    step's tokens) vLLM's logging stat logger writes one INFO line per step and
    rank (LoggingStatLogger._log_iteration_details, vLLM 0.32): tens to hundreds
    a second into the journal. Its summary every 10 s stays.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("%sIteration("))


_VLLM_STAT_LOG = logging.getLogger("vllm.v1.metrics.loggers")


def _build_engine(
    engine_args: Any,
    stat_logger: Callable[..., StatLoggerBase],
    slot: int | None,
    priority: StartPriority | None = None,
) -> AsyncLLM:
    """Construct the engine as `vllm serve` does (blocking: seconds to minutes), with
    Sluice's scheduler where it has a board slot (server/engines/vllm_scheduler.py),
    told the start priority where its rule 6 may lower and raise its own."""
    if not any(isinstance(f, _NoIterationLines) for f in _VLLM_STAT_LOG.filters):
        _VLLM_STAT_LOG.addFilter(_NoIterationLines())
    config = engine_config(engine_args)
    if slot is not None:
        sched = config.scheduler_config
        name = "InteractiveFirstAsync" if sched.async_scheduling else "InteractiveFirst"
        sched.scheduler_cls = f"server.engines.vllm_scheduler.{name}"
        extra = config.additional_config if isinstance(config.additional_config, dict) else {}
        config.additional_config = {**extra, SEAT_KEY: slot}
        if priority is not None and priority.start is not None:  # start_priority.py 3, 4
            config.additional_config[PRIORITY_KEY] = [priority.start, priority.serve]
    return AsyncLLM.from_vllm_config(
        config,
        usage_context=USAGE_CONTEXT,
        stat_loggers=[stat_logger],
        enable_log_requests=engine_args.enable_log_requests,
        aggregate_engine_logging=engine_args.aggregate_engine_logging,
        disable_log_stats=engine_args.disable_log_stats,
    )


def lighten_output_path(llm: Any) -> None:
    """Take out of vLLM's in-process output path what Sluice pays for per output
    and never uses (issue 27: on 2 cores the front's CPU is taken from the engine).

    * vLLM reads an environment variable for every output of every request
      (`envs.VLLM_COMPUTE_NANS_IN_LOGITS` in IterationStats.update_from_output): 5 us
      a read here, uncached. Its engine-core processes cache them once started
      (`enable_envs_cache`, vllm/v1/engine/core.py); so does this process once the
      engine is built. Nothing in Sluice sets a VLLM_ variable after start.
    * vLLM adds its PrometheusStatLogger to every AsyncLLM: per step a histogram
      observation per decoding request, per finished request a dozen more (1.6 us
      per output, measured), into prometheus_client's global registry, which
      Sluice never serves (`/metrics` is its own registry, server/operations/metrics.py).
      Sluice's own stat logger and vLLM's others stay.
    """
    enable_envs_cache()
    manager = getattr(llm, "logger_manager", None)
    if manager is not None:
        manager.stat_loggers = [
            lg for lg in manager.stat_loggers if not isinstance(lg, PrometheusStatLogger)
        ]


def watch_outputs(llm: Any, observe: Callable[[Any], None]) -> None:
    """Call `observe` with each step's EngineCoreOutputs as the engine client
    receives them, before vLLM's output handler hands them to the requests'
    collectors: a reader that sees its last output finds its step accounted
    (batching/ledger.py). vLLM 0.32's AsyncLLM.output_handler looks up
    `engine_core.get_output_async` on each pass, so an instance attribute
    takes its place, from the next pass on."""
    core = llm.engine_core
    get = core.get_output_async

    async def get_output_async() -> Any:
        outputs = await get()
        observe(outputs)
        return outputs

    core.get_output_async = get_output_async


def step_outputs(outputs: Any, states: Mapping[str, Any]) -> list[StepOutput]:
    """One step's outputs by Sluice's request ids. vLLM 0.32 gives each request
    an internal id (the given id and 8 random characters, input_processor.py), and
    each sample of an n > 1 request its own child; the output processor's
    states map both back (`external_req_id`, the parent's for a child). A prompt's
    first output carries what the engine computed of it (`prefill_stats`: the
    prompt less the prefix cache's hit)."""
    found = []
    for eco in outputs.outputs:
        state = states.get(eco.request_id)
        if state is None:
            continue
        parent = state.parent_req
        ps = eco.prefill_stats
        found.append(
            StepOutput(
                state.external_req_id if parent is None else parent.external_req_id,
                len(eco.new_token_ids),
                None if ps is None else int(ps.num_computed_tokens),
                eco.finish_reason is not None,
            )
        )
    return found


class EngineAdapter:
    """One vLLM AsyncLLM, and what Sluice needs from it."""

    def __init__(
        self,
        engine_args: Any,
        model_name: str,
        *,
        tool_call_parser: str = "hermes",
        auto_tool_choice: bool = True,
        adapters: Sequence[Adapter] = (),
    ) -> None:
        self._engine_args = engine_args
        # The static LoRA adapters (--lora-modules), loaded at start.
        self._adapters = tuple(adapters)
        # vLLM's --tool-call-parser and --enable-auto-tool-choice; the reasoning
        # parser is the engine's own --reasoning-parser (one flag for both uses).
        self._tool_flags = (tool_call_parser, auto_tool_choice)
        self._model_name = model_name
        self._stats = _StatsBox()
        # Each request's share of the engine's steps (batching/ledger.py).
        self._ledger = StepLedger()
        # The engine's board slot (server/engines/board.py), taken at its first start
        # when the front made a board (--interactive-first): None runs vLLM's own
        # scheduler.
        self._slot: int | None = None
        self._board: Board | None = None
        self._llm: AsyncLLM | None = None
        self._names_ranks = False  # set at start (names_ranks)
        # Prefix placement's block hashes (vllm_prefix.py): set at start where
        # Sluice names the rank and the engine's prefix cache is on.
        self._hasher: PrefixHasher | None = None
        # What a LoRA must fit (server/engines/lora.py rule 7), from the model's config at start.
        self._shapes: ModelShapes | None = None
        self._tokenizer: Any = None
        self._renderer: Any = None
        self._parsers: OutputParsers | None = None
        # A pooling model's parameters and tokenization (set at start).
        self._pooling: Pooling | None = None
        # add_special_tokens for prompts and rendered chats (set at start).
        self._special_tokens = {"text": False, "chat": False}
        # Whether the chat template renders a system message after the first
        # (Qwen3's does, in place); if not, they are merged into the first.
        self._inline_system = True
        # One thread: tokenizer calls are serialised (HF fast tokenizers are
        # not safe to share across threads mid-call) and batched by the caller.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-tok")
        self._batcher = Batcher(self._pool, self._tokenize_batch)
        self.info = ModelInfo(model_name, 0, None, int(time.time()))

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> EngineAdapter:
        """The adapter of one served model (server/engines/registry.py), not started."""
        return cls(
            spec.engine_args,
            spec.name,
            tool_call_parser=spec.tool_call_parser,
            auto_tool_choice=spec.enable_auto_tool_choice,
            adapters=spec.adapters,
        )

    # -- life cycle ---------------------------------------------------------

    def _seat(self) -> int | None:
        """This engine's first board slot, taken once (None without a board)."""
        if self._slot is None and os.environ.get(BOARD_ENV):
            ranks = max(1, int(getattr(self._engine_args, "data_parallel_size", 1) or 1))
            self._slot = allocate(ranks)
            if self._slot is not None:
                self._board = Board.from_env()
        return self._slot

    async def start(self) -> None:
        """Build the engine on a worker thread (it takes seconds to minutes),
        so the event loop keeps answering /health and /ready meanwhile."""
        factory = _stat_logger_factory(self._stats)
        # At a lower CPU priority until ready (server/engines/start_priority.py):
        # a start must not take the cores from a model that serves.
        priority = start_priority.plan()
        front = start_priority.threads()
        slot = self._seat()
        llm = await start_priority.build_lowered(
            priority,
            functools.partial(_build_engine, self._engine_args, factory, slot, priority),
            None
            if self._board is None or slot is None
            else functools.partial(self._board.interactive_elsewhere, slot),
        )
        lighten_output_path(llm)
        watch_outputs(llm, self._observe)
        self._llm = llm
        start_priority.restore(
            priority,
            [pid for core, _ in self.processes() for pid in process_tree(core)],
            start_priority.threads() - front,  # the engine client's, in this process
        )
        self._names_ranks = names_ranks(llm.vllm_config)
        self._shapes = ModelShapes.from_config(llm.model_config.hf_config)
        for adapter in self._adapters:
            await self.load_adapter(adapter)
        self._renderer = llm.renderer
        self._tokenizer = llm.get_tokenizer()
        self._inline_system = self._renders_inline_system()
        self._special_tokens = {
            "text": bool(self._renderer.default_cmpl_tok_params.add_special_tokens),
            "chat": bool(self._renderer.default_chat_tok_params.add_special_tokens),
        }
        kind = model_kind(llm.model_config, await llm.get_supported_tasks())
        if kind != "generate":
            self._pooling = Pooling(llm, kind)
        sampling_defaults, default_max_tokens = generation_defaults(llm.model_config)
        sched = llm.vllm_config.scheduler_config
        cache = llm.vllm_config.cache_config
        self._ledger.block_size = block = int(cache.block_size or 16)
        prefix_block = block if cache.enable_prefix_caching else 0
        if prefix_block:  # hashes only what the driver asks for (Driver.prefix)
            self._hasher = PrefixHasher(block, str(cache.prefix_caching_hash_algo or "sha256"))
        self.info = ModelInfo(
            name=self._model_name,
            max_model_len=int(llm.model_config.max_model_len),
            eos_token_id=getattr(self._tokenizer, "eos_token_id", None),
            created=int(time.time()),
            sampling_defaults=sampling_defaults,
            default_max_tokens=default_max_tokens,
            max_num_seqs=int(sched.max_num_seqs),
            max_num_batched_tokens=int(sched.max_num_batched_tokens),
            # Known once the engine core's handshake filled num_gpu_blocks
            # (summed over data-parallel ranks); 0 if not.
            kv_cache_tokens=int(cache.num_gpu_blocks or 0) * int(cache.block_size or 0),
            prefix_block=prefix_block,
            dp_ranks=dp_ranks(llm.vllm_config),
            max_loras=max_loras(llm.vllm_config),
            prefill_chunk=int(sched.long_prefill_token_threshold or 0),
            interactive_first=self._slot is not None,
            kind=kind,
        )
        log.info(
            "engine capacity",
            extra={
                "fields": {
                    "kind": kind,
                    "max_num_seqs": self.info.max_num_seqs,
                    "max_num_batched_tokens": self.info.max_num_batched_tokens,
                    "kv_cache_tokens": self.info.kv_cache_tokens,
                    "dp_ranks": self.info.dp_ranks,
                    "long_prefill_token_threshold": self.info.prefill_chunk,
                }
            },
        )
        tool_parser, auto_tools = self._tool_flags
        reasoning = self._engine_args.reasoning_parser or ""
        if kind != "generate":
            return  # no text comes out: no parsers
        try:
            self._parsers = OutputParsers(
                self._tokenizer,
                tool_parser=tool_parser,
                reasoning_parser=reasoning,
                auto_tools=auto_tools,
            )
        except TypeError as exc:  # vLLM's check: the tokenizer lacks the parsers' tags
            log.warning("tool calls off for this model: %s", exc)
        self.info = dataclasses.replace(
            self.info, qwen3_split=reasoning == "qwen3" or self._parsers is None
        )

    async def load_adapter(self, adapter: Adapter) -> None:
        """Load a LoRA adapter into the engine now, as `vllm serve` does with
        its --lora-modules at start (OpenAIServingModels.init_static_loras):
        a bad adapter fails here, not on its first request, and the first
        request does not wait for the load. SluiceError (400) naming the cause."""
        if self._llm is None:
            raise SluiceError("engine not started", status=503, retry_after=5)
        if self._shapes is not None:
            # Before vLLM: it finds a misfit only when copying the weights in.
            try:
                await asyncio.to_thread(check_shapes, Path(adapter.path), self._shapes)
            except (OSError, ValueError) as exc:
                raise SluiceError(
                    f"LoRA adapter {adapter.name!r}: {exc}",
                    param="lora_path",
                    code="adapter_mismatch",
                ) from None
        try:
            await self._llm.add_lora(lora_request(adapter))
        except Exception as exc:
            raise SluiceError(
                f"LoRA adapter {adapter.name!r} ({adapter.path}) failed to load: "
                + (str(exc).splitlines() or [type(exc).__name__])[0],
                param="lora_path",
                code="adapter_load_failed",
            ) from exc

    async def sleep(self) -> None:
        """vLLM's sleep mode, level 1: the weights to host memory, the KV cache
        dropped (so the prefix cache with it). Only for an engine started with
        --enable-sleep-mode, which vLLM refuses at start off CUDA/ROCm/XPU."""
        if self._llm is None:
            raise SluiceError("engine not started", status=503, retry_after=5)
        await self._llm.sleep(level=1)

    async def wake_up(self) -> None:
        if self._llm is None:
            raise SluiceError("engine not started", status=503, retry_after=5)
        await self._llm.wake_up()

    def shutdown(self) -> None:
        if self._llm is not None:
            ranks = dp_ranks(self._llm.vllm_config)
            self._llm.shutdown()
            self._llm = None
            board, slot = self._board, self._slot
            if board is not None and slot is not None:
                # Its schedulers are gone (dead, or unloaded): their last word must
                # not hold the other models' background work until it is stale.
                for rank in range(ranks):
                    board.set_pending(slot + rank, False)
                    board.set_unshown(slot + rank, 0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def errored(self) -> bool:
        return self._llm is not None and bool(self._llm.errored)

    async def check_health(self) -> None:
        """vLLM's own check (the engine is not known dead), then a round trip
        through each engine core (a utility call its busy loop answers between
        steps): a core that is stopped or stuck does not answer, and the caller's
        timeout calls it hung (server/engines/supervisor.py)."""
        if self._llm is None:
            raise SluiceError("engine not started", status=503)
        await self._llm.check_health()
        await self._llm.is_sleeping()

    def processes(self) -> tuple[tuple[int, int | None], ...]:
        """(pid, exit code or None while it runs) of each engine core process
        this engine started, from vLLM's own process handles (never by name);
        () before the start or for an engine without local processes."""
        llm = self._llm
        if llm is None:
            return ()
        core = getattr(llm, "engine_core", None)
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        procs = getattr(manager, "processes", None) or ()
        return tuple((int(p.pid), p.exitcode) for p in procs if p.pid is not None)

    def stats(self) -> EngineStats:
        return self._stats.get()

    def take_steps(self) -> list[EngineStep]:
        return self._stats.take_steps()

    def watch_steps(self, callback: Callable[[], None] | None) -> None:
        self._stats.on_step = callback

    def step_share(self) -> StepCounters | None:
        board, slot = self._board, self._slot
        if board is None or slot is None or self._llm is None:
            return None
        ranks = range(dp_ranks(self._llm.vllm_config))
        return StepCounters.total(board.read(slot + rank).counters for rank in ranks)

    def set_unshown(self, rank: int, count: int) -> None:
        board, slot = self._board, self._slot
        if board is not None and slot is not None:
            board.set_unshown(slot + rank, count)

    def charge(self, request_id: str) -> Charge:
        return self._ledger.close(request_id)

    def _observe(self, outputs: Any) -> None:
        """One step, as the engine client received it: its time to the ledger
        (outputs without step details: their tokens count, no time)."""
        if self._llm is None:
            return
        stats = outputs.scheduler_stats
        d = getattr(stats, "iteration_details", None)
        seen = step_outputs(outputs, self._llm.output_processor.request_states)
        if d is not None and not d.is_dummy:
            prefill, decode = int(d.num_ctx_tokens), int(d.num_generation_tokens)
        elif seen:
            prefill = decode = 0
        else:
            return
        self._ledger.step(step_seconds(stats), prefill, decode, seen, int(outputs.engine_index))

    # -- tokenization -------------------------------------------------------

    async def tokenize_chat(
        self,
        conversations: Sequence[tuple[Sequence[Message], dict[str, Any]]],
    ) -> list[list[int]]:
        """Apply the chat template and tokenize (see `_tokenize` for where)."""
        size = sum(len(m.content) for messages, _ in conversations for m in messages)
        return await self._tokenize([("chat", c) for c in conversations], size)

    async def tokenize_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        return await self._tokenize([("text", t) for t in texts], sum(map(len, texts)))

    async def _tokenize(self, jobs: list[Any], size: int) -> list[list[int]]:
        """Small inputs on the loop, large ones batched on the tokenizer thread.

        A chat turn or a short prompt tokenizes in tens of microseconds, less
        than the thread hand-off costs. Anything longer goes to the thread,
        where a millisecond-scale tokenization cannot stall every stream on
        the loop, and where the Rust tokenizer runs without the GIL while the
        loop feeds the engine. Measured on a burst of 128 prompts of about
        4,000 characters arriving at once: tokenized on the loop, they waited
        93-161 ms (median) in Sluice before dispatch, since the driver ran
        only after every handler had tokenized; on the thread, 37-45 ms.
        """
        if size <= INLINE_TOKENIZE_CHARS:
            results = self._tokenize_batch(jobs)
        else:
            results = list(await asyncio.gather(*(self._batcher.submit(j) for j in jobs)))
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results  # type: ignore[return-value]

    def _renders_inline_system(self) -> bool:
        """vLLM's probe (its /v1/messages ``_detect_merge_inline_system``),
        through the engine's own renderer: a [system, user, system, user]
        conversation renders, or the template refuses a later system message
        (Qwen3.5's raises "System message must be at the beginning")."""
        probe = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
        try:
            self._renderer.render_messages(
                probe, ChatParams(chat_template_kwargs={"tokenize": False})
            )
        except Exception:
            log.warning(
                "the chat template refuses a system message after the first: such "
                "messages (Claude Code's) are merged into the first, which moves the "
                "prompt's prefix, so the prefix cache misses after each new one"
            )
            return False
        return True

    def _render_chat(self, messages: Sequence[Message], kwargs: dict[str, Any]) -> str:
        """The prompt text vLLM's server renders for these messages.

        The engine's renderer parses the messages as vLLM's server does
        (developer role, `name`, tool calls), resolves the template and keeps
        only the template kwargs it accepts. As `vllm serve` does for HF
        tokenizers, it renders text (`tokenize=False`) and tokenization
        follows, here batched with the other texts of the call.
        """
        if "chat_template" in kwargs:
            # As vLLM's server without --trust-request-chat-template: the
            # model's template only, never Jinja source from a caller.
            raise SluiceError(
                "a chat template passed with the request is refused",
                param="chat_template_kwargs.chat_template",
            )
        if not self._inline_system:
            messages = merge_system(tuple(messages))
        msgs: list[Any] = [m.template_dict() for m in messages]
        params = ChatParams(
            chat_template_kwargs={**kwargs, "add_generation_prompt": True, "tokenize": False}
        )
        _, prompt = self._renderer.render_messages(msgs, params)
        return str(prompt["prompt"])

    def _tokenize_batch(self, jobs: list[Any]) -> list[list[int] | BaseException]:
        """Render templates, then encode the texts in one call per kind (loop or thread).

        Prompts and rendered chats are encoded with the special-token setting
        of the renderer's defaults for completions and chat (vLLM's server's:
        a prompt gets the model's BOS if it has one, a chat has it from its
        template), so a batch holding both makes two calls.
        """
        out: list[list[int] | BaseException | None] = [None] * len(jobs)
        by_special: dict[bool, list[tuple[int, str]]] = {}
        for i, (kind, item) in enumerate(jobs):
            if kind == "text":
                by_special.setdefault(self._special_tokens["text"], []).append((i, item))
                continue
            try:
                text = self._render_chat(*item)
            except SluiceError as exc:
                out[i] = exc
                continue
            except Exception as exc:  # a template that raises for this input
                out[i] = SluiceError(f"chat template failed: {exc}", param="messages")
                continue
            by_special.setdefault(self._special_tokens["chat"], []).append((i, text))
        for special, items in by_special.items():
            # One trip into the Rust tokenizer for all texts of this kind.
            encoded = self._tokenizer([t for _, t in items], add_special_tokens=special)
            for (i, _), ids in zip(items, encoded["input_ids"], strict=True):
                out[i] = list(ids)
        return cast(list[list[int] | BaseException], out)  # every slot is filled above

    # -- output parsing and constraints ---------------------------------------

    def chat_parser(self, req: ChatRequest) -> RequestParsing:
        """vLLM's tool-call and reasoning parsers for one chat request."""
        if self._parsers is None:
            raise SluiceError(
                "tool calls are not available for this model (its tokenizer lacks the"
                " tags of --tool-call-parser or --reasoning-parser)",
                param="tools",
                code="unsupported",
            )
        return self._parsers.for_request(req)

    async def check_constraint(self, constraint: Constraint) -> None:
        """The engine's own check of a structured-output constraint, as a 400.

        On the tokenizer thread: compiling a grammar takes up to milliseconds
        (a regex under vLLM's timeout), too long for the event loop.
        """
        llm = self._llm
        if llm is None:
            raise SluiceError("engine not started", status=503, retry_after=5)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            self._pool,
            functools.partial(
                check_constraint,
                constraint,
                model_config=llm.model_config,
                config=llm.vllm_config.structured_outputs_config,
                tokenizer=self._tokenizer,
            ),
        )

    def detokenize(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's configuration as vLLM's /tokenizer_info gives it
        (its TokenizerInfo: init kwargs without file paths, the class, the
        chat template); lm-eval's remote tokenizer reads its special tokens."""
        template = getattr(self._tokenizer, "chat_template", None)
        info: dict[str, Any] = TokenizerInfo(self._tokenizer, template).to_dict()
        return info

    def count_tokens(self, text: str) -> int:
        # On the loop, like detokenize: a finished answer's thinking, once per
        # response (/v1/responses' reasoning_tokens).
        return len(self._tokenizer.encode(text, add_special_tokens=False)) if text else 0

    # -- pooling (server/engines/vllm_pooling.py) ------------------------------

    def _pooler(self) -> Pooling:
        if self._pooling is None:
            raise SluiceError(
                f"model {self._model_name!r} does not run vLLM's pooling runner", param="model"
            )
        return self._pooling

    def pooling_params(
        self, task: PoolTask, dimensions: int | None = None, use_activation: bool | None = None
    ) -> PoolingParams:
        return self._pooler().params(task, dimensions, use_activation)

    async def tokenize_pooling(
        self,
        inputs: Sequence[str | Sequence[int]],
        *,
        add_special_tokens: bool = True,
        truncate_prompt_tokens: int | None = None,
        truncation_side: Side | None = None,
        param: str = "input",
    ) -> list[list[int]]:
        """Embedding inputs to token ids as vLLM's /v1/embeddings makes them
        (vllm_pooling.py rule 3): inline when small, as `_tokenize` decides,
        else one call on the tokenizer thread."""
        call = functools.partial(
            self._pooler().tokenize,
            inputs,
            add_special_tokens=add_special_tokens,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            param=param,
        )
        size = sum(len(x) for x in inputs if isinstance(x, str))
        if size <= INLINE_TOKENIZE_CHARS:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def tokenize_pairs(
        self,
        query: str,
        documents: Sequence[str],
        params: PoolingParams,
        *,
        truncate_prompt_tokens: int | None = None,
        truncation_side: Side | None = None,
    ) -> list[tuple[list[int], PoolingParams]]:
        """A cross-encoder's prompt per (query, document) pair (vllm_pooling.py
        rule 4), on the tokenizer thread when large."""
        call = functools.partial(
            self._pooler().pairs,
            query,
            documents,
            params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
        )
        if len(query) * len(documents) + sum(map(len, documents)) <= INLINE_TOKENIZE_CHARS:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    # -- generation ---------------------------------------------------------

    @staticmethod
    def sampling_params(s: Sampling, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            seed=s.seed,
            stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=s.min_tokens,
            logprobs=s.logprobs,
            prompt_logprobs=s.prompt_logprobs,
            ignore_eos=s.ignore_eos,
            skip_special_tokens=s.skip_special_tokens,
            include_stop_str_in_output=s.include_stop_str_in_output,
            structured_outputs=to_structured_outputs(s.constraint),
            extra_args={_FROM_START: True} if s.constraint and s.constraint.from_start else None,
            output_kind=RequestOutputKind.DELTA,
        )

    def prefix_hashes(
        self, prompt_tokens: Sequence[int], cache_salt: str | None, adapter: Adapter | None = None
    ) -> tuple[int, ...]:
        """The prompt's full blocks hashed as the engine's prefix cache hashes
        them (its block size and --prefix-caching-hash-algo, the LoRA adapter's
        name and path as lora_request() gives them, `cache_salt` in the first
        block: vllm_prefix.py); () with the prefix cache off. The driver asks only
        for what the core uses (Driver.prefix). The values are this process's own: vLLM seeds
        its chain (NONE_HASH) per process unless PYTHONHASHSEED is set, and
        placement only needs equal prefixes to hash equal here."""
        hasher = self._hasher
        if hasher is None:
            return ()
        lora = None if adapter is None else (adapter.name, adapter.path)
        return hasher.hashes(prompt_tokens, cache_salt, lora)

    async def add(
        self,
        request_id: str,
        prompt_tokens: Sequence[int],
        params: SamplingParams | PoolingParams,
        priority: int,
        adapter: Adapter | None = None,
        cache_salt: str | None = None,
        rank: int | None = None,
        background: bool = False,
    ) -> Any:
        """Add one request; returns vLLM's per-request output collector.

        The prompt goes in as `TokensInput`, the engine input that
        `Renderer.render_cmpl()` builds for a text model (and that vLLM's
        server builds itself for pre-tokenized ids): 1.5 us against 3.7 us for
        a render_cmpl() round trip of the same 1,655 ids, and no deprecated
        raw-prompt path. `cache_salt` rides in it as vLLM's server puts a
        request's `cache_salt` there: the engine mixes it into the hash of the
        prompt's first KV block, so prompts of different salts share no
        cached block (vllm/v1/core/kv_cache_utils.py). `rank` is the data-parallel
        rank Sluice placed it on (batching/room.py `place`), passed as vLLM's
        `data_parallel_rank` where that names the same rank (`names_ranks`).
        """
        if self._llm is None:
            raise SluiceError("engine not started", status=503, retry_after=5)
        lora = None if adapter is None else lora_request(adapter)
        dp_rank = rank if self._names_ranks else None
        if background and self._slot is not None:
            params = mark(params)  # for Sluice's scheduler (vllm_scheduler.py)
        if isinstance(params, PoolingParams):
            # A pooling request: one output, its vector or score (vllm_pooling.py rule 5).
            collector = await self._llm.add_request(
                request_id,
                tokens_input(list(prompt_tokens), cache_salt=cache_salt),
                params,
                priority=priority,
                lora_request=lora,
                data_parallel_rank=dp_rank,
            )
            self._ledger.admit(request_id, len(prompt_tokens), rank or 0)
            return PooledStream(collector)
        # A constraint from the first token: tell the engine's reasoning gate
        # the thinking is over (else it waits for a </think> that never comes).
        from_start = bool(params.extra_args and params.extra_args.get(_FROM_START))
        collector = await self._llm.add_request(
            request_id,
            tokens_input(list(prompt_tokens), cache_salt=cache_salt),
            params,
            priority=priority,
            lora_request=lora,
            data_parallel_rank=dp_rank,
            **({"reasoning_ended": True} if from_start else {}),
        )
        self._ledger.admit(request_id, len(prompt_tokens), rank or 0)
        return collector

    async def abort(self, request_ids: Sequence[str]) -> None:
        if self._llm is not None and request_ids and not self._llm.errored:
            await self._llm.abort(list(request_ids))
