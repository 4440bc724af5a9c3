"""A model of vLLM's scheduler fed by Sluice's real core: compares room rules where
the machine is too busy to measure them (issue 27).

Why it exists: the room's rules trade feeding the engine against a chat turn's
wait, and on a shared 2-core machine a run moves by tens of percent (engine steps
took 100x longer than quiet while other engines ran). This replays the bench's
saturated points in simulated time against the real `batching` core (this
checkout's, or an older one's with --core), with a deterministic engine. It is a
model: numbers from it guide a choice and go into comments as "modelled"; the
benchmark (./scripts/bench) decides.

The engine (vLLM 0.32's scheduler, as server/engines/step_flags.py configures it): a
first-come-first-served waiting queue; each step schedules the running requests
first (a decode token each, or the next chunk of a prompt, capped at 512 tokens
with vLLM's adaptive floor: budget / requests), then waiting ones while budget
(2,048) and slots (128) last; KV in 16-token blocks, allocated as chunks are
scheduled; a request that cannot get blocks preempts the newest running request
(recomputed later), a waiting one that cannot blocks the queue behind it. A step
takes 6.5 ms + 0.053 ms per token (the demo model on 2 quiet cores: 7 ms for a
decode-only step of 7, 34 ms with a 512-token chunk). The engine schedules step
N+1 as soon as step N ends; the front hears of step N 1 ms later, so what it
releases then enters the queue for step N+2, as in vLLM. Calibration: issue 21's
room gives 39.7 req/s and TTFT p99 9.8 s at the c=384 spread (measured: 39.8 and
9.95 s), chat TTFT p95 71 ms beside the flood (measured 75 ms); everything sent
at once (--nohold) 43.7 req/s (vLLM's server measured 43.1, Sluice's
--no-hold-backlog 44.9).

    python -m bench.points.room_sim spread              # this checkout's core
    python -m bench.points.room_sim spread --requests 1152   # the benchmark's count, tail included
    python -m bench.points.room_sim noisy --set long_prefills=0
    python -m bench.points.room_sim three --core /tmp/old   # an older `batching` package
    python -m bench.points.room_sim three --slower 3        # every step 3x longer
"""

from __future__ import annotations

import argparse
import heapq
import importlib
import math
import random
import statistics
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

BLOCK = 16
FRONT_DELAY = 0.001  # the front hears of a step this long after it ended
SCENARIOS = ("spread", "wide", "noisy", "three", "dp")


def step_time(tokens: int) -> float:
    return 0.0065 + 0.000053 * tokens


@dataclass
class Req:
    rid: str
    prompt: int
    out: int
    caller: str
    arrival: float
    computed: int = 0  # tokens in the KV cache (prompt, then generated)
    generated: int = 0
    blocks: int = 0
    released_at: float | None = None
    rank: int = 0  # the data-parallel rank vLLM's client placed it on
    first_at: float | None = None
    done_at: float | None = None


