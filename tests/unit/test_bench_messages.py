"""bench/run/messages_backend.py against a tiny aiohttp server replaying a recorded
/v1/messages stream: what the request sends and how it times the answer."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from vllm.benchmarks.lib import endpoint_request_func as erf

from bench.run import messages_backend as mb


def _ev(payload: dict[str, Any]) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()


def _block_delta(index: int, delta: dict[str, Any]) -> bytes:
    return _ev({"type": "content_block_delta", "index": index, "delta": delta})


# A Messages stream as Sluice (and Anthropic) sends it: the head and a ping
# before any token, a thinking block, a text block, usage in message_delta.
HEAD = _ev(
    {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "content": [],
            "usage": {"input_tokens": 7, "output_tokens": 0},
        },
    }
) + _ev({"type": "ping"})
BODY = [
    _ev({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking"}})
    + _block_delta(0, {"type": "thinking_delta", "thinking": "hm"}),
    _ev({"type": "content_block_stop", "index": 0})
    + _ev({"type": "content_block_start", "index": 1, "content_block": {"type": "text"}})
    + _block_delta(1, {"type": "text_delta", "text": "Hel"}),
    _block_delta(1, {"type": "text_delta", "text": "lo"}),
    _ev({"type": "content_block_stop", "index": 1})
    + _ev({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}})
    + _ev({"type": "message_delta", "usage": {"output_tokens": 3}})
    + _ev({"type": "message_stop"}),
]


class _Replay:
    """Serves HEAD, waits until the client's SSE reader has parsed it, then
    the body frame by frame; keeps the request body and when the first token
    frame left (same process, same clock as the client)."""

    def __init__(self, body: list[bytes]) -> None:
        self.body = body
        self.head_read = asyncio.Event()
        self.first_sent = 0.0
        self.request: dict[str, Any] = {}
        self.headers: dict[str, str] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.request = await request.json()
        self.headers = dict(request.headers)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(HEAD)
        await self.head_read.wait()
        self.first_sent = time.perf_counter()
        for frame in self.body:
            await resp.write(frame)
        await resp.write_eof()
        return resp


async def _run(replay: _Replay, monkeypatch: Any) -> erf.RequestFuncOutput:
    class Reader(erf.StreamedResponseHandler):
        def add_chunk(self, chunk_bytes: bytes) -> list[str]:
            messages = super().add_chunk(chunk_bytes)
            if any("message_start" in m for m in messages):
                replay.head_read.set()
            return messages

    monkeypatch.setattr(erf, "StreamedResponseHandler", Reader)
    app = web.Application()
    app.router.add_post("/v1/messages", replay.handle)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        inp = erf.RequestFuncInput(
            prompt="hi there",
            api_url=str(server.make_url("/v1/messages")),
            prompt_len=2,
            output_len=64,
            model="sluice-demo",
            ignore_eos=True,
            extra_body={"thinking": {"type": "disabled"}},
        )
        return await mb.async_request_anthropic_messages(inp, session)


async def test_ttft_is_the_first_token_delta_not_the_head(monkeypatch: Any) -> None:
    replay = _Replay(BODY)
    out = await _run(replay, monkeypatch)
    assert out.success, out.error
    # The head and the ping were read before the first delta left the server.
    assert out.start_time + out.ttft >= replay.first_sent
    assert len(out.itl) == 2 and all(x >= 0 for x in out.itl)
    assert out.latency >= out.ttft + sum(out.itl) - 1e-9
    assert (out.output_tokens, out.generated_text) == (3, "Hello")
    assert replay.request == {
        "model": "sluice-demo",
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 64,
        "stream": True,
        "ignore_eos": True,
        "thinking": {"type": "disabled"},
    }
    assert replay.headers["anthropic-version"] == "2023-06-01"


async def test_a_stream_without_tokens_or_stop_or_with_an_error_fails(monkeypatch: Any) -> None:
    stop = [_ev({"type": "message_stop"})]
    error = _ev({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
    for body, why in (
        (stop, "TTFT"),
        (BODY[:-1], "message_stop"),
        ([*BODY[:1], error], "overloaded_error"),
    ):
        out = await _run(_Replay(body), monkeypatch)
        assert not out.success and why in out.error


def test_registered_as_a_backend_of_vllm_bench_serve() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    mb.register()
    mb.register()
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    assert parser.parse_args(["--backend", mb.NAME, "--model", "m"]).backend == mb.NAME
    assert erf.ASYNC_REQUEST_FUNCS[mb.NAME] is mb.async_request_anthropic_messages
    assert erf.OPENAI_COMPATIBLE_BACKENDS.count(mb.NAME) == 1
