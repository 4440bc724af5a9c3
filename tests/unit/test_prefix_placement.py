"""Prefix placement end to end with the fake engine at two data-parallel ranks.

The app hashes each prompt's blocks through the engine (Engine.prefix_hashes,
the caller's cache_salt in the first), the core places the release by its prefix
within the load bound (batching/prefix.py P1-P4) and the driver hands the rank to
the engine. Each test first puts a conversation's first turn on rank 1, where
load alone would not send its next turn: with both ranks idle, room.py's `place`
ties to rank 0. The real engine's side (its prefix-cache hits):
tests/system/test_parallel.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from batching import EngineStep
from server.callers import parse_callers
from server.engines.lora import Adapter
from tests.fakes import FakeEngine
from tests.support import until
from tests.unit.test_handlers import CHAT

pytestmark = pytest.mark.timeout(30)

KEYS = {"ann": "sk-ann-pq", "bob": "sk-bob-rs"}
CALLERS = "".join(f'[callers.{name}]\nkey = "{key}"\n' for name, key in KEYS.items())
SYSTEM = "You are a careful assistant. Answer in one short line, please. " * 2


def turns(name: str, n: int) -> list[dict[str, str]]:
    """A conversation's messages up to its n-th user turn (each turn repeats the last)."""
    msgs = [{"role": "system", "content": f"{name}: {SYSTEM}"}]
    for i in range(1, n + 1):
        if i > 1:
            msgs.append({"role": "assistant", "content": f"answer {i - 1}"})
        msgs.append({"role": "user", "content": f"question {i} of {name}"})
    return msgs


def body(name: str, n: int) -> dict[str, Any]:
    return {"model": "fake", "messages": turns(name, n), "max_tokens": 2}


async def post(client: Any, payload: dict[str, Any], caller: str | None = None) -> str:
    """Send one chat request; the engine request id it became."""
    headers = {"Authorization": f"Bearer {KEYS[caller]}"} if caller else {}
    resp = await client.post(CHAT, json=payload, headers=headers)
    assert resp.status == 200, await resp.text()
    return str(resp.headers["X-Request-Id"])


def rank_of(engine: FakeEngine, rid: str) -> int | None:
    (eid,) = [e for e in engine.added if e.startswith(rid)]
    return engine.ranks[eid]


async def app(make_client: Any, callers: bool = False, **kw: Any) -> tuple[Any, Any, FakeEngine]:
    engine = FakeEngine(dp_ranks=2, max_model_len=2048, step=0.001)
    if callers:
        table = parse_callers(CALLERS)
        kw.update(caller_table=table, callers=table.policies)
    client, a, engine = await make_client(engine, warmup=False, **kw)
    return client, a, engine


async def first_turns(
    client: Any,
    engine: FakeEngine,
    first: tuple[dict[str, Any], str | None],
    second: tuple[dict[str, Any], str | None],
) -> tuple[str, str]:
    """`first` and `second` in flight together, the first unstarted when the second
    is placed: by room the first goes to rank 0 and the second to rank 1."""
    engine.first_output = asyncio.Event()
    a = asyncio.create_task(post(client, *first))
    await until(lambda: len(engine.held) == 1, what="first turn in the engine")
    b = asyncio.create_task(post(client, *second))
    await until(lambda: len(engine.held) == 2, what="second turn in the engine")
    engine.first_output.set()
    ra, rb = await a, await b
    engine.first_output = None
    assert (rank_of(engine, ra), rank_of(engine, rb)) == (0, 1)
    return ra, rb


async def metric_lines(client: Any, name: str) -> list[str]:
    text = await (await client.get("/metrics")).text()
    return sorted(ln for ln in text.splitlines() if ln.startswith(name))


async def test_a_conversations_later_turns_go_to_its_first_turns_rank(make_client: Any) -> None:
    client, _, engine = await app(make_client)
    await first_turns(client, engine, (body("a", 1), None), (body("b", 1), None))
    later = [rank_of(engine, await post(client, body("b", n))) for n in (2, 3)]
    assert later == [1, 1]  # load alone: [0, 0] (both ranks idle)
    lines = await metric_lines(client, "sluice_engine_rank_placements_total")
    assert 'sluice_engine_rank_placements_total{rank="1",why="prefix"} 2.0' in lines, lines


async def test_no_prefix_placement_places_by_load_and_hashes_nothing(make_client: Any) -> None:
    client, _, engine = await app(make_client, prefix_placement=False)
    await first_turns(client, engine, (body("a", 1), None), (body("b", 1), None))
    later = [rank_of(engine, await post(client, body("b", n))) for n in (2, 3)]
    assert later == [0, 0]
    assert engine.hashed == 0
    lines = await metric_lines(client, "sluice_engine_rank_placements_total")
    assert all('why="load"' in ln for ln in lines if not ln.startswith("#")), lines


