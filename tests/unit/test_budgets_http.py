"""Budgets over HTTP, with the fake engine (batching/budgets.py; issue 52 item 4):
a caller past its tokens_per_day gets 429 `insufficient_quota` with Retry-After
at the reset, in each API's own error shape, while another caller is served;
engine-free routes still answer; SIGHUP's new budget keeps the spend; a batch
pauses at the budget and completes after a short clock's reset, each
custom_id once, and a line the door refused for the budget (a race) is sent
again after the reset, not failed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from batching import Charge
from server.api.openai_batches.runner import BATCHES
from server.app import reload_callers
from server.callers import parse_callers
from server.operations.usage import UsageQuery
from server.settings import EnvView
from server.state import BUDGETS, USAGE
from tests.fakes import FakeEngine
from tests.unit.test_batches_http import content, finished, jsonl, line, serve, upload
from tests.unit.test_callers_http import bearer, with_file
from tests.unit.test_handlers import CHAT, HI, assert_error, chat, retry_after, scrape

pytestmark = pytest.mark.timeout(60)

FILE = """
[callers.capped]
key = "sk-capped"
tokens_per_day = {limit}

[callers.free]
key = "sk-free"
"""


async def _spent(client: Any) -> None:
    """One request of `capped` that spends its whole budget (8 + 5 tokens)."""
    resp = await client.post(CHAT, json=chat(), headers=bearer("sk-capped"))
    assert resp.status == 200, await resp.text()


async def test_over_tokens_per_day_is_429_insufficient_quota_another_caller_served(
    make_client: Any,
) -> None:
    client, app, _ = await with_file(make_client, FILE.format(limit=10))
    await _spent(client)
    resp = await client.post(CHAT, json=chat(), headers=bearer("sk-capped"))
    err = await assert_error(resp, 429, code="insufficient_quota")
    assert err["type"] == "insufficient_quota" and err["param"] is None
    assert "tokens_per_day" in err["message"]
    midnight = (time.time() // 86400 + 1) * 86400
    assert abs(retry_after(resp) - (midnight - time.time())) <= 2
    served = await client.post(CHAT, json=chat(), headers=bearer("sk-free"))
    assert served.status == 200, await served.text()
    # Engine-free routes are not refused.
    assert (await client.get("/v1/models", headers=bearer("sk-capped"))).status == 200
    assert app[BUDGETS].used("capped", time.time())[0].tokens == 13


async def test_anthropic_and_ollama_refuse_in_their_own_shapes(make_client: Any) -> None:
    client, _, _ = await with_file(make_client, FILE.format(limit=10))
    await _spent(client)
    resp = await client.post(
        "/v1/messages",
        json={"model": "fake", "max_tokens": 5, "messages": HI},
        headers={"x-api-key": "sk-capped", "anthropic-version": "2023-06-01"},
    )
    assert resp.status == 429
    body = orjson.loads(await resp.read())
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
    assert "budget" in body["error"]["message"]
    assert retry_after(resp) >= 1
    resp = await client.post(
        "/api/chat",
        json={"model": "fake", "messages": HI, "stream": False},
        headers=bearer("sk-capped"),
    )
    assert resp.status == 429
    body = orjson.loads(await resp.read())
    assert set(body) == {"error"} and "budget" in body["error"], body
    assert retry_after(resp) >= 1


async def test_sighup_applies_a_new_budget_and_keeps_the_spend(
    make_client: Any, tmp_path: Path
) -> None:
    path = tmp_path / "callers.toml"
    path.write_text(FILE.format(limit=10))
    client, app, _ = await with_file(make_client, "", path)
    await _spent(client)
    path.write_text(FILE.format(limit=20))
    assert await reload_callers(app)
    await _spent(client)  # 13 of 20: served
    path.write_text(FILE.format(limit=20))
    assert await reload_callers(app)  # the spend (26) stays
    resp = await client.post(CHAT, json=chat(), headers=bearer("sk-capped"))
    await assert_error(resp, 429, code="insufficient_quota")


async def test_a_batch_pauses_at_the_budget_and_completes_after_the_reset(
    make_client: Any,
) -> None:
    """A short clock (SLUICE_BUDGET_DAY_SECONDS: 1.5 s days): each line spends
    the day's budget, so each waits for the next day; none fails, each runs once."""
    day = 1.5
    table = parse_callers(FILE.format(limit=10))
    client, _ = await serve(
        make_client,
        caller_table=table,
        callers=table.policies,
        env=EnvView(budget_day=day),
        batch_lines_in_flight=1,  # one line at a time: each spends a day's budget
    )
    t0 = time.time()
    headers = bearer("sk-capped")
    file_id = await upload(client, jsonl(*(line(f"q{i}") for i in range(3))), headers)
    resp = await client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"},
        headers=headers,
    )
    assert resp.status == 200, await resp.text()
    batch = await finished(client, (await resp.json())["id"], headers)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    out = await content(client, batch["output_file_id"], headers)
    assert sorted(x["custom_id"] for x in out) == ["q0", "q1", "q2"]
    assert time.time() - t0 >= day  # it waited for at least one reset
    # Paused, not knocking: no line was sent to be refused for the budget.
    m = scrape(await (await client.get("/metrics")).text())
    by = {
        (s.labels["caller"], s.labels["status"]): s.value for s in m["sluice_caller_requests_total"]
    }
    assert by == {("capped", "200"): 3}


