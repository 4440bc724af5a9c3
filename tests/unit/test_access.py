"""Request ids and access lines for every route (server/http/middleware.py), and a
stream that fails after its headers went out (server/http/pipeline.py)."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from server.api.openai_chat.endpoint import ChatEncoder
from server.callers import CallerDirectory
from server.http.middleware import install
from server.operations import logs
from server.operations.metrics import Metrics
from server.settings import Settings
from server.state import CALLERS, METRICS, SETTINGS
from tests.support import until
from tests.unit.test_handlers import chat, events

CHAT = "/v1/chat/completions"
HEX_ID = re.compile(r"[0-9a-f]{32}")


def access_lines(caplog: pytest.LogCaptureFixture, rid: str | None = None) -> list[Any]:
    """The access records (for request id `rid` when given)."""
    return [
        r
        for r in caplog.records
        if r.name == "sluice.access" and (rid is None or r.fields["request_id"] == rid)  # type: ignore[attr-defined]
    ]


def requests_total(text: str, endpoint: str, status: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "sluice_requests_total" and s.labels == {
                "endpoint": endpoint,
                "status": status,
                "adapter": "",
            }:
                return float(s.value)
    return 0.0


async def test_errors_echo_the_request_id(make_client: Any) -> None:
    client, _, _ = await make_client()
    r = await client.post(CHAT, json=chat(model="other"), headers={"x-request-id": "given-1"})
    assert r.status == 404 and r.headers["x-request-id"] == "given-1"
    r = await client.post(CHAT, json=chat(max_tokens=-1))
    assert r.status == 400 and HEX_ID.fullmatch(r.headers["x-request-id"])
    r = await client.get("/no/such/path", headers={"x-request-id": "given-2"})
    assert r.status == 404 and r.headers["x-request-id"] == "given-2"
    assert (await r.json())["error"]["type"] == "not_found_error"
    r = await client.get("/v1/models", headers={"x-request-id": "x" * 129})  # unusable
    assert r.status == 200 and HEX_ID.fullmatch(r.headers["x-request-id"])


async def test_a_401_echoes_the_id_and_writes_one_line(
    make_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client, _, _ = await make_client(api_key="k-1")
    caplog.set_level(logging.DEBUG, logger="sluice.access")
    r = await client.get("/v1/models", headers={"x-request-id": "no-key"})
    assert r.status == 401 and r.headers["x-request-id"] == "no-key"
    [line] = access_lines(caplog, "no-key")
    assert line.levelno == logging.INFO
    assert line.fields["status"] == 401 and line.fields["error"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("method", "path", "level"),
    [
        ("GET", "/health", logging.DEBUG),
        ("GET", "/ready", logging.DEBUG),
        ("GET", "/metrics", logging.DEBUG),
        ("GET", "/", logging.DEBUG),
        ("GET", "/static/status.js", logging.DEBUG),
        ("GET", "/status.json", logging.DEBUG),
        ("GET", "/v1/models", logging.INFO),
        ("POST", "/tokenize", logging.INFO),
        ("POST", "/detokenize", logging.INFO),
    ],
)
async def test_every_route_has_an_id_and_one_access_line(
    make_client: Any, caplog: pytest.LogCaptureFixture, method: str, path: str, level: int
) -> None:
    client, _, _ = await make_client()
    caplog.set_level(logging.DEBUG, logger="sluice.access")
    body = {"prompt": "hi"} if path == "/tokenize" else {"tokens": [1, 2]}
    r = await client.request(
        method, path, json=body if method == "POST" else None, headers={"x-request-id": "r-1"}
    )
    assert r.status == 200, await r.text()
    assert r.headers["x-request-id"] == "r-1"
    [line] = access_lines(caplog, "r-1")
    assert line.levelno == level
    assert line.fields["endpoint"] == path and line.fields["status"] == 200
    assert line.fields["method"] == method and line.fields["total_ms"] >= 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_generation_writes_its_rich_line_once(
    make_client: Any, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    client, _, _ = await make_client()
    caplog.set_level(logging.DEBUG, logger="sluice.access")
    r = await client.post(CHAT, json=chat(stream=stream), headers={"x-request-id": "gen-1"})
    assert r.status == 200 and r.headers["x-request-id"] == "gen-1"
    await r.read()
    [line] = access_lines(caplog, "gen-1")
    assert line.levelno == logging.INFO
    assert line.fields["endpoint"] == "chat" and line.fields["stream"] is stream
    assert line.fields["batch_id"] >= 0 and line.fields["ttft_ms"] > 0


async def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event(
    make_client: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a SluiceError (a bug in an encoder): the stream still ends in the
    API's shape, with no traceback on the wire; logged once, counted as 500."""
    original = ChatEncoder.stream_delta
    calls = 0

    def failing(self: ChatEncoder, choice: int, delta: Any) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("encoder bug")
        return original(self, choice, delta)

    monkeypatch.setattr(ChatEncoder, "stream_delta", failing)
    client, _, _ = await make_client(warmup=False)
    caplog.set_level(logging.DEBUG)
    r = await client.post(
        CHAT, json=chat(stream=True, max_tokens=8), headers={"x-request-id": "s-1"}
    )
    assert r.status == 200
    # Before the fix a fresh 500 went into the started body: the client hung.
    text = (await asyncio.wait_for(r.read(), 10)).decode()
    evs = events(text)  # ends with exactly one [DONE]
    assert evs[-1] == {
        "error": {
            "message": "internal server error",
            "type": "internal_server_error",
            "param": None,
            "code": None,
        }
    }
    assert "error" not in str(evs[:-1]) and "Traceback" not in text and "encoder bug" not in text
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert len(tracebacks) == 1 and "encoder bug" in str(tracebacks[0].exc_info[1])  # type: ignore[index]
    [line] = access_lines(caplog, "s-1")
    assert line.fields["status"] == 500
    metrics = await (await client.get("/metrics")).text()
    assert requests_total(metrics, "chat", "500") == 1


