"""What the benchmark runs: scenario points, their sizes, their client flags.

Why it exists: the plan is data. Every point is a list of client jobs (flags for
`vllm bench serve`, minus the per-run ones the runner adds: URL, model, seed,
result file), so the same point runs unchanged against Sluice, vLLM's server and,
where marked, the raw engine. Pure: no processes, no vLLM import.

Sizes: the default ("full") plan is sized for about 20-25 minutes on the 2-core
CPU machines with the demo model (three repetitions per point); `--quick` shrinks
every count to a smoke test of the pipeline (minutes, numbers meaningless).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.report import mixed_classes, split_mixed

CONCURRENCY = "concurrency"
POISSON = "poisson"
MIXED = "mixed"
PREFIX = "prefix_burst"
IDENTICAL = "identical_burst"
WINDOW = "window"
STRUCTURED = "structured"
RAW_CEILING = "raw"  # not a scenario of its own: raw points live in CONCURRENCY
SCENARIOS: tuple[str, ...] = (
    CONCURRENCY,
    POISSON,
    MIXED,
    PREFIX,
    IDENTICAL,
    STRUCTURED,
    WINDOW,
    RAW_CEILING,
)
SCENARIO_TITLES: dict[str, str] = {
    CONCURRENCY: "Concurrency sweep (random prompts, closed loop)",
    POISSON: "Poisson request-rate sweep (random prompts, open loop)",
    MIXED: "Mixed load: 70% short / 20% medium / 10% long (Poisson, fixed total rate)",
    PREFIX: "Shared-prefix burst (prefix_repetition dataset, all at once)",
    IDENTICAL: "Identical-request burst (one greedy 256-token prompt repeated, all at once)",
    WINDOW: "Coalescing-window sweep (Sluice only)",
    STRUCTURED: "JSON-schema constraint vs plain at c=32 (random prompts, EOS honoured)",
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


@dataclass(frozen=True, slots=True)
class Job:
    """One client process of a point: its role and its dataset/load flags.

    ``ignore_eos`` False lets a request end when the model (or a constraint)
    says so, instead of running to its output length; ``chat`` sends it to
    /v1/chat/completions instead of /v1/completions.
    """

    role: str
    args: tuple[str, ...]
    ignore_eos: bool = True
    chat: bool = False


@dataclass(frozen=True, slots=True)
class Point:
    """One scenario point; its jobs run concurrently (several only for mixed load)."""

    scenario: str
    name: str
    jobs: tuple[Job, ...]
    prefix_metrics: bool = False  # scrape /metrics around it (prefill tokens computed)
    raw: bool = False  # also measured through the raw in-process engine
    concurrency: int | None = None
    seed_name: str | None = None  # seed key when `name` carries more (window configs)


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
    raw_concurrency: tuple[int, ...] = (32, 128)


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
)

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
        "all",
        (
            *_random(input_len, output_len),
            "--num-prompts",
            str(prompts),
            "--max-concurrency",
            str(concurrency),
        ),
    )


def build_plan(
    scenarios: Sequence[str],
    sizes: Sizes,
    *,
    max_model_len: int,
    input_len: int = 128,
    output_len: int = 64,
) -> Plan:
    """The points of the selected scenarios, in run order."""
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
    raw_points = tuple(p for p in conc_points if p.raw)
    if POISSON in sel:
        for rate in sizes.rates:
            n = max(1, round(rate * sizes.rate_seconds))
            job = Job(
                "all",
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
        jobs = tuple(
            Job(
                j.role,
                (
                    *_random(j.input_len, j.output_len),
                    "--num-prompts",
                    str(j.num_prompts),
                    "--request-rate",
                    f"{j.request_rate:g}",
                ),
            )
            for j in split_mixed(
                mixed_classes(max_model_len), sizes.mixed_rate, sizes.mixed_seconds
            )
        )
        points.append(Point(MIXED, f"{sizes.mixed_rate:g} req/s", jobs))
    if PREFIX in sel:
        prefix_len = min(1024, max_model_len // 8)
        job = Job(
            "all",
            (
                "--dataset-name",
                "prefix_repetition",
                "--prefix-repetition-prefix-len",
                str(prefix_len),
                "--prefix-repetition-suffix-len",
                "64",
                "--prefix-repetition-num-prefixes",
                "4",
                "--prefix-repetition-output-len",
                "32",
                "--num-prompts",
                str(sizes.prefix_prompts),
            ),
        )
        points.append(
            Point(
                PREFIX, f"{sizes.prefix_prompts} x ({prefix_len}+64)", (job,), prefix_metrics=True
            )
        )
    if IDENTICAL in sel:
        # One prefix and no suffix: every prompt is the same (the client's own
        # dataset; its `custom` JSONL reader needs pandas, absent here). Greedy.
        job = Job(
            "all",
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


def seed_for(scenario: str, point: str, rep: int) -> int:
    """The client's --seed for a point in a repetition: the same for every system.

    Different per point and repetition, so no run finds another run's prompts in
    the prefix cache; equal across systems, so they see the same prompts.
    """
    return zlib.crc32(f"{scenario}/{point}/{rep}".encode()) % 1_000_000
