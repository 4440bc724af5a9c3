"""Issue 44 without an engine: CORS's decisions and its place ahead of the API key,
the root path, TLS contexts (mutual TLS required, a bad certificate, a reload
on a live context), the flags, and traces that reach a real OTLP/HTTP receiver
from the real app (the fake engine stands in for vLLM; the integration test,
tests/integration/test_network.py, runs the same on the real engine)."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web

from server.cli import parse_serve_args
from server.http import tls
from server.http.cors import CorsPolicy, parse_list, preflight, response_headers
from server.http.root_path import normalize, strip
from server.operations.tracing import endpoint_url, queue_split
from tests.otlp_receiver import Receiver
from tests.support import free_port

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
PAGE = "https://chat.example"

# --- CORS ----------------------------------------------------------------------


def test_cors_rules() -> None:
    p = CorsPolicy(origins=(PAGE,), methods=("GET", "POST"), headers=("authorization",))
    status, h = preflight(p, PAGE, "POST", "Authorization")
    assert status == 200
    assert h["Access-Control-Allow-Origin"] == PAGE and h["Vary"] == "Origin"
    assert h["Access-Control-Allow-Methods"] == "GET, POST"
    assert h["Access-Control-Allow-Headers"] == "Authorization"
    assert "Access-Control-Allow-Credentials" not in h
    for origin, method, asked, refused in [
        ("https://evil.example", "POST", "", "origin"),
        (PAGE, "DELETE", "", "method"),
        (PAGE, "POST", "authorization, x-secret", "headers"),
    ]:
        status, h = preflight(p, origin, method, asked)
        assert status == 400 and h["X-Cors-Refused"] == refused
        assert "Access-Control-Allow-Origin" not in h
    assert response_headers(p, PAGE) == {"Access-Control-Allow-Origin": PAGE, "Vary": "Origin"}
    assert response_headers(p, "https://evil.example") == {}
    assert response_headers(p, None) == {}
    anyone = CorsPolicy(origins=("*",))
    assert response_headers(anyone, "https://x") == {"Access-Control-Allow-Origin": "*"}
    assert preflight(anyone, "https://x", "PATCH", "x-anything")[0] == 200
    creds = CorsPolicy(origins=("*",), credentials=True)
    assert response_headers(creds, "https://x") == {
        "Access-Control-Allow-Origin": "https://x",
        "Vary": "Origin",
        "Access-Control-Allow-Credentials": "true",
    }


def test_list_flags_take_vllms_json_or_commas() -> None:
    assert parse_list('["https://a", "https://b"]', "--allowed-origins") == (
        "https://a",
        "https://b",
    )
    assert parse_list("https://a, https://b", "--allowed-origins") == ("https://a", "https://b")
    with pytest.raises(ValueError, match="--allowed-origins"):
        parse_list('["https://a", 3]', "--allowed-origins")


async def test_a_preflight_is_answered_without_the_key_and_answers_carry_the_origin(
    make_client: Any,
) -> None:
    client, _, _ = await make_client(api_key="sekrit", cors=CorsPolicy(origins=(PAGE,)), window=0.0)
    pre = await client.options(
        CHAT,
        headers={
            "Origin": PAGE,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert pre.status == 200, await pre.text()
    assert pre.headers["Access-Control-Allow-Origin"] == PAGE
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert pre.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    ok = await client.post(
        CHAT, json=BODY, headers={"Origin": PAGE, "Authorization": "Bearer sekrit"}
    )
    assert ok.status == 200 and ok.headers["Access-Control-Allow-Origin"] == PAGE
    # A refusal is readable by the page too (its body says why).
    denied = await client.post(CHAT, json=BODY, headers={"Origin": PAGE})
    assert denied.status == 401 and denied.headers["Access-Control-Allow-Origin"] == PAGE
    # Another origin: served as without CORS, with no header the browser would honour.
    other = await client.post(
        CHAT,
        json=BODY,
        headers={"Origin": "https://evil.example", "Authorization": "Bearer sekrit"},
    )
    assert other.status == 200 and "Access-Control-Allow-Origin" not in other.headers
    bad = await client.options(
        CHAT, headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    )
    assert bad.status == 400 and "Access-Control-Allow-Origin" not in bad.headers


async def test_cors_is_off_by_default(make_client: Any) -> None:
    client, _, _ = await make_client()
    pre = await client.options(
        CHAT, headers={"Origin": PAGE, "Access-Control-Request-Method": "POST"}
    )
    assert pre.status == 405 and "Access-Control-Allow-Origin" not in pre.headers
    ok = await client.get("/v1/models", headers={"Origin": PAGE})
    assert ok.status == 200 and "Access-Control-Allow-Origin" not in ok.headers


# --- the root path ---------------------------------------------------------------


def test_root_path_rules() -> None:
    assert normalize("/llm/") == "/llm" and normalize("llm") == "/llm" and normalize("/") == ""
    with pytest.raises(ValueError):
        normalize("/llm?x=1")
    assert strip("/llm/v1/models", "/llm") == "/v1/models"
    assert strip("/llm", "/llm") == "/"
    assert strip("/llmx/v1/models", "/llm") is None
    assert strip("/v1/models", "/llm") is None
    assert strip("/v1/models", "") is None


async def test_the_root_path_serves_the_same_routes_behind_the_same_key(make_client: Any) -> None:
    client, _, _ = await make_client(api_key="sekrit", root_path="/llm", window=0.0)
    key = {"Authorization": "Bearer sekrit"}
    both = [await client.get(p, headers=key) for p in ("/llm/v1/models", "/v1/models")]
    assert [r.status for r in both] == [200, 200]
    assert (await both[0].json()) == (await both[1].json())
    r = await client.post("/llm" + CHAT + "?x=1", json=BODY, headers=key)
    assert r.status == 200, await r.text()
    # The prefix comes off before the key is checked: it opens nothing.
    assert (await client.get("/llm/v1/models")).status == 401
    assert (await client.get("/llm/health")).status == 200
    assert (await client.get("/llmx/v1/models", headers=key)).status == 404


# --- TLS -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    out = {"dir": d}
    for name, who in (("server", "127.0.0.1"), ("client", "client.example")):
        cert = ca.issue_cert(who, "localhost")
        cert.private_key_pem.write_to_path(str(d / f"{name}.key"))
        (d / f"{name}.pem").write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
        out[name], out[f"{name}_key"] = d / f"{name}.pem", d / f"{name}.key"
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    other.cert_pem.write_to_path(str(d / "other_ca.pem"))
    new = other.issue_cert("127.0.0.1")
    new.private_key_pem.write_to_path(str(d / "new.key"))
    (d / "new.pem").write_bytes(b"".join(p.bytes() for p in new.cert_chain_pems))
    out.update(ca=d / "ca.pem", other_ca=d / "other_ca.pem")
    out.update(new=d / "new.pem", new_key=d / "new.key")
    return out


def test_a_bad_certificate_is_a_value_error_naming_the_file(pki: dict[str, Path]) -> None:
    d = pki["dir"]
    (d / "garbage.pem").write_text("not a certificate\n")
    cases = [
        (tls.TlsConfig(d / "missing.pem"), "no such file"),
        (tls.TlsConfig(d / "garbage.pem"), "not a readable certificate"),
        (tls.TlsConfig(pki["server"], pki["new_key"]), "matching private key"),
        (tls.TlsConfig(pki["server"], pki["server_key"], ca_certs=d / "garbage.pem"), "CA bundle"),
        (tls.TlsConfig(pki["server"], pki["server_key"], cert_reqs=ssl.CERT_REQUIRED), "needs"),
    ]
    for cfg, says in cases:
        with pytest.raises(ValueError, match=says):
            tls.server_context(cfg)
    assert [tls.cert_reqs(v) for v in ("0", "optional", "2", "REQUIRED")] == [
        ssl.CERT_NONE,
        ssl.CERT_OPTIONAL,
        ssl.CERT_REQUIRED,
        ssl.CERT_REQUIRED,
    ]
    with pytest.raises(ValueError, match="--ssl-cert-reqs"):
        tls.cert_reqs("3")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--ssl-certfile", "/nonexistent/cert.pem"], "no such file: /nonexistent/cert.pem"),
        (["--ssl-keyfile", "k.pem"], "need --ssl-certfile"),
        (["--ssl-cert-reqs", "sometimes"], "--ssl-cert-reqs must be"),
        (["--allowed-origins", "[1]"], "--allowed-origins"),
        (["--root-path", "/a?b"], "--root-path"),
        (["--otlp-traces-endpoint", "collector:4317"], "--otlp-traces-endpoint must be"),
    ],
)
def test_a_bad_network_flag_is_one_line_and_exit_2(
    demo_cache_root: Path, capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_serve_args(["--demo-cache-dir", str(demo_cache_root), *flags], {})
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sluice serve: error: ") and says in lines[0]


def test_network_flags_into_settings(demo_cache_root: Path, pki: dict[str, Path]) -> None:
    s = parse_serve_args(
        [
            "--demo-cache-dir",
            str(demo_cache_root),
            "--ssl-certfile",
            str(pki["server"]),
            "--ssl-keyfile",
            str(pki["server_key"]),
            "--ssl-ca-certs",
            str(pki["ca"]),
            "--ssl-cert-reqs",
            "1",
            "--allowed-origins",
            f'["{PAGE}"]',
            "--allow-credentials",
            "--root-path",
            "/llm/",
            "--otlp-traces-endpoint",
            "http://127.0.0.1:4318",
        ],
        {},
    )
    assert s.tls == tls.TlsConfig(pki["server"], pki["server_key"], pki["ca"], ssl.CERT_OPTIONAL)
    assert s.cors == CorsPolicy(origins=(PAGE,), credentials=True)
    assert s.root_path == "/llm" and s.url.startswith("https://") and s.url.endswith("/llm/v1")
    assert s.otlp_traces_endpoint == "http://127.0.0.1:4318/v1/traces"
    # The engine does not export spans of its own to it (over gRPC).
    assert s.engine_args.otlp_traces_endpoint is None
    d = parse_serve_args(["--demo-cache-dir", str(demo_cache_root)], {})
    assert (d.tls, d.cors, d.root_path, d.otlp_traces_endpoint) == (None, None, "", None)


async def _serve_tls(ctx: ssl.SSLContext) -> tuple[web.AppRunner, str]:
    async def hello(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        return web.json_response({"client": bool(peer)})

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ctx).start()
    return runner, f"https://127.0.0.1:{port}/"


def _client(pki: dict[str, Path], *, cert: bool, ca: str = "ca") -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki[ca])
    if cert:
        ctx.load_cert_chain(pki["client"], pki["client_key"])
    return ctx


async def test_mutual_tls_required_refuses_a_client_without_a_certificate(
    pki: dict[str, Path],
) -> None:
    cfg = tls.TlsConfig(pki["server"], pki["server_key"], pki["ca"], ssl.CERT_REQUIRED)
    runner, url = await _serve_tls(tls.server_context(cfg))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url, ssl=_client(pki, cert=True)) as r:
                assert (await r.json()) == {"client": True}
            with pytest.raises(aiohttp.ClientError):
                async with s.get(url, ssl=_client(pki, cert=False)) as r:
                    await r.read()
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await s.get(url, ssl=ssl.create_default_context())  # without the test CA
    finally:
        await runner.cleanup()


async def test_a_reload_serves_the_new_certificate_to_new_connections_only(
    pki: dict[str, Path], tmp_path: Path
) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(pki["server"].read_bytes())
    key.write_bytes(pki["server_key"].read_bytes())
    cfg = tls.TlsConfig(cert, key)
    ctx = tls.server_context(cfg)
    runner, url = await _serve_tls(ctx)
    one = aiohttp.TCPConnector(limit=1, ssl=_client(pki, cert=False))
    old = aiohttp.ClientSession(connector=one)
    try:
        assert (await (await old.get(url)).json()) == {"client": False}  # kept alive
        cert.write_text("half written")
        assert not await tls.reload(ctx, cfg)  # kept the old one
        async with aiohttp.ClientSession() as s:
            assert (await s.get(url, ssl=_client(pki, cert=False))).status == 200
        cert.write_bytes(pki["new"].read_bytes())
        key.write_bytes(pki["new_key"].read_bytes())
        assert await tls.reload(ctx, cfg)
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await s.get(url, ssl=_client(pki, cert=False))
            assert (await s.get(url, ssl=_client(pki, cert=False, ca="other_ca"))).status == 200
        # The connection opened before the reload goes on with its certificate.
        assert (await (await old.get(url)).json()) == {"client": False}
    finally:
        await old.close()
        await runner.cleanup()


# --- traces ----------------------------------------------------------------------


def test_trace_rules() -> None:
    assert endpoint_url("http://c:4318") == "http://c:4318/v1/traces"
    assert endpoint_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ValueError):
        endpoint_url("grpc://c:4317")
    assert queue_split(0.5, 0.01, "backlog") == (0.01, 0.49)
    assert queue_split(0.004, 0.01, "backlog") == (0.004, 0.0)
    assert queue_split(0.008, 0.01, "deadline") == (0.008, 0.0)


async def test_a_request_leaves_one_span_tree_continuing_the_callers_trace(
    make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the SDK's own setting
    rec = Receiver()
    runner = web.AppRunner(rec.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", rec.port).start()
    try:
        client, _, _ = await make_client(otlp_traces_endpoint=rec.url, window=0.02)
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        parent = "00f067aa0ba902b7"
        r = await client.post(
            CHAT,
            json={**BODY, "user": "alice"},
            headers={"traceparent": f"00-{trace_id}-{parent}-01", "x-request-id": "req-1"},
        )
        assert r.status == 200
        for _ in range(200):  # the server span and its three children (none held)
            if len(spans := rec.of("req-1")) >= 4:
                break
            await asyncio.sleep(0.05)
        by = {s["name"]: s for s in spans}
        server = by["chat fake"]
        assert server["trace_id"] == trace_id and server["parent_span_id"] == parent
        a = server["attributes"]
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.request.model"] == "fake"
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] == 5
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["sluice.caller"] == "alice" and a["http.response.status_code"] == 200
        assert a["sluice.class"] == "interactive"
        assert a["sluice.window_wait_s"] > 0 and a["sluice.backlog_wait_s"] == 0
        assert "sluice.release_reason" in a and "first_token" in server["events"]
        assert server["resource"]["service.name"] == "sluice"
        for name in ("sluice.prepare", "sluice.window", "sluice.engine"):
            child = by[name]
            assert child["parent_span_id"] == server["span_id"]
            assert server["start"] <= child["start"] <= child["end"] <= server["end"]
        assert by["sluice.window"]["end"] <= by["sluice.engine"]["start"]
        assert "first_token" in by["sluice.engine"]["events"]
        # A flex request's span names its class (batching/classes.py rule 1).
        flex = {**BODY, "service_tier": "flex"}
        r = await client.post(CHAT, json=flex, headers={"x-request-id": "req-2"})
        assert r.status == 200
        for _ in range(200):
            if spans := [s for s in rec.of("req-2") if s["name"] == "chat fake"]:
                break
            await asyncio.sleep(0.05)
        assert spans[0]["attributes"]["sluice.class"] == "background"
    finally:
        await runner.cleanup()
