"""Per-request detail (`vllm bench serve --save-detailed`): what a run's summary cannot say.

Why it exists: a caller's TTFT while another caller ran, the shares of service
between callers, the thirds of a spread by prompt length all need each
request's own timings, not the client's percentiles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.report.client import combine_mixed


def pooled_metrics(
    results: Mapping[str, Mapping[str, float]], logs: Mapping[str, RequestLog]
) -> dict[str, float]:
    """Several callers' jobs as one burst: req/s over the longest job, and the TTFT
    percentiles of every answered request of them all (from per-request detail)."""
    out = combine_mixed(results)
    ttfts = [log.ttfts[i] * 1000 for log in logs.values() for i in log.ok()]
    if ttfts:
        out["ttft_p50"] = percentile(ttfts, 50)
        out["ttft_p99"] = percentile(ttfts, 99)
    return out


@dataclass(frozen=True, slots=True)
class RequestLog:
    """The per-request lists of a `--save-detailed` client result.

    Times are the client's `time.perf_counter()` (CLOCK_MONOTONIC on Linux,
    one clock for every process on the machine), so two concurrent client
    processes' requests can be placed on one time line. A failed request has
    latency 0 and its error text (the HTTP reason, such as "Service
    Unavailable", or a traceback).
    """

    starts: tuple[float, ...]
    latencies: tuple[float, ...]
    ttfts: tuple[float, ...]  # seconds
    output_lens: tuple[int, ...]
    errors: tuple[str, ...]
    input_lens: tuple[int, ...] = ()  # prompt tokens (the client's count); () if not saved

    @classmethod
    def from_result(cls, data: Mapping[str, Any]) -> RequestLog | None:
        """The lists of a client result, or None when it was saved without detail."""
        starts = data.get("start_times")
        if not isinstance(starts, list):
            return None
        n = len(starts)
        lat = list(data.get("latencies") or [0.0] * n)
        ttfts = list(data.get("ttfts") or [0.0] * n)
        outs = list(data.get("output_lens") or [0] * n)
        errs = list(data.get("errors") or [""] * n)
        ins = list(data.get("input_lens") or [])
        if not len(lat) == len(ttfts) == len(outs) == len(errs) == n or len(ins) not in (0, n):
            raise ValueError("client result: per-request lists of different lengths")
        return cls(
            tuple(float(x) for x in starts),
            tuple(float(x or 0.0) for x in lat),
            tuple(float(x or 0.0) for x in ttfts),
            tuple(int(x or 0) for x in outs),
            tuple(str(e or "") for e in errs),
            tuple(int(x or 0) for x in ins),
        )

    def ok(self) -> list[int]:
        """Indices of the successful requests."""
        return [i for i, e in enumerate(self.errors) if not e]

    def span(self) -> tuple[float, float] | None:
        """First start to last end over all requests (a refused one ends at its start)."""
        if not self.starts:
            return None
        ends = [s + lat for s, lat in zip(self.starts, self.latencies, strict=True)]
        return min(self.starts), max(ends)

    def error_counts(self) -> dict[str, int]:
        """Failed requests by the first line of their error (at most 80 characters)."""
        out: dict[str, int] = {}
        for e in self.errors:
            if e:
                key = e.strip().splitlines()[-1 if "Traceback" in e else 0][:80] or "(empty)"
                out[key] = out.get(key, 0) + 1
        return out


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation (numpy's default, which the
    client uses for its own percentiles)."""
    if not values:
        return math.nan
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def noisy_metrics(
    results: Mapping[str, Mapping[str, float]],
    logs: Mapping[str, RequestLog],
    floods: Sequence[str] = ("flood",),
) -> dict[str, float]:
    """One record of a noisy-neighbour point from its `chat` and `flood` jobs.

    The chat caller's TTFT percentiles, completions and refusals (the client's
    own numbers, prefixed `chat_`). With a flood beside it: the chat caller's
    TTFT percentiles again, over only its answered requests sent while the flood
    ran (the flood's client starts a few seconds after the chat client: it
    builds 2,000-token prompts first; and it may end before it); the share of
    chat requests sent while the flood ran; the flood's requests that completed
    inside the chat job's span (first chat request sent to last chat request
    done) and their rate, which does not depend on how long the flood runs on
    after the chat job ends; and the flood's own totals.

    Several flood jobs (`floods`: the three-caller point's bulk callers) get
    these per job, under their own role; "beside" is then from the first of
    them starting to the last ending.
    """
    out: dict[str, float] = {}
    chat = results.get("chat", {})
    for k in ("ttft_p50", "ttft_p95", "ttft_p99", "completed", "failed"):
        if k in chat:
            out[f"chat_{k}"] = chat[k]
    if not any(f in results for f in floods):
        return out
    for f in floods:
        for k in ("completed", "failed", "req_s"):
            if k in results.get(f, {}):
                out[f"{f}_{k}"] = results[f][k]
    chat_log = logs.get("chat")
    flood_logs = [logs[f] for f in floods if f in logs]
    if chat_log is None or len(flood_logs) != len(floods):
        return out
    chat_span = chat_log.span()
    flood_spans = [sp for fl in flood_logs if (sp := fl.span()) is not None]
    if chat_span is None or len(flood_spans) != len(floods):
        return out
    lo, hi = chat_span
    for f, fl in zip(floods, flood_logs, strict=True):
        done = [i for i in fl.ok() if lo <= fl.starts[i] + fl.latencies[i] <= hi]
        out[f"{f}_span_completed"] = float(len(done))
        if hi > lo:
            out[f"{f}_span_req_s"] = len(done) / (hi - lo)
            out[f"{f}_span_tok_s"] = sum(fl.output_lens[i] for i in done) / (hi - lo)
    f_lo, f_hi = min(sp[0] for sp in flood_spans), max(sp[1] for sp in flood_spans)
    beside = [i for i, s in enumerate(chat_log.starts) if f_lo <= s <= f_hi]
    out[f"chat_beside_{'_'.join(floods)}"] = len(beside) / len(chat_log.starts)
    answered = set(chat_log.ok())
    ttfts = [chat_log.ttfts[i] * 1000 for i in beside if i in answered]
    if ttfts:
        for p in (50, 95, 99):
            out[f"chat_ttft_p{p}"] = percentile(ttfts, p)
    return out


def three_caller_metrics(
    results: Mapping[str, Mapping[str, float]],
    logs: Mapping[str, RequestLog],
    bulk: Sequence[str],
) -> dict[str, float]:
    """The noisy neighbour's view with the bulk callers as its floods, plus the
    bulk work as one (completed and req/s during the chat span) and the second
    bulk caller's completions per the first's (their weights' ratio, if shared
    as weighted)."""
    out = noisy_metrics(results, logs, bulk)
    if f"chat_beside_{'_'.join(bulk)}" in out:
        out["chat_beside_bulk"] = out.pop(f"chat_beside_{'_'.join(bulk)}")
    spans = [out.get(f"{b}_span_completed") for b in bulk]
    if all(n is not None for n in spans):
        out["bulk_span_completed"] = sum(n or 0.0 for n in spans)
        rates = [out.get(f"{b}_span_req_s") for b in bulk]
        if all(r is not None for r in rates):
            out["bulk_span_req_s"] = sum(r or 0.0 for r in rates)
        first, second = spans[0] or 0.0, spans[-1] or 0.0
        if first > 0:
            out["bulk_b_per_a"] = second / first
    return out


def share_metrics(
    results: Mapping[str, Mapping[str, float]],
    logs: Mapping[str, RequestLog],
    callers: Sequence[str],
) -> dict[str, float]:
    """Callers side by side (the LoRA point): each one's TTFT p95 (the client's), the
    worst of them, and each one's share of service while all of them ran.

    The span is from the last caller's first request sent to the first caller's last
    request done: a caller that finishes early (or starts late) would otherwise
    count time when it was not competing. Service is fair share's: prompt + 2 x
    generated tokens (the client's counts) of the requests that ended inside the
    span; `share_dev` is the largest |share x callers - 1| (0.2: a share 20% off an
    equal one). `req_s` is every caller's completions in the span per second.
    """
    out: dict[str, float] = {}
    worst = -math.inf
    for c in callers:
        for k in ("ttft_p95", "completed", "failed"):
            if k in results.get(c, {}):
                out[f"{c}_{k}"] = results[c][k]
        worst = max(worst, results.get(c, {}).get("ttft_p95", -math.inf))
    if worst > -math.inf:
        out["worst_ttft_p95"] = worst
    spans = [sp for c in callers if c in logs and (sp := logs[c].span()) is not None]
    if len(spans) != len(callers):
        return out
    lo, hi = max(sp[0] for sp in spans), min(sp[1] for sp in spans)
    if hi <= lo:
        return out
    service: dict[str, float] = {}
    done_n = 0
    for c in callers:
        lg = logs[c]
        done = [i for i in lg.ok() if lo <= lg.starts[i] + lg.latencies[i] <= hi]
        done_n += len(done)
        ins = lg.input_lens
        service[c] = sum((ins[i] if ins else 0) + 2 * lg.output_lens[i] for i in done)
    total = sum(service.values())
    out["req_s"] = done_n / (hi - lo)
    out["span_s"] = hi - lo
    if total > 0:
        n = len(callers)
        for c in callers:
            out[f"{c}_share"] = service[c] / total
        out["share_dev"] = max(abs(service[c] / total * n - 1.0) for c in callers)
    return out


def spread_metrics(result: Mapping[str, float], detail: RequestLog | None) -> dict[str, float]:
    """One record of the spread-lengths backlog: the client's numbers plus, from
    per-request detail, the largest TTFT and the TTFT tails of the shortest and
    longest thirds of the answered requests by prompt length (ties at a third's
    edge go by order)."""
    out = dict(result)
    if detail is None or not detail.input_lens:
        return out
    ok = detail.ok()
    if not ok:
        return out
    out["ttft_max"] = max(detail.ttfts[i] for i in ok) * 1000
    by_len = sorted(ok, key=lambda i: detail.input_lens[i])
    third = len(by_len) // 3
    if third:
        out["short_third_ttft_p95"] = percentile(
            [detail.ttfts[i] * 1000 for i in by_len[:third]], 95
        )
        out["long_third_ttft_p99"] = percentile(
            [detail.ttfts[i] * 1000 for i in by_len[-third:]], 99
        )
    return out
