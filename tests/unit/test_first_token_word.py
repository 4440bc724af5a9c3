"""The front's word to Sluice's scheduler on first tokens (batching/step_share.py rule 2,
through server/engines/board.py), with the fake engine: a streamed interactive turn is
counted on its rank from its dispatch until a frame carrying its first text goes out,
so a first token without text (a thinking model's `<think>`, part of a character)
still holds the background's next step; background streams and whole responses are
not counted (nobody reads their first token); a stream the client leaves ends its
count."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fakes import FakeEngine
from tests.support import until
from tests.unit.test_handlers import CHAT, COMP, chat, comp, stream_events

pytestmark = pytest.mark.timeout(30)


async def test_a_streamed_turn_is_due_until_a_frame_carries_its_text(make_client: Any) -> None:
    engine = FakeEngine(script=("", "", "Hi", " there"), step=0.02)
    client, _, _ = await make_client(engine=engine, warmup=False)
    evs = await stream_events(await client.post(COMP, json=comp(stream=True)))
    assert "".join(e["choices"][0]["text"] for e in evs if e.get("choices")) == "Hi there"
    # Counted before its first output; shown with the third (the first with text).
    assert engine.unshown == [(0, 1, 0), (0, 0, 3)]


async def test_background_streams_and_whole_responses_are_not_counted(make_client: Any) -> None:
    engine = FakeEngine(script=("", "Hi"), step=0.01)
    client, _, _ = await make_client(engine=engine, warmup=False)
    await stream_events(await client.post(CHAT, json=chat(stream=True, service_tier="flex")))
    r = await client.post(COMP, json=comp())
    assert r.status == 200, await r.text()
    assert engine.unshown == []


async def test_a_stream_left_before_its_text_ends_its_count(make_client: Any) -> None:
    engine = FakeEngine(script=("",) * 200, step=0.02)
    client, _, _ = await make_client(engine=engine, warmup=False)
    resp = await client.post(COMP, json=comp(stream=True, max_tokens=200))
    assert resp.status == 200
    await until(lambda: engine.outputs_put >= 2, what="two outputs without text")
    resp.close()  # the client goes away
    await until(lambda: engine.unshown[-1][1] == 0, what="the count back to 0")
    assert [c for _, c, _ in engine.unshown] == [1, 0]
