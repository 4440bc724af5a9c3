"""OpenAI's Files and Batches (issue 42) on the real app with a fake engine: a
batch runs through the app's own door to its synchronous endpoint, each line
once, its answer that endpoint's own; validation errors by line; a caller sees
only its own; the door opens only on its socket, with its secret; a batch a
restart left running resumes without running its done lines again; one past
its window expires. The real engine and the `openai` client:
tests/integration/test_batches.py; a SIGKILL mid-batch: tests/system/test_state_restart.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from server.api.openai_batches.output import batch_object, result_line, with_status
from server.api.openai_batches.parse import check_line, parse_batch_create
from server.api.openai_batches.runner import BATCHES
from server.app import drain
from server.callers import parse_callers
from server.http.door import DOOR, DOOR_HEADER
from server.operations.state_db import JobRow, StateDB
from server.state import RUNTIME
from server.wire.request import Limits
from tests.fakes import FakeEngine
from tests.support import until
from tests.unit.test_handlers import CHAT, chat

pytestmark = pytest.mark.timeout(60)

KEYS = """
[callers.a]
key = "sk-a"

[callers.b]
key = "sk-b"
"""


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def jsonl(*lines: dict[str, Any]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": chat(**body)}


async def serve(make_client: Any, engine: FakeEngine | None = None, **kw: Any) -> tuple[Any, Any]:
    client, app, _ = await make_client(engine=engine or FakeEngine(step=0.001), **kw)
    await app[DOOR].open(client.server.runner)  # as serve() opens it beside the TCP site
    return client, app


async def upload(client: Any, data: bytes, headers: dict[str, str] | None = None) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="in.jsonl", content_type="application/jsonl")
    resp = await client.post("/v1/files", data=form, headers=headers or {})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["object"] == "file" and body["bytes"] == len(data)
    return str(body["id"])


async def run_batch(
    client: Any, data: bytes, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    file_id = await upload(client, data, headers)
    resp = await client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"},
        headers=headers or {},
    )
    assert resp.status == 200, await resp.text()
    return await finished(client, (await resp.json())["id"], headers)


async def finished(
    client: Any, batch_id: str, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def done() -> bool:
        resp = await client.get(f"/v1/batches/{batch_id}", headers=headers or {})
        seen.update(await resp.json())
        return seen["status"] in ("completed", "failed", "expired", "cancelled")

    for _ in range(2000):
        if await done():
            return seen
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch not finished: {seen}")


async def content(client: Any, file_id: str, headers: dict[str, str] | None = None) -> list[Any]:
    resp = await client.get(f"/v1/files/{file_id}/content", headers=headers or {})
    assert resp.status == 200, await resp.text()
    return [orjson.loads(x) for x in (await resp.read()).splitlines()]


async def test_a_batch_runs_each_line_once_with_the_endpoints_own_answer(make_client: Any) -> None:
    client, _ = await serve(make_client)
    batch = await run_batch(
        client, jsonl(*(line(f"q{i}", max_tokens=3 + i % 3, temperature=0) for i in range(40)))
    )
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    assert batch["error_file_id"] is None
    out = await content(client, batch["output_file_id"])
    assert sorted(x["custom_id"] for x in out) == sorted(f"q{i}" for i in range(40))
    sync = await (await client.post(CHAT, json=chat(max_tokens=4, temperature=0))).json()
    one = next(x for x in out if x["custom_id"] == "q1")
    assert one["response"]["status_code"] == 200 and one["error"] is None
    body = one["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"] == sync["choices"] and body["usage"] == sync["usage"]
    text = await (await client.get("/metrics")).text()
    assert "sluice_batch_lines_total 40.0" in text
    tokens = sum(x["response"]["body"]["usage"]["total_tokens"] for x in out)
    assert (
        f"sluice_batch_tokens_total {float(tokens)}" in text
    )  # the lines' own, not the sync one's


async def test_every_line_in_flight_the_setting_allows_reaches_the_engine(
    make_client: Any,
) -> None:
    """`--batch-lines-in-flight` past aiohttp's 100 connections a client session
    opens by default: that many lines run at the engine at once, not 100."""
    engine = FakeEngine(step=0.02, max_num_seqs=256)  # a line: 0.02 s a token
    client, _ = await serve(make_client, engine=engine, batch_lines_in_flight=150)
    file_id = await upload(client, jsonl(*(line(f"f{i}", max_tokens=100) for i in range(160))))
    await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
    await until(lambda: engine.peak_running >= 150, what="150 lines at the engine at once")
    assert engine.peak_running == 150


async def test_a_line_the_endpoint_refuses_is_in_the_error_file(make_client: Any) -> None:
    client, _ = await serve(make_client)
    unknown = {"custom_id": "x", "method": "POST", "url": CHAT, "body": {**chat(), "model": "no"}}
    batch = await run_batch(client, jsonl(line("ok"), unknown))
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    [err] = await content(client, batch["error_file_id"])
    assert err["custom_id"] == "x" and err["response"]["status_code"] == 404
    assert err["response"]["body"]["error"]["code"] == "model_not_found"


def test_lines_are_checked_as_the_endpoint_checks_a_body() -> None:
    seen: set[str] = set()
    limits = Limits()
    raw = [
        orjson.dumps(line("a")),
        orjson.dumps(line("a")),
        orjson.dumps({**line("b"), "url": "/v1/completions"}),
        orjson.dumps(line("c", max_tokens=-1)),
        b"{not json",
        orjson.dumps({**line("d"), "method": "GET"}),
        orjson.dumps(line("e", stream=True)),
    ]
    out = [check_line(i + 1, r, CHAT, seen, limits) for i, r in enumerate(raw)]
    codes = [getattr(o, "code", None) for o in out]
    assert codes[0] is None
    assert codes[1:3] == ["duplicate_custom_id", "mismatched_endpoint"]
    assert [getattr(o, "line", None) for o in out[1:]] == [2, 3, 4, 5, 6, 7]
    assert getattr(out[3], "param", "").startswith("body.max_tokens")
    assert codes[4] == "invalid_json_line"
    assert getattr(out[5], "param", None) == "method"
    assert getattr(out[6], "param", None) == "body.stream"


async def test_a_file_that_does_not_validate_fails_with_its_line_numbers(make_client: Any) -> None:
    client, _ = await serve(make_client)
    bad = jsonl(line("a"), line("a"), {**line("b"), "url": "/v1/embeddings"}, line("c", n=0))
    batch = await run_batch(client, bad)
    assert batch["status"] == "failed" and batch["failed_at"]
    errors = batch["errors"]["data"]
    assert [(e["line"], e["code"]) for e in errors[:2]] == [
        (2, "duplicate_custom_id"),
        (3, "mismatched_endpoint"),
    ]
    assert errors[2]["line"] == 4 and errors[2]["param"].startswith("body.")
    assert batch["output_file_id"] is None


async def test_a_caller_sees_only_its_own_files_and_batches(make_client: Any) -> None:
    table = parse_callers(KEYS)
    client, _ = await serve(
        make_client, caller_table=table, callers=table.policies, admin_key="sk-admin"
    )
    a, b = _bearer("sk-a"), _bearer("sk-b")
    batch = await run_batch(client, jsonl(line("one")), a)
    assert batch["status"] == "completed"
    for path in (
        f"/v1/files/{batch['input_file_id']}",
        f"/v1/files/{batch['output_file_id']}/content",
        f"/v1/batches/{batch['id']}",
    ):
        assert (await client.get(path, headers=b)).status == 404
        assert (await client.get(path, headers=a)).status == 200
        assert (await client.get(path, headers=_bearer("sk-admin"))).status == 200
    listed = await (await client.get("/v1/batches", headers=b)).json()
    assert listed["data"] == [] and listed["has_more"] is False
    everyone = await (await client.get("/v1/batches", headers=_bearer("sk-admin"))).json()
    assert [x["id"] for x in everyone["data"]] == [batch["id"]]
    new = {"input_file_id": batch["input_file_id"], "endpoint": CHAT}
    assert (await client.post("/v1/batches", json=new, headers=b)).status == 404


async def test_the_door_opens_only_on_its_socket_with_its_secret(make_client: Any) -> None:
    client, app = await serve(make_client, caller_table=parse_callers(KEYS))
    secret = app[DOOR].secret
    # Over TCP, even with the right secret: refused as a bad key.
    resp = await client.post(CHAT, json=chat(), headers={DOOR_HEADER: secret})
    assert resp.status == 401
    door = aiohttp.UnixConnector(path=str(app[DOOR].path))
    async with aiohttp.ClientSession(connector=door) as s:
        async with s.post("http://x" + CHAT, json=chat(), headers={DOOR_HEADER: "guess"}) as r:
            assert r.status == 401
        async with s.post("http://x" + CHAT, json=chat(), headers={DOOR_HEADER: secret}) as r:
            assert r.status == 200


async def test_pages_of_batches(make_client: Any) -> None:
    client, _ = await serve(make_client)
    ids = [(await run_batch(client, jsonl(line(f"p{i}"))))["id"] for i in range(3)]
    first = await (await client.get("/v1/batches?limit=2")).json()
    assert [x["id"] for x in first["data"]] == ids[::-1][:2] and first["has_more"] is True
    rest = await (await client.get(f"/v1/batches?limit=2&after={first['last_id']}")).json()
    assert [x["id"] for x in rest["data"]] == [ids[0]] and rest["has_more"] is False


async def test_cancel_stops_the_lines_and_counts_the_rest(make_client: Any) -> None:
    engine = FakeEngine(step=0.05)
    client, app = await serve(make_client, engine=engine, batch_lines_in_flight=2)
    file_id = await upload(client, jsonl(*(line(f"c{i}", max_tokens=50) for i in range(20))))
    made = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
    batch_id = (await made.json())["id"]
    await until(lambda: len(engine.added) >= 2, what="lines running")
    assert app[RUNTIME].batches_running == 1  # the status page's count
    cancelled = await (await client.post(f"/v1/batches/{batch_id}/cancel")).json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"]
    batch = await finished(client, batch_id)
    assert batch["status"] == "cancelled" and batch["cancelled_at"]
    await until(lambda: app[RUNTIME].batches_running == 0, what="none running")
    assert len(engine.added) < 20
    errors = await content(client, batch["error_file_id"])
    done = await content(client, batch["output_file_id"]) if batch["output_file_id"] else []
    ids = [x["custom_id"] for x in errors + done]
    assert sorted(ids) == sorted(f"c{i}" for i in range(20))  # each once
    assert {x["error"]["code"] for x in errors if x["error"]} == {"batch_cancelled"}


async def _left_running(
    make_client: Any, tmp_path: Path, data: bytes, created: int, done: int
) -> str:
    """A batch as a kill leaves it: in_progress, lines 1..`done` with their rows
    written, the rest not (their answers never came whole)."""
    client, _ = await serve(make_client, state_dir=tmp_path)
    file_id = await upload(client, data)
    await client.close()
    create = parse_batch_create(orjson.dumps({"input_file_id": file_id, "endpoint": CHAT}))
    left = with_status(batch_object("batch_left", create, created), "in_progress", created)
    left["request_counts"] = {"total": data.count(b"\n"), "completed": 0, "failed": 0}
    db = StateDB(tmp_path)
    await db.open()
    try:
        await db.put_job(
            "batches", JobRow("batch_left", None, created, "in_progress", orjson.dumps(left))
        )
        for n in range(1, done + 1):
            custom_id = orjson.loads(data.splitlines()[n - 1])["custom_id"]
            body = result_line(f"batch_req_left_{n}", custom_id, f"rid-{n}", 200, b"{}")
            await db.put_line("batch_left", n, 200, body)
    finally:
        await db.close()
    return "batch_left"


async def test_a_batch_left_running_resumes_and_done_lines_do_not_run_again(
    make_client: Any, tmp_path: Path
) -> None:
    data = jsonl(*(line(f"r{i}") for i in range(6)))
    batch_id = await _left_running(make_client, tmp_path, data, int(time.time()), done=2)
    engine = FakeEngine(step=0.001)
    client, _ = await serve(make_client, engine=engine, state_dir=tmp_path)
    batch = await finished(client, batch_id)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 6
    assert len([r for r in engine.added if r.startswith(batch_id)]) == 4  # not the done two
    out = await content(client, batch["output_file_id"])
    assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(6))


async def test_a_batch_past_its_window_expires_with_the_rest_counted(
    make_client: Any, tmp_path: Path
) -> None:
    data = jsonl(line("e1"), line("e2"), line("e3"))
    batch_id = await _left_running(make_client, tmp_path, data, 1000, done=1)  # long ago
    client, _ = await serve(make_client, state_dir=tmp_path)
    batch = await finished(client, batch_id)
    assert batch["status"] == "expired" and batch["expired_at"]
    assert batch["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    [kept] = await content(client, batch["output_file_id"])
    assert kept["custom_id"] == "e1"
    errors = await content(client, batch["error_file_id"])
    assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [
        ("e2", "batch_expired"),
        ("e3", "batch_expired"),
    ]


async def test_a_callers_files_are_bounded_and_old_ones_are_swept(make_client: Any) -> None:
    client, app = await serve(make_client, batch_disk_per_caller=1000)
    first = await upload(client, b"x" * 600)
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", b"y" * 600, filename="more.jsonl")
    over = await client.post("/v1/files", data=form)
    assert over.status == 413 and (await over.json())["error"]["code"] == "quota_exceeded"
    listed = await (await client.get("/v1/files")).json()
    assert [f["id"] for f in listed["data"]] == [first]  # nothing of the refused upload kept
    batch = await run_batch(client, jsonl(line("s1")))
    swept = await app[BATCHES].sweep(time.time() + 10, retention=5)
    assert swept == 4  # the batch, its input, its output and the first upload
    for path in (f"/v1/files/{first}", f"/v1/batches/{batch['id']}"):
        assert (await client.get(path)).status == 404
    assert not any(app[BATCHES].files.iterdir())


async def test_a_drain_finishes_the_running_lines_and_the_rest_resume(
    make_client: Any, tmp_path: Path
) -> None:
    """SIGTERM (the drain): no new line is sent, the running ones finish and
    are kept; the next start runs only the rest."""
    engine = FakeEngine(step=0.01)
    client, app = await serve(
        make_client, engine=engine, state_dir=tmp_path, batch_lines_in_flight=2
    )
    file_id = await upload(client, jsonl(*(line(f"d{i}", max_tokens=30) for i in range(10))))
    made = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
    batch_id = (await made.json())["id"]
    await until(
        lambda: len([r for r in engine.added if r.startswith(batch_id)]) >= 2,
        what="two lines running",
    )
    await drain(app, 10.0)
    await until(lambda: batch_id not in app[BATCHES].running, what="the batch set aside")
    sent = [r for r in engine.added if r.startswith(batch_id)]
    assert 2 <= len(sent) < 10
    kept = await app[BATCHES].db.line_statuses(batch_id)
    assert len(kept) == len(sent) and set(kept.values()) == {200}  # each sent line finished
    assert (await (await client.get(f"/v1/batches/{batch_id}")).json())["status"] == "in_progress"
    await client.close()
    again = FakeEngine(step=0.001)
    client, _ = await serve(make_client, engine=again, state_dir=tmp_path)
    batch = await finished(client, batch_id)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 10
    assert len([r for r in again.added if r.startswith(batch_id)]) == 10 - len(sent)


async def test_a_full_disk_fails_the_batch_and_keeps_what_was_written(
    make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.api.openai_batches import runner

    async def no_space(self: Any, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner._Out, "write", no_space)
    client, app = await serve(make_client)
    batch = await run_batch(client, jsonl(line("f1"), line("f2")))
    assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "server_error"
    kept = await app[BATCHES].db.line_statuses(batch["id"])
    assert kept == {1: 200, 2: 200}  # the lines' results stay in the database
    resp = await client.get(f"/v1/files/{batch['input_file_id']}/content")
    assert resp.status == 200 and len((await resp.read()).splitlines()) == 2
