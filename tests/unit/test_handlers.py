"""The HTTP front end to end: the real app on a loopback socket, a FakeEngine behind it.

Each test drives the routes and the generation pipeline through aiohttp's client and checks what an
OpenAI client would see (shapes validated with the `openai` package's models),
plus what the engine saw (added / aborted / unfinished requests). Waits poll
for a state with a generous ceiling; nothing here asserts how fast anything is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from typing import Any

import orjson
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from server.state import MODELS, RUNTIME, Phase
from tests.fakes import FakeEngine
from tests.support import until

# A hang is a failure, not a five-minute stall of the suite.
pytestmark = pytest.mark.timeout(30)

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]  # FakeEngine: "<user>hi" = 8 prompt tokens


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": HI, "max_tokens": 5, **kw}


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": "fake", "prompt": "abc", "max_tokens": 5, **kw}


def real(ids: list[str]) -> list[str]:
    """Engine request ids other than the app's start-up warm-up generation."""
    return [i for i in ids if not i.startswith("warmup-")]


def events(text: str) -> list[Any]:
    """An SSE body -> decoded `data:` payloads; the terminator stays the string [DONE]."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    out: list[Any] = []
    for frame in text.split("\n\n"):
        if not frame:
            continue
        assert frame.startswith("data: "), frame
        payload = frame[len("data: ") :]
        out.append(payload if payload == "[DONE]" else orjson.loads(payload))
    assert out.count("[DONE]") == 1 and out[-1] == "[DONE]"
    return out[:-1]


async def stream_events(resp: Any) -> list[Any]:
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return events(await resp.text())


def chat_chunks(evs: list[Any]) -> list[ChatCompletionChunk]:
    return [ChatCompletionChunk.model_validate(e) for e in evs]


def completion_chunks(evs: list[Any]) -> list[dict[str, Any]]:
    """Streamed text_completion chunks, validated with the SDK's Completion model.

    That model (meant for whole responses) requires a finish_reason, while a
    stream chunk carries null until the end: validate with a stand-in there and
    return the raw events.
    """
    out = []
    for e in evs:
        assert e["object"] == "text_completion"
        stand_in = {
            **e,
            "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in e["choices"]],
        }
        Completion.model_validate(stand_in)
        out.append(e)
    return out


def assembled(chunks: list[ChatCompletionChunk], field: str = "content") -> dict[int, str]:
    out: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            piece = getattr(c.delta, field, None)
            if piece is None and c.delta.model_extra:
                piece = c.delta.model_extra.get(field)
            out[c.index] = out.get(c.index, "") + (piece or "")
    return out


async def assert_error(
    resp: Any, status: int, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    text = await resp.text()
    assert resp.status == status, text
    assert resp.headers["Content-Type"].startswith("application/json")
    body = orjson.loads(text)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


def retry_after(resp: Any) -> int:
    value = resp.headers.get("Retry-After")
    assert value is not None and value.isdigit(), resp.headers
    assert int(value) >= 1
    return int(value)


# ---------------------------------------------------------------------------
# 1. OpenAI shapes


async def test_chat_non_stream_shape_reasoning_and_usage(make_client: Any) -> None:
    client, _, engine = await make_client()
    resp = await client.post(CHAT, json=chat())
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("application/json")
    raw = await resp.json()
    cc = ChatCompletion.model_validate(raw)
    assert cc.object == "chat.completion" and cc.model == "fake"
    assert cc.id.startswith("chatcmpl-")
    assert len(cc.choices) == 1
    ch = cc.choices[0]
    assert ch.index == 0 and ch.finish_reason == "length"
    assert ch.message.role == "assistant"
    assert ch.message.content == "Hello world"
    assert raw["choices"][0]["message"]["reasoning_content"] == "hmm"
    assert cc.usage is not None
    assert (cc.usage.prompt_tokens, cc.usage.completion_tokens) == (8, 5)
    assert cc.usage.total_tokens == 13
    assert len(real(engine.added)) == 1


async def test_chat_thinking_off_keeps_everything_in_content(make_client: Any) -> None:
    client, _, _ = await make_client()
    body = chat(chat_template_kwargs={"enable_thinking": False})
    raw = await (await client.post(CHAT, json=body)).json()
    cc = ChatCompletion.model_validate(raw)
    assert cc.choices[0].message.content == "<think>hmm</think>Hello world"
    assert raw["choices"][0]["message"].get("reasoning_content") is None

    resp = await client.post(CHAT, json={**body, "stream": True})
    chunks = chat_chunks(await stream_events(resp))
    assert assembled(chunks) == {0: "<think>hmm</think>Hello world"}
    assert assembled(chunks, "reasoning_content") == {0: ""}


async def test_chat_stream_shape_reasoning_usage_and_done(make_client: Any) -> None:
    client, _, _ = await make_client()
    body = chat(stream=True, stream_options={"include_usage": True})
    resp = await client.post(CHAT, json=body)
    assert resp.headers["Cache-Control"] == "no-cache"
    evs = await stream_events(resp)
    chunks = chat_chunks(evs)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    # Only the last chunk carries usage, with no choices.
    *body_chunks, last = chunks
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (8, 5)
    assert last.usage.total_tokens == 13
    assert all(c.usage is None for c in body_chunks)
    assert assembled(body_chunks) == {0: "Hello world"}
    assert assembled(body_chunks, "reasoning_content") == {0: "hmm"}
    finishes = [(c.index, c.finish_reason) for ch in body_chunks for c in ch.choices]
    assert [f for f in finishes if f[1] is not None] == [(0, "length")]
    # The finish chunk comes after every piece of text.
    assert body_chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("n", [1, 2])
async def test_chat_stream_first_frame_comes_with_the_first_token(make_client: Any, n: int) -> None:
    """No frame with `choices` before the engine's first output (vLLM's server
    sends the role frame with it): a client timing its first frame times the
    first token, not the headers."""
    gate = asyncio.Event()
    client, _, engine = await make_client(engine=FakeEngine(first_output=gate), warmup=False)
    resp = await client.post(CHAT, json=chat(stream=True, n=n))
    assert resp.status == 200  # the headers are out
    await until(lambda: len(engine.held) == 1, what="the first output held back")
    # Two round trips on the same server: whatever the stream's handler wrote
    # before waiting on the engine has reached this client by now.
    for _ in range(2):
        assert (await client.get("/health")).status == 200
    early = resp.content.read_nowait()
    assert early == b"", early
    gate.set()
    chunks = chat_chunks(await stream_events(resp))
    # One role frame per choice, then that choice's text, as vLLM sends them.
    heads = chunks[:n]
    assert [c.choices[0].index for c in heads] == list(range(n))
    assert all(c.choices[0].delta.role == "assistant" for c in heads)
    assert all(c.choices[0].delta.content == "" for c in heads)
    assert all(c.choices[0].delta.role is None for c in chunks[n:])


async def test_chat_stream_without_include_usage_has_no_usage_chunk(make_client: Any) -> None:
    client, _, _ = await make_client()
    chunks = chat_chunks(await stream_events(await client.post(CHAT, json=chat(stream=True))))
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


async def test_chat_n_choices(make_client: Any) -> None:
    client, _, engine = await make_client()
    cc = ChatCompletion.model_validate(await (await client.post(CHAT, json=chat(n=3))).json())
    assert [c.index for c in cc.choices] == [0, 1, 2]
    assert {c.message.content for c in cc.choices} == {"Hello world"}
    assert all(c.finish_reason == "length" for c in cc.choices)
    assert cc.usage is not None and cc.usage.completion_tokens == 15

    resp = await client.post(CHAT, json=chat(n=2, stream=True))
    chunks = chat_chunks(await stream_events(resp))
    assert assembled(chunks) == {0: "Hello world", 1: "Hello world"}
    assert assembled(chunks, "reasoning_content") == {0: "hmm", 1: "hmm"}
    finishes = sorted(
        (c.index, c.finish_reason) for ch in chunks for c in ch.choices if c.finish_reason
    )
    assert finishes == [(0, "length"), (1, "length")]
    assert len(real(engine.added)) == 2  # n is one engine request each time


async def test_completion_non_stream_multi_prompt_and_n(make_client: Any) -> None:
    client, _, engine = await make_client()
    resp = await client.post(COMP, json=comp(prompt=["a", "bb"], n=2, max_tokens=3))
    assert resp.status == 200
    c = Completion.model_validate(await resp.json())
    assert c.object == "text_completion" and c.id.startswith("cmpl-")
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    assert {ch.text for ch in c.choices} == {"<think>hmm</think>"}
    assert {ch.finish_reason for ch in c.choices} == {"length"}
    assert c.usage is not None
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (3, 12)
    assert len(real(engine.added)) == 2  # one engine request per prompt


async def test_completion_stream_multi_prompt_usage_and_done(make_client: Any) -> None:
    client, _, _ = await make_client()
    body = comp(
        prompt=["a", "bb"], n=2, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    evs = await stream_events(await client.post(COMP, json=body))
    chunks = completion_chunks(evs)
    *body_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 3
    assert last["usage"]["completion_tokens"] == 16
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for ch in body_chunks:
        assert ch.get("usage") is None
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finishes[c["index"]] = c["finish_reason"]
    assert texts == dict.fromkeys(range(4), "<think>hmm</think>Hello")
    assert finishes == dict.fromkeys(range(4), "length")


async def test_completion_echo(make_client: Any) -> None:
    client, _, _ = await make_client()
    c = Completion.model_validate(
        await (await client.post(COMP, json=comp(echo=True, max_tokens=2))).json()
    )
    assert c.choices[0].text == "abc<think>hmm"

    evs = await stream_events(await client.post(COMP, json=comp(echo=True, stream=True)))
    chunks = completion_chunks(evs)
    assert [(c["index"], c["text"]) for c in chunks[0]["choices"]] == [(0, "abc")]
    text = "".join(c["text"] for ch in chunks for c in ch["choices"])
    assert text == "abc<think>hmm</think>Hello world"


async def test_completion_token_id_prompt_echo_is_detokenized(make_client: Any) -> None:
    client, _, engine = await make_client()
    body = comp(prompt=[1, 2, 3], echo=True, max_tokens=1)
    c = Completion.model_validate(await (await client.post(COMP, json=body)).json())
    assert c.choices[0].text == engine.detokenize([1, 2, 3]) + "<think>"
    assert c.usage is not None and c.usage.prompt_tokens == 3


# ---------------------------------------------------------------------------
# 2. x-request-id


@pytest.mark.parametrize(("path", "prefix"), [(CHAT, "chatcmpl-"), (COMP, "cmpl-")])
async def test_request_id_echoed(make_client: Any, path: str, prefix: str) -> None:
    client, _, engine = await make_client()
    body = chat() if path == CHAT else comp()
    resp = await client.post(path, json=body, headers={"x-request-id": "abc-123"})
    assert resp.status == 200
    assert resp.headers["x-request-id"] == "abc-123"
    assert (await resp.json())["id"] == f"{prefix}abc-123"
    assert any(i.startswith("abc-123") for i in engine.added)

    resp = await client.post(
        path, json={**body, "stream": True}, headers={"x-request-id": "abc-456"}
    )
    assert resp.headers["x-request-id"] == "abc-456"
    assert {e["id"] for e in await stream_events(resp)} == {f"{prefix}abc-456"}


async def test_request_id_generated_when_absent_or_unusable(make_client: Any) -> None:
    client, _, _ = await make_client()
    seen = set()
    for headers in ({}, {"x-request-id": "x" * 500}):
        resp = await client.post(CHAT, json=chat(), headers=headers)
        rid = resp.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid), rid
        assert (await resp.json())["id"] == f"chatcmpl-{rid}"
        seen.add(rid)
    assert len(seen) == 2


# ---------------------------------------------------------------------------
# 3. Bad input


BAD_CHAT_BODIES: list[tuple[str, Any, str | None]] = [
    ("negative max_tokens", chat(max_tokens=-1), "max_tokens"),
    ("zero max_tokens", chat(max_tokens=0), "max_tokens"),
    ("string max_tokens", chat(max_tokens="5"), "max_tokens"),
    ("temperature < 0", chat(temperature=-0.1), "temperature"),
    ("temperature type", chat(temperature="hot"), "temperature"),
    ("n above max_n", chat(n=9), "n"),
    ("n zero", chat(n=0), "n"),
    ("missing messages", {"model": "fake"}, "messages"),
    ("empty messages", {"model": "fake", "messages": []}, "messages"),
    ("messages not a list", {"model": "fake", "messages": "hi"}, "messages"),
    ("invalid role", chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    ("missing content", chat(messages=[{"role": "user"}]), "messages[0].content"),
    ("stream not bool", chat(stream="yes"), "stream"),
]


@pytest.mark.parametrize(
    ("body", "param"),
    [(b, p) for _, b, p in BAD_CHAT_BODIES],
    ids=[i for i, _, _ in BAD_CHAT_BODIES],
)
async def test_chat_bad_fields_400(make_client: Any, body: Any, param: str | None) -> None:
    client, _, engine = await make_client()
    err = await assert_error(await client.post(CHAT, json=body), 400, param=param)
    assert err["type"] == "invalid_request_error"
    assert real(engine.added) == []


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"", "invalid_json"),
        (b'[{"model": "fake"}]', "invalid_json"),
        (b'"just a string"', "invalid_json"),
        (b'{"model": "fake", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    ],
    ids=["malformed", "empty", "array", "string", "invalid-utf8"],
)
@pytest.mark.parametrize("path", [CHAT, COMP])
async def test_unparseable_bodies_400(
    make_client: Any, path: str, raw: bytes, code: str | None
) -> None:
    client, _, _ = await make_client()
    resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
    await assert_error(resp, 400, code=code)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "fake"},
        {"model": "fake", "prompt": ""},
        {"model": "fake", "prompt": []},
        {"model": "fake", "prompt": 5},
        comp(max_tokens=-3),
        comp(n=100),
    ],
    ids=["missing", "empty-string", "empty-list", "number", "neg-max-tokens", "n-too-big"],
)
async def test_completion_bad_prompt_400(make_client: Any, body: Any) -> None:
    client, _, _ = await make_client()
    await assert_error(await client.post(COMP, json=body), 400)


async def test_n_above_configured_max_n(make_client: Any) -> None:
    client, _, _ = await make_client(max_n=2)
    await assert_error(await client.post(CHAT, json=chat(n=3)), 400, param="n")
    assert (await client.post(CHAT, json=chat(n=2))).status == 200


@pytest.mark.parametrize("path", [CHAT, COMP])
async def test_unknown_model_404(make_client: Any, path: str) -> None:
    client, _, _ = await make_client()
    body = chat(model="gpt-9") if path == CHAT else comp(model="gpt-9")
    err = await assert_error(await client.post(path, json=body), 404, param="model")
    assert "gpt-9" in err["message"]
    # The model path works as well as the name.
    body["model"] = "/models/fake"
    assert (await client.post(path, json=body)).status == 200


async def test_max_tokens_above_the_room_left_is_lowered_to_it(make_client: Any) -> None:
    """As vLLM does (issue 26: Qwen Code asks for 32000 whatever the model)."""
    client, _, _ = await make_client()
    # Chat: 8 prompt tokens + 250 > 256: 248 are generated, the answer is cut.
    body = await (await client.post(CHAT, json=chat(max_tokens=250))).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 248
    # The same on completions (a 5-token prompt).
    body = await (await client.post(COMP, json=comp(prompt="hello", max_tokens=9000))).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 251


async def test_the_generation_configs_max_tokens_is_the_default(make_client: Any) -> None:
    """vLLM's server takes a request's default max_tokens from the generation
    config (max_new_tokens, or --override-generation-config): so does Sluice."""
    client, _, _ = await make_client(FakeEngine(default_max_tokens=3))
    body = await (await client.post(CHAT, json=chat(max_tokens=None))).json()
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"
    body = await (await client.post(CHAT, json=chat(max_tokens=7))).json()
    assert body["usage"]["completion_tokens"] == 7


async def test_a_prompt_over_the_context_is_a_400_naming_both_numbers(make_client: Any) -> None:
    client, _, engine = await make_client()
    # Completions: a 300-token prompt alone exceeds the context.
    err = await assert_error(
        await client.post(COMP, json=comp(prompt="x" * 300, max_tokens=1)),
        400,
        code="context_length_exceeded",
    )
    assert "256" in err["message"] and "300" in err["message"], err
    # Chat: a prompt of exactly the context leaves no room either.
    long = chat(messages=[{"role": "user", "content": "x" * 250}])
    err = await assert_error(
        await client.post(CHAT, json=long), 400, code="context_length_exceeded"
    )
    assert "256" in err["message"], err
    assert real(engine.added) == []


async def test_body_too_large_413(make_client: Any) -> None:
    client, _, engine = await make_client(max_body_bytes=1000)
    big = chat(messages=[{"role": "user", "content": "x" * 2000}])
    err = await assert_error(await client.post(CHAT, json=big), 413)
    assert err["type"] == "invalid_request_error"
    assert real(engine.added) == []
    assert (await client.post(CHAT, json=chat())).status == 200


async def test_api_key(make_client: Any) -> None:
    client, _, _ = await make_client(api_key="sekret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        err = await assert_error(
            await client.post(CHAT, json=chat(), headers=headers), 401, code="invalid_api_key"
        )
        assert "sekret" not in err["message"]
        assert err["type"] == "authentication_error"
    await assert_error(await client.get("/v1/models"), 401)
    ok = {"Authorization": "Bearer sekret"}
    assert (await client.post(CHAT, json=chat(), headers=ok)).status == 200
    assert (await client.post(COMP, json=comp(), headers=ok)).status == 200
    assert (await client.get("/v1/models", headers=ok)).status == 200
    # Probes stay open without a key.
    assert (await client.get("/health")).status == 200


async def test_bad_requests_do_not_disturb_good_streams(make_client: Any) -> None:
    client, _, _ = await make_client(engine=FakeEngine(step=0.01))

    async def good(i: int) -> dict[int, str]:
        resp = await client.post(
            CHAT, json=chat(max_tokens=15, stream=True), headers={"x-request-id": f"good-{i}"}
        )
        return assembled(chat_chunks(await stream_events(resp)))

    async def bad(kind: int) -> None:
        if kind == 0:
            resp = await client.post(CHAT, data=b"{oops", headers={"Content-Type": "x"})
            await assert_error(resp, 400)
        elif kind == 1:
            await assert_error(await client.post(CHAT, json=chat(temperature=-1)), 400)
        elif kind == 2:
            await assert_error(await client.post(CHAT, json=chat(model="nope")), 404)
        else:
            await assert_error(await client.post(CHAT, json=chat(top_p=0)), 400)

    alone = await good(99)
    assert alone[0].startswith("Hello world")
    results = await asyncio.gather(*(good(i) for i in range(3)), *(bad(k) for k in range(4)))
    assert results[:3] == [alone] * 3


# ---------------------------------------------------------------------------
# 4. Overload


async def test_overload_503_with_retry_after(make_client: Any) -> None:
    client, app, engine = await make_client(
        engine=FakeEngine(step=0.05), max_pending_requests=2, warmup=False
    )
    core = app[MODELS].default.driver.core
    first = [
        asyncio.create_task(client.post(CHAT, json=chat(max_tokens=6, temperature=1)))
        for _ in range(2)
    ]
    await until(lambda: core.pending_requests == 2, what="two admitted")
    # Refused at once: a hang here would trip the wait_for.
    resp = await asyncio.wait_for(client.post(CHAT, json=chat(max_tokens=6)), 2.0)
    await assert_error(resp, 503, code="queue_requests")
    retry_after(resp)
    for t in first:
        r = await t
        assert r.status == 200
        ChatCompletion.model_validate(await r.json())
    assert len(real(engine.added)) == 2
    # The slots come back once the first two are done.
    await until(lambda: core.pending_requests == 0, what="slots freed")
    assert (await client.post(CHAT, json=chat(max_tokens=1))).status == 200


# ---------------------------------------------------------------------------
# 5. Lifecycle


async def test_starting_then_ready(make_client: Any) -> None:
    client, app, _ = await make_client(engine=FakeEngine(start_delay=0.5), wait_ready=False)
    assert app[RUNTIME].phase is Phase.STARTING
    resp = await client.get("/ready")
    await assert_error(resp, 503)
    retry_after(resp)
    health = await client.get("/health")
    assert health.status == 200 and (await health.json())["phase"] == "starting"
    resp = await client.post(CHAT, json=chat())
    await assert_error(resp, 503, code="warming_up")
    retry_after(resp)
    await until(lambda: app[RUNTIME].phase is Phase.READY, what="ready")
    assert (await client.get("/ready")).status == 200
    assert (await client.post(CHAT, json=chat())).status == 200


async def test_engine_fails_to_start(make_client: Any) -> None:
    client, app, _ = await make_client(engine=FakeEngine(fail_start=True), wait_ready=False)
    await until(lambda: app[RUNTIME].phase is Phase.DEAD, what="dead")
    resp = await client.get("/health")
    err = await assert_error(resp, 503, code="engine_dead")
    assert "failed to start" in err["message"]
    await assert_error(await client.get("/ready"), 503)
    await assert_error(await client.post(CHAT, json=chat()), 503, code="engine_dead")


async def test_engine_death_mid_stream(make_client: Any) -> None:
    client, app, engine = await make_client(engine=FakeEngine(step=0.02), warmup=False)
    stream = await client.post(CHAT, json=chat(max_tokens=200, stream=True, temperature=1))
    assert stream.status == 200
    head = await stream.content.readline()  # the first chunk is out: headers are gone
    plain = asyncio.create_task(client.post(CHAT, json=chat(max_tokens=200, temperature=1)))
    await until(lambda: len(engine.unfinished) == 2, what="both running")
    engine.kill()
    evs = events((head + await stream.content.read()).decode())  # ends with [DONE]
    errors = [e for e in evs if "error" in e]
    assert len(errors) == 1 and evs[-1] is errors[0]
    assert set(errors[0]["error"]) == {"message", "type", "param", "code"}
    assert "died" in errors[0]["error"]["message"]
    resp = await asyncio.wait_for(plain, 5.0)
    await assert_error(resp, 503)
    retry_after(resp)
    await assert_error(await client.get("/health"), 503, code="engine_dead")
    await assert_error(await client.post(CHAT, json=chat()), 503)
    assert app[RUNTIME].phase is Phase.DEAD


# ---------------------------------------------------------------------------
# 6. Disconnects


async def test_disconnect_mid_stream_aborts_engine_request(make_client: Any) -> None:
    client, app, engine = await make_client(engine=FakeEngine(step=0.01), warmup=False)
    resp = await client.post(
        CHAT, json=chat(max_tokens=200, stream=True), headers={"x-request-id": "gone-1"}
    )
    assert resp.status == 200
    await resp.content.readline()
    [eid] = real(engine.added)
    assert eid.startswith("gone-1") and eid in engine.unfinished
    resp.close()  # drops the connection
    await until(lambda: eid in engine.aborted, what="abort")
    await until(lambda: not engine.unfinished, what="engine empty")
    await until(app[MODELS].default.driver.idle.is_set, what="driver idle")
    assert app[MODELS].default.driver.core.pending_requests == 0


async def test_disconnect_while_queued_never_reaches_engine(make_client: Any) -> None:
    client, app, engine = await make_client(
        window=5.0, adaptive=False, release_lone=False, warmup=False
    )
    core = app[MODELS].default.driver.core
    task = asyncio.create_task(client.post(CHAT, json=chat(), headers={"x-request-id": "queued-1"}))
    await until(lambda: core.queued_requests == 1, what="queued")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: core.queued_requests == 0, what="queue empty")
    await until(app[MODELS].default.driver.idle.is_set, what="driver idle")
    assert core.pending_requests == 0 and app[MODELS].default.driver.queued == 0
    assert not any(i.startswith("queued-1") for i in engine.added)
    assert core.next_deadline() is None  # nothing left to release later


async def test_queued_request_expires_with_503(make_client: Any) -> None:
    """A request that outlives --queue-timeout in the queue gets an answer (no hang)."""
    client, app, engine = await make_client(
        window=5.0, adaptive=False, release_lone=False, queue_timeout=0.2, warmup=False
    )
    resp = await asyncio.wait_for(client.post(CHAT, json=chat()), 3.0)
    await assert_error(resp, 503)
    assert real(engine.added) == []
    assert app[MODELS].default.driver.idle.is_set()


async def test_background_work_waits_its_own_queue_timeout(make_client: Any) -> None:
    """A flex request waits --background-queue-timeout, not --queue-timeout
    (batching/classes.py rule 4): the noisy point's background flood lost 3 of 48
    prompts to the 60 s meant for a chat turn."""
    client, _, engine = await make_client(
        window=5.0,
        adaptive=False,
        release_lone=False,
        queue_timeout=0.2,
        background_queue_timeout=1.0,
        warmup=False,
    )
    t0 = time.monotonic()
    resp = await asyncio.wait_for(client.post(CHAT, json=chat(service_tier="flex")), 5.0)
    await assert_error(resp, 503)
    assert time.monotonic() - t0 >= 1.0 and real(engine.added) == []


# ---------------------------------------------------------------------------
# 7. Dedupe


async def test_identical_greedy_requests_share_one_generation(make_client: Any) -> None:
    client, _, engine = await make_client(
        window=0.05, adaptive=False, release_lone=False, warmup=False
    )
    body = chat(temperature=0, max_tokens=5)
    a, b = await asyncio.gather(client.post(CHAT, json=body), client.post(CHAT, json=body))
    ra, rb = await a.json(), await b.json()
    assert a.status == b.status == 200
    assert len(real(engine.added)) == 1
    assert ra["id"] != rb["id"]
    ca, cb = ChatCompletion.model_validate(ra), ChatCompletion.model_validate(rb)
    assert ca.choices[0].message.content == cb.choices[0].message.content == "Hello world"
    assert ca.usage == cb.usage


async def test_sampled_requests_are_not_deduplicated(make_client: Any) -> None:
    client, _, engine = await make_client(
        window=0.05, adaptive=False, release_lone=False, warmup=False
    )
    body = chat(temperature=0.7, max_tokens=3)
    a, b = await asyncio.gather(client.post(CHAT, json=body), client.post(CHAT, json=body))
    assert a.status == b.status == 200
    assert len(real(engine.added)) == 2


async def test_dedupe_one_caller_leaves_other_completes(make_client: Any) -> None:
    client, app, engine = await make_client(
        engine=FakeEngine(step=0.01), window=0.05, adaptive=False, release_lone=False, warmup=False
    )
    body = chat(temperature=0, max_tokens=30, stream=True)
    a, b = await asyncio.gather(
        client.post(CHAT, json=body, headers={"x-request-id": "dup-a"}),
        client.post(CHAT, json=body, headers={"x-request-id": "dup-b"}),
    )
    assert a.status == b.status == 200
    [eid] = real(engine.added)
    await a.content.readline()
    a.close()
    text = assembled(chat_chunks(await stream_events(b)))
    assert eid not in engine.aborted
    await until(app[MODELS].default.driver.idle.is_set, what="driver idle")
    assert not engine.unfinished
    # The same request alone (nothing to share with) streams the same text.
    alone = await client.post(CHAT, json=body)
    assert assembled(chat_chunks(await stream_events(alone))) == text
    assert len(real(engine.added)) == 2


async def _both_leave(make_client: Any) -> tuple[Any, Any, str]:
    client, app, engine = await make_client(
        engine=FakeEngine(step=0.01), window=0.05, adaptive=False, release_lone=False, warmup=False
    )
    body = chat(temperature=0, max_tokens=200, stream=True)
    a, b = await asyncio.gather(client.post(CHAT, json=body), client.post(CHAT, json=body))
    [eid] = real(engine.added)
    await a.content.readline()
    await b.content.readline()
    a.close()
    [gen] = app[MODELS].default.driver.running_generations()
    await until(lambda: len(gen._subscribers) == 1, what="the server to see a leave")
    assert eid not in engine.aborted  # b still reads it
    b.close()
    await until(lambda: eid in engine.aborted, what="abort after last reader")
    await until(
        lambda: not engine.unfinished and app[MODELS].default.driver.idle.is_set(), what="idle"
    )
    return app, engine, eid


async def test_dedupe_both_callers_leave_aborts(make_client: Any) -> None:
    # A shared generation has no pump task to leak (tests/unit/test_ownership.py).
    await _both_leave(make_client)


# ---------------------------------------------------------------------------
# 8. Metrics


def scrape(text: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


async def test_metrics(make_client: Any) -> None:
    engine = FakeEngine(step=0.05)
    client, app, _ = await make_client(engine=engine, max_pending_requests=1, warmup=False)
    running = asyncio.create_task(client.post(CHAT, json=chat(max_tokens=4, temperature=1)))
    await until(lambda: app[MODELS].default.driver.core.pending_requests == 1, what="admitted")
    await assert_error(await client.post(CHAT, json=chat()), 503)
    assert (await running).status == 200

    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    m = scrape(await resp.text())
    reqs = {(s.labels["endpoint"], s.labels["status"]): s.value for s in m["sluice_requests_total"]}
    assert reqs[("chat", "200")] == 1 and reqs[("chat", "503")] == 1
    rej = {s.labels["reason"]: s.value for s in m["sluice_rejections_total"]}
    assert rej == {"queue_requests": 1}
    assert m["sluice_queue_requests"][0].value == 0
    assert [s.value for s in m["sluice_batch_size_count"]] == [1]
    assert "sluice_engine_kv_cache_usage" in m
    assert "sluice_dedupe_hits_total" in m
    assert m["sluice_dedupe_hits_total"][0].value == 0


async def test_metrics_kv_cache_and_dedupe_hits(make_client: Any) -> None:
    engine = FakeEngine()
    engine.stats_value = dataclasses.replace(engine.stats_value, kv_cache_usage=0.42)
    client, _, _ = await make_client(
        engine=engine, window=0.05, adaptive=False, release_lone=False, warmup=False
    )
    body = chat(temperature=0)
    await asyncio.gather(client.post(CHAT, json=body), client.post(CHAT, json=body))
    m = scrape(await (await client.get("/metrics")).text())
    assert m["sluice_engine_kv_cache_usage"][0].value == pytest.approx(0.42)
    assert m["sluice_dedupe_hits_total"][0].value == 1


async def test_metrics_count_warming_up_refusals(make_client: Any) -> None:
    client, _, _ = await make_client(engine=FakeEngine(start_delay=0.5), wait_ready=False)
    await assert_error(await client.post(CHAT, json=chat()), 503)
    m = scrape(await (await client.get("/metrics")).text())
    rej = {s.labels["reason"]: s.value for s in m["sluice_rejections_total"]}
    assert rej.get("starting") == 1
