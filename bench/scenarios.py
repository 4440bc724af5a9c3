"""What the benchmark runs: scenario points, their sizes, their client flags.

Why it exists: the plan is data. Every point is a list of client jobs (flags for
`vllm bench serve`, minus the per-run ones the runner adds: URL, model, seed,
result file), so the same point runs unchanged against Sluice, vLLM's server and,
where marked, the raw engine. Pure: no processes, no vLLM import.

Sizes: the default ("full") plan is sized for about 20-25 minutes on the 2-core
CPU machines with the demo model (three repetitions per point); `--quick` shrinks
every count to a smoke test of the pipeline (minutes, numbers meaningless).

Engine flags per point: most points run on the run's engine flags; the two
KV-bound scenarios (noisy neighbour, mixed load past capacity) carry extra flags
that shrink the KV cache to about 16k tokens and the context to 4,096, so that a
few long prompts fill it (issue 11). The runner starts one server per distinct
set of extra flags. Jobs may name a caller: the runner gives each caller its own
bearer key (and Sluice a callers file naming them).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The mixed load: its classes and their client jobs.


@dataclass(frozen=True, slots=True)
class MixedClass:
    """One class of the mixed load: its share and its lengths."""

    role: str
    share: float
    input_len: int
    output_len: int


@dataclass(frozen=True, slots=True)
class MixedJob:
    """One of the concurrent client processes of the mixed load."""

    role: str
    input_len: int
    output_len: int
    request_rate: float
    num_prompts: int


def mixed_classes(max_model_len: int) -> tuple[MixedClass, ...]:
    """70% short chat turns, 20% medium summaries, 10% long documents.

    Input lengths scale with the context: 1/128, 1/16 and 1/2 of it (64, 512,
    4096 tokens at 8,192; 256, 2,048, 16,384 at 32,768). Outputs are short for
    chat and longer for summaries.
    """
    ctx = max(256, max_model_len)
    return (
        MixedClass("short", 0.70, max(16, ctx // 128), 64),
        MixedClass("medium", 0.20, ctx // 16, 128),
        MixedClass("long", 0.10, ctx // 2, 128),
    )


def split_mixed(
    classes: Sequence[MixedClass], total_rate: float, duration_s: float
) -> list[MixedJob]:
    """Split a fixed total Poisson rate over the classes, by share.

    Each class gets `share x total_rate` requests per second and as many prompts
    as that rate sends in `duration_s` (at least one), so the three clients run
    for about the same time and the short requests see the long ones all along.
    """
    if total_rate <= 0 or duration_s <= 0:
        raise ValueError("mixed load needs a positive rate and duration")
    total_share = sum(c.share for c in classes)
    if not math.isclose(total_share, 1.0, abs_tol=1e-6):
        raise ValueError(f"mixed-load shares sum to {total_share}, not 1")
    jobs = []
    for c in classes:
        rate = c.share * total_rate
        jobs.append(
            MixedJob(
                role=c.role,
                input_len=c.input_len,
                output_len=c.output_len,
                request_rate=rate,
                num_prompts=max(1, round(rate * duration_s)),
            )
        )
    return jobs


CONCURRENCY = "concurrency"
POISSON = "poisson"
MIXED = "mixed"
PREFIX = "prefix_burst"
PREFIX_CALLERS = "prefix_callers"  # issue 28: the shared-prefix burst from four callers
IDENTICAL = "identical_burst"
NOISY = "noisy_neighbour"
PAST_CAPACITY = "mixed_past_capacity"
WINDOW = "window"
SPREAD = "backlog_spread"  # issue 21: one caller, prompt lengths spread, past capacity
THREE = "three_callers"  # issue 21: chat beside two weighted bulk callers, KV-bound
CHAT_MIX = "chat_mix"  # issue 21: a 70/20/10 chat mix below capacity, closed loop
LORA = "lora_adapters"  # issue 20: four callers on four LoRA adapters, max_loras 2
STRUCTURED = "structured"
DATA_PARALLEL = "data_parallel"
RAW_CEILING = "raw"  # not a scenario of its own: raw points live in CONCURRENCY
SCENARIOS: tuple[str, ...] = (
    CONCURRENCY,
    POISSON,
    MIXED,
    PREFIX,
    PREFIX_CALLERS,
    IDENTICAL,
    STRUCTURED,
    NOISY,
    PAST_CAPACITY,
    SPREAD,
    THREE,
    CHAT_MIX,
    LORA,
    WINDOW,
    DATA_PARALLEL,
    RAW_CEILING,
)
# Run when --scenarios is not given: all but data parallelism, which starts two
# engine cores per server (issue 19's targets), the LoRA point, which makes
# four adapters and serves them (issue 20's), and the shared prefix from four
# callers, a server of its own for the price of one isolation (issue 28's);
# ask for those by name.
DEFAULT_SCENARIOS: tuple[str, ...] = tuple(
    s for s in SCENARIOS if s not in (DATA_PARALLEL, LORA, PREFIX_CALLERS)
)
KV_BOUND_SCENARIOS: frozenset[str] = frozenset({NOISY, PAST_CAPACITY, THREE})
SCENARIO_TITLES: dict[str, str] = {
    CONCURRENCY: "Concurrency sweep (random prompts, closed loop)",
    POISSON: "Poisson request-rate sweep (random prompts, open loop)",
    MIXED: "Mixed load: 70% short / 20% medium / 10% long (Poisson, fixed total rate)",
    PREFIX: "Shared-prefix burst (prefix_repetition dataset, all at once)",
    PREFIX_CALLERS: "Shared-prefix burst from four callers (each sends the same prompts)",
    IDENTICAL: "Identical-request burst (one greedy 256-token prompt repeated, all at once)",
    NOISY: "Noisy neighbour on a KV-bound engine (a chat caller, alone and beside a flood)",
    PAST_CAPACITY: "Mixed 70/20/10 load past capacity on a KV-bound engine (Poisson)",
    SPREAD: "One caller, backlog past capacity: prompt lengths spread evenly, 32 out (closed loop)",
    THREE: "Three callers on a KV-bound engine: chat beside two bulk callers weighted 1:3",
    CHAT_MIX: "Chat mix 70/20/10 short/medium/long below capacity (closed loop, chat API)",
    WINDOW: "Coalescing-window sweep (Sluice only)",
    STRUCTURED: "JSON-schema constraint vs plain at c=32 (random prompts, EOS honoured)",
    DATA_PARALLEL: "Data parallelism: --data-parallel-size 2, 64 in / 64 out, closed loop",
    LORA: "LoRA: four callers, each on its own adapter, --max-loras 2 (closed loop)",
}
STRUCTURED_CONCURRENCY = 32
# Bounded (enums, a boolean, a small integer range): a random-weight model
# loops inside a free string or number until max_tokens.
STRUCTURED_SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Rome", "Lima", "Pune"]},
        "rain": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "rain", "level"],
    "additionalProperties": False,
}


ALL = "all"  # the role of a point's only job, whose metrics are not prefixed


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """Engine flags some points need beyond the run's (appended: later flags win)."""

    name: str
    flags: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Job:
    """One client process of a point: its role, its dataset/load flags and, when
    it stands for one caller of several, that caller's name (its bearer key is
    the runner's business).

    ``ignore_eos`` False lets a request end when the model (or a constraint)
    says so, instead of running to its output length; ``chat`` sends it to
    /v1/chat/completions instead of /v1/completions.
    """

    role: str
    args: tuple[str, ...]
    ignore_eos: bool = True
    chat: bool = False
    caller: str | None = None
    # The role whose seed it takes (None: its own): callers sending the same prompts.
    seed_role: str | None = None