async def test_no_second_answer_on_a_started_response(caplog: pytest.LogCaptureFixture) -> None:
    """Any handler that streams and then raises: the middleware ends the started
    response rather than writing a fresh 500 into its body."""

    async def streams_then_fails(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"partial ")
        raise RuntimeError("handler bug")

    app = web.Application()
    install(app)
    settings = Settings()
    app[SETTINGS] = settings
    app[CALLERS] = CallerDirectory(settings.caller_table, settings.api_key)
    app[METRICS] = Metrics()
    app.router.add_get("/s", streams_then_fails)
    caplog.set_level(logging.DEBUG)
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/s", headers={"x-request-id": "b-1"})
        assert r.status == 200 and r.headers["x-request-id"] == "b-1"
        assert await asyncio.wait_for(r.read(), 10) == b"partial "
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert len(tracebacks) == 1 and "handler bug" in str(tracebacks[0].exc_info[1])  # type: ignore[index]
    [line] = access_lines(caplog, "b-1")
    assert line.fields["status"] == 500 and line.levelno == logging.INFO


async def test_a_client_gone_before_the_headers_is_a_499_without_a_traceback(
    make_client: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race of issue 28: the client left while its stream's headers were
    being written, before aiohttp cancelled the handler. Fault injection: the
    connection closes just before the first write of a stream's headers."""
    client, app, _ = await make_client(warmup=False)
    real = web.StreamResponse.prepare

    async def closing(self: web.StreamResponse, request: web.BaseRequest) -> Any:
        if request.path == CHAT and request.transport is not None:
            request.transport.close()
        return await real(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", closing)
    caplog.set_level(logging.INFO)
    with pytest.raises(aiohttp.ClientError):
        await client.post(CHAT, json=chat(stream=True), headers={"x-request-id": "gone"})
    await until(lambda: bool(access_lines(caplog, "gone")), what="the access line")
    [line] = access_lines(caplog, "gone")
    assert (line.fields["status"], line.fields["error"]) == (499, "client went away")
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    text = app[METRICS].render().decode()
    assert requests_total(text, "chat", "499") == 1 and requests_total(text, "chat", "500") == 0


async def test_a_request_the_parser_refuses_gets_an_access_line_and_one_log_line(
    make_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A bare CR in a header is refused by aiohttp's parser before any
    middleware runs: one access line (status 400) and one log line without a
    traceback, both through Sluice's loggers (so in its JSON log)."""
    client, _, _ = await make_client(warmup=False)
    caplog.set_level(logging.DEBUG)
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\rb\r\n\r\n")
    await writer.drain()
    head = await reader.read(4096)
    writer.close()
    assert head.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), head
    await until(lambda: bool(access_lines(caplog)), what="the access line")
    [line] = access_lines(caplog)
    assert line.fields["status"] == 400 and HEX_ID.fullmatch(line.fields["request_id"])
    assert line.fields["error"] == "bad_http_request"
    others = [r for r in caplog.records if r.name != "sluice.access"]
    assert [r.name for r in others] == ["sluice.http"], [r.getMessage() for r in others]
    [refusal] = others
    assert refusal.exc_info is None and refusal.exc_text is None
    assert "\n" not in refusal.getMessage() and "refused by the HTTP parser" in refusal.getMessage()
    assert logs.JsonFormatter().format(refusal).count("\n") == 0
