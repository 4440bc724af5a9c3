"""Issue 44 on the real engine: one Sluice on the demo model with TLS (client
certificates optional, checked against the test CA), CORS for one origin, a
root path, an API key and an OTLP endpoint at a real OTLP/HTTP receiver run by
the test; every check runs against it.

The `openai` and `anthropic` clients speak HTTPS with the test CA (trustme) to
`/llm/v1`, chat and a stream each; a client without the CA, and one showing a
certificate of another CA, are refused at the handshake (a client without a
certificate where one is required: tests/unit/test_network.py, no engine
needed). A SIGHUP with a new certificate serves it to new connections while a
stream begun before it finishes on its old connection. The spans reach the
receiver with the GenAI attributes and the window and engine timings,
continuing the caller's `traceparent`. Chromium (tests/integration/test_status_page.py's
pattern) makes a cross-origin call from a page on another origin: its
preflight is answered without the key, a page on an origin not listed is
refused by the browser.
"""

from __future__ import annotations

import contextlib
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trustme
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.integration.test_status_page import FLAGS, chromium_path
from tests.otlp_receiver import Receiver, receiver_thread
from tests.support import SluiceProcess, free_port

MODEL = "sluice-demo"
KEY = "net-test-key"
ROOT = "/llm"
ASK: Any = [{"role": "user", "content": "Hello over TLS"}]


def wait_for(cond: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout} s")
        time.sleep(0.05)


class Pki:
    """Two CAs: the server's first certificate from `ca`, its renewal from `ca2`."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.ca, self.ca2, self.stranger = trustme.CA(), trustme.CA(), trustme.CA()
        self.cert, self.key = d / "server.pem", d / "server.key"
        self.write(self.ca, self.cert, self.key)
        self.ca_pem, self.ca2_pem = d / "ca.pem", d / "ca2.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_pem))
        self.ca2.cert_pem.write_to_path(str(self.ca2_pem))
        self.both = d / "both.pem"
        self.both.write_bytes(self.ca_pem.read_bytes() + self.ca2_pem.read_bytes())

    @staticmethod
    def write(ca: trustme.CA, cert: Path, key: Path, *who: str) -> None:
        leaf = ca.issue_cert(*(who or ("127.0.0.1", "localhost")))
        cert.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(str(key))

    def client(
        self, ca: Path | None = None, *, cert_of: trustme.CA | None = None
    ) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(ca or self.both))
        if cert_of is not None:
            c, k = self.dir / "client.pem", self.dir / "client.key"
            self.write(cert_of, c, k, "client.example")
            ctx.load_cert_chain(c, k)
        return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with receiver_thread() as rec:
        yield rec


@pytest.fixture(scope="module")
def page_origin() -> str:
    """The origin the server allows: a page server the browser test starts there."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def server(
    demo_cache_root: Path,
    tmp_path_factory: pytest.TempPathFactory,
    pki: Pki,
    receiver: Receiver,
    page_origin: str,
) -> Iterator[SluiceProcess]:
    d = tmp_path_factory.mktemp("net")
    (d / "key").write_text(KEY)
    (d / "key").chmod(0o600)
    args = [
        "--log-format",
        "plain",
        "--api-key-file",
        str(d / "key"),
        "--ssl-certfile",
        str(pki.cert),
        "--ssl-keyfile",
        str(pki.key),
        "--ssl-ca-certs",
        str(pki.ca_pem),
        "--ssl-cert-reqs",
        "optional",
        "--allowed-origins",
        f'["{page_origin}"]',
        "--root-path",
        ROOT,
        "--otlp-traces-endpoint",
        receiver.url,
    ]
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # the SDK's export interval (ms)
    proc = SluiceProcess(
        args, cache_dir=demo_cache_root, log_path=d / "sluice.log", env=env, tls=pki.client()
    )
    with proc.running():
        yield proc


