"""Micro-benchmark of the policy core's hot path: add + due + finished, one core.

Why it exists: the core runs on the event loop, in front of every request; it must
cost a few microseconds per request (target: 200,000 req/s, 5 us/request) so that the
front end, not the policy, stays the thing to optimise.

What it measures: requests are pre-built outside the timed region (building a frozen
`Request` is the server's cost, reported separately). Each timed step admits one
request, calls `due(now)`, and reports generations as finished 1000 dispatches after
their release (so about 1000 are in flight). Requests spread round-robin over GROUPS
group keys (a base model and LoRA adapters).

* window 10 ms: 2000 arrivals per window, so about 1000 wait on average, in groups of
  ~50 (under the 64-entry size cap): batches leave on the DEADLINE rule.
* window 0: every request is its own IMMEDIATE batch (the queue stays empty).
* backlog path: as window 10 ms, with the engine's capacity known (as in the server),
  so every eligible generation goes through the backlog and the room test; the slots
  and step budget are large enough that nothing is actually held, and each release is
  reported `started()` at once.

No dedupe fingerprints.

Run: `python bench/points/core_bench.py`.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from batching import Coalescer, CoalescerConfig, EngineCapacity, Request, group_key

GROUPS = 40


def _requests(n: int, prompt_len: int, groups: int) -> list[Request]:
    keys = [group_key("bench-model", f"lora{g}" if g else None) for g in range(groups)]
    reqs = []
    for i in range(n):
        key = keys[i % groups]
        prompt = (i % 50_000,) * (prompt_len - (i % 7))
        reqs.append(Request(f"r{i}", key, prompt, 64, 0.0, priority=i % 3))
    return reqs


# Known, and never the limit here: about 1000 in flight, 2000 released per window.
_ROOMY = EngineCapacity(max_seqs=1_000_000, step_tokens=1_000_000, kv_tokens=1_000_000_000)


def run(window: float, n: int, queued: int, held: bool = False) -> float:
    cfg = CoalescerConfig(
        window=window,
        max_pending_requests=queued * 4 + 1024,
        engine=_ROOMY if held else EngineCapacity(),
    )
    reqs = _requests(n + queued, 12, GROUPS)
    # Arrival times: 2 x `queued` per window, so that on average `queued` wait.
    step = (window / (2 * queued)) if window else 1e-6
    reqs = [
        Request(r.id, r.key, r.prompt_tokens, r.max_new_tokens, i * step, r.priority)
        for i, r in enumerate(reqs)
    ]
    co = Coalescer(cfg)
    # Warm up: fill the queue without releasing.
    for r in reqs[:queued]:
        co.add(r, r.arrival)
    gc.collect()
    gc.disable()
    add = co.add
    due = co.due
    finished = co.finished
    started = co.started
    pop_events = co.pop_events
    # Generations finish `queued` dispatches later, so about that many are in flight too.
    flying: deque[str] = deque()
    t0 = time.perf_counter()
    for r in reqs[queued:]:
        now = r.arrival
        add(r, now)
        batches = due(now)
        if batches:
            for b in batches:
                for e in b.entries:
                    flying.append(e.request.id)
                    if held:
                        started(e.request.id, now)
            while len(flying) > queued:
                finished(flying.popleft(), now)
            pop_events()
    dt = time.perf_counter() - t0
    gc.enable()
    assert co.pending_requests <= 2 * queued + 2 * cfg.max_batch_seqs * GROUPS
    return n / dt


def build_cost(n: int) -> float:
    key = group_key("bench-model")
    prompt = (1,) * 12
    t0 = time.perf_counter()
    for i in range(n):
        Request("r", key, prompt, 64, float(i))
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=200_000, help="requests per scenario")
    ap.add_argument("--queued", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3, help="best of N")
    args = ap.parse_args()
    print(
        f"python {sys.version.split()[0]}, n={args.n}, ~{args.queued} queued, best of {args.repeat}"
    )
    scenarios = [
        ("window 10 ms", 0.010, False),
        ("window 0 (immediate)", 0.0, False),
        ("window 10 ms, backlog path", 0.010, True),
        ("window 0, backlog path", 0.0, True),
    ]
    for name, window, held in scenarios:
        rate = max(run(window, args.n, args.queued, held) for _ in range(args.repeat))
        print(f"{name:32s} {rate:12,.0f} req/s  {1e6 / rate:6.2f} us/request")
    rate = max(build_cost(args.n) for _ in range(args.repeat))
    name = "(server side) Request(...) build"
    print(f"{name:32s} {rate:12,.0f} req/s  {1e6 / rate:6.2f} us/request")


if __name__ == "__main__":
    main()
