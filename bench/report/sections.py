"""What each scenario's part of the run's page shows: its table's metrics and its
plot panels.

Why it exists: the page's text (markdown.py) and its plot (plots.py) read the same
choices; one table of them per scenario keeps a new scenario's section one entry
here.
"""

from __future__ import annotations

from bench.report.plots import BarPanel, LinePanel, Panel
from bench.report.prometheus import RUNNING_POLL_S
from bench.scenarios import (
    CHAT_MIX,
    CONCURRENCY,
    DATA_PARALLEL,
    IDENTICAL,
    LORA,
    LORA_CALLERS,
    MIXED,
    NOISY,
    PAST_CAPACITY,
    POISSON,
    PREFIX,
    PREFIX_CALLERS,
    SPREAD,
    SPREAD_POINT,
    STRUCTURED,
    THREE,
    WIDE_POINT,
)

# Both bursts report the same things: prefill work actually done, and latency.
BURST_METRICS = (
    "prefill_tokens",
    "prefix_queries",
    "prefix_hits",
    "ttft_p50",
    "ttft_p99",
    "req_s",
    "failed",
)
# The mixed-load classes' view: the mixed load and issue 21's chat mix (past
# capacity adds its short class's refusals).
CLASS_METRICS = (
    "short_ttft_p50",
    "short_ttft_p95",
    "short_ttft_p99",
    "medium_ttft_p95",
    "long_ttft_p95",
    "req_s",
    "failed",
)
# Each scenario's table, in SCENARIOS order; WINDOW and RAW_CEILING have
# sections of their own.
# Issue 27, on every saturated point: the engine's mean running count, and Sluice's
# engine steps, their mean time and the share of the point spent in them (held and
# --no-hold-backlog alike), the steps beside a held backlog, the under-fed ones and
# their share.
UNDERFED_METRICS = (
    "engine_steps",
    "step_ms",
    "in_steps",
    "held_steps",
    "underfed_steps",
    "underfed_share",
    "underfed_policy_steps",
    "underfed_rest_share",
)
SCENARIO_METRICS: dict[str, tuple[str, ...]] = {
    CONCURRENCY: (
        "req_s",
        "out_tok_s",
        "ttft_p50",
        "ttft_p99",
        "tpot_p50",
        "running_mean",
        *UNDERFED_METRICS,
        "front_cpu_ms",
        "failed",
    ),
    POISSON: ("req_s", "ttft_p50", "ttft_p99", "tpot_p50", "e2el_p99", "failed"),
    MIXED: CLASS_METRICS,
    PREFIX: BURST_METRICS,
    PREFIX_CALLERS: BURST_METRICS,
    IDENTICAL: BURST_METRICS,
    STRUCTURED: ("req_s", "out_tok_s", "ttft_p50", "ttft_p99", "tpot_p50", "e2el_p99", "failed"),
    NOISY: (
        "chat_ttft_p50",
        "chat_ttft_p95",
        "chat_ttft_p99",
        "chat_completed",
        "chat_failed",
        "flood_span_completed",
        "flood_span_req_s",
        "flood_span_tok_s",
        "flood_completed",
        "flood_failed",
        "chat_beside_flood",
        *UNDERFED_METRICS,
    ),
    PAST_CAPACITY: (*CLASS_METRICS[:-1], "short_failed", "failed"),
    SPREAD: (
        "ttft_p50",
        "ttft_p99",
        "ttft_max",
        "short_third_ttft_p95",
        "long_third_ttft_p99",
        "req_s",
        "completed",
        "running_mean",
        *UNDERFED_METRICS,
        "failed",
    ),
    LORA: (
        "req_s",
        "worst_ttft_p95",
        *(f"{c}_ttft_p95" for c in LORA_CALLERS),
        *(f"{c}_share" for c in LORA_CALLERS),
        "share_dev",
        "adapter_wait_steps",
        *UNDERFED_METRICS,
        "span_s",
    ),
    THREE: (
        "chat_ttft_p50",
        "chat_ttft_p95",
        "chat_ttft_p99",
        "chat_completed",
        "chat_failed",
        "bulk_span_completed",
        "bulk_span_req_s",
        "bulk_a_span_completed",
        "bulk_b_span_completed",
        "bulk_b_per_a",
        "chat_beside_bulk",
        *UNDERFED_METRICS,
    ),
    CHAT_MIX: CLASS_METRICS,
    DATA_PARALLEL: (
        "req_s",
        "out_tok_s",
        "ttft_p50",
        "ttft_p99",
        "tpot_p50",
        "running_peak",
        "running_p50",
        "running_mean",
        *UNDERFED_METRICS,
        "front_cpu_ms",
        "failed",
    ),
}
# What the front-CPU column measures (every point records it; these tables show it).
FRONT_CPU_NOTE = (
    "Front CPU per request: the user + system CPU time of the server's own process "
    "(/proc/PID/stat, all its threads) while the point ran, over the requests it "
    "completed. On both servers that process holds the HTTP front and the engine "
    "client's output processing (detokenization, vLLM's output handler); the engine "
    "cores and vLLM's DP coordinator are child processes, not counted. The DP points' "
    f"/metrics scrapes (every {RUNNING_POLL_S:g} s) are counted on both."
)
WINDOW_METRICS = ("req_s", "ttft_p50", "ttft_p99", "tpot_p50", "failed")