@pytest.fixture
def closing() -> Iterator[contextlib.ExitStack]:
    """Closes the test's clients (an SSL socket left to the collector is a warning)."""
    with contextlib.ExitStack() as stack:
        yield stack


def _openai(server: SluiceProcess, ctx: ssl.SSLContext) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base}{ROOT}/v1",
        api_key=KEY,
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=ctx),
    )


def test_openai_and_anthropic_clients_over_tls(
    server: SluiceProcess, pki: Pki, closing: contextlib.ExitStack
) -> None:
    oc = closing.enter_context(_openai(server, pki.client()))
    done = oc.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6)
    assert done.choices[0].finish_reason in ("length", "stop") and done.usage is not None
    stream = oc.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    ac = anthropic.Anthropic(
        base_url=f"{server.base}{ROOT}",
        api_key=KEY,
        max_retries=0,
        http_client=anthropic.DefaultHttpxClient(verify=pki.client()),
    )
    closing.enter_context(ac)
    msg = ac.messages.create(model=MODEL, max_tokens=6, messages=ASK)
    assert msg.stop_reason in ("max_tokens", "end_turn")
    with ac.messages.stream(model=MODEL, max_tokens=6, messages=ASK) as s:
        final = s.get_final_message()
    assert final.usage.output_tokens > 0
    # A client certificate of the CA the server was given is accepted (optional).
    ok = httpx.get(f"{server.base}/v1/models", verify=pki.client(cert_of=pki.ca), headers=_key())
    assert ok.status_code == 200


def _key() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_clients_the_server_cannot_trust_or_that_cannot_trust_it_are_refused(
    server: SluiceProcess, pki: Pki, closing: contextlib.ExitStack
) -> None:
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(server.base + "/health")  # the system's CAs only
    with pytest.raises(openai.APIConnectionError):
        closing.enter_context(_openai(server, ssl.create_default_context())).models.list()
    # A certificate the client shows is checked: one of another CA is refused.
    with pytest.raises(httpx.HTTPError):
        httpx.get(
            server.base + "/v1/models",
            verify=pki.client(cert_of=pki.stranger),
            headers=_key(),
        ).raise_for_status()
    # Plain HTTP on the TLS port gets no answer of the API's.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{server.port}/health").raise_for_status()


def test_the_spans_continue_the_callers_trace(
    server: SluiceProcess, receiver: Receiver, pki: Pki, closing: contextlib.ExitStack
) -> None:
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    oc = closing.enter_context(_openai(server, pki.client()))
    oc.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=5,
        user="tracer-test",
        extra_headers={"traceparent": f"00-{trace_id}-{parent}-01", "x-request-id": "net-trace-1"},
    )
    wait_for(lambda: len(receiver.of("net-trace-1")) >= 4, timeout=30, what="the spans")
    by = {s["name"]: s for s in receiver.of("net-trace-1")}
    top = by[f"chat {MODEL}"]
    assert (top["trace_id"], top["parent_span_id"]) == (trace_id, parent)
    a = top["attributes"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.usage.input_tokens"] > 0 and 0 < a["gen_ai.usage.output_tokens"] <= 5
    assert a["gen_ai.response.finish_reasons"][0] in ("length", "stop")
    assert a["sluice.caller"] == "default" or a["sluice.caller"]
    assert a["http.route"] == "/v1/chat/completions"  # the root path came off
    assert a["sluice.queue_wait_s"] >= 0 and "sluice.window_wait_s" in a
    assert a["sluice.backlog_wait_s"] >= 0 and a["sluice.release_reason"]
    assert a["sluice.ttft_s"] > 0
    engine = by["sluice.engine"]
    assert engine["parent_span_id"] == top["span_id"]
    assert engine["start"] <= engine["events"]["first_token"] <= engine["end"] <= top["end"]
    assert by["sluice.window"]["end"] <= engine["start"]


def test_sighup_serves_a_new_certificate_while_an_old_stream_finishes(
    server: SluiceProcess, pki: Pki, closing: contextlib.ExitStack
) -> None:
    # This client trusts the first certificate only.
    oc = closing.enter_context(_openai(server, pki.client(pki.ca_pem)))
    stream = oc.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=1500,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    closing.enter_context(stream)
    chunks = iter(stream)
    assert next(chunks).choices is not None
    Pki.write(pki.ca2, pki.cert, pki.key)  # the renewal, in place
    server.signal(signal.SIGHUP)
    wait_for(lambda: "TLS certificate reloaded" in server.tail(20000), timeout=30, what="reload")
    # New connections: the new certificate (a client of the old CA only is refused).
    assert httpx.get(server.base + "/health", verify=pki.client(pki.ca2_pem)).status_code == 200
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(server.base + "/health", verify=pki.client(pki.ca_pem))
    # The stream begun before goes on to its end on its connection.
    rest = list(chunks)
    assert rest, "the stream had ended before the reload"
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in rest)


