"""The request class over HTTP, with the fake engine (batching/classes.py): a
body's `service_tier: "flex"` and a caller the callers file marks `background`
are background work (ordered behind interactive work, named `flex` in the
response), everything else interactive; the class is in the access line and
the metrics, and a SIGHUP reload changes a caller's class."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from batching import BACKGROUND_PRIORITY
from server.app import reload_callers
from server.callers import CallerTable, load_callers
from tests.fakes import FakeEngine
from tests.unit.test_handlers import CHAT, COMP, assert_error, chat, comp, scrape, stream_events

pytestmark = pytest.mark.timeout(30)

FILE = """
[callers.chat]
key = "sk-chat"

[callers.bulk]
key = "sk-bulk"
background = true
"""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _table(path: Path) -> CallerTable:
    path.write_text(FILE)
    return load_callers(path)


async def _client(make_client: Any, path: Path, engine: FakeEngine) -> Any:
    table = _table(path)
    return await make_client(
        engine=engine, caller_table=table, callers=table.policies, callers_file=path, warmup=False
    )


async def test_flex_and_background_callers_are_background_everything_else_interactive(
    make_client: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = FakeEngine()
    client, _, _ = await _client(make_client, tmp_path / "callers.toml", engine)
    sent = [
        ("sk-chat", chat(priority=3), "default"),
        ("sk-chat", chat(priority=3, service_tier="flex"), "flex"),
        ("sk-chat", chat(service_tier="auto"), "default"),
        ("sk-bulk", chat(), "flex"),
        ("sk-bulk", chat(service_tier="default"), "flex"),  # the file's word stands
    ]
    with caplog.at_level(logging.INFO):
        for key, body, tier in sent:
            r = await client.post(CHAT, json=body, headers=bearer(key))
            assert r.status == 200, await r.text()
            assert (await r.json())["service_tier"] == tier
        r = await client.post(COMP, json=comp(service_tier="flex"), headers=bearer("sk-chat"))
        assert r.status == 200, await r.text()
    lines = [r.fields for r in caplog.records if r.getMessage() == "request"]  # type: ignore[attr-defined]
    assert [f["class"] for f in lines] == [
        "interactive",
        "background",
        "interactive",
        "background",
        "background",
        "background",
    ]
    # The engine's priority (the request's own, --engine-priority request): a
    # background request's is raised past any interactive one (rule 2).
    assert list(engine.priorities.values()) == [
        3,
        3 + BACKGROUND_PRIORITY,
        0,
        BACKGROUND_PRIORITY,
        BACKGROUND_PRIORITY,
        BACKGROUND_PRIORITY,
    ]
    m = scrape(await (await client.get("/metrics")).text())
    by = {
        (s.labels["class"], s.labels["status"]): s.value for s in m["sluice_class_requests_total"]
    }
    assert by == {("interactive", "200"): 2, ("background", "200"): 4}


async def test_a_streamed_chat_names_its_tier_in_every_chunk(
    make_client: Any, tmp_path: Path
) -> None:
    client, _, _ = await _client(make_client, tmp_path / "callers.toml", FakeEngine())
    for body, tier in (
        (chat(stream=True, service_tier="flex"), "flex"),
        (chat(stream=True), "default"),
    ):
        evs = await stream_events(await client.post(CHAT, json=body, headers=bearer("sk-chat")))
        assert evs and {e["service_tier"] for e in evs} == {tier}


async def test_a_service_tier_that_is_not_a_string_is_a_400(
    make_client: Any, tmp_path: Path
) -> None:
    client, _, _ = await _client(make_client, tmp_path / "callers.toml", FakeEngine())
    r = await client.post(CHAT, json=chat(service_tier=1), headers=bearer("sk-chat"))
    await assert_error(r, 400, param="service_tier")


async def test_sighup_reload_changes_a_callers_class(make_client: Any, tmp_path: Path) -> None:
    path = tmp_path / "callers.toml"
    engine = FakeEngine()
    client, app, _ = await _client(make_client, path, engine)
    r = await client.post(CHAT, json=chat(), headers=bearer("sk-chat"))
    assert (await r.json())["service_tier"] == "default"
    path.write_text(FILE.replace('key = "sk-chat"', 'key = "sk-chat"\nbackground = true'))
    assert await reload_callers(app) is True
    r = await client.post(CHAT, json=chat(), headers=bearer("sk-chat"))
    assert (await r.json())["service_tier"] == "flex"
    assert list(engine.priorities.values()) == [0, BACKGROUND_PRIORITY]
