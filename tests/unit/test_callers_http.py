"""Callers over HTTP, with the fake engine: 429 for one caller while another is
served, keys that name callers, the `user` field without keys, SIGHUP reload,
per-caller metrics, and the held backlog reaching the engine only as it has room."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from server.app import reload_callers
from server.callers import load_callers, parse_callers
from server.state import MODELS
from tests.fakes import FakeEngine
from tests.support import until
from tests.unit.test_handlers import CHAT, assert_error, chat, retry_after, scrape

pytestmark = pytest.mark.timeout(30)

FILE = """
[callers.chat]
key = "sk-chat"
weight = 4

[callers.batch]
key = "sk-batch"
max_concurrency = 1
max_queued = 0
"""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def with_file(make_client: Any, text: str, path: Path | None = None, **kw: Any) -> Any:
    table = parse_callers(text) if path is None else load_callers(path)
    return await make_client(caller_table=table, callers=table.policies, callers_file=path, **kw)


async def test_caller_over_its_limit_gets_429_while_another_is_served(make_client: Any) -> None:
    engine = FakeEngine(step=0.02)
    client, app, _ = await with_file(make_client, FILE, engine=engine, warmup=False)
    first = asyncio.create_task(
        client.post(CHAT, json=chat(max_tokens=20), headers=bearer("sk-batch"))
    )
    await until(
        lambda: app[MODELS].default.driver.core.pending_requests == 1, what="batch admitted"
    )
    over = await client.post(CHAT, json=chat(), headers=bearer("sk-batch"))
    err = await assert_error(over, 429, code="caller_limit")
    assert "batch" in err["message"]
    assert retry_after(over) >= 1
    served = await client.post(CHAT, json=chat(), headers=bearer("sk-chat"))
    assert served.status == 200, await served.text()
    assert (await first).status == 200

    m = scrape(await (await client.get("/metrics")).text())
    by = {
        (s.labels["caller"], s.labels["status"]): s.value for s in m["sluice_caller_requests_total"]
    }
    assert by == {("batch", "200"): 1, ("batch", "429"): 1, ("chat", "200"): 1}
    waits = {s.labels["caller"]: s.value for s in m["sluice_queue_wait_seconds_count"]}
    assert waits == {"batch": 1, "chat": 1}
    service = {s.labels["caller"]: s.value for s in m["sluice_caller_service_total"]}
    prompt = {s.labels["caller"]: s.value for s in m["sluice_caller_prompt_tokens_total"]}
    generated = {s.labels["caller"]: s.value for s in m["sluice_caller_generated_tokens_total"]}
    assert generated == {"batch": 20, "chat": 5}
    assert service["chat"] == prompt["chat"] + 2 * 5
    assert {s.labels["caller"] for s in m["sluice_caller_fair_share_counter"]} == {"batch", "chat"}
    assert m["sluice_backlog_generations"][0].value == 0
    assert m["sluice_engine_unstarted"][0].value == 0


async def test_the_access_log_names_the_caller(
    make_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client, _, _ = await with_file(make_client, FILE, warmup=False)
    with caplog.at_level(logging.INFO):
        assert (await client.post(CHAT, json=chat(), headers=bearer("sk-chat"))).status == 200
    lines = [r.fields for r in caplog.records if r.getMessage() == "request"]  # type: ignore[attr-defined]
    assert [f["caller"] for f in lines] == ["chat"]
    assert "sk-chat" not in caplog.text


async def test_only_known_keys_get_in(make_client: Any) -> None:
    client, _, _ = await with_file(make_client, FILE, warmup=False)
    for headers in ({}, bearer("sk-other"), {"Authorization": "sk-chat"}):
        await assert_error(await client.post(CHAT, json=chat(), headers=headers), 401)
    assert (await client.post(CHAT, json=chat(), headers=bearer("sk-chat"))).status == 200


async def test_without_keys_the_user_field_names_the_caller(make_client: Any) -> None:
    client, app, _ = await make_client(warmup=False)
    for user in ("alice", "bob", "alice", None):
        body = chat(user=user) if user else chat()
        assert (await client.post(CHAT, json=body)).status == 200
    # Each name is a caller of its own in the core (fair share)...
    assert {c.name for c in app[MODELS].default.driver.core.callers()} == {
        "alice",
        "bob",
        "default",
    }
    # ...but a client's string is never a metric label (issue 28): one bucket.
    m = scrape(await (await client.get("/metrics")).text())
    by = {s.labels["caller"]: s.value for s in m["sluice_caller_requests_total"]}
    assert by == {"user": 3, "default": 1}


async def test_one_api_key_is_one_caller(make_client: Any) -> None:
    client, _, _ = await make_client(api_key="sekret", warmup=False)
    body = chat(user="alice")  # the key names the caller, not the user field
    assert (await client.post(CHAT, json=body, headers=bearer("sekret"))).status == 200
    m = scrape(await (await client.get("/metrics")).text())
    assert {s.labels["caller"] for s in m["sluice_caller_requests_total"]} == {"default"}


async def test_sighup_reload_swaps_keys_and_limits_and_a_bad_file_keeps_them(
    make_client: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "callers.toml"
    path.write_text(FILE)
    client, app, _ = await with_file(make_client, FILE, path=path, warmup=False)
    path.write_text(
        FILE.replace("sk-chat", "sk-chat-2").replace("max_queued = 0", "max_queued = 5")
    )
    assert await reload_callers(app) is True
    await assert_error(await client.post(CHAT, json=chat(), headers=bearer("sk-chat")), 401)
    assert (await client.post(CHAT, json=chat(), headers=bearer("sk-chat-2"))).status == 200
    core = app[MODELS].default.driver.core
    assert core.config.callers.get("batch").max_queued == 5

    path.write_text("[callers.chat]\nweight = 2\n")  # no key: refused, old callers stay
    with caplog.at_level(logging.ERROR, logger="sluice"):
        assert await reload_callers(app) is False
    [rec] = [r for r in caplog.records if "keeping the old callers" in r.getMessage()]
    why = rec.fields["why"]  # type: ignore[attr-defined]
    assert "callers.chat.key must be a non-empty string" in why and str(path) in why
    assert "sk-" not in caplog.text + why
    assert (await client.post(CHAT, json=chat(), headers=bearer("sk-chat-2"))).status == 200
    assert core.config.callers.get("batch").max_queued == 5


async def test_the_backlog_reaches_the_engine_only_as_it_has_room(make_client: Any) -> None:
    # Two engine slots: twelve requests all complete, and the engine is given at
    # most what its next `feed_steps` steps can take (room.py rule 2: its slots
    # and its own queue; this fake runs whatever it holds, so it counts both).
    engine = FakeEngine(step=0.005, max_num_seqs=2)
    client, app, _ = await make_client(engine=engine, warmup=False)
    held = []

    async def watch() -> None:
        while True:
            held.append(app[MODELS].default.driver.core.backlog_generations)
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(
            *(client.post(CHAT, json=chat(max_tokens=10, user=f"u{i % 3}")) for i in range(12))
        )
    finally:
        watcher.cancel()
    assert [r.status for r in results] == [200] * 12
    feed = app[MODELS].default.driver.core.config.feed_steps
    assert 2 <= engine.peak_running <= feed * 2
    assert max(held) >= 5  # most of the burst waited in Sluice, not in the engine
    assert app[MODELS].default.driver.core.backlog_generations == 0


async def test_engine_priority_is_the_requests_own_or_sluices_order(make_client: Any) -> None:
    engine = FakeEngine()
    client, _, _ = await make_client(engine=engine, warmup=False)
    assert (await client.post(CHAT, json=chat(priority=3))).status == 200
    assert list(engine.priorities.values()) == [3]

    engine = FakeEngine()
    client, _, _ = await make_client(engine=engine, engine_priority="order", warmup=False)
    assert (await client.post(CHAT, json=chat(priority=-1))).status == 200
    assert (await client.post(CHAT, json=chat(priority=0))).status == 200
    # The release key as one int: priority in the high part, the virtual start
    # (arrival + the prompt's delay, batching/order.py) in ms below it.
    first, second = engine.priorities.values()
    assert divmod(first, 1 << 42)[0] == -1
    assert divmod(second, 1 << 42)[0] == 0
    assert divmod(second, 1 << 42)[1] >= divmod(first, 1 << 42)[1]
