"""The issues' targets, checked on a run's medians: rows of (target, measured, verdict).

Why it exists: the verdicts are the point of a run, so they are computed from the
records by plain code (unit-tested, tests/unit/test_bench_report.py), never
written by hand. Each issue's targets are one function; a target whose
scenario was not run gives no row.

Noise: between two full runs of the same code, closed-loop throughput on the
2-core machines moved by up to 12% (bench/results/ANALYSIS.md). "No regression"
and "parity" therefore read a ratio of at least 0.9 as within noise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bench.report.client import Spread, ratio
from bench.report.systems import NOHOLD, RAW, SLUICE, VLLM
from bench.report.tables import Record, Table, aggregate
from bench.scenarios import (
    ALONE_POINT,
    CHAT_MIX,
    CONCURRENCY,
    DATA_PARALLEL,
    DP_LEN,
    FLOOD_POINT,
    IDENTICAL,
    LORA,
    LORA_CALLERS,
    LORA_POINT,
    MIXED,
    NOISY,
    PAST_CAPACITY,
    PREFIX,
    SPREAD,
    THREE,
    THREE_POINT,
    WIDE_POINT,
    dp_point,
)

Row = tuple[str, str, str]
NOISE = 0.9  # a throughput ratio at or above this is within run-to-run noise


def _get(records: Sequence[Record], sc: str, point: str, system: str, m: str) -> Spread | None:
    return aggregate(records, sc).get(point, system, m)


def issue7(records: Sequence[Record]) -> list[Row]:
    """Issue 7: throughput and latency against vLLM's server and the raw engine."""
    rows: list[Row] = []

    def get(sc: str, point: str, system: str, m: str) -> Spread | None:
        return _get(records, sc, point, system, m)

    for c in ("c=32", "c=128"):
        s, v = get(CONCURRENCY, c, SLUICE, "req_s"), get(CONCURRENCY, c, VLLM, "req_s")
        r = ratio(s, v)
        if r is not None:
            rows.append(
                (f"{c}: Sluice req/s >= 1.3x vLLM", f"{r:.2f}x", "met" if r >= 1.3 else "MISSED")
            )
        s99, v99 = (
            get(CONCURRENCY, c, SLUICE, "ttft_p99"),
            get(CONCURRENCY, c, VLLM, "ttft_p99"),
        )
        r = ratio(s99, v99)
        if r is not None:
            rows.append(
                (f"{c}: Sluice TTFT p99 <= vLLM", f"{r:.2f}x", "met" if r <= 1.0 else "MISSED")
            )
        raw = get(CONCURRENCY, c, RAW, "req_s")
        r = ratio(s, raw)
        if r is not None:
            rows.append(
                (
                    f"{c}: Sluice req/s vs raw engine (goal 0.8x)",
                    f"{r:.2f}x",
                    "met" if r >= 0.8 else "below goal",
                )
            )
    s, v = (
        get(CONCURRENCY, "c=1", SLUICE, "ttft_p50"),
        get(CONCURRENCY, "c=1", VLLM, "ttft_p50"),
    )
    if s is not None and v is not None:
        d = s.median - v.median
        rows.append(
            ("c=1: Sluice TTFT p50 <= vLLM + 1 ms", f"{d:+.1f} ms", "met" if d <= 1.0 else "MISSED")
        )
    mixed = aggregate(records, MIXED)
    for point in mixed.points:
        s, v = (
            mixed.get(point, SLUICE, "short_ttft_p95"),
            mixed.get(point, VLLM, "short_ttft_p95"),
        )
        r = ratio(v, s)
        if r is not None:
            rows.append(
                (
                    "mixed: short TTFT p95 >= 2x better",
                    f"{r:.2f}x better",
                    "met" if r >= 2 else "MISSED",
                )
            )
    for sc in (PREFIX, IDENTICAL):
        tab = aggregate(records, sc)
        for point in tab.points:
            s, v = (
                tab.get(point, SLUICE, "prefill_tokens"),
                tab.get(point, VLLM, "prefill_tokens"),
            )
            if s is not None and v is not None:
                rows.append(
                    (
                        f"{sc}: fewer prefill tokens than vLLM",
                        f"{s.median:.0f} vs {v.median:.0f}",
                        "met" if s.median < v.median else "MISSED",
                    )
                )
    return rows


def _ms(x: float) -> str:
    return f"{x:,.0f} ms" if x >= 10 else f"{x:.1f} ms"