@dataclass(frozen=True, slots=True)
class Point:
    """One scenario point; its jobs run concurrently (several for mixed load and
    the noisy neighbour). `engine`, when set, adds its flags to the run's engine
    flags for the server that runs this point."""

    scenario: str
    name: str
    jobs: tuple[Job, ...]
    prefix_metrics: bool = False  # scrape /metrics around it (prefill tokens computed)
    # Sluice's Prometheus counters scraped around it: (metric key, counter name).
    counters: tuple[tuple[str, str], ...] = ()
    raw: bool = False  # also measured through the raw in-process engine
    concurrency: int | None = None
    seed_name: str | None = None  # seed key when `name` carries more (window configs)
    engine: EngineProfile | None = None
    # Sample the engine's running count from /metrics while it runs (issue 19:
    # does the engine reach its summed data-parallel slots?).
    running_metrics: bool = False

    @property
    def callers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(j.caller for j in self.jobs if j.caller is not None))


@dataclass(frozen=True, slots=True)
class Sizes:
    """Counts for one plan (full or quick)."""

    concurrency: dict[int, int]  # concurrency -> prompts
    rates: tuple[float, ...]
    rate_seconds: float
    mixed_rate: float
    mixed_seconds: float
    prefix_prompts: int
    identical_prompts: int
    window_low: tuple[int, int]  # (concurrency, prompts)
    window_high: tuple[int, int]
    structured_prompts: int
    wide_prompts: int  # the c=512 point of the sweep
    chat_seconds: float  # the noisy neighbour's chat job: CHAT_RATE for this long
    flood_prompts: int  # the flood's prompts: enough to outlast the chat job
    past_capacity_rate: float
    past_capacity_seconds: float
    spread_prompts: int  # the one caller's prompts, SPREAD_CONCURRENCY in flight
    bulk_prompts: int  # each bulk caller's prompts beside the chat job (three callers)
    chat_mix_rounds: int  # requests per stream of the chat mix's longest class
    raw_concurrency: tuple[int, ...] = (32, 128)
    # DATA_PARALLEL: (concurrency, prompts); 3 x the concurrency outlasts the
    # ramp (issue 19 measured 43-93 running at c=256 for a whole run).
    data_parallel: tuple[tuple[int, int], ...] = ((256, 768), (512, 1536))
    # LORA: each caller's prompts, LORA_STREAMS in flight (at 64 out, about 15
    # rounds per stream: several adapter swaps at max_loras 2).
    lora_prompts: int = 240


