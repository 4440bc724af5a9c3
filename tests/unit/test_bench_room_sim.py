"""bench/points/room_sim.py, the model the room's constants were chosen on: its engine
keeps vLLM's rules, and it tells a held backlog from none (short runs)."""

from __future__ import annotations

import batching
from bench.points.room_sim import Engine, Req, run


def test_the_engine_runs_prefills_first_then_its_queue_in_order_within_kv() -> None:
    eng = Engine(seqs=4, budget=1024, kv_tokens=1024)
    long, chat, other = (
        Req("l", 2000, 4, "b", 0.0),
        Req("c", 64, 4, "c", 0.0),
        Req("o", 64, 4, "c", 0.0),
    )
    eng.waiting += [long, chat]
    first = eng.schedule()
    assert [(r.rid, n) for r, n, _ in first] == [("l", 512), ("c", 64)]  # the capped chunk
    eng.finish(first, 0.01)
    eng.waiting.append(other)
    second = eng.schedule()
    # The long prompt's next chunk comes first; its KV (1,024 tokens) is full, so it
    # preempts the newest running request (the chat turn) to get blocks.
    assert (second[0][0].rid, second[0][1]) == ("l", 512)
    assert chat in eng.waiting and chat.computed == 0


def test_a_held_backlog_keeps_vllms_queue_short_and_nothing_held_keeps_it_long() -> None:
    held = run(batching, "spread", {}, span=3.0)
    none = run(batching, "spread", {}, nohold=True, span=3.0)
    assert held["engine_waiting"] < 20 < none["engine_waiting"]
    assert none["underfed_share"] == 0.0 and held["held_s"]["feed"] > 0
    assert held["req_s"] > 0 and none["req_s"] > 0


def test_a_fixed_count_runs_every_request_to_its_end_and_counts_the_steps() -> None:
    """--requests, as `vllm bench serve` sends its prompts: all of them end, and
    req/s is over the whole run, tail included."""
    got = run(batching, "spread", {}, total=200)
    assert got["requests"] == 200
    assert got["steps"] >= 32  # each decodes 32 tokens, one a step
    assert got["req_s"] > 0


def test_a_slower_machine_takes_longer_steps_and_the_chat_wait_splits_off_the_queue() -> None:
    """--slower: every step that many times longer (a machine like an AVX2 one in
    float32); the chat caller's TTFT and, apart, its wait in Sluice's backlog."""
    quick = run(batching, "three", {}, span=4.0)
    slow = run(batching, "three", {}, span=4.0, slower=3.0)
    assert slow["req_s"] < quick["req_s"]
    assert slow["chat_ttft_p50_ms"] > quick["chat_ttft_p50_ms"]
    assert 0.0 <= slow["chat_queue_p95_ms"] <= slow["chat_ttft_p95_ms"]