async def test_one_rank_hashes_nothing(make_client: Any) -> None:
    client, _, engine = await make_client(FakeEngine(max_model_len=2048), warmup=False)
    await post(client, body("a", 1))
    await post(client, body("a", 2))
    assert engine.hashed == 0
    assert engine.ranks and set(engine.ranks.values()) == {None}
    assert await metric_lines(client, "sluice_engine_rank_placements") == []


async def test_one_rank_hashes_nothing_with_the_order_off_by_default(make_client: Any) -> None:
    """--prefix-order is off by default: one rank with the prefix cache on hashes
    nothing, as before the order existed (issue 62's 'no harm')."""
    engine = FakeEngine(max_model_len=4096, prefix_cache=True)
    client, _, engine = await make_client(engine, warmup=False)
    await post(client, body("a", 1))
    assert engine.hashed == 0


async def test_one_rank_with_the_prefix_cache_hashes_the_leading_blocks(
    make_client: Any,
) -> None:
    """The prefix-warm order (batching/warm.py W5; on with --prefix-order) needs
    only a prompt's first 128 blocks: a longer prompt is hashed that far, once per
    request."""
    engine = FakeEngine(max_model_len=4096, prefix_cache=True)
    client, _, engine = await make_client(engine, warmup=False, prefix_order=True)
    long = {"model": "fake", "messages": [{"role": "user", "content": "alpha " * 500}]}
    long["max_tokens"] = 2
    await post(client, long)
    await post(client, body("a", 1))
    assert engine.hashed == 2
    assert engine.hashed_tokens[0] == 128 * engine.block_size
    assert engine.hashed_tokens[1] < 128 * engine.block_size


async def test_no_prefix_order_hashes_nothing_with_one_rank(make_client: Any) -> None:
    engine = FakeEngine(max_model_len=2048, prefix_cache=True)
    client, _, engine = await make_client(engine, warmup=False, prefix_order=False)
    await post(client, body("a", 1))
    assert engine.hashed == 0


async def test_another_callers_salt_shares_no_placement(make_client: Any) -> None:
    """Ann's conversation is on rank 1; Bob sending the same turn has another salt,
    so none of its blocks is believed held anywhere: placed by load (rank 0)."""
    client, _, engine = await app(make_client, callers=True)
    await first_turns(client, engine, (body("x", 1), "ann"), (body("a", 1), "ann"))
    bob = rank_of(engine, await post(client, body("a", 2), "bob"))
    ann = rank_of(engine, await post(client, body("a", 2), "ann"))
    assert (bob, ann) == (0, 1)
    salts = {engine.salts[e] for e in engine.added}
    assert len(salts) == 2 and None not in salts


async def test_an_overloaded_rank_stops_getting_the_turns(make_client: Any) -> None:
    """Rank 1 reports 8 running (the bound: 8 > 1.25 x (0 + 1)): the conversation's
    next turn goes to rank 0, and is answered; once rank 1 is idle again the turn
    after stays on rank 0, which now holds the longer prefix (the second turn's)."""
    client, _, engine = await app(make_client)
    await first_turns(client, engine, (body("a", 1), None), (body("b", 1), None))

    def step(rank: int, running: int) -> EngineStep:
        return EngineStep(rank, 0, running, running, running, 0, 0.1)

    # The driver takes reported steps at its next round, before it releases.
    engine.report_steps(step(0, 0), step(1, 8))
    assert rank_of(engine, await post(client, body("b", 2))) == 0
    engine.report_steps(step(1, 0))
    assert rank_of(engine, await post(client, body("b", 3))) == 0
    lines = await metric_lines(client, "sluice_engine_rank_placements_total")
    assert 'sluice_engine_rank_placements_total{rank="0",why="bound"} 1.0' in lines, lines


async def test_an_adapters_turn_is_not_believed_held_where_the_base_models_is(
    make_client: Any,
) -> None:
    """A conversation on the base model is on rank 1; its next turn sent to adapter
    alpha hashes apart (vLLM keys every block of an adapter's request by it), so it
    is placed by load (rank 0); alpha's own next turn then follows alpha's rank."""
    alpha = Adapter("alpha", "/adapters/alpha", 1, "fake")
    client, _, engine = await app(make_client, adapters=(alpha,))
    await first_turns(client, engine, (body("a", 1), None), (body("b", 1), None))
    on_alpha = [
        rank_of(engine, await post(client, {**body("b", n), "model": "alpha"})) for n in (2, 3)
    ]
    assert on_alpha == [0, 0]  # hashed as the base model's: [1, 1]