FULL = Sizes(
    concurrency={1: 16, 8: 64, 32: 256, 128: 512},
    rates=(10.0, 20.0, 40.0, 80.0),
    rate_seconds=5.0,
    mixed_rate=8.0,
    mixed_seconds=20.0,
    prefix_prompts=128,
    identical_prompts=64,
    window_low=(1, 12),
    window_high=(128, 256),
    structured_prompts=256,
    wide_prompts=1536,
    # vLLM's server served the flood at 6.9 req/s beside the chat job and the
    # mixed load at 22-23 req/s at most (a pilot run, demo model, 2 cores): 420
    # prompts outlast 35 s of chat by half, and 32 req/s is 1.4x capacity.
    chat_seconds=35.0,
    flood_prompts=420,
    past_capacity_rate=32.0,
    past_capacity_seconds=20.0,
    # 3 x 384: every stream sends three prompts, so the backlog lasts the run.
    spread_prompts=1152,
    # Two bulk callers of 16 streams at 1,500 tokens: about the flood's load
    # (vLLM's server: ~600 bulk requests in the 35 s of chat).
    bulk_prompts=360,
    chat_mix_rounds=8,
)
QUICK = Sizes(
    concurrency={1: 3, 8: 16, 32: 32, 128: 128},
    rates=(10.0, 40.0),
    rate_seconds=2.0,
    mixed_rate=8.0,
    mixed_seconds=3.0,
    prefix_prompts=24,
    identical_prompts=16,
    window_low=(1, 3),
    window_high=(128, 128),
    structured_prompts=32,
    wide_prompts=512,
    chat_seconds=6.0,
    flood_prompts=48,
    past_capacity_rate=32.0,
    past_capacity_seconds=3.0,
    spread_prompts=384,
    bulk_prompts=24,
    chat_mix_rounds=1,
    data_parallel=((256, 256), (512, 512)),
    lora_prompts=32,
)

# The c=512 point: a backlog beyond the engine's max_num_seqs (128 by default on
# CPU), with the short requests of the measurement (64 in, 32 out).
WIDE_CONCURRENCY = 512
WIDE_LEN = (64, 32)
WIDE_POINT = f"c={WIDE_CONCURRENCY} ({WIDE_LEN[0]} in, {WIDE_LEN[1]} out)"

# The KV-bound engine of issue 11: a KV cache of about 16k tokens (a handful of
# long prompts fill it, as Qwen3-14B's does on a 24 GB card) and a 4,096 context.
# Issue 19: two data-parallel ranks, each with its own scheduler (both servers).
DP_ENGINE = EngineProfile("DP=2", ("--data-parallel-size", "2"))
DP_LEN = (64, 64)


def dp_point(concurrency: int) -> str:
    """The name of the data-parallel point at `concurrency`."""
    return f"c={concurrency} ({DP_LEN[0]} in, {DP_LEN[1]} out)"