def issue11(records: Sequence[Record]) -> list[Row]:
    """Issue 11: the held backlog (noisy neighbour, mixed load past capacity, the sweep)."""
    rows: list[Row] = []
    noisy = aggregate(records, NOISY)
    alone = noisy.get(ALONE_POINT, SLUICE, "chat_ttft_p95")
    flood = noisy.get(FLOOD_POINT, SLUICE, "chat_ttft_p95")
    v_alone = noisy.get(ALONE_POINT, VLLM, "chat_ttft_p95")
    v_flood = noisy.get(FLOOD_POINT, VLLM, "chat_ttft_p95")
    if alone is not None and flood is not None and alone.median > 0:
        bound = max(3 * alone.median, alone.median + 150)
        rows.append(
            (
                "noisy neighbour: chat TTFT p95 beside the flood <= 3x alone (or alone + 150 ms)",
                f"{_ms(flood.median)} vs {_ms(alone.median)} alone "
                f"({flood.median / alone.median:.1f}x; bound {_ms(bound)})",
                "met" if flood.median <= bound else "MISSED",
            )
        )
    r = ratio(v_flood, flood)
    if r is not None and flood is not None and v_flood is not None:
        v_note = f", vLLM {_ms(v_alone.median)} alone" if v_alone is not None else ""
        rows.append(
            (
                "noisy neighbour: chat TTFT p95 beside the flood >= 5x better than vLLM",
                f"{_ms(flood.median)} vs {_ms(v_flood.median)} ({r:.1f}x better{v_note})",
                "met" if r >= 5 else "MISSED",
            )
        )
    refused = noisy.get(FLOOD_POINT, SLUICE, "chat_failed")
    if refused is not None:
        sent = noisy.get(FLOOD_POINT, SLUICE, "chat_completed")
        of = f" of {refused.high + sent.high:.0f}" if sent is not None else ""
        rows.append(
            (
                "noisy neighbour: the chat caller is never refused",
                f"{refused.high:.0f}{of} refused (worst repetition)",
                "met" if refused.high == 0 else "MISSED",
            )
        )
    s_fl = noisy.get(FLOOD_POINT, SLUICE, "flood_span_req_s")
    v_fl = noisy.get(FLOOD_POINT, VLLM, "flood_span_req_s")
    r = ratio(s_fl, v_fl)
    if r is not None and s_fl is not None and v_fl is not None:
        s_n = noisy.get(FLOOD_POINT, SLUICE, "flood_span_completed")
        v_n = noisy.get(FLOOD_POINT, VLLM, "flood_span_completed")
        done = f"; {s_n.median:.0f} vs {v_n.median:.0f} completed" if s_n and v_n else ""
        rows.append(
            (
                "noisy neighbour: flood throughput >= 0.9x vLLM's",
                f"{s_fl.median:.2f} vs {v_fl.median:.2f} req/s ({r:.2f}x{done})",
                "met" if r >= 0.9 else "MISSED",
            )
        )
    shares = [
        v.low
        for system in noisy.systems()
        if (v := noisy.get(FLOOD_POINT, system, "chat_beside_flood")) is not None
    ]
    if shares:
        rows.append(
            (
                "noisy neighbour (set-up check): chat requests sent while the flood ran "
                "(the TTFT rows count only these)",
                f"{min(shares):.0%} (lowest over systems and repetitions)",
                "ok" if min(shares) >= 0.8 else "SET-UP: the flood ran beside too few",
            )
        )
    past = aggregate(records, PAST_CAPACITY)
    for point in past.points:
        s, v = (
            past.get(point, SLUICE, "short_ttft_p95"),
            past.get(point, VLLM, "short_ttft_p95"),
        )
        r = ratio(v, s)
        if r is not None and s is not None and v is not None:
            rows.append(
                (
                    f"mixed past capacity ({point}): short TTFT p95 >= 2x better than vLLM",
                    f"{_ms(s.median)} vs {_ms(v.median)} ({r:.2f}x better)",
                    "met" if r >= 2 else "MISSED",
                )
            )
        # a refused request is not a fast one: the percentiles count answers only
        refused = past.get(point, SLUICE, "failed")
        if refused is not None:
            rows.append(
                (
                    f"mixed past capacity ({point}): nothing refused (TTFT counts answers only)",
                    f"{refused.high:.0f} refused (worst repetition)",
                    "met" if refused.high == 0 else "MISSED",
                )
            )
    conc = aggregate(records, CONCURRENCY)
    for c in ("c=1", "c=32", "c=128"):
        r = ratio(conc.get(c, SLUICE, "req_s"), conc.get(c, VLLM, "req_s"))
        if r is not None:
            rows.append(
                (
                    f"{c}: no throughput regression (Sluice req/s >= {NOISE}x vLLM, noise band)",
                    f"{r:.2f}x",
                    "met" if r >= NOISE else "MISSED",
                )
            )
    s, v = conc.get(WIDE_POINT, SLUICE, "req_s"), conc.get(WIDE_POINT, VLLM, "req_s")
    r = ratio(s, v)
    if r is not None and s is not None and v is not None:
        verdict = "met" if r >= 1.0 else "parity within noise" if r >= NOISE else "MISSED"
        rows.append(
            (
                f"{WIDE_POINT}: req/s at least parity with vLLM",
                f"{s.median:.1f} vs {v.median:.1f} req/s ({r:.2f}x)",
                verdict,
            )
        )
    s, v = conc.get(WIDE_POINT, SLUICE, "ttft_p99"), conc.get(WIDE_POINT, VLLM, "ttft_p99")
    r = ratio(s, v)
    if r is not None and s is not None and v is not None:
        rows.append(
            (
                f"{WIDE_POINT}: TTFT p99 at least parity with vLLM",
                f"{_ms(s.median)} vs {_ms(v.median)} ({r:.2f}x)",
                "met" if r <= 1.0 else "within noise" if r <= 1 / NOISE else "MISSED",
            )
        )
    return rows


