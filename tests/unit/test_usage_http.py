"""OpenAI's Usage API over the ledger (server/api/usage/endpoint.py): the
admin key sees every caller, a caller's key its own rows, open mode all; the
page is OpenAI's shape (the openai client's own types read it), with every
bucket, pages by cursor, and bad parameters are OpenAI-shaped 400s."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from openai.types.admin.organization.usage_completions_response import (
    UsageCompletionsResponse,
)
from openai.types.admin.organization.usage_embeddings_response import (
    UsageEmbeddingsResponse,
)

from server.callers import parse_callers
from server.operations.state_db import StateDB
from server.operations.usage import UsageEvent
from server.state import METRICS, STATUS, USAGE

CALLERS = '[callers.alice]\nkey = "sk-alice"\n[callers.bob]\nkey = "sk-bob"\n'
ADMIN = {"Authorization": "Bearer sk-admin"}
ALICE = {"Authorization": "Bearer sk-alice"}
URL = "/v1/organization/usage/completions"


def event(at: float, caller: str, kind: str = "completions", **kw: Any) -> UsageEvent:
    fields: dict[str, Any] = {
        "at": at,
        "caller": caller,
        "model": "fake",
        "adapter": None,
        "kind": kind,
        "request_class": "interactive",
        "batch_id": None,
        "prompt_tokens": 10,
        "cached_tokens": 4,
        "completion_tokens": 5,
        "engine_seconds": 0.25,
        "block_seconds": 1.0,
    }
    return UsageEvent(**(fields | kw))


async def keyed(make_client: Any, **kw: Any) -> tuple[Any, Any, int]:
    table = parse_callers(CALLERS, base="fake")
    client, app, _ = await make_client(
        warmup=False, caller_table=table, callers=table.policies, admin_key="sk-admin", **kw
    )
    now = int(time.time())
    book = app[USAGE]
    book.record(event(now - 120, "alice"))
    book.record(event(now - 60, "alice", batch_id="batch_1"))
    book.record(event(now - 60, "bob", completion_tokens=7))
    book.record(event(now - 60, "bob", kind="embeddings", completion_tokens=0))
    return client, app, now


def callers_in(body: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in body["data"]:
        for r in b["results"]:
            out[r["api_key_id"]] = out.get(r["api_key_id"], 0) + r["num_model_requests"]
    return out


async def test_the_admin_key_sees_every_caller(make_client: Any) -> None:
    client, _, now = await keyed(make_client)
    params = {"start_time": now - 3600, "bucket_width": "1h", "group_by": "api_key_id"}
    resp = await client.get(URL, params=params, headers=ADMIN)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    UsageCompletionsResponse.model_validate(body)  # the openai client reads it
    assert callers_in(body) == {"alice": 2, "bob": 1}
    (r,) = [r for b in body["data"] for r in b["results"] if r["api_key_id"] == "bob"]
    assert r["object"] == "organization.usage.completions.result"
    assert (r["input_tokens"], r["output_tokens"], r["input_cached_tokens"]) == (10, 7, 4)
    assert (r["engine_seconds"], r["kv_block_seconds"]) == (0.25, 1.0)  # Sluice's own
    assert r["project_id"] is None and r["model"] is None and r["batch"] is None


async def test_a_callers_key_sees_only_its_own(make_client: Any) -> None:
    client, _, now = await keyed(make_client)
    params = {"start_time": now - 3600, "group_by[]": "api_key_id"}
    body = await (await client.get(URL, params=params, headers=ALICE)).json()
    assert callers_in(body) == {"alice": 2}
    # Asking for another caller's rows gives nothing, not bob's.
    params |= {"api_key_ids": "bob"}
    body = await (await client.get(URL, params=params, headers=ALICE)).json()
    assert callers_in(body) == {}
    resp = await client.get(URL, params={"start_time": now - 3600})
    assert resp.status == 401


async def test_open_mode_sees_everything_and_embeddings_count_apart(make_client: Any) -> None:
    client, app, _ = await make_client(warmup=False)
    now = int(time.time())
    app[USAGE].record(event(now - 5, "default"))
    app[USAGE].record(event(now - 5, "default", kind="embeddings"))
    app[USAGE].record(event(now - 5, "default", kind="embeddings"))
    resp = await client.get(
        "/v1/organization/usage/embeddings",
        params={"start_time": now - 60, "bucket_width": "1m", "group_by": "model,project_id"},
    )
    body = await resp.json()
    UsageEmbeddingsResponse.model_validate(body)
    results = [r for b in body["data"] for r in b["results"]]
    got = [(r["object"], r["num_model_requests"], r["model"], r["project_id"]) for r in results]
    assert got == [("organization.usage.embeddings.result", 2, "fake", "default")]
    assert "output_tokens" not in results[0]


async def test_every_bucket_is_there_and_pages_follow_the_cursor(make_client: Any) -> None:
    client, _, now = await keyed(make_client)
    start = now - 10 * 60
    params: dict[str, Any] = {"start_time": start, "bucket_width": "1m", "limit": 4}
    seen: list[int] = []
    total = 0
    for _ in range(5):
        body = await (await client.get(URL, params=params, headers=ADMIN)).json()
        seen += [b["start_time"] for b in body["data"]]
        total += sum(r["num_model_requests"] for b in body["data"] for r in b["results"])
        if not body["has_more"]:
            assert body["next_page"] is None
            break
        params["page"] = body["next_page"]
    first = start - start % 60
    assert seen == list(range(first, first + 60 * len(seen), 60))
    assert len(seen) == 11 and total == 3  # every minute, the empty ones too


async def test_group_by_batch_and_the_batch_filter(make_client: Any) -> None:
    client, _, now = await keyed(make_client)
    base = {"start_time": now - 3600, "bucket_width": "1h"}
    body = await (await client.get(URL, params=base | {"group_by": "batch"}, headers=ADMIN)).json()
    got = sorted((r["batch"], r["num_model_requests"]) for b in body["data"] for r in b["results"])
    assert got == [(False, 2), (True, 1)]
    body = await (await client.get(URL, params=base | {"batch": "true"}, headers=ADMIN)).json()
    assert sum(r["num_model_requests"] for b in body["data"] for r in b["results"]) == 1


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"bucket_width": "5m"}, "bucket_width"),
        ({}, "start_time"),
        ({"limit": "32"}, "limit"),
        ({"group_by": "colour"}, "group_by"),
        ({"page": "page_7"}, "page"),
        ({"end_time": "1"}, "end_time"),
        ({"user_ids": "u1"}, "user_ids"),
        ({"batch": "maybe"}, "batch"),
    ],
)
async def test_a_bad_parameter_is_an_openai_shaped_400(
    make_client: Any, params: dict[str, str], param: str
) -> None:
    client, _, _ = await make_client(warmup=False)
    if param != "start_time":
        params = {"start_time": str(int(time.time()) - 86400)} | params
    resp = await client.get(URL, params=params)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


async def test_engine_seconds_per_caller_in_prometheus(make_client: Any) -> None:
    _, app, _ = await keyed(make_client)
    text = app[METRICS].render().decode()
    assert 'sluice_caller_engine_seconds_total{caller="alice"} 0.5' in text
    assert 'sluice_caller_engine_seconds_total{caller="bob"} 0.5' in text


async def test_the_status_page_shows_usage_per_caller(make_client: Any) -> None:
    client, app, _ = await keyed(make_client)
    await app[USAGE].flush()
    await app[USAGE].refresh_recent(force=True)
    status = app[STATUS]
    status.sample()
    app[USAGE].record(event(time.time(), "alice", engine_seconds=1.0))
    status.sample()  # the engine seconds' rate needs two samples
    doc = await (await client.get("/status.json", headers=ADMIN)).json()
    rows = {u["caller"]: u for u in doc["usage"]}
    assert set(rows) == {"alice", "bob"}
    assert (rows["alice"]["hour_requests"], rows["alice"]["day_tokens"]) == (2, 30)
    assert rows["bob"]["day_requests"] == 2  # its embeddings request too
    assert set(doc["series"]["caller_engine_s"]) == {"alice", "bob"}
    # A caller's key: its own line, the others summed into one.
    doc = await (await client.get("/status.json", headers=ALICE)).json()
    assert [u["caller"] for u in doc["usage"]] == ["alice", "(other callers)"]
    assert set(doc["series"]["caller_engine_s"]) == {"alice", "(other callers)"}


async def test_a_clean_stop_writes_what_is_pending(make_client: Any, tmp_path: Path) -> None:
    client, app, _ = await make_client(warmup=False, state_dir=tmp_path)
    now = time.time()
    app[USAGE].record(event(now, "default"))
    assert app[USAGE].pending == 1
    await client.close()  # the app's cleanup: the flush loop's last flush, then the DB closes
    db = StateDB(tmp_path)
    await db.open()
    assert await db.usage_totals(int(now) - 3600) == {"default": (15, 0.25)}
    await db.close()


async def test_the_openai_clients_own_usage_call_reads_it(make_client: Any) -> None:
    from openai import AsyncOpenAI

    client, _, now = await keyed(make_client)
    async with AsyncOpenAI(
        base_url=str(client.make_url("/v1")), api_key="sk-alice", admin_api_key="sk-admin"
    ) as openai:
        page = await openai.admin.organization.usage.completions(
            start_time=now - 3600, bucket_width="1h", group_by=["api_key_id", "model"]
        )
    results = [r for b in page.data for r in b.results]
    got = sorted((r.api_key_id, r.model, r.num_model_requests) for r in results)
    assert got == [("alice", "fake", 2), ("bob", "fake", 1)]
    assert not page.has_more


async def test_group_by_api_splits_the_apis_a_caller_used(make_client: Any) -> None:
    """Sluice's own `group_by=api`: usage per API the requests came through."""
    client, app, now = await keyed(make_client)
    app[USAGE].record(event(now - 30, "alice", api="messages", completion_tokens=9))
    app[USAGE].record(event(now - 30, "alice", api="chat"))
    params = {"start_time": now - 3600, "bucket_width": "1h", "group_by": "api_key_id,api"}
    body = await (await client.get(URL, params=params, headers=ALICE)).json()
    got = sorted(
        (r["api"], r["num_model_requests"], r["output_tokens"])
        for b in body["data"]
        for r in b["results"]
    )
    assert got == [("", 2, 10), ("chat", 1, 5), ("messages", 1, 9)]
    body = await (
        await client.get(URL, params=params | {"group_by": "model"}, headers=ALICE)
    ).json()
    assert {r["api"] for b in body["data"] for r in b["results"]} == {None}