# LoRA (issue 20): four demo adapters (`python -m server make-demo-adapter DIR
# --seed N`, rank 8), both servers with --max-loras 2, four callers each on its own
# adapter, 16 closed-loop streams each of 128 in / 64 out (64 in flight: the engine
# is busy, and half the callers' adapters are always out of a slot). The runner
# makes the adapters under its raw dir and puts that path for ADAPTER_DIR.
ADAPTER_DIR = "{adapters}"
LORA_ADAPTERS = ("a0", "a1", "a2", "a3")
LORA_CALLERS = tuple(f"lora_{a}" for a in LORA_ADAPTERS)
LORA_MAX_LORAS = 2
LORA_RANK = 8
LORA_STREAMS = 16
LORA_LEN = (128, 64)
LORA_POINT = f"4 adapters, max-loras {LORA_MAX_LORAS}, 4 x {LORA_STREAMS} streams"
LORA_ENGINE = EngineProfile(
    "LoRA",
    (
        "--enable-lora",
        "--max-loras",
        str(LORA_MAX_LORAS),
        "--max-lora-rank",
        str(LORA_RANK),
        "--lora-modules",
        *(f"{a}={ADAPTER_DIR}/{a}" for a in LORA_ADAPTERS),
    ),
)
ADAPTER_WAIT_COUNTER = "sluice_engine_adapter_wait_steps_total"
ENGINE_STEPS_COUNTER = "sluice_engine_steps_total"  # the share's denominator

# Issue 27: Sluice's engine steps, their time (vLLM's iteration details), the steps
# beside a held backlog and the under-fed ones (batching/room.py, underfed),
# scraped around every saturated point on both Sluice systems (held and
# --no-hold-backlog); the report gives the under-fed share, the time per step and
# the share of the point's time in steps (runner.py, underfed_share, step_time).
UNDERFED_COUNTERS: tuple[tuple[str, str], ...] = (
    ("engine_steps", ENGINE_STEPS_COUNTER),
    ("step_s", "sluice_engine_step_seconds_total"),
    ("held_steps", "sluice_engine_steps_held_total"),
    ("underfed_steps", "sluice_engine_underfed_steps_total"),
    ("underfed_policy_steps", "sluice_engine_underfed_policy_steps_total"),
)


# The shared-prefix burst from four callers (issue 28): the prefix point's
# prompts, split over four callers with a key each, every caller sending the
# same prompts (one seed). With the prefix cache isolated per caller (Sluice's
# default with keys) each caller computes the prefixes once; shared, once in
# all. A server of its own: its jobs name callers, the other points' do not.
PREFIX_CALLER_NAMES = tuple(f"prefix_{i}" for i in range(4))
PREFIX_CALLERS_ENGINE = EngineProfile("four callers", ())

KV_BOUND_TOKENS = 16_384
KV_BOUND_CONTEXT = 4096

# The noisy neighbour: a chat caller (Poisson, short turns) and a batch caller
# that keeps FLOOD_CONCURRENCY long prompts in flight (closed loop). At 2,128
# tokens a stream, seven fill the cache; the other 25 wait.
CHAT_CALLER = "chat"
FLOOD_CALLER = "batch"
MIXED_CALLER = "mixed"  # the one caller of the load past capacity
CHAT_RATE = 3.0
CHAT_LEN = (64, 32)
FLOOD_CONCURRENCY = 32
FLOOD_LEN = (2000, 128)
ALONE_POINT = "chat alone"
FLOOD_POINT = "chat + flood"

# One caller, a backlog past capacity (issue 21): 384 streams in flight (three
# times the engine's 128 slots on CPU), prompt lengths uniform over about
# 16-700 tokens (the client's random range: 358 x (1 +- 0.955)), 32 out.
# (The client samples lengths with the tokenizer's special tokens taken off
# the 358, so on a model that adds some the range moves down by as many.)
SPREAD_CONCURRENCY = 384
SPREAD_LEN = (358, 32)
SPREAD_RANGE = 0.955
SPREAD_POINT = f"c={SPREAD_CONCURRENCY} (16-700 in, {SPREAD_LEN[1]} out)"