class Engine:
    """vLLM's scheduler, as far as the room can tell it apart (see the module doc)."""

    def __init__(self, seqs: int = 128, budget: int = 2048, kv_tokens: int = 524288) -> None:
        self.seqs, self.budget, self.chunk = seqs, budget, 512
        self.total = kv_tokens // BLOCK
        self.free = self.total
        self.waiting: list[Req] = []
        self.running: list[Req] = []

    def _alloc(self, r: Req, tokens: int) -> bool:
        want = math.ceil(tokens / BLOCK) - r.blocks
        if want > self.free:
            return False
        if want > 0:
            self.free -= want
            r.blocks += want
        return True

    def _preempt(self, r: Req) -> None:
        self.free += r.blocks
        r.blocks = r.computed = 0
        self.running.remove(r)
        self.waiting.insert(0, r)

    def schedule(self) -> list[tuple[Req, int, bool]]:
        """One step: (request, tokens, in prefill) for each request scheduled."""
        budget = self.budget
        eligible = len(self.running) + len(self.waiting)
        cap = max(self.chunk, self.budget // eligible) if eligible > 1 else 0
        out: list[tuple[Req, int, bool]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            need = r.prompt + r.generated - r.computed
            n = min(need if need == 1 else min(need, cap or need), budget)
            while not self._alloc(r, r.computed + n):
                if self.running[-1] is r:
                    break
                self._preempt(self.running[-1])
            else:
                out.append((r, n, r.generated == 0))
                budget -= n
                i += 1
                continue
            self._preempt(r)
        while budget > 0 and self.waiting and len(self.running) < self.seqs:
            r = self.waiting[0]
            n = min(r.prompt + r.generated - r.computed, cap or budget, budget)
            if not self._alloc(r, r.computed + n):
                break  # first come, first served: the rest waits behind it
            self.waiting.pop(0)
            self.running.append(r)
            out.append((r, n, r.generated == 0))
            budget -= n
        return out

    def finish(self, sched: list[tuple[Req, int, bool]], t: float) -> tuple[list[Req], list[Req]]:
        """A step ran: its first tokens and finished requests."""
        firsts, done = [], []
        for r, n, _ in sched:
            r.computed += n
            if r.computed >= r.prompt + r.generated:
                r.generated += 1
                if r.first_at is None:
                    r.first_at = t
                    firsts.append(r)
                if r.generated >= r.out:
                    done.append(r)
        for r in done:
            self.running.remove(r)
            self.free += r.blocks
            r.blocks = 0
            r.done_at = t
        return firsts, done

    @property
    def kv_usage(self) -> float:
        return 1 - self.free / self.total


def run(
    b: ModuleType,
    scenario: str,
    settings: dict[str, Any],
    *,
    nohold: bool = False,
    seed: int = 1,
    span: float = 35.0,
    total: int = 0,
    slower: float = 1.0,
) -> dict[str, Any]:
    """One scenario point: `span` seconds of load after 2 s of warm-up (closed-loop
    streams, a Poisson chat caller at 3 req/s where the bench has one); or, with
    `total`, the streams' first `total` requests, as `vllm bench serve` sends a
    fixed number of prompts, req/s then over the whole run (first arrival to last
    end: the benchmark's duration, tail included)."""
    warm = 2.0
    rng = random.Random(seed)
    kv_tokens = 16384 if scenario in ("noisy", "three") else 524288
    # "dp": two data-parallel ranks, each its own scheduler, step loop and KV cache,
    # each request placed by vLLM's client (`place`).
    ranks = 2 if scenario == "dp" else 1
    # Two engines share the two cores there, beside the front: measured at c=512
    # (bench/results/issue27-cpu.md) a step of 128 decodes took about 110 ms, 8x
    # the one-engine model's.
    slow = (8.0 if scenario == "dp" else 1.0) * slower
    # And their steps vary, which keeps equal requests on two ranks from finishing
    # in lockstep: +-10% a step there (seeded).
    jitter = 0.1 if scenario == "dp" else 0.0
    engs = [Engine(kv_tokens=kv_tokens) for _ in range(ranks)]
    names = {
        "noisy": ("chat", "batch"),
        "three": ("chat", "bulk_a", "bulk_b"),
        "spread": ("default",),
        "wide": ("default",),
        "dp": ("default",),
    }[scenario]
    capacity = b.EngineCapacity(
        max_seqs=128, step_tokens=2048, kv_tokens=kv_tokens, prefill_chunk=512, ranks=ranks
    )
    config = b.CoalescerConfig(
        window=0.01,
        max_batch_seqs=128,
        max_batch_tokens=2048,
        engine=b.EngineCapacity() if nohold else capacity,
        callers=b.Callers(tuple(b.CallerPolicy(n, 3.0 if n == "bulk_b" else 1.0) for n in names)),
        **settings,
    )
    core = b.Coalescer(config)
    steps_api = hasattr(core, "room_counters")
    key = b.group_key("m")
    reqs: dict[str, Req] = {}
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, payload: Any = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    if scenario in ("noisy", "three"):
        t = 0.0
        while (t := t + rng.expovariate(3.0)) <= span:
            push(warm + t, "arrive", ("chat", 64, 32, False))
    streams = {"noisy": [("batch", 2000, 128)] * 32, "spread": [("default", 0, 32)] * 384}
    streams["three"] = [("bulk_a", 1500, 128), ("bulk_b", 1500, 128)] * 16
    streams["wide"] = [("default", 64, 32)] * 512
    streams["dp"] = [("default", 64, 64)] * 512
    for i, (caller, prompt, out) in enumerate(streams.get(scenario, [])):
        push(0.0001 * i, "arrive", (caller, prompt or rng.randint(16, 700), out, True))

    stop = warm + span
    loops: dict[str, tuple[str, int, int]] = {}
    in_transit: list[list[Req]] = [[] for _ in engs]
    reported: list[Any] = []
    busy = [False] * ranks  # a step is running on the rank
    per_step: list[tuple[int, int]] = []  # (tokens, waiting after)
    inflight = [0] * ranks  # unfinished requests placed on each rank
    first_rank = 0

    def place(named: int | None) -> int:
        """vLLM 0.32's DP client (core_client.py get_core_engine_for_request), one
        client: the rank the request names (Sluice's placement, room.py `place`), or
        the one with the fewest of its unfinished requests, ties rotating."""
        nonlocal first_rank
        if named is None:
            best = min(range(ranks), key=lambda i: (inflight[(first_rank + i) % ranks], i))
            named = (first_rank + best) % ranks
            first_rank = (first_rank + 1) % ranks
        inflight[named] += 1
        return named

    def due(t: float) -> None:
        kv = [e.kv_usage for e in engs]
        load = b.EngineLoad(
            sum(len(e.running) for e in engs),
            sum(len(e.waiting) for e in engs),
            statistics.mean(kv),
            min(kv) if ranks > 1 else None,
        )
        batches = core.due(t, load, list(reported)) if steps_api else core.due(t, load)
        reported.clear()
        for batch in batches:
            for e in batch.entries:
                r = reqs[e.request.id]
                r.released_at = t
                r.rank = place(getattr(e, "rank", None))
                in_transit[r.rank].append(r)
        core.pop_events()
        deadline = core.next_deadline()
        if deadline is not None:
            push(max(deadline, t), "tick")
        for rank in range(ranks):
            if in_transit[rank] and not busy[rank]:
                push(t, "kick", rank)

    def start_step(t: float, rank: int) -> None:
        eng = engs[rank]
        eng.waiting.extend(in_transit[rank])
        in_transit[rank].clear()
        sched = eng.schedule()
        busy[rank] = bool(sched)
        if sched:
            took = (
                slow * step_time(sum(n for _, n, _ in sched)) * rng.uniform(1 - jitter, 1 + jitter)
            )
            push(t + took, "step_end", (rank, sched))

    n = 0
    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            caller, prompt, out, loop = payload
            if loop and (n >= total if total else t > stop):
                continue
            n += 1
            r = reqs[f"{caller}-{n}"] = Req(f"{caller}-{n}", prompt, out, caller, t)
            core.add(b.Request(r.rid, key, tuple(range(prompt)), out, t, caller=caller), t)
            if loop:
                loops[r.rid] = (caller, prompt, out)
            due(t)
        elif kind == "tick":
            due(t)
        elif kind == "kick":
            if not busy[payload]:
                start_step(t, payload)
        elif kind == "step_end":
            rank, sched = payload
            eng = engs[rank]
            firsts, done = eng.finish(sched, t)
            for r in done:
                inflight[r.rank] -= 1
            prefill = sum(n for _, n, p in sched if p)
            decode = sum(n for _, n, p in sched if not p)
            step = None
            if steps_api:
                step = b.EngineStep(
                    rank,
                    prefill,
                    decode,
                    len(sched),
                    len(eng.running),
                    len(eng.waiting),
                    eng.kv_usage,
                )
            per_step.append((prefill + decode, len(eng.waiting)))
            start_step(t, rank)  # the rank schedules its next step at once
            push(t + FRONT_DELAY, "report", (firsts, done, step))
        elif kind == "report":
            firsts, done, step = payload
            for r in firsts:
                core.started(r.rid, t)
            for r in done:
                core.finished(r.rid, t, r.out)
                if r.rid in loops:
                    caller, prompt, out = loops.pop(r.rid)
                    prompt = rng.randint(16, 700) if scenario == "spread" else prompt
                    push(t, "arrive", (caller, prompt, out, True))
            if step is not None:
                reported.append(step)
            due(t)
    if total:
        return _summary(scenario, reqs, per_step, core, steps_api, 0.0, math.inf)
    return _summary(scenario, reqs, per_step, core, steps_api, warm, stop)


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[int(q * (len(values) - 1))] if values else math.nan


def _summary(
    scenario: str,
    reqs: dict[str, Req],
    per_step: list[tuple[int, int]],
    core: Any,
    steps_api: bool,
    lo: float,
    hi: float,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    answered = [r for r in reqs.values() if r.caller == "chat" and r.first_at]
    chat = [1000 * (r.first_at - r.arrival) for r in answered if r.first_at]
    if chat:
        out["chat_ttft_p50_ms"] = _p(chat, 0.5)
        out["chat_ttft_p95_ms"] = _p(chat, 0.95)
        # Of that, the wait in Sluice's backlog (arrival to release): what the
        # policy held, apart from the engine's own queue and steps.
        queued = [1000 * (r.released_at - r.arrival) for r in answered if r.released_at is not None]
        out["chat_queue_p95_ms"] = _p(queued, 0.95)
    work = [r for r in reqs.values() if r.caller != "chat" and r.done_at and lo <= r.done_at <= hi]
    if math.isinf(hi):  # a fixed count: over the whole run, as the benchmark's duration
        ends = [r.done_at for r in work if r.done_at is not None]
        out["req_s"] = len(work) / (max(ends) - min(r.arrival for r in work))
        out["requests"] = len(work)
        out["steps"] = len(per_step)
    else:
        out["req_s"] = len(work) / (hi - lo)
    if scenario == "three":
        a = sum(r.caller == "bulk_a" for r in work)
        out["bulk_b_per_a"] = sum(r.caller == "bulk_b" for r in work) / max(1, a)
    if scenario in ("spread", "wide", "dp"):
        timed = [
            (r.first_at, r)
            for r in reqs.values()
            if r.first_at is not None and lo <= r.arrival <= hi
        ]
        ttft = [1000 * (first - r.arrival) for first, r in timed]
        out["ttft_p50_ms"] = _p(ttft, 0.5)
        out["ttft_p99_ms"] = _p(ttft, 0.99)
        # From release to first token: the wait in vLLM's queue, where Sluice no
        # longer decides the order.
        engine_wait = [1000 * (first - (r.released_at or r.arrival)) for first, r in timed]
        out["engine_wait_p50_ms"] = _p(engine_wait, 0.5)
        out["engine_wait_p99_ms"] = _p(engine_wait, 0.99)
    mid = per_step[len(per_step) // 10 : -len(per_step) // 10 or None]
    out["tokens_per_step"] = statistics.mean(x for x, _ in mid)
    out["engine_waiting"] = statistics.mean(w for _, w in mid)
    if steps_api:
        c = core.room_counters
        out["underfed_share"] = c.underfed_steps / max(1, c.steps_held)
        policy = getattr(c, "underfed_policy_steps", 0)  # an older core has none
        out["underfed_rest_share"] = (c.underfed_steps - policy) / max(1, c.steps_held)
        out["held_s"] = {k: round(v, 1) for k, v in c.held_seconds if v}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("scenario", choices=SCENARIOS)
    ap.add_argument("--core", help="a directory holding another `batching` package")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a CoalescerConfig field (a Python literal), e.g. feed_steps=3",
    )
    ap.add_argument("--nohold", action="store_true", help="engine capacity unknown: hold nothing")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--requests",
        type=int,
        default=0,
        help="send this many requests in all (as the benchmark does) instead of a span",
    )
    ap.add_argument(
        "--slower",
        type=float,
        default=1.0,
        help="every step this many times longer (a slower machine: 1.8 on an AVX2 one in float32)",
    )
    ns = ap.parse_args(argv)
    if ns.core:
        sys.path.insert(0, ns.core)
    b = importlib.import_module("batching")
    import ast

    settings = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in ns.set)}
    res = run(
        b,
        ns.scenario,
        settings,
        nohold=ns.nohold,
        seed=ns.seed,
        total=ns.requests,
        slower=ns.slower,
    )
    print(
        ns.scenario,
        settings,
        {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