# --- a browser on another origin ------------------------------------------------

_PAGE = (
    """<!doctype html><title>cors</title><script>
async function call(url, key) {
  try {
    const r = await fetch(url, {method: "POST", headers: {
      "Authorization": "Bearer " + key, "Content-Type": "application/json"},
      body: JSON.stringify({model: "MODEL", max_tokens: 4,
                            messages: [{role: "user", content: "hi"}]})});
    return {status: r.status, body: await r.json()};
  } catch (e) { return {error: String(e)}; }
}
</script>"""
).replace("MODEL", MODEL)


@pytest.fixture
async def page_server(page_origin: str) -> AsyncIterator[str]:
    app = web.Application()

    async def page(_: web.Request) -> web.Response:
        return web.Response(text=_PAGE, content_type="text/html")

    app.router.add_get("/", page)
    port = int(page_origin.rsplit(":", 1)[1])
    ts = TestServer(app, host="127.0.0.1", port=port)
    await ts.start_server()
    try:
        yield page_origin
    finally:
        await ts.close()


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[Any]:
    """Headless Chromium (test_status_page.py's); the test CA is not the browser's,
    so its context ignores certificate errors (TLS is checked with the real
    clients above)."""
    executable = chromium_path()
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            user_data_dir=str(tmp_path / "profile"),
            executable_path=executable,
            headless=True,
            args=FLAGS,
            ignore_https_errors=True,
        )
        try:
            yield context.pages[0] if context.pages else await context.new_page()
        finally:
            await context.close()


async def test_a_page_on_another_origin_calls_the_api_from_chromium(
    server: SluiceProcess, page_server: str, browser: Any
) -> None:
    page = browser
    api = f"{server.base}{ROOT}/v1/chat/completions"
    await page.goto(page_server + "/")
    got = await page.evaluate("([u, k]) => call(u, k)", [api, KEY])
    assert got.get("status") == 200, got
    assert got["body"]["choices"][0]["message"]["role"] == "assistant"
    log = server.tail(40000)
    assert "OPTIONS" in log  # its preflight, answered without the key
    # The same page served from an origin not listed: the browser refuses the answer.
    other = page_server.replace("127.0.0.1", "localhost")
    await page.goto(other + "/")
    refused = await page.evaluate("([u, k]) => call(u, k)", [api, KEY])
    assert "error" in refused and "Failed to fetch" in refused["error"], refused


def test_a_bad_certificate_is_one_line_and_exit_2_before_any_engine(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("-----BEGIN CERTIFICATE-----\nnot one\n")
    done = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--ssl-certfile", str(tmp_path / "cert.pem")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        process_group=0,
    )
    assert done.returncode == 2
    # (vLLM's import may print its own notice about Triton first.)
    lines = [ln for ln in done.stderr.splitlines() if "Triton" not in ln]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("sluice serve: error: --ssl-certfile/--ssl-keyfile")
    assert "Traceback" not in done.stderr and "engine" not in done.stdout + done.stderr