# Three callers on the KV-bound engine (issue 21): the noisy neighbour's chat
# caller and two bulk callers of 16 streams each, weights 1:1:3.
BULK_CALLERS = ("bulk_a", "bulk_b")
BULK_CONCURRENCY = 16
BULK_LEN = (1500, 128)
CALLER_WEIGHTS: dict[str, float] = {"bulk_b": 3.0}  # every other caller: 1
THREE_POINT = "chat + 2 bulk (1:1:3)"

# The chat mix below capacity (issue 21): 24 closed-loop streams split 70/20/10
# (17 / 5 / 2), ~30 / 220 / 720-token prompts, 24 / 64 / 128 out.
CHAT_MIX_CLASSES: tuple[tuple[str, int, int, int], ...] = (
    # role, streams, input, output
    ("short", 17, 30, 24),
    ("medium", 5, 220, 64),
    ("long", 2, 720, 128),
)
CHAT_MIX_POINT = "24 streams"


def kv_bound(kv_bytes_per_token: int) -> EngineProfile:
    """The engine of the KV-bound scenarios: its flags follow the run's, so they win."""
    return EngineProfile(
        "KV-bound",
        (
            "--kv-cache-memory-bytes",
            str(KV_BOUND_TOKENS * kv_bytes_per_token),
            "--max-model-len",
            str(KV_BOUND_CONTEXT),
        ),
    )


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int = 2) -> int | None:
    """KV-cache bytes per token of a Hugging Face decoder config: layers x 2 (K
    and V) x KV heads x head size x bytes per value (2 for bf16/fp16). None when
    the config lacks the sizes. The demo model: 2 x 2 x 2 x 64 x 2 = 1 KiB."""
    try:
        layers = int(config["num_hidden_layers"])
        q_heads = int(config["num_attention_heads"])
        heads = int(config.get("num_key_value_heads") or q_heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // q_heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return layers * 2 * heads * head_dim * dtype_bytes


# Sluice-only window configurations: label -> extra `sluice serve` flags. The
# main comparison blocks run Sluice with its defaults (10 ms, adaptive).
WINDOW_CONFIGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("0 ms", ("--window-ms", "0")),
    ("2 ms adaptive", ("--window-ms", "2", "--adaptive-window")),
    ("5 ms adaptive", ("--window-ms", "5", "--adaptive-window")),
    ("10 ms adaptive", ("--window-ms", "10", "--adaptive-window")),
    ("20 ms adaptive", ("--window-ms", "20", "--adaptive-window")),
    ("10 ms fixed", ("--window-ms", "10", "--no-adaptive-window")),
)


@dataclass(frozen=True, slots=True)
class Plan:
    """The whole run: comparison points (Sluice vs vLLM) and window points."""

    points: tuple[Point, ...]
    window_points: tuple[Point, ...]
    window_configs: tuple[tuple[str, tuple[str, ...]], ...]
    raw_points: tuple[Point, ...] = field(default=())


def _random(input_len: int, output_len: int) -> tuple[str, ...]:
    return (
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
    )


def _closed_loop(input_len: int, output_len: int, prompts: int, concurrency: int) -> Job:
    """Random prompts, `concurrency` requests in flight, `prompts` in all."""
    return Job(
        ALL,
        (
            *_random(input_len, output_len),
            "--num-prompts",
            str(prompts),
            "--max-concurrency",
            str(concurrency),
        ),
    )


def _mixed_jobs(
    max_model_len: int,
    rate: float,
    seconds: float,
    extra: tuple[str, ...] = (),
    caller: str | None = None,
) -> tuple[Job, ...]:
    """The three concurrent Poisson clients of the 70/20/10 mixed load."""
    return tuple(
        Job(
            j.role,
            (
                *_random(j.input_len, j.output_len),
                "--num-prompts",
                str(j.num_prompts),
                "--request-rate",
                f"{j.request_rate:g}",
                *extra,
            ),
            caller=caller,
        )
        for j in split_mixed(mixed_classes(max_model_len), rate, seconds)
    )