def _row(
    name: str, s: Spread | None, v: Spread | None, ok: Callable[[float], bool], unit: str
) -> list[Row]:
    """A Sluice/vLLM ratio row (`ok` judges the ratio of medians), or none without both."""
    r = ratio(s, v)
    if r is None or s is None or v is None:
        return []
    fmt = _ms if unit == "ms" else (lambda x: f"{x:,.2f} {unit}")
    return [(name, f"{fmt(s.median)} vs {fmt(v.median)} ({r:.2f}x)", _met(ok(r)))]


def _pair(tab: Table, point: str, m: str) -> tuple[Spread | None, Spread | None]:
    """One point's metric on Sluice and on vLLM's server, for `_row`."""
    return tab.get(point, SLUICE, m), tab.get(point, VLLM, m)


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _chat_bound(alone: float) -> float:
    """Issue 21's bound on a chat turn beside other work: 2x alone, or alone + 30 ms."""
    return max(2 * alone, alone + 30)


def issue21(records: Sequence[Record]) -> list[Row]:
    """Issue 21: the release key and an engine step that leaves room for a chat turn."""
    rows: list[Row] = []
    spread = aggregate(records, SPREAD)
    for point in spread.points:

        def cmp(m: str, point: str = point) -> tuple[Spread | None, Spread | None]:
            return spread.get(point, SLUICE, m), spread.get(point, VLLM, m)

        rows += _row(
            f"{point}: TTFT p99 <= 1.1x vLLM's", *cmp("ttft_p99"), lambda r: r <= 1.1, "ms"
        )
        rows += _row(
            f"{point}: max TTFT <= 1.5x vLLM's", *cmp("ttft_max"), lambda r: r <= 1.5, "ms"
        )
        rows += _row(
            f"{point}: shortest third's TTFT p95 <= 0.7x vLLM's",
            *cmp("short_third_ttft_p95"),
            lambda r: r <= 0.7,
            "ms",
        )
        s, v = cmp("long_third_ttft_p99")
        r = ratio(s, v)
        if r is not None and s is not None and v is not None:
            rows.append(
                (
                    f"{point}: longest third's TTFT p99 (reported, no target)",
                    f"{_ms(s.median)} vs {_ms(v.median)} ({r:.2f}x)",
                    "–",
                )
            )
        # Every stream's prompts complete in a closed loop: the rate is what differs.
        rows += _row(
            f"{point}: completed per second >= 0.95x vLLM's",
            *cmp("req_s"),
            lambda r: r >= 0.95,
            "req/s",
        )
    conc = aggregate(records, CONCURRENCY)
    rows += _row(
        f"{WIDE_POINT}: TTFT p99 <= vLLM's",
        *_pair(conc, WIDE_POINT, "ttft_p99"),
        lambda r: r <= 1.0,
        "ms",
    )
    rows += _row(
        f"{WIDE_POINT}: req/s >= 0.95x vLLM's",
        *_pair(conc, WIDE_POINT, "req_s"),
        lambda r: r >= 0.95,
        "req/s",
    )
    noisy = aggregate(records, NOISY)
    alone = noisy.get(ALONE_POINT, SLUICE, "chat_ttft_p95")
    three = aggregate(records, THREE)
    for label, tab, point in (
        ("noisy neighbour", noisy, FLOOD_POINT),
        ("three callers", three, THREE_POINT),
    ):
        beside = tab.get(point, SLUICE, "chat_ttft_p95")
        if alone is not None and beside is not None and alone.median > 0:
            bound = _chat_bound(alone.median)
            rows.append(
                (
                    f"{label}: chat TTFT p95 <= 2x alone (or alone + 30 ms)",
                    f"{_ms(beside.median)} vs {_ms(alone.median)} alone "
                    f"({beside.median / alone.median:.1f}x; bound {_ms(bound)})",
                    _met(beside.median <= bound),
                )
            )
    rows += _row(
        "noisy neighbour: flood throughput >= 0.95x vLLM's",
        *_pair(noisy, FLOOD_POINT, "flood_span_req_s"),
        lambda r: r >= 0.95,
        "req/s",
    )
    rows += _row(
        "three callers: bulk throughput >= 0.95x vLLM's",
        *_pair(three, THREE_POINT, "bulk_span_req_s"),
        lambda r: r >= 0.95,
        "req/s",
    )
    share = three.get(THREE_POINT, SLUICE, "bulk_b_per_a")
    if share is not None:
        rows.append(
            (
                "three callers: bulk callers' completed work within 20% of 1:3 (Sluice)",
                f"bulk_b / bulk_a = {share.median:.2f} (bound 2.40-3.60)",
                _met(3 * 0.8 <= share.median <= 3 * 1.2),
            )
        )
    rows += _every_rep_short_p95(records)
    mix = aggregate(records, CHAT_MIX)
    for point in mix.points:
        rows += _row(
            f"chat mix below capacity ({point}): short TTFT p95 <= 0.8x vLLM's",
            *_pair(mix, point, "short_ttft_p95"),
            lambda r: r <= 0.8,
            "ms",
        )
    return rows