# The plot: one panel per scenario view, each on the scenario's own x axis.
_CONC_X = "concurrency (requests in flight)"
_RATE_X = "offered rate (req/s)"
_CLASSES = (("short", "short_ttft_p95"), ("medium", "medium_ttft_p95"), ("long", "long_ttft_p95"))
# The c=512 point has other prompt lengths than the sweep: a panel of its own.
_SWEEP_ONLY = (WIDE_POINT,)
PANELS: tuple[Panel, ...] = (
    LinePanel(CONCURRENCY, "req_s", "Concurrency sweep: throughput", _CONC_X, skip=_SWEEP_ONLY),
    LinePanel(
        CONCURRENCY,
        "ttft_p99",
        "Concurrency sweep: TTFT p99",
        _CONC_X,
        log_y=True,
        skip=_SWEEP_ONLY,
    ),
    BarPanel(
        CONCURRENCY,
        (("p50", "ttft_p50"), ("p99", "ttft_p99")),
        f"Backlog beyond max_num_seqs: {WIDE_POINT}, TTFT",
        "TTFT (ms)",
        only=(WIDE_POINT,),
    ),
    LinePanel(POISSON, "ttft_p99", "Poisson sweep: TTFT p99", _RATE_X, log_y=True),
    BarPanel(MIXED, _CLASSES, "Mixed 70/20/10 load: TTFT p95 by request class", "TTFT p95 (ms)"),
    BarPanel(
        NOISY,
        (("p50", "chat_ttft_p50"), ("p95", "chat_ttft_p95")),
        "Noisy neighbour: the chat caller's TTFT",
        "chat TTFT (ms, log scale)",
        log_y=True,
    ),
    BarPanel(
        NOISY,
        (("flood", "flood_span_req_s"),),
        "Noisy neighbour: the flood's req/s during the chat span",
        "req/s",
    ),
    BarPanel(
        PAST_CAPACITY,
        _CLASSES,
        "Mixed 70/20/10 past capacity (KV-bound): TTFT p95",
        "TTFT p95 (ms, log scale)",
        log_y=True,
    ),
    BarPanel(
        SPREAD,
        (
            ("p99", "ttft_p99"),
            ("max", "ttft_max"),
            ("shortest third p95", "short_third_ttft_p95"),
            ("longest third p99", "long_third_ttft_p99"),
        ),
        f"One caller past capacity, {SPREAD_POINT}: TTFT",
        "TTFT (ms)",
    ),
    BarPanel(
        THREE,
        (("chat p95", "chat_ttft_p95"),),
        "Three callers (KV-bound): the chat caller's TTFT p95",
        "chat TTFT p95 (ms, log scale)",
        log_y=True,
    ),
    BarPanel(
        THREE,
        (("bulk", "bulk_span_req_s"),),
        "Three callers: bulk req/s during the chat span",
        "req/s",
    ),
    BarPanel(CHAT_MIX, _CLASSES, "Chat mix 70/20/10 below capacity: TTFT p95", "TTFT p95 (ms)"),
    BarPanel(
        LORA,
        tuple((c.removeprefix("lora_"), f"{c}_ttft_p95") for c in LORA_CALLERS),
        "LoRA, 4 adapters at max-loras 2: each caller's TTFT p95",
        "TTFT p95 (ms, log scale)",
        log_y=True,
    ),
    BarPanel(
        LORA,
        tuple((c.removeprefix("lora_"), f"{c}_share") for c in LORA_CALLERS),
        "LoRA: each caller's share of service (prompt + 2 x generated; fair: 0.25)",
        "share",
    ),
    BarPanel(DATA_PARALLEL, (("req/s", "req_s"),), "Data parallelism (DP=2): req/s", "req/s"),
    BarPanel(
        DATA_PARALLEL,
        (("running", "running_p50"),),
        "Data parallelism: the engine's median running count (2 x 128 slots)",
        "requests running",
    ),
    BarPanel(
        DATA_PARALLEL,
        (("p50", "ttft_p50"), ("p99", "ttft_p99")),
        "Data parallelism (DP=2): TTFT",
        "TTFT (ms)",
    ),
)
