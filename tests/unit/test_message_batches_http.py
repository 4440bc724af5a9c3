"""Anthropic's Message Batches (issue 42) on the real app with a fake engine:
create, retrieve, list, results, cancel and delete in the `anthropic`
client's own types (validated with its pydantic models); a request the
Messages endpoint would refuse is a 400 naming its index; a caller sees only
its own; the OpenAI routes and these do not show each other's batches. The
real engine and the `anthropic` client: tests/integration/test_batches.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from anthropic.types.messages import (
    DeletedMessageBatch,
    MessageBatch,
    MessageBatchIndividualResponse,
)

from server.api.anthropic_batches.output import message_batch, result
from server.callers import parse_callers
from tests.fakes import FakeEngine
from tests.support import until
from tests.unit.test_batches_http import KEYS, jsonl, line, run_batch, serve

pytestmark = pytest.mark.timeout(60)

BATCHES = "/v1/messages/batches"


def params(**kw: Any) -> dict[str, Any]:
    return {"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **kw}


def key(k: str) -> dict[str, str]:
    return {"x-api-key": k}


async def create(client: Any, requests: list[dict[str, Any]], **kw: Any) -> MessageBatch:
    resp = await client.post(BATCHES, json={"requests": requests}, **kw)
    assert resp.status == 200, await resp.text()
    return MessageBatch.model_validate(await resp.json())


async def ended(client: Any, batch_id: str, **kw: Any) -> MessageBatch:
    for _ in range(2000):
        resp = await client.get(f"{BATCHES}/{batch_id}", **kw)
        assert resp.status == 200, await resp.text()
        batch = MessageBatch.model_validate(await resp.json())
        if batch.processing_status == "ended":
            return batch
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch not ended: {batch}")


async def results(client: Any, batch: MessageBatch, **kw: Any) -> list[Any]:
    assert batch.results_url is not None
    resp = await client.get(batch.results_url.split(str(client.make_url("")))[-1], **kw)
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "application/x-jsonl"
    return [
        MessageBatchIndividualResponse.model_validate(orjson.loads(x))
        for x in (await resp.read()).splitlines()
    ]


async def test_a_batch_runs_each_request_with_the_messages_endpoints_answer(
    make_client: Any,
) -> None:
    client, _ = await serve(make_client)
    unknown = {"custom_id": "nope", "params": {**params(), "model": "no-such-model"}}
    requests = [{"custom_id": f"m{i}", "params": params(temperature=0)} for i in range(8)]
    made = await create(client, [*requests, unknown])
    assert made.id.startswith("msgbatch_") and len(made.id) == len("msgbatch_") + 24
    assert made.processing_status == "in_progress" and made.results_url is None
    assert made.request_counts.processing == 9
    assert (made.expires_at - made.created_at).total_seconds() == 24 * 3600
    batch = await ended(client, made.id)
    assert batch.ended_at is not None and batch.cancel_initiated_at is None
    counts = batch.request_counts
    assert (counts.succeeded, counts.errored, counts.processing) == (8, 1, 0)
    assert batch.results_url == str(client.make_url(f"{BATCHES}/{made.id}/results"))
    got = {r.custom_id: r.result for r in await results(client, batch)}
    assert sorted(got) == sorted([*(f"m{i}" for i in range(8)), "nope"])
    sync = await (await client.post("/v1/messages", json=params(temperature=0))).json()
    one = got["m1"]
    assert one.type == "succeeded"
    assert one.message.type == "message" and one.message.content
    assert one.message.model_dump(exclude_unset=True)["content"] == sync["content"]
    assert one.message.usage.input_tokens == sync["usage"]["input_tokens"]
    bad = got["nope"]
    assert bad.type == "errored" and bad.error.error.type == "not_found_error"
    assert bad.error.request_id


async def test_a_request_the_endpoint_would_refuse_is_a_400_naming_its_index(
    make_client: Any,
) -> None:
    client, _ = await serve(make_client)
    cases = [
        (
            [
                {"custom_id": "a", "params": params()},
                {"custom_id": "b", "params": params(max_tokens=-1)},
            ],
            "requests.1.params.max_tokens",
        ),
        (
            [{"custom_id": "a", "params": params()}, {"custom_id": "a", "params": params()}],
            "requests.1.custom_id",
        ),
        ([{"custom_id": "not ok!", "params": params()}], "requests.0.custom_id"),
        ([{"custom_id": "a", "params": params(stream=True)}], "requests.0.params.stream"),
        ([{"custom_id": "a", "params": {"model": "fake", "messages": []}}], "requests.0.params"),
    ]
    for requests, where in cases:
        resp = await client.post(BATCHES, json={"requests": requests})
        assert resp.status == 400, (where, await resp.text())
        body = await resp.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(where), (where, body)
    resp = await client.post(BATCHES, json={"requests": []})
    assert resp.status == 400
    listed = await (await client.get(BATCHES)).json()
    assert listed["data"] == []  # nothing was made


async def test_a_caller_sees_only_its_own_and_the_apis_do_not_mix(make_client: Any) -> None:
    table = parse_callers(KEYS)
    client, _ = await serve(
        make_client, caller_table=table, callers=table.policies, admin_key="sk-admin"
    )
    a, b, admin = key("sk-a"), key("sk-b"), key("sk-admin")
    made = await create(client, [{"custom_id": "x", "params": params()}], headers=a)
    batch = await ended(client, made.id, headers=a)
    for path in (f"{BATCHES}/{made.id}", f"{BATCHES}/{made.id}/results"):
        resp = await client.get(path, headers=b)
        assert resp.status == 404
        err = await resp.json()
        assert err["type"] == "error" and err["error"]["type"] == "not_found_error"
        assert (await client.get(path, headers=admin)).status == 200
    for method, path in (
        ("POST", f"{BATCHES}/{made.id}/cancel"),
        ("DELETE", f"{BATCHES}/{made.id}"),
    ):
        assert (await client.request(method, path, headers=b)).status == 404
    assert (await (await client.get(BATCHES, headers=b)).json())["data"] == []
    everyone = await (await client.get(BATCHES, headers=admin)).json()
    assert [x["id"] for x in everyone["data"]] == [made.id]
    # An OpenAI batch of a's is not a Message Batch, and the other way round.
    openai = await run_batch(client, jsonl(line("o")), {"Authorization": "Bearer sk-a"})
    assert [x["id"] for x in (await (await client.get(BATCHES, headers=a)).json())["data"]] == [
        made.id
    ]
    assert (await client.get(f"{BATCHES}/{openai['id']}", headers=a)).status == 404
    listed = await (await client.get("/v1/batches", headers=a)).json()
    assert [x["id"] for x in listed["data"]] == [openai["id"]]
    assert (await client.get(f"/v1/batches/{made.id}", headers=a)).status == 404
    assert batch.processing_status == "ended"


async def test_pages_of_message_batches(make_client: Any) -> None:
    client, _ = await serve(make_client)
    ids = [(await create(client, [{"custom_id": "p", "params": params()}])).id for _ in range(5)]
    newest = ids[::-1]
    first = await (await client.get(f"{BATCHES}?limit=2")).json()
    assert [x["id"] for x in first["data"]] == newest[:2] and first["has_more"] is True
    assert (first["first_id"], first["last_id"]) == (newest[0], newest[1])
    nxt = await (await client.get(f"{BATCHES}?limit=2&after_id={first['last_id']}")).json()
    assert [x["id"] for x in nxt["data"]] == newest[2:4] and nxt["has_more"] is True
    last = await (await client.get(f"{BATCHES}?limit=2&after_id={nxt['last_id']}")).json()
    assert [x["id"] for x in last["data"]] == newest[4:] and last["has_more"] is False
    back = await (await client.get(f"{BATCHES}?limit=2&before_id={newest[4]}")).json()
    assert [x["id"] for x in back["data"]] == newest[2:4] and back["has_more"] is True
    assert (await client.get(f"{BATCHES}?limit=1001")).status == 400
    every = await (await client.get(BATCHES)).json()
    assert [x["id"] for x in every["data"]] == newest and every["has_more"] is False


async def test_cancel_ends_it_with_the_rest_canceled_and_delete(make_client: Any) -> None:
    engine = FakeEngine(step=0.05)
    client, _ = await serve(make_client, engine=engine, batch_lines_in_flight=2)
    requests = [{"custom_id": f"c{i}", "params": params(max_tokens=50)} for i in range(20)]
    made = await create(client, requests)
    await until(lambda: len(engine.added) >= 2, what="requests running")
    running = await client.delete(f"{BATCHES}/{made.id}")
    assert running.status == 400 and (await running.json())["type"] == "error"
    resp = await client.post(f"{BATCHES}/{made.id}/cancel")
    cancelling = MessageBatch.model_validate(await resp.json())
    assert cancelling.processing_status == "canceling" and cancelling.cancel_initiated_at
    batch = await ended(client, made.id)
    counts = batch.request_counts
    assert counts.canceled > 0 and counts.succeeded + counts.errored + counts.canceled == 20
    assert batch.cancel_initiated_at is not None and batch.ended_at is not None
    got = await results(client, batch)
    assert sorted(r.custom_id for r in got) == sorted(f"c{i}" for i in range(20))  # each once
    assert sum(r.result.type == "canceled" for r in got) == counts.canceled
    gone = await client.delete(f"{BATCHES}/{made.id}")
    assert gone.status == 200, await gone.text()
    assert DeletedMessageBatch.model_validate(await gone.json()).id == made.id
    assert (await client.get(f"{BATCHES}/{made.id}")).status == 404
    assert (await (await client.get("/v1/files")).json())["data"] == []  # its files too


def test_the_view_of_each_state_and_each_result() -> None:
    stored = {
        "id": "msgbatch_x",
        "status": "expired",
        "created_at": 0,
        "expires_at": 86400,
        "expired_at": 86400,
        "request_counts": {"total": 5, "completed": 2, "failed": 1},
    }
    view = MessageBatch.model_validate(message_batch(stored, "http://h/r"))
    assert view.processing_status == "ended" and view.results_url == "http://h/r"
    assert view.request_counts.expired == 2 and view.request_counts.errored == 1
    assert message_batch(stored, "u")["ended_at"] == "1970-01-02T00:00:00Z"
    running = message_batch({**stored, "status": "finalizing"}, "u")
    assert running["processing_status"] == "in_progress" and running["results_url"] is None
    assert running["request_counts"]["processing"] == 2 and running["ended_at"] is None
    expired = orjson.dumps(
        {"custom_id": "e", "response": None, "error": {"code": "batch_expired", "message": ""}}
    )
    custom_id, raw = result(expired)
    assert custom_id == "e"
    assert MessageBatchIndividualResponse.model_validate_json(raw).result.type == "expired"