def _every_rep_short_p95(records: Sequence[Record]) -> list[Row]:
    """Mixed past capacity: short p95 >= 2x better than vLLM's in every repetition
    (pairs of one repetition's Sluice and vLLM records)."""
    rows: list[Row] = []
    by: dict[tuple[str, int, str], float] = {}
    for r in records:
        if r.scenario == PAST_CAPACITY and "short_ttft_p95" in r.metrics:
            by[(r.point, r.rep, r.system)] = r.metrics["short_ttft_p95"]
    points = dict.fromkeys(p for p, _, _ in by)
    for point in points:
        reps = sorted({rep for p, rep, _ in by if p == point})
        better = [
            by[(point, rep, VLLM)] / by[(point, rep, SLUICE)]
            for rep in reps
            if (point, rep, VLLM) in by and by.get((point, rep, SLUICE), 0) > 0
        ]
        if better:
            rows.append(
                (
                    f"mixed past capacity ({point}): short TTFT p95 >= 2x better than "
                    "vLLM's in every repetition",
                    ", ".join(f"{b:.2f}x" for b in better) + " better",
                    _met(min(better) >= 2),
                )
            )
    return rows


def issue20(records: Sequence[Record]) -> list[Row]:
    """Issue 20, item 4: four callers on four adapters at max_loras 2, against vLLM's
    server on the same load."""
    tab = aggregate(records, LORA)
    rows = _row(
        f"LoRA ({LORA_POINT}): req/s >= 0.95x vLLM's",
        *_pair(tab, LORA_POINT, "req_s"),
        lambda r: r >= 0.95,
        "req/s",
    )
    dev = tab.get(LORA_POINT, SLUICE, "share_dev")
    if dev is not None:
        shares = [tab.get(LORA_POINT, SLUICE, f"{c}_share") for c in LORA_CALLERS]
        text = ", ".join(f"{s.median:.3f}" for s in shares if s is not None)
        rows.append(
            (
                "LoRA: every caller's share of service within 20% of a quarter (Sluice)",
                f"{text} (largest deviation {dev.median:.0%})",
                _met(dev.median <= 0.2),
            )
        )
    rows += _row(
        "LoRA: worst caller's TTFT p95 <= vLLM's worst",
        *_pair(tab, LORA_POINT, "worst_ttft_p95"),
        lambda r: r <= 1.0,
        "ms",
    )
    return rows