def _noisy_points(sizes: Sizes, engine: EngineProfile) -> list[Point]:
    """The chat caller alone, then beside the batch caller's flood.

    Both jobs save per-request detail (start, latency, error), so the report can
    count the flood's completions during the chat job's span and check that the
    chat requests were sent while the flood ran.
    """
    n_chat = max(1, round(CHAT_RATE * sizes.chat_seconds))
    chat = Job(
        "chat",
        (
            *_random(*CHAT_LEN),
            "--num-prompts",
            str(n_chat),
            "--request-rate",
            f"{CHAT_RATE:g}",
            "--save-detailed",
        ),
        caller=CHAT_CALLER,
    )
    flood = Job(
        "flood",
        (
            *_random(*FLOOD_LEN),
            "--num-prompts",
            str(sizes.flood_prompts),
            "--max-concurrency",
            str(FLOOD_CONCURRENCY),
            "--save-detailed",
        ),
        caller=FLOOD_CALLER,
    )
    return [
        Point(NOISY, ALONE_POINT, (chat,), engine=engine),
        Point(NOISY, FLOOD_POINT, (chat, flood), engine=engine, counters=UNDERFED_COUNTERS),
    ]


def _three_caller_points(sizes: Sizes, engine: EngineProfile, chat: Job) -> list[Point]:
    """The chat caller beside two bulk callers of 16 streams each (weights 1:1:3)."""
    bulk = tuple(
        Job(
            name,
            (
                *_random(*BULK_LEN),
                "--num-prompts",
                str(sizes.bulk_prompts),
                "--max-concurrency",
                str(BULK_CONCURRENCY),
                "--save-detailed",
            ),
            caller=name,
        )
        for name in BULK_CALLERS
    )
    return [Point(THREE, THREE_POINT, (chat, *bulk), engine=engine, counters=UNDERFED_COUNTERS)]


