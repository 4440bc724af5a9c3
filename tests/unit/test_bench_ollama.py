"""bench/run/ollama_backend.py against a tiny aiohttp server replaying an /api/chat
stream (newline-delimited JSON): what the request sends and how it times the
answer."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from vllm.benchmarks.lib import endpoint_request_func as erf

from bench.run import ollama_backend as ob


def _line(content: str = "", thinking: str = "", **extra: Any) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    return json.dumps({"model": "m", "message": message, "done": False, **extra}).encode() + b"\n"


DONE = (
    json.dumps(
        {
            "model": "m",
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "done_reason": "length",
            "prompt_eval_count": 9,
            "eval_count": 3,
        }
    ).encode()
    + b"\n"
)
# One empty first line (a tag token), thinking, then text; the final object
# split across two writes, as TCP may split it.
BODY = [_line(), _line(thinking="hm"), _line("Hel") + _line("lo"), DONE[:20], DONE[20:]]


class _Replay:
    def __init__(self, body: list[bytes]) -> None:
        self.body = body
        self.request: dict[str, Any] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.request = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for chunk in self.body:
            await resp.write(chunk)
        await resp.write_eof()
        return resp


async def _run(replay: _Replay) -> erf.RequestFuncOutput:
    app = web.Application()
    app.router.add_post("/api/chat", replay.handle)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        inp = erf.RequestFuncInput(
            prompt="hi there",
            api_url=str(server.make_url("/api/chat")),
            prompt_len=2,
            output_len=64,
            model="sluice-demo",
            ignore_eos=True,
            extra_body={"think": False},
        )
        return await ob.async_request_ollama_chat(inp, session)


async def test_a_stream_is_timed_from_its_first_token_line() -> None:
    replay = _Replay(BODY)
    out = await _run(replay)
    assert out.success, out.error
    # Three lines with content or thinking: the first sets TTFT, two gaps.
    assert out.ttft > 0 and len(out.itl) == 2 and all(x >= 0 for x in out.itl)
    assert (out.output_tokens, out.prompt_len, out.generated_text) == (3, 9, "Hello")
    assert replay.request == {
        "model": "sluice-demo",
        "messages": [{"role": "user", "content": "hi there"}],
        "stream": True,
        "options": {"num_predict": 64, "ignore_eos": True},
        "think": False,
    }


async def test_a_stream_without_tokens_or_done_or_with_an_error_fails() -> None:
    error = json.dumps({"error": "busy"}).encode() + b"\n"
    for body, why in (
        ([_line(), DONE], "TTFT"),
        (BODY[:-2], "done object"),
        ([_line("a"), error], "busy"),
    ):
        out = await _run(_Replay(body))
        assert not out.success and why in out.error


def test_registered_as_a_backend_of_vllm_bench_serve() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ob.register()
    ob.register()
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    assert parser.parse_args(["--backend", ob.NAME, "--model", "m"]).backend == ob.NAME
    assert erf.ASYNC_REQUEST_FUNCS[ob.NAME] is ob.async_request_ollama_chat
    assert erf.OPENAI_COMPATIBLE_BACKENDS.count(ob.NAME) == 1
