"""Task ownership in the generation path (issue 18, item 4): a multi-prompt
request's pumps end inside its own call, and a deduplicated generation runs
no task of its own (its readers fetch for each other)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from server.http.pipeline import _each_output
from tests.fakes import FakeEngine
from tests.support import until
from tests.unit.test_handlers import CHAT, COMP, chat, comp, events, real


class _Outputs:
    """A generation stand-in: `count` outputs, one per step of 1 ms."""

    def __init__(self, count: int) -> None:
        self.count = count

    async def outputs(self, subscriber: str) -> Any:
        for i in range(self.count):
            await asyncio.sleep(0.001)
            yield i


class _Ticket:
    id = "t"


def _pumps() -> list[asyncio.Task[Any]]:
    """Live tasks running a pipeline pump (whatever their names)."""
    return [
        t
        for t in asyncio.all_tasks()
        if not t.done() and getattr(t.get_coro(), "__qualname__", "").endswith(".pump")
    ]


async def test_a_consumer_that_stops_early_leaves_no_pump_running() -> None:
    seen: list[tuple[int, Any]] = []

    async def handle(pi: int, out: Any) -> None:
        seen.append((pi, out))
        if len(seen) == 2:
            raise ConnectionResetError("the client went away")

    gens: Any = [_Outputs(1000), _Outputs(1000)]
    with pytest.raises(ConnectionResetError):  # itself, not an ExceptionGroup
        await _each_output(gens, [_Ticket(), _Ticket()], handle)
    assert _pumps() == []  # ended before the call returned
    assert len(seen) == 2


async def test_engine_death_mid_stream_of_several_prompts(make_client: Any) -> None:
    """A prompt's failure (a SluiceError from its generation) reaches the
    stream's error event as itself: 503 "died", not an internal error."""
    client, _, engine = await make_client(engine=FakeEngine(step=0.02), warmup=False)
    body = comp(prompt=["a", "bb"], max_tokens=200, stream=True, temperature=1)
    stream = await client.post(COMP, json=body)
    assert stream.status == 200
    head = await stream.content.readline()
    await until(lambda: len(engine.unfinished) == 2, what="both prompts running")
    engine.kill()
    evs = events((head + await asyncio.wait_for(stream.content.read(), 10)).decode())
    assert "died" in evs[-1]["error"]["message"], evs[-1]


async def test_a_shared_generation_runs_no_task_of_its_own(make_client: Any) -> None:
    """Two joined readers: the outputs are fetched in the readers' own tasks
    (nothing in the app-wide group), and each reader gets all of them."""
    client, _, engine = await make_client(
        engine=FakeEngine(step=0.01), window=0.05, adaptive=False, release_lone=False, warmup=False
    )
    before = set(asyncio.all_tasks())
    body = chat(temperature=0, max_tokens=30, stream=True)
    a, b = await asyncio.gather(client.post(CHAT, json=body), client.post(CHAT, json=body))
    [eid] = real(engine.added)
    await a.content.readline()
    await b.content.readline()
    new = {t.get_name() for t in set(asyncio.all_tasks()) - before}
    assert not any(n.startswith("pump-") for n in new), new
    texts = [(await r.read()).decode() for r in (a, b)]
    assert texts[0].endswith("data: [DONE]\n\n") and texts[0].count('"finish_reason":"length"') == 1
    assert len(real(engine.added)) == 1 and eid not in engine.aborted