# Issue 19: two data-parallel ranks of vLLM's CPU default max_num_seqs (128).
DP_SLOTS = 2 * 128
# A 0.5 s sample may land while freed slots are being refilled.
DP_SLOTS_REACHED = 0.95


def issue19(records: Sequence[Record]) -> list[Row]:
    """Issue 19: data parallelism fed to its summed slots, at vLLM's throughput and tail."""
    rows: list[Row] = []
    dp = aggregate(records, DATA_PARALLEL)
    for point in dp.points:
        peak = dp.get(point, SLUICE, "running_peak")
        if peak is not None:
            other = dp.get(point, VLLM, "running_peak")
            rows.append(
                (
                    f"data parallel ({point}): the engine's running count reaches the summed "
                    f"slots (2 x 128 = {DP_SLOTS})",
                    f"peak {peak.median:.0f}"
                    + (f" (vLLM's server: {other.median:.0f})" if other is not None else ""),
                    _met(peak.median >= DP_SLOTS_REACHED * DP_SLOTS),
                )
            )
        rows += _row(
            f"data parallel ({point}): req/s >= 0.95x vLLM",
            *_pair(dp, point, "req_s"),
            lambda r: r >= 0.95,
            "req/s",
        )
        rows += _row(
            f"data parallel ({point}): TTFT p99 <= 1.1x vLLM",
            *_pair(dp, point, "ttft_p99"),
            lambda r: r <= 1.1,
            "ms",
        )
    return rows


# Issue 27: at each saturated point, at most this share of Sluice's engine steps
# beside a held backlog may be under-fed (batching/room.py, underfed).
UNDERFED_SHARE = 0.02
DP_WIDE_POINT = f"c=512 ({DP_LEN[0]} in, {DP_LEN[1]} out)"
# The saturated points: (scenario, point; None: every point of the scenario).
SATURATED: tuple[tuple[str, str | None], ...] = (
    (SPREAD, None),
    (CONCURRENCY, WIDE_POINT),
    (DATA_PARALLEL, DP_WIDE_POINT),
    (THREE, THREE_POINT),
    (NOISY, FLOOD_POINT),
    (LORA, LORA_POINT),
)