async def test_a_line_refused_for_the_budget_waits_for_the_reset_and_is_not_failed(
    make_client: Any,
) -> None:
    """The race: the runner saw the budget unspent, the door refuses the line
    (429 insufficient_quota). The line is sent again after the reset, once."""
    day = 4.0
    table = parse_callers(FILE.format(limit=10))
    client, app = await serve(
        make_client, caller_table=table, callers=table.policies, env=EnvView(budget_day=day)
    )
    batches = app[BATCHES]
    real = batches._over_budget
    lies = [None]  # the runner's first look misses the spend (it raced it)
    batches._over_budget = lambda owner: lies.pop() if lies else real(owner)
    await asyncio.sleep(day - time.time() % day + 0.05)  # early in a day
    await _spent(client)
    reset = (time.time() // day + 1) * day
    headers = bearer("sk-capped")
    file_id = await upload(client, jsonl(line("q0")), headers)
    resp = await client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"},
        headers=headers,
    )
    assert resp.status == 200, await resp.text()
    batch = await finished(client, (await resp.json())["id"], headers)
    assert batch["request_counts"] == {"total": 1, "completed": 1, "failed": 0}, batch
    assert time.time() >= reset
    out = await content(client, batch["output_file_id"], headers)
    assert [x["custom_id"] for x in out] == ["q0"]
    m = scrape(await (await client.get("/metrics")).text())
    by = {
        (s.labels["caller"], s.labels["status"]): s.value for s in m["sluice_caller_requests_total"]
    }
    assert by == {("capped", "200"): 2, ("capped", "429"): 1}


def test_the_short_clock_is_read_once_from_the_environment() -> None:
    assert EnvView.from_mapping({"SLUICE_BUDGET_DAY_SECONDS": "20"}).budget_day == 20.0
    for bad in ("", "0", "-1", "x", "inf", "nan"):
        assert EnvView.from_mapping({"SLUICE_BUDGET_DAY_SECONDS": bad}).budget_day is None
    assert EnvView.from_mapping({}).budget_day is None


async def test_engine_seconds_are_spent_and_counted_in_usage(make_client: Any) -> None:
    """Each request's engine seconds (the fake's per-generation charge, as the
    adapter's ledger would give it) reach both the budget and the usage record."""
    text = FILE.replace("tokens_per_day = {limit}", "engine_seconds_per_day = 0.9")
    engine = FakeEngine(charge_each=Charge(0.5, 2.0))
    client, app, _ = await with_file(make_client, text, engine=engine, warmup=False)
    for _ in range(2):
        await _spent(client)
    resp = await client.post(CHAT, json=chat(), headers=bearer("sk-capped"))
    err = await assert_error(resp, 429, code="insufficient_quota")
    assert "engine_seconds_per_day" in err["message"]
    page = await app[USAGE].query(
        UsageQuery("completions", int(time.time()) - 60, int(time.time()) + 60, width=3600)
    )
    (used,) = [r for b in page.buckets for r in b.results]
    assert (used.requests, used.engine_seconds, used.block_seconds) == (2, 1.0, 4.0)


async def test_a_budgets_spend_survives_a_restart(make_client: Any, tmp_path: Path) -> None:
    """The spend is in the durable usage (server/operations/usage.py): a new
    process on the same state directory starts from it."""
    text = FILE.format(limit=10)
    client, _, _ = await with_file(make_client, text, state_dir=tmp_path, warmup=False)
    await _spent(client)
    await client.close()  # a clean stop: the usage is written
    again, _, _ = await with_file(make_client, text, state_dir=tmp_path, warmup=False)
    resp = await again.post(CHAT, json=chat(), headers=bearer("sk-capped"))
    await assert_error(resp, 429, code="insufficient_quota")
    served = await again.post(CHAT, json=chat(), headers=bearer("sk-free"))
    assert served.status == 200, await served.text()
