"""bench/points/prefix_point.py's pure parts, and its callers against a fake
server (no engine): the round-robin copy of docs/haproxy.cfg, the spread's
prompts, the report's ratio lines from recorded runs, and a failed turn
counted rather than raised."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench.points.prefix_point import DEFAULT_SYSTEMS, SESSION_HEADER, one_run, report
from bench.run.balancer import CONFIG, round_robin_config
from bench.run.servers import free_port
from bench.run.spread_prompts import LENGTHS, STEPS, length_order, spread_prompt


def test_the_round_robin_config_is_the_shipped_one_without_its_use_backend_line() -> None:
    shipped = CONFIG.read_text().splitlines()
    out = round_robin_config(CONFIG.read_text()).splitlines()
    gone = [line for line in shipped if line not in out]
    assert [g.strip() for g in gone] == ["use_backend affinity if { var(txn.affinity) -m found }"]
    assert [line for line in shipped if line not in gone] == out
    assert "    default_backend sluice" in out  # unkeyed and keyed alike: round robin


def test_a_config_without_one_use_backend_line_raises() -> None:
    once = round_robin_config(CONFIG.read_text())
    with pytest.raises(ValueError, match="found 0"):
        round_robin_config(once)
    twice = CONFIG.read_text().replace("    default_backend sluice\n", "") + (
        "    use_backend affinity if TRUE\n" * 2
    )
    with pytest.raises(ValueError, match="found 3"):
        round_robin_config(twice)


def test_the_spread_has_13_geometric_lengths_from_16_to_2000_tokens() -> None:
    assert len(LENGTHS) == STEPS == 13
    assert (LENGTHS[0], LENGTHS[-1]) == (16, 2000)
    step = (2000 / 16) ** (1 / 12)
    ratios = [b / a for a, b in itertools.pairwise(LENGTHS)]
    assert all(abs(r - step) < 0.05 for r in ratios), ratios


def test_each_caller_goes_through_every_length_in_an_order_of_its_own() -> None:
    for caller in range(4):
        lengths = [len(spread_prompt(0, caller, t).split()) for t in range(2 * STEPS)]
        assert sorted(lengths[:STEPS]) == sorted(LENGTHS)
        assert lengths[STEPS:] == lengths[:STEPS]  # cycling
    orders = {tuple(length_order(0, c)) for c in range(8)}
    assert len(orders) == 8


def test_no_two_spread_prompts_share_their_first_16_words_and_a_seed_repeats() -> None:
    prompts = [spread_prompt(r, c, t) for r in range(2) for c in range(32) for t in range(13)]
    heads = {tuple(p.split()[:16]) for p in prompts}
    assert len(heads) == len(prompts)
    assert spread_prompt(1, 2, 3) == spread_prompt(1, 2, 3)
    assert spread_prompt(1, 2, 3) != spread_prompt(0, 2, 3)


def args_of(**over: Any) -> argparse.Namespace:
    base: dict[str, Any] = {
        "repeat": 3,
        "conversations": 32,
        "turns": 6,
        "system_words": 1600,
        "user_words": 180,
        "max_tokens": 64,
        "no_shared": False,
        "spread": False,
        "systems": DEFAULT_SYSTEMS,
        "out": Path("bench/results/prefix-cpu.md"),
    }
    return argparse.Namespace(**(base | over))


def run(p50: float, p95: float, req_s: float, hit: float, failed: float = 0) -> dict[str, float]:
    return {"ttft_p50": p50, "ttft_p95": p95, "req_s": req_s, "hit_rate": hit, "failed": failed}


def test_the_spread_report_compares_placement_with_none() -> None:
    args = args_of(spread=True, out=Path("bench/results/prefix-spread-cpu.md"))
    lines = report(
        {
            "sluice": [run(100, 300, 9.9, 0.01), run(110, 330, 10.1, 0.01)],
            "no-placement": [run(100, 300, 10.0, 0.02), run(100, 300, 10.0, 0.02)],
        },
        args,
    )
    assert "Unrelated prompts of 13 lengths" in lines[0]
    assert lines[2].startswith(
        "`./scripts/bench prefix --repeat 3 --conversations 32 --turns 6 --spread --max-tokens 64`"
    )
    assert "| sluice | 105 [100-110] | 315 [300-330] | 10.00 [9.90-10.10] | 0.010" in lines[6]
    assert lines[-1] == (
        "* against --no-prefix-placement: req/s 1.00x (target >= 0.98x), TTFT p50 1.05x, "
        "p95 1.05x; hit rate 0.010 against 0.020."
    )


def test_the_balanced_report_gives_affinity_against_round_robin_and_one_process() -> None:
    systems = "sluice,lb-affinity,lb-roundrobin"
    lines = report(
        {
            "sluice": [run(500, 1000, 6.0, 0.88)],
            "lb-affinity": [run(400, 900, 6.6, 0.88, failed=1)],
            "lb-roundrobin": [run(800, 1800, 5.5, 0.44)],
        },
        args_of(repeat=1, systems=systems, out=Path("/tmp/lb.md")),
    )
    assert f"--max-tokens 64 --systems {systems} --out /tmp/lb.md`" in lines[2]
    assert "## Two instances behind HAProxy (issue 43 item 4)" in lines
    assert "| lb-affinity | 400 [400-400] | 900 [900-900] | 6.60 [6.60-6.60] | 0.880" in "\n".join(
        lines
    )
    assert "| 1 [1-1] |" in next(line for line in lines if line.startswith("| lb-affinity"))
    assert lines[-2:] == [
        "* lb-affinity against lb-roundrobin: hit rate 2.00x, req/s 1.20x, TTFT p95 0.50x.",
        "* lb-affinity against `sluice` (one process, `--data-parallel-size 2`, prefix "
        "placement): hit rate 1.00x, req/s 1.10x, TTFT p95 0.90x.",
    ]
    without_sluice = report(
        {"lb-affinity": [run(1, 1, 1, 1)], "lb-roundrobin": [run(1, 1, 1, 1)]}, args_of()
    )
    assert not any("| sluice" in line or "`sluice`" in line for line in without_sluice)


@contextlib.contextmanager
def fake_sluice(seen: list[tuple[str, int]]) -> Iterator[str]:
    """A chat server on its own thread that fails every conversation's second
    turn with a 503 and records (X-Session-Id, messages) of every request."""
    turns: dict[str, int] = {}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        key = request.headers[SESSION_HEADER]
        seen.append((key, len(body["messages"])))
        turns[key] = turns.get(key, 0) + 1
        if turns[key] == 2:
            return web.Response(status=503, text="busy")
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n')
        return out

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.setup())
    port = free_port()
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_a_failed_turn_is_counted_and_its_conversation_goes_on() -> None:
    seen: list[tuple[str, int]] = []
    args = args_of(conversations=2, turns=3, system_words=3, user_words=2)
    with fake_sluice(seen) as base:
        got = one_run(base, [base], args, rep=5)
    assert got["failed"] == 2
    assert got["req_s"] > 0 and not math.isnan(got["ttft_p95"])
    # Every turn keyed by its conversation; the third sent without the failed
    # second: system, user, answer, user.
    assert sorted(seen) == sorted([(f"5-{c}", n) for c in range(2) for n in (2, 4, 4)])