def issue27(records: Sequence[Record]) -> list[Row]:
    """Issue 27: the held backlog costs nothing. The engine's steps are not under-fed
    where the backlog holds work, and what the backlog is for does not move."""
    rows: list[Row] = []
    for sc, only in SATURATED:
        tab = aggregate(records, sc)
        for point in tab.points:
            share = tab.get(point, SLUICE, "underfed_share")
            if (only is not None and point != only) or share is None:
                continue
            n = tab.get(point, SLUICE, "underfed_steps")
            held = tab.get(point, SLUICE, "held_steps")
            of = f" ({n.median:,.0f} of {held.median:,.0f})" if n and held else ""
            rest = tab.get(point, SLUICE, "underfed_rest_share")
            if rest is not None and rest.median < share.median:
                # The rest were beside work only rules 4-5 held: a short turn's room.
                of += (
                    f"; {rest.median:.1%} beside work the reserve and long-prefill bound "
                    "did not hold"
                )
            rows.append(
                (
                    f"{point}: under-fed steps <= {UNDERFED_SHARE:.0%} of the steps beside a "
                    "held backlog (Sluice)",
                    f"{share.median:.1%}{of}",
                    _met(share.median <= UNDERFED_SHARE),
                )
            )
    spread = aggregate(records, SPREAD)
    for point in spread.points:
        rows += _row(
            f"{point}: req/s >= 1.0x vLLM's",
            *_pair(spread, point, "req_s"),
            lambda r: r >= 1.0,
            "req/s",
        )
        rows += _row(
            f"{point}: req/s >= 0.98x Sluice's own --no-hold-backlog",
            spread.get(point, SLUICE, "req_s"),
            spread.get(point, NOHOLD, "req_s"),
            lambda r: r >= 0.98,
            "req/s",
        )
        rows += _row(
            f"{point}: TTFT p99 <= 1.0x vLLM's",
            *_pair(spread, point, "ttft_p99"),
            lambda r: r <= 1.0,
            "ms",
        )
        rows += _row(
            f"{point}: requests in the engine (its running count, mean) >= 0.95x vLLM's",
            *_pair(spread, point, "running_mean"),
            lambda r: r >= 0.95,
            "running",
        )
    conc = aggregate(records, CONCURRENCY)
    rows += _row(
        f"{WIDE_POINT}: TTFT p99 <= 1.07x vLLM's",
        *_pair(conc, WIDE_POINT, "ttft_p99"),
        lambda r: r <= 1.07,
        "ms",
    )
    dp = aggregate(records, DATA_PARALLEL)
    rows += _row(
        f"data parallel ({DP_WIDE_POINT}): req/s >= 0.98x vLLM's",
        *_pair(dp, DP_WIDE_POINT, "req_s"),
        lambda r: r >= 0.98,
        "req/s",
    )
    rows += _row(
        f"data parallel ({DP_WIDE_POINT}): TTFT p99 <= 1.1x vLLM's",
        *_pair(dp, DP_WIDE_POINT, "ttft_p99"),
        lambda r: r <= 1.1,
        "ms",
    )
    lora = aggregate(records, LORA)
    rows += _row(
        "LoRA: worst caller's TTFT p95 <= vLLM's worst",
        *_pair(lora, LORA_POINT, "worst_ttft_p95"),
        lambda r: r <= 1.0,
        "ms",
    )
    dev = lora.get(LORA_POINT, SLUICE, "share_dev")
    if dev is not None:
        rows.append(
            (
                "LoRA: every caller's share of service within 10% of a quarter (Sluice)",
                f"largest deviation {dev.median:.0%}",
                _met(dev.median <= 0.10),
            )
        )
    for label, sc, point, bound in (
        ("noisy neighbour", NOISY, FLOOD_POINT, 75.0),
        ("three callers", THREE, THREE_POINT, 68.0),
    ):
        chat = aggregate(records, sc).get(point, SLUICE, "chat_ttft_p95")
        if chat is not None:
            rows.append(
                (
                    f"{label}: chat TTFT p95 <= {bound:.0f} ms (Sluice)",
                    _ms(chat.median),
                    _met(chat.median <= bound),
                )
            )
    share = aggregate(records, THREE).get(THREE_POINT, SLUICE, "bulk_b_per_a")
    if share is not None:
        rows.append(
            (
                "three callers: bulk callers' completed work within 20% of 1:3 (Sluice)",
                f"bulk_b / bulk_a = {share.median:.2f} (bound 2.40-3.60)",
                _met(3 * 0.8 <= share.median <= 3 * 1.2),
            )
        )
    return rows


# Issue 27, item 3: the front's own CPU per request, at most half of vLLM's server's.
FRONT_CPU_BOUND = 0.5
FRONT_CPU_POINTS = (
    (CONCURRENCY, "c=128"),
    (CONCURRENCY, WIDE_POINT),
    (DATA_PARALLEL, dp_point(512)),
)


def issue27_cpu(records: Sequence[Record]) -> list[Row]:
    """Issue 27, item 3: on these 2 cores the front competes with the engine; its
    own CPU per request (the server process, not the engine cores) against vLLM's
    server's, at c=128, c=512 and data parallelism's c=512."""
    rows: list[Row] = []
    for sc, point in FRONT_CPU_POINTS:
        rows += _row(
            f"{point}{' (DP=2)' if sc == DATA_PARALLEL else ''}: front CPU per request "
            f"<= {FRONT_CPU_BOUND}x vLLM's server's",
            *_pair(aggregate(records, sc), point, "front_cpu_ms"),
            lambda r: r <= FRONT_CPU_BOUND,
            "ms/req",
        )
    return rows


TARGET_SETS: tuple[tuple[str, Callable[[Sequence[Record]], list[Row]]], ...] = (
    ("issue 27: the held backlog costs nothing", issue27),
    ("issue 27, item 3: the front's own CPU", issue27_cpu),
    ("issue 20: adapter-aware release (LoRA)", issue20),
    ("issue 19: data parallelism", issue19),
    ("issue 21: the release key and the engine step", issue21),
    ("issue 11: the held backlog", issue11),
    ("issue 7", issue7),
)