def _prefix_args(max_model_len: int, prompts: int) -> tuple[str, ...]:
    """The shared-prefix burst's client flags: 4 prefixes of up to 1,024 tokens
    (an eighth of the context), 64-token suffixes, 32 out."""
    return (
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(min(1024, max_model_len // 8)),
        "--prefix-repetition-suffix-len", "64",
        "--prefix-repetition-num-prefixes", "4",
        "--prefix-repetition-output-len", "32",
        "--num-prompts", str(prompts),
    )  # fmt: skip


def _prefix_callers_point(sizes: Sizes, max_model_len: int) -> Point:
    """The prefix burst's prompts from four callers at once, each the same quarter."""
    n = max(4, sizes.prefix_prompts // len(PREFIX_CALLER_NAMES))
    jobs = tuple(
        Job(
            caller,
            (*_prefix_args(max_model_len, n), "--save-detailed"),
            caller=caller,
            seed_role=PREFIX_CALLER_NAMES[0],
        )
        for caller in PREFIX_CALLER_NAMES
    )
    prefix_len = min(1024, max_model_len // 8)
    name = f"4 callers x {n} x ({prefix_len}+64)"
    return Point(PREFIX_CALLERS, name, jobs, prefix_metrics=True, engine=PREFIX_CALLERS_ENGINE)


def _lora_point(sizes: Sizes) -> Point:
    """Four callers, each on its own adapter (the client's --lora-modules with one
    name: every request names that adapter as its model)."""
    jobs = tuple(
        Job(
            caller,
            (
                *_random(*LORA_LEN),
                "--num-prompts",
                str(sizes.lora_prompts),
                "--max-concurrency",
                str(LORA_STREAMS),
                "--lora-modules",
                adapter,
                "--save-detailed",
            ),
            caller=caller,
        )
        for caller, adapter in zip(LORA_CALLERS, LORA_ADAPTERS, strict=True)
    )
    return Point(
        LORA,
        LORA_POINT,
        jobs,
        engine=LORA_ENGINE,
        counters=(("adapter_wait_steps", ADAPTER_WAIT_COUNTER), *UNDERFED_COUNTERS),
    )


def _chat_mix_jobs(rounds: int) -> tuple[Job, ...]:
    """The chat mix's three closed-loop clients. Each stream sends about as many
    output tokens as a long stream's `rounds` requests, so the classes run for
    about the same time and the short turns see the long ones all along."""
    longest = max(out for *_, out in CHAT_MIX_CLASSES)
    jobs = []
    for role, streams, input_len, output_len in CHAT_MIX_CLASSES:
        per_stream = max(1, round(rounds * longest / output_len))
        job = _closed_loop(input_len, output_len, streams * per_stream, streams)
        jobs.append(Job(role, job.args, chat=True))
    return tuple(jobs)


def build_plan(
    scenarios: Sequence[str],
    sizes: Sizes,
    *,
    max_model_len: int,
    input_len: int = 128,
    output_len: int = 64,
    kv_bytes_per_token: int | None = None,
) -> Plan:
    """The points of the selected scenarios, in run order.

    `kv_bytes_per_token` sizes the KV-bound scenarios' cache (required for them).
    """
    sel = set(scenarios)
    points: list[Point] = []
    conc_points: list[Point] = []
    if CONCURRENCY in sel or RAW_CEILING in sel:
        for c, n in sizes.concurrency.items():
            job = _closed_loop(input_len, output_len, n, c)
            conc_points.append(
                Point(
                    CONCURRENCY,
                    f"c={c}",
                    (job,),
                    raw=RAW_CEILING in sel and c in sizes.raw_concurrency,
                    concurrency=c,
                )
            )
        if CONCURRENCY in sel:
            points.extend(conc_points)
            job = _closed_loop(*WIDE_LEN, sizes.wide_prompts, WIDE_CONCURRENCY)
            points.append(
                Point(
                    CONCURRENCY,
                    WIDE_POINT,
                    (job,),
                    concurrency=WIDE_CONCURRENCY,
                    counters=UNDERFED_COUNTERS,
                    running_metrics=True,
                )
            )
    if SPREAD in sel:
        job = _closed_loop(*SPREAD_LEN, sizes.spread_prompts, SPREAD_CONCURRENCY)
        # Per-request detail: the report splits the requests by prompt length.
        # A dict: a bare number would spread the output lengths too.
        ratio = json.dumps({"input": SPREAD_RANGE, "output": 0})
        args = (*job.args, "--random-range-ratio", ratio, "--save-detailed")
        points.append(
            Point(
                SPREAD,
                SPREAD_POINT,
                (Job(ALL, args),),
                concurrency=SPREAD_CONCURRENCY,
                counters=UNDERFED_COUNTERS,
                running_metrics=True,
            )
        )
    if CHAT_MIX in sel:
        jobs = _chat_mix_jobs(sizes.chat_mix_rounds)
        points.append(Point(CHAT_MIX, CHAT_MIX_POINT, jobs, concurrency=24))
    raw_points = tuple(p for p in conc_points if p.raw)
    if POISSON in sel:
        for rate in sizes.rates:
            n = max(1, round(rate * sizes.rate_seconds))
            job = Job(
                ALL,
                (
                    *_random(input_len, output_len),
                    "--num-prompts",
                    str(n),
                    "--request-rate",
                    f"{rate:g}",
                ),
            )
            points.append(Point(POISSON, f"{rate:g} req/s", (job,)))
    if MIXED in sel:
        jobs = _mixed_jobs(max_model_len, sizes.mixed_rate, sizes.mixed_seconds)
        points.append(Point(MIXED, f"{sizes.mixed_rate:g} req/s", jobs))
    if PREFIX in sel:
        prefix_len = min(1024, max_model_len // 8)
        job = Job(ALL, _prefix_args(max_model_len, sizes.prefix_prompts))
        points.append(
            Point(
                PREFIX, f"{sizes.prefix_prompts} x ({prefix_len}+64)", (job,), prefix_metrics=True
            )
        )
    if PREFIX_CALLERS in sel:
        points.append(_prefix_callers_point(sizes, max_model_len))
    if IDENTICAL in sel:
        # One prefix and no suffix: every prompt is the same (the client's own
        # dataset; its `custom` JSONL reader needs pandas, absent here). Greedy.
        job = Job(
            ALL,
            (
                "--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", "256",
                "--prefix-repetition-suffix-len", "0",
                "--prefix-repetition-num-prefixes", "1",
                "--prefix-repetition-output-len", str(output_len),
                "--temperature", "0",
                "--num-prompts", str(sizes.identical_prompts),
            ),
        )  # fmt: skip
        points.append(
            Point(IDENTICAL, f"{sizes.identical_prompts} x 1 prompt", (job,), prefix_metrics=True)
        )
    if STRUCTURED in sel:
        # The same prompts with and without the constraint, EOS honoured in
        # both: the constrained answers end when their JSON closes. Chat with
        # thinking off: with the engine's reasoning parser, vLLM's server holds
        # a constraint on /v1/completions until a </think> that never comes.
        # The client sends ignore_eos with random prompts whatever its flags
        # (seen on the wire); the extra body overrides it.
        no_think = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": False}
        c, n = STRUCTURED_CONCURRENCY, sizes.structured_prompts
        for name, extra in (
            ("plain", no_think),
            ("json schema", {**no_think, "structured_outputs": {"json": STRUCTURED_SCHEMA}}),
        ):
            job = _closed_loop(input_len, output_len, n, c)
            args = (*job.args, "--extra-body", json.dumps(extra))
            job = Job(job.role, args, ignore_eos=False, chat=True)
            points.append(Point(STRUCTURED, f"{name} c={c}", (job,), concurrency=c))
    if sel & KV_BOUND_SCENARIOS:
        if kv_bytes_per_token is None or kv_bytes_per_token <= 0:
            raise ValueError("the KV-bound scenarios need the model's KV bytes per token")
        kv = kv_bound(kv_bytes_per_token)
        noisy = _noisy_points(sizes, kv)
        if NOISY in sel:
            points.extend(noisy)
        elif THREE in sel:
            points.append(noisy[0])  # chat alone: the three-caller target's yardstick
        if THREE in sel:
            points.extend(_three_caller_points(sizes, kv, noisy[0].jobs[0]))
        if PAST_CAPACITY in sel:
            rate = sizes.past_capacity_rate
            # One caller sends the whole mix (it shares a server with the noisy
            # neighbour's callers file); per-request detail: refusal reasons.
            jobs = _mixed_jobs(
                KV_BOUND_CONTEXT,
                rate,
                sizes.past_capacity_seconds,
                ("--save-detailed",),
                caller=MIXED_CALLER,
            )
            points.append(Point(PAST_CAPACITY, f"{rate:g} req/s", jobs, engine=kv))
    if LORA in sel:
        points.append(_lora_point(sizes))
    if DATA_PARALLEL in sel:
        for c, n in sizes.data_parallel:
            job = _closed_loop(*DP_LEN, n, c)
            points.append(
                Point(
                    DATA_PARALLEL,
                    dp_point(c),
                    (job,),
                    concurrency=c,
                    engine=DP_ENGINE,
                    running_metrics=True,
                    counters=UNDERFED_COUNTERS,
                )
            )
    check_callers(points)
    window_points: list[Point] = []
    if WINDOW in sel:
        for label, (c, n) in (("low", sizes.window_low), ("high", sizes.window_high)):
            job = _closed_loop(input_len, output_len, n, c)
            window_points.append(Point(WINDOW, f"{label} (c={c})", (job,), concurrency=c))
    return Plan(
        tuple(points),
        tuple(window_points),
        WINDOW_CONFIGS if window_points else (),
        raw_points,
    )


def by_engine(points: Sequence[Point]) -> list[tuple[EngineProfile | None, list[Point]]]:
    """The points grouped by engine profile (one server start per group and system),
    groups in order of first appearance, points in plan order within a group."""
    groups: dict[EngineProfile | None, list[Point]] = {}
    for p in points:
        groups.setdefault(p.engine, []).append(p)
    return list(groups.items())


def callers_of(points: Sequence[Point]) -> tuple[str, ...]:
    """Every caller the points' jobs name, in order of first appearance."""
    return tuple(dict.fromkeys(c for p in points for c in p.callers))


def check_callers(points: Sequence[Point]) -> None:
    """Every job of a server that gets a callers file names a caller: Sluice,
    given one, refuses a request without a key (401)."""
    for engine, group in by_engine(points):
        if callers_of(group) and any(j.caller is None for p in group for j in p.jobs):
            name = engine.name if engine else "the run's engine"
            raise ValueError(f"{name}: some jobs name a caller and others none")


def seed_for(scenario: str, point: str, rep: int, role: str = ALL) -> int:
    """The client's --seed for one job of a point in a repetition: the same for
    every system.

    Different per point and repetition, so no run finds another run's prompts in
    the prefix cache; equal across systems, so they see the same prompts. The
    concurrent jobs of one point get different seeds too: the random dataset
    builds prompt i as (offset_i + i + 0, 1, 2, ...) from the seed alone, so with
    one seed a 64-token chat prompt would be the first 64 tokens of a 2,000-token
    flood prompt, and a prefix-cache hit.
    """
    key = f"{scenario}/{point}/{rep}" if role == ALL else f"{scenario}/{point}/{role}/{rep}"
    return zlib.crc32(key.encode()) % 1_000_000
