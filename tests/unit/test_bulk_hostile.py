"""The bulk surface under hostile input (issue 50), on the real app with a fake engine.

Malformed multipart uploads (fuzzed with hypothesis: boundaries, part
headers, charsets, codings, truncation) are 400s in OpenAI's shape, never a
500; `purpose: "batch_output"` is the server's own; a file a batch still
needs cannot be deleted, and a batch that ends always writes what it
completed; one caller's concurrent uploads and Message Batches never take it
over its quota; identifier patterns match whole; the admin key creates no
file and no batch. Real concurrency on the real server and engine:
tests/integration/test_batches.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.api.anthropic_batches.parse import parse_create
from server.api.openai_batches.parse import parse_window
from server.api.openai_batches.runner import BATCHES
from server.callers import parse_callers
from server.errors import SluiceError
from server.wire.request import Limits
from tests.fakes import FakeEngine
from tests.support import ErrorRecords
from tests.unit.test_batches_http import (
    KEYS,
    content,
    finished,
    jsonl,
    line,
    run_batch,
    serve,
    upload,
)
from tests.unit.test_handlers import CHAT
from tests.unit.test_message_batches_http import create, ended, params, results

pytestmark = pytest.mark.timeout(120)

EXAMPLES = 300
GOOD = jsonl(line("g1"))


@pytest.fixture
def errors() -> Iterator[ErrorRecords]:
    handler = ErrorRecords()
    logging.getLogger("sluice").addHandler(handler)
    try:
        yield handler
    finally:
        logging.getLogger("sluice").removeHandler(handler)


def _openai_error(status: int, body: bytes) -> dict[str, Any]:
    assert 400 <= status < 500, (status, body[:300])
    doc = orjson.loads(body)
    assert set(doc) == {"error"}, doc
    assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    return dict(doc["error"])


# -- multipart ----------------------------------------------------------------------

_HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)
_BOUNDARY = st.one_of(
    st.just("b0undary"),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=90),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=3),
)
_DISPOSITION = st.one_of(
    st.sampled_from(
        [
            'form-data; name="purpose"',
            'form-data; name="file"; filename="in.jsonl"',
            "form-data; name=file; filename=a",
            "form-data; name=\"file\"; filename*=UTF-8''%E2%82%AC.jsonl",
            "form-data; name=\"file\"; filename*=nope''%FF",
            "form-data",
            'attachment; name="purpose"',
            'form-data; name="purpose"; name="file"',
            "form-data; =; ;;",
        ]
    ),
    _HEADER_TEXT,
)
_HEADERS = st.dictionaries(
    st.sampled_from(
        ["Content-Type", "Content-Transfer-Encoding", "Content-Encoding", "Content-Length", "X-Y"]
    ),
    st.one_of(
        st.sampled_from(
            [
                "text/plain; charset=utf-8",
                "text/plain; charset=latin-1",
                "text/plain; charset=utf-16",
                "text/plain; charset=nope",
                "multipart/mixed; boundary=inner",
                "base64",
                "quoted-printable",
                "binary",
                "gzip",
                "deflate",
                "br",
                "identity",
                "0",
                "3",
                "99999",
                "-1",
            ]
        ),
        _HEADER_TEXT,
    ),
    max_size=3,
)
_PAYLOAD = st.one_of(
    st.sampled_from(
        [b"batch", b"batch_output", b"b\xe9tch", "batch".encode("utf-16"), b"batch\x00", GOOD]
    ),
    st.binary(max_size=200),
)


@st.composite
def _part(draw: st.DrawFn) -> bytes:
    lines = [f"Content-Disposition: {draw(_DISPOSITION)}".encode()]
    lines += [f"{k}: {v}".encode() for k, v in draw(_HEADERS).items()]
    if draw(st.booleans()):
        lines.append(draw(st.binary(max_size=40)))  # a header line that is not one
    return b"\r\n".join(lines) + b"\r\n\r\n" + draw(_PAYLOAD)


@st.composite
def multipart(draw: st.DrawFn) -> tuple[str, bytes]:
    """A Content-Type and a body: often well formed, often not."""
    boundary = draw(_BOUNDARY)
    declared = draw(
        st.one_of(
            st.just(boundary),
            st.just(f'"{boundary}"'),
            st.just("b" * 71),
            _BOUNDARY,
        )
    )
    content_type = draw(
        st.sampled_from(
            [
                f"multipart/form-data; boundary={declared}",
                f"multipart/form-data; boundary={declared}; charset=utf-16",
                f"multipart/mixed; boundary={declared}",
                "multipart/form-data",
                "multipart/form-data; boundary=",
            ]
        )
    )
    sep = b"--" + boundary.encode()
    parts = draw(st.lists(_part(), max_size=4))
    body = b"".join(sep + b"\r\n" + p + b"\r\n" for p in parts)
    body += draw(st.sampled_from([sep + b"--\r\n", sep + b"--", b"", sep]))
    if draw(st.booleans()):
        body = body[: draw(st.integers(0, len(body)))]  # cut short
    return content_type, body


@pytest.fixture
async def files_client(make_client: Any) -> Any:
    """One server for every example of a test (state left by one is what the
    next must survive)."""
    return await serve(make_client)


async def _good_upload(client: Any) -> None:
    """The server still takes a well-formed upload."""
    assert await upload(client, GOOD)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=multipart())
async def test_a_malformed_upload_is_a_400_in_openais_shape(
    files_client: Any, errors: ErrorRecords, case: tuple[str, bytes]
) -> None:
    client, app = files_client
    errors.records.clear()
    content_type, body = case
    resp = await client.post("/v1/files", data=body, headers={"Content-Type": content_type})
    answer = await resp.read()
    if resp.status == 200:
        made = orjson.loads(answer)
        assert made["object"] == "file" and made["purpose"] != "batch_output", made
    else:
        _openai_error(resp.status, answer)
    assert not errors.records, [r.getMessage() for r in errors.records]
    await _good_upload(client)
    # Nothing of a refused upload is left on disk or counted.
    listed = await (await client.get("/v1/files")).json()
    kept = {f["id"] for f in listed["data"]}
    assert {p.name for p in app[BATCHES].files.iterdir()} == kept
    quota = await app[BATCHES].quota()
    assert quota.used(None) == sum(f["bytes"] for f in listed["data"])


def _form(boundary: bytes, purpose: bytes, extra: bytes = b"") -> bytes:
    return (
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n' + extra
        + b"\r\n" + purpose + b"\r\n--" + boundary
        + b'\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
        + GOOD + b"\r\n--" + boundary + b"--\r\n"
    )  # fmt: skip


# The cases, each a 500 before: no boundary, one too long (RFC 2046:
# at most 70), one that never appears, a purpose that is not UTF-8, a charset
# that does not exist, a part cut short, a nested multipart part.
MALFORMED = {
    "no boundary": ("multipart/form-data", _form(b"x", b"batch")),
    "boundary too long": (
        f"multipart/form-data; boundary={'b' * 200}",
        _form(b"b" * 200, b"batch"),
    ),
    "boundary never appears": ("multipart/form-data; boundary=zz", b"hello world\r\n"),
    "purpose not utf-8": ("multipart/form-data; boundary=x", _form(b"x", b"b\xe9tch")),
    "unknown charset": (
        "multipart/form-data; boundary=x",
        _form(b"x", b"batch", b"Content-Type: text/plain; charset=nope\r\n"),
    ),
    "cut short": ("multipart/form-data; boundary=x", _form(b"x", b"batch")[:150]),
    "nested": (
        "multipart/form-data; boundary=x",
        b"--x\r\nContent-Type: multipart/mixed; boundary=y\r\n"
        b'Content-Disposition: form-data; name="file"\r\n\r\nabc\r\n--x--\r\n',
    ),
    "base64 file": (
        "multipart/form-data; boundary=x",
        b'--x\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--x\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n'
        b"Content-Transfer-Encoding: base64\r\n\r\neyJ9\r\n--x--\r\n",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_what_the_check_found_is_a_400(
    make_client: Any, errors: ErrorRecords, case: str
) -> None:
    client, _ = await serve(make_client)
    content_type, body = MALFORMED[case]
    resp = await client.post("/v1/files", data=body, headers={"Content-Type": content_type})
    assert resp.status == 400, await resp.text()
    _openai_error(resp.status, await resp.read())
    assert not errors.records, [r.getMessage() for r in errors.records]
    await _good_upload(client)


async def test_batch_output_is_no_upload_purpose(make_client: Any) -> None:
    """OpenAI's upload purposes (the `openai` client's FilePurpose) do not
    include it: only the server writes batch_output files."""
    client, _ = await serve(make_client)
    form = aiohttp.FormData()
    form.add_field("purpose", "batch_output")
    form.add_field("file", GOOD, filename="in.jsonl")
    resp = await client.post("/v1/files", data=form)
    assert resp.status == 400
    error = _openai_error(resp.status, await resp.read())
    assert error["param"] == "purpose" and "batch_output" not in error["message"]
    assert (await (await client.get("/v1/files")).json())["data"] == []


# -- files in use, and a batch's end --------------------------------------------------


async def _running(client: Any, engine: FakeEngine, n: int) -> dict[str, Any]:
    """A batch of `n` slow lines, some of them done and the rest not."""
    file_id = await upload(client, jsonl(*(line(f"r{i}", max_tokens=40) for i in range(n))))
    made = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
    batch = await made.json()

    async def some_done() -> bool:
        got = await (await client.get(f"/v1/batches/{batch['id']}")).json()
        return bool(got["request_counts"]["completed"] >= 2)

    for _ in range(3000):
        if await some_done():
            return dict(batch)
        await asyncio.sleep(0.01)
    raise AssertionError("no line of the batch was done")


def _each_once(out: list[Any], errors: list[Any], n: int) -> None:
    done = [x["custom_id"] for x in out]
    assert len(done) == len(set(done)) >= 2
    unrun = [x["custom_id"] for x in errors]
    assert sorted(done + unrun) == sorted(f"r{i}" for i in range(n))
    assert {x["error"]["code"] for x in errors} <= {"batch_cancelled"}


async def test_a_file_a_batch_needs_cannot_be_deleted(make_client: Any) -> None:
    engine = FakeEngine(step=0.02)
    client, _ = await serve(make_client, engine=engine, batch_lines_in_flight=2)
    batch = await _running(client, engine, 30)
    resp = await client.delete(f"/v1/files/{batch['input_file_id']}")
    assert resp.status == 409
    error = _openai_error(resp.status, await resp.read())
    assert error["code"] == "file_in_use" and batch["id"] in error["message"]
    await client.post(f"/v1/batches/{batch['id']}/cancel")
    done = await finished(client, batch["id"])
    assert done["status"] == "cancelled", done
    out, errs = await content(client, done["output_file_id"]), []
    errs = await content(client, done["error_file_id"])
    _each_once(out, errs, 30)
    for key in ("output_file_id", "error_file_id"):  # its results, while it is
        resp = await client.delete(f"/v1/files/{done[key]}")
        assert resp.status == 409 and (await resp.json())["error"]["code"] == "file_in_use"
    assert await content(client, done["output_file_id"]) == out
    # Its input, once it has ended: the caller's to delete.
    resp = await client.delete(f"/v1/files/{batch['input_file_id']}")
    assert resp.status == 200 and (await resp.json())["deleted"] is True


async def test_a_message_batchs_files_go_only_with_it(make_client: Any) -> None:
    client, app = await serve(make_client)
    made = await create(client, [{"custom_id": f"m{i}", "params": params()} for i in range(3)])
    batch = await ended(client, made.id)
    stored = orjson.loads((await app[BATCHES].db.get_job("batches", made.id)).body)  # type: ignore[union-attr]
    for key in ("input_file_id", "output_file_id"):
        resp = await client.delete(f"/v1/files/{stored[key]}")
        assert resp.status == 409 and (await resp.json())["error"]["code"] == "file_in_use"
    got = await results(client, batch)
    assert sorted(r.custom_id for r in got) == ["m0", "m1", "m2"]
    assert {r.result.type for r in got} == {"succeeded"}
    assert (await client.delete(f"/v1/messages/batches/{made.id}")).status == 200
    assert (await (await client.get("/v1/files")).json())["data"] == []


async def test_a_batch_whose_input_is_gone_still_writes_what_it_completed(
    make_client: Any,
) -> None:
    """The input file gone from the disk under a running batch (not through
    the API: that is refused): cancelled, it ends with its done lines."""
    engine = FakeEngine(step=0.02)
    client, app = await serve(make_client, engine=engine, batch_lines_in_flight=2)
    batch = await _running(client, engine, 30)
    app[BATCHES].file_path(batch["input_file_id"]).unlink()
    await client.post(f"/v1/batches/{batch['id']}/cancel")
    done = await finished(client, batch["id"])
    assert done["status"] == "cancelled", done
    out = await content(client, done["output_file_id"])
    kept = await app[BATCHES].db.line_statuses(batch["id"])
    assert sorted(x["custom_id"] for x in out) == sorted(f"r{n - 1}" for n in kept)
    assert done["request_counts"]["completed"] == len(out) >= 2


# -- the quota --------------------------------------------------------------------


async def test_concurrent_uploads_and_message_batches_stay_within_the_quota(
    make_client: Any,
) -> None:
    """12 uploads at once (each several chunks) with room for 3, then 8
    Message Batches at once with room for 2: never above the quota, and the
    room goes to whole files, not to parts of all of them."""
    client, app = await serve(make_client, batch_disk_per_caller=500_000)
    size = 150_000

    async def one(i: int) -> int:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", b"x" * size, filename=f"{i}.jsonl")
        resp = await client.post("/v1/files", data=form)
        if resp.status != 200:
            assert (await resp.json())["error"]["code"] == "quota_exceeded"
        return resp.status

    statuses = await asyncio.gather(*(one(i) for i in range(12)))
    assert statuses.count(200) == 3 and statuses.count(413) == 9
    listed = await (await client.get("/v1/files")).json()
    assert sum(f["bytes"] for f in listed["data"]) == 3 * size
    # 50 kB left: each Message Batch's input file is about 20 kB.
    pad = "y" * 10_000
    requests = [{"custom_id": f"q{i}", "params": params(system=pad)} for i in range(2)]

    async def batch() -> int:
        resp = await client.post("/v1/messages/batches", json={"requests": requests})
        if resp.status != 200:
            body = await resp.json()
            assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
        return resp.status

    made = await asyncio.gather(*(batch() for _ in range(8)))
    assert 1 <= made.count(200) <= 2 and made.count(413) >= 6
    listed = await (await client.get("/v1/files")).json()
    reserved = [f["bytes"] for f in listed["data"] if f["purpose"] != "batch_output"]
    assert sum(reserved) <= 500_000
    for made_batch in (await (await client.get("/v1/messages/batches")).json())["data"]:
        await ended(client, made_batch["id"])  # none left running at the end
    listed = await (await client.get("/v1/files")).json()
    assert (await app[BATCHES].quota()).used(None) == sum(f["bytes"] for f in listed["data"])


async def test_a_message_batch_at_the_quota_is_refused(make_client: Any) -> None:
    client, _ = await serve(make_client, batch_disk_per_caller=1_000)
    await upload(client, b"x" * 1_000)
    resp = await client.post(
        "/v1/messages/batches", json={"requests": [{"custom_id": "a", "params": params()}]}
    )
    assert resp.status == 413, await resp.text()
    assert (await client.get("/v1/messages/batches")).status == 200
    assert (await (await client.get("/v1/messages/batches")).json())["data"] == []


# -- identifier patterns -------------------------------------------------------------

# What Anthropic's ^[a-zA-Z0-9_-]{1,64}$ and the window's whole hours refuse
# (JSON Schema's `$` is the string's end: no trailing newline).
ODD = ["\n", "\x00", "\u00e9", "\u0661", "\uff11", " ", "\r"]


def test_identifier_patterns_match_whole() -> None:
    for odd in ODD:
        _refused(odd)
    assert parse_window("24h") == 86400.0
    good = orjson.dumps({"requests": [{"custom_id": "a-Z_9", "params": params()}]})
    assert len(parse_create(good, Limits())) == 1


def _refused(odd: str) -> None:
    for custom_id in (f"ok{odd}", f"{odd}ok", f"o{odd}k", odd):
        body = orjson.dumps({"requests": [{"custom_id": custom_id, "params": params()}]})
        with pytest.raises(SluiceError) as err:
            parse_create(body, Limits())
        assert err.value.param == "requests.0.custom_id"
    for window in (f"24h{odd}", f"{odd}24h", f"2{odd}4h"):
        with pytest.raises(SluiceError) as err:
            parse_window(window)
        assert err.value.param == "completion_window"


async def test_a_limit_that_is_no_number_is_a_400(make_client: Any) -> None:
    client, _ = await serve(make_client)
    for path in ("/v1/files", "/v1/batches", "/v1/messages/batches"):
        for limit in ("\u00b2", "\uff11", "1\n", "-1", "1e3"):
            resp = await client.get(path, params={"limit": limit})
            assert resp.status == 400, (path, limit, await resp.text())


# -- the admin key ----------------------------------------------------------------


async def test_the_admin_key_creates_no_file_and_no_batch(make_client: Any) -> None:
    """It is no caller's: refused on creation as on the generation routes,
    while it still sees, cancels and deletes every caller's."""
    table = parse_callers(KEYS)
    client, _ = await serve(
        make_client, caller_table=table, callers=table.policies, admin_key="sk-admin"
    )
    admin = {"Authorization": "Bearer sk-admin"}
    assert (await client.post(CHAT, json={}, headers=admin)).status == 401  # as ever
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", GOOD, filename="in.jsonl")
    resp = await client.post("/v1/files", data=form, headers=admin)
    assert resp.status == 401
    assert _openai_error(resp.status, await resp.read())["code"] == "invalid_api_key"
    mine = {"Authorization": "Bearer sk-a"}
    batch = await run_batch(client, GOOD, mine)
    resp = await client.post(
        "/v1/batches",
        json={"input_file_id": batch["input_file_id"], "endpoint": CHAT},
        headers=admin,
    )
    assert resp.status == 401
    resp = await client.post(
        "/v1/messages/batches",
        json={"requests": [{"custom_id": "a", "params": params()}]},
        headers={"x-api-key": "sk-admin"},
    )
    assert resp.status == 401 and (await resp.json())["type"] == "error"
    for path in ("/v1/files", "/v1/batches", f"/v1/batches/{batch['id']}"):
        assert (await client.get(path, headers=admin)).status == 200


async def test_a_cancel_does_not_wait_for_a_running_line(make_client: Any) -> None:
    """Every place in flight taken by a long line: the cancel abandons them at
    once (docs/bulk.md), not after the first of them has finished."""
    engine = FakeEngine(step=0.5)  # a line of 50 tokens: 25 s
    client, _ = await serve(make_client, engine=engine, batch_lines_in_flight=2)
    file_id = await upload(client, jsonl(*(line(f"s{i}", max_tokens=50) for i in range(6))))
    made = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
    batch_id = (await made.json())["id"]
    for _ in range(1000):
        if len(engine.added) >= 2:
            break
        await asyncio.sleep(0.01)
    await client.post(f"/v1/batches/{batch_id}/cancel")
    done = await asyncio.wait_for(finished(client, batch_id), 10)
    assert done["status"] == "cancelled" and done["request_counts"]["completed"] == 0
    unrun = await content(client, done["error_file_id"])
    assert sorted(x["custom_id"] for x in unrun) == [f"s{i}" for i in range(6)]
