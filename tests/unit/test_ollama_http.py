"""Ollama's API through the whole HTTP pipeline on the fake engine, spoken to by
the official `ollama` Python client over a real loopback socket: chat and
generate, streamed (newline-delimited JSON, the first line with the first
token) and whole, tool calls with vLLM's real parsers (demo tokenizer),
the model routes, `/` for a browser and for Ollama's clients, the key as
`Authorization: Bearer` naming a caller, refusals in Ollama's shape and status
(overload a fast 503 with Retry-After), an error after the stream started as
one more line, abort on disconnect, and accepted-and-ignored fields counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import ollama
import orjson
import pytest

from server.callers import parse_callers
from server.state import MODELS, RUNTIME, Phase
from tests.fakes import FakeEngine
from tests.support import until
from tests.unit.test_handlers import real, retry_after, scrape
from tests.unit.test_tools_http import AUTO_SCRIPT, PARAMS

pytestmark = pytest.mark.timeout(60)

HI = [{"role": "user", "content": "hi"}]
THINKING = ("<think>", "hmm", "</think>", "Hello", " world")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_time"}},
]


@pytest.fixture
async def client_for() -> AsyncIterator[Callable[..., ollama.AsyncClient]]:
    """client_for(test client, key=None): an `ollama` client of the test server,
    closed after the test."""
    made: list[ollama.AsyncClient] = []

    def make(client: Any, key: str | None = None) -> ollama.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        made.append(ollama.AsyncClient(host=str(client.make_url("")).rstrip("/"), headers=headers))
        return made[-1]

    yield make
    for oc in made:
        await oc._client.aclose()


@pytest.fixture(scope="module")
def tok(demo_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


async def test_chat_whole_and_streamed_agree(make_client: Any, client_for: Any) -> None:
    client, _, _ = await make_client(FakeEngine(script=THINKING))
    oc = client_for(client)
    whole = await oc.chat(model="fake:latest", messages=HI, stream=False)
    assert whole.model == "fake:latest" and whole.done and whole.done_reason == "stop"
    assert whole.message.role == "assistant"
    assert whole.message.thinking == "hmm" and whole.message.content == "Hello world"
    assert whole.eval_count == 5 and (whole.prompt_eval_count or 0) > 0
    assert (whole.total_duration or 0) >= (whole.eval_duration or 0) > 0
    parts = [p async for p in await oc.chat(model="fake:latest", messages=HI, stream=True)]
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == "Hello world"
    assert "".join(p.message.thinking or "" for p in parts) == "hmm"
    assert parts[-1].done_reason == "stop" and parts[-1].eval_count == 5


async def test_generate_whole_streamed_and_raw(make_client: Any, client_for: Any) -> None:
    client, _, engine = await make_client(FakeEngine(script=THINKING))
    oc = client_for(client)
    whole = await oc.generate(model="fake", prompt="hi", system="be brief")
    assert whole.response == "Hello world" and whole.thinking == "hmm"
    assert engine.rendered[-1][0][0].content == "be brief"
    parts = [p async for p in await oc.generate(model="fake", prompt="hi", stream=True)]
    assert "".join(p.response or "" for p in parts) == "Hello world"
    raw = await oc.generate(model="fake", prompt="<raw>", raw=True, options={"num_predict": 3})
    assert raw.response == "<think>hmm</think>"  # the client's prompt: no split
    assert raw.done_reason == "length" and raw.prompt_eval_count == len(b"<raw>")
    loaded = await oc.generate(model="fake", prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


async def test_the_first_line_goes_out_with_the_first_token(make_client: Any) -> None:
    hold = asyncio.Event()
    engine = FakeEngine(script=THINKING, first_output=hold)
    client, _, _ = await make_client(engine, warmup=False)
    resp = await client.post("/api/chat", json={"model": "fake", "messages": HI})
    assert resp.status == 200 and resp.content_type == "application/x-ndjson"
    await until(lambda: bool(engine.held), what="prefill held")
    first = asyncio.ensure_future(resp.content.readline())
    await asyncio.sleep(0.1)
    assert not first.done()  # nothing before the first output
    hold.set()
    line = orjson.loads(await first)
    assert line["done"] is False and line["model"] == "fake"
    rest = [orjson.loads(x) for x in (await resp.content.read()).splitlines()]
    assert rest[-1]["done"] is True


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_in_ollamas_shape(
    make_client: Any, client_for: Any, tok: Any, stream: bool
) -> None:
    client, _, _ = await make_client(FakeEngine(script=AUTO_SCRIPT, tokenizer=tok), warmup=False)
    oc = client_for(client)
    kw: dict[str, Any] = {"model": "fake", "messages": HI, "tools": TOOLS, "think": False}
    if stream:
        parts = [p async for p in await oc.chat(stream=True, **kw)]
        calls = [c for p in parts for c in p.message.tool_calls or ()]
        content = "".join(p.message.content or "" for p in parts)
    else:
        msg = (await oc.chat(**kw)).message
        calls, content = list(msg.tool_calls or ()), msg.content
    assert content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    # The call and its result go back as the next turn.
    turn = [
        *HI,
        {"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "content": "4 C", "tool_name": "get_weather"},
    ]
    again = await oc.chat(model="fake", messages=turn, tools=TOOLS, think=False)
    assert again.done


async def test_format_options_and_keep_alive_reach_the_engine(
    make_client: Any, client_for: Any
) -> None:
    client, _, engine = await make_client(FakeEngine(script=("{}",)))
    oc = client_for(client)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    await oc.chat(
        model="fake",
        messages=HI,
        format=schema,
        think=False,
        keep_alive="10m",
        options={"temperature": 0, "seed": 3, "num_predict": 4, "num_gpu": 1},
    )
    assert engine.constraints[-1].kind == "json" and orjson.loads(engine.constraints[-1].value)
    m = scrape(await (await client.get("/metrics")).text())
    ignored = {
        s.labels["field"]: s.value
        for s in m["sluice_ignored_fields_total"]
        if s.labels["api"] == "ollama"
    }
    assert ignored == {"options.num_gpu": 1}  # keep_alive is read (parse.py rule 11)
    done = {(s.labels["endpoint"], s.labels["status"]): s.value for s in m["sluice_requests_total"]}
    assert done[("ollama_chat", "200")] == 1


async def test_models_version_and_probes(make_client: Any, client_for: Any) -> None:
    client, _, _ = await make_client()
    oc = client_for(client)
    listed = await oc.list()
    assert [m.model for m in listed.models] == ["fake:latest"]
    running = await oc.ps()
    assert running.models[0].context_length == 256
    shown = await oc.show("fake:latest")
    assert shown.modelinfo == {"general.architecture": "sluice", "sluice.context_length": 256}
    version = await (await client.get("/api/version")).json()
    assert version["version"].count(".") == 2
    # `/`: the status page for a browser, Ollama's probe for its clients.
    page = await client.get("/", headers={"Accept": "text/html,*/*;q=0.8"})
    assert page.content_type == "text/html"
    probe = await client.head("/", headers={"Accept": "application/json"})
    assert probe.status == 200 and probe.content_type == "text/plain"
    text = await client.get("/", headers={"User-Agent": "ollama-python/0.6.3"})
    assert await text.text() == "Ollama is running"


async def test_refusals_in_ollamas_shape(make_client: Any, client_for: Any) -> None:
    client, app, _ = await make_client()
    oc = client_for(client)
    with pytest.raises(ollama.ResponseError) as nf:
        await oc.chat(model="fake:7b", messages=HI)
    assert nf.value.status_code == 404 and "fake:7b" in nf.value.error
    with pytest.raises(ollama.ResponseError) as img:
        await oc.chat(model="fake", messages=[{"role": "user", "content": "x", "images": [b"x"]}])
    assert img.value.status_code == 400 and "messages[0].images" in img.value.error
    with pytest.raises(ollama.ResponseError) as emb:
        await oc.embed(model="fake", input="x")
    # A chat model does not embed: the 400 naming it (registry.py rule 3).
    assert emb.value.status_code == 400 and "embedding model" in emb.value.error
    # The older route too, in Ollama's shape (keep_alive is no refusal).
    legacy = await client.post(
        "/api/embeddings", json={"model": "fake", "prompt": "x", "keep_alive": "5m"}
    )
    assert legacy.status == 400
    assert (await legacy.json()).keys() == {"error"}
    assert "is a generative model" in (await legacy.json())["error"]
    with pytest.raises(ollama.ResponseError) as pull:
        await oc.pull("fake")
    assert pull.value.status_code == 501 and "--model" in pull.value.error
    for method, path in [("DELETE", "/api/delete"), ("POST", "/api/copy"), ("POST", "/api/create")]:
        r = await client.request(method, path, json={"model": "fake"})
        assert r.status == 501 and set(await r.json()) == {"error"}
    unknown = await client.get("/api/nothing")
    assert unknown.status == 404 and set(await unknown.json()) == {"error"}
    app[RUNTIME].phase = Phase.DRAINING
    r = await client.post("/api/chat", json={"model": "fake", "messages": HI})
    assert r.status == 503 and retry_after(r) >= 1
    assert set(await r.json()) == {"error"}


async def test_overload_is_a_fast_503_with_retry_after(make_client: Any) -> None:
    client, app, engine = await make_client(
        engine=FakeEngine(step=0.05), max_pending_requests=1, warmup=False
    )
    body = {"model": "fake", "messages": HI, "stream": False, "options": {"num_predict": 6}}
    first = asyncio.create_task(client.post("/api/chat", json=body))
    await until(lambda: app[MODELS].default.driver.core.pending_requests == 1, what="one admitted")
    resp = await asyncio.wait_for(client.post("/api/chat", json=body), 2.0)
    assert resp.status == 503 and retry_after(resp) >= 1
    assert set(await resp.json()) == {"error"}
    assert (await first).status == 200
    assert len(real(engine.added)) == 1


async def test_the_bearer_key_names_the_caller(make_client: Any, client_for: Any) -> None:
    table = parse_callers('[callers.team]\nkey = "sk-team"\n')
    client, _, _ = await make_client(caller_table=table, callers=table.policies)
    assert (await client_for(client, "sk-team").chat(model="fake", messages=HI)).done
    with pytest.raises(ollama.ResponseError) as denied:
        await client_for(client, "wrong").chat(model="fake", messages=HI)
    assert denied.value.status_code == 401 and denied.value.error == "invalid or missing API key"
    assert (await client.get("/api/version")).status == 200  # a probe: open
    assert (await client.get("/api/tags")).status == 401
    m = scrape(await (await client.get("/metrics")).text())
    by = {(s.labels["caller"], s.labels["status"]) for s in m["sluice_caller_requests_total"]}
    assert ("team", "200") in by


async def test_an_error_after_the_stream_started_is_one_more_line(
    make_client: Any, client_for: Any
) -> None:
    client, _, engine = await make_client(engine=FakeEngine(step=0.02), warmup=False)
    body = {"model": "fake", "messages": HI, "options": {"num_predict": 200}}
    resp = await client.post("/api/chat", json=body)
    head = await resp.content.readline()
    await until(lambda: bool(real(list(engine._producers))), what="generating")
    engine.kill()
    lines = (head + await resp.content.read()).splitlines()
    assert orjson.loads(lines[-1]).keys() == {"error"}
    assert "died" in orjson.loads(lines[-1])["error"]
    with pytest.raises(ollama.ResponseError):  # the client raises on that line
        async for _ in await client_for(client).chat(model="fake", messages=HI, stream=True):
            pass


async def test_a_client_that_leaves_is_aborted_in_the_engine(make_client: Any) -> None:
    client, _, engine = await make_client(FakeEngine(step=0.05))
    resp = await client.post(
        "/api/generate", json={"model": "fake", "prompt": "hi", "options": {"num_predict": 200}}
    )
    await resp.content.readline()
    resp.close()
    await until(lambda: bool(real(engine.aborted)), what="aborted")


async def test_embed_on_an_embedding_model(make_client: Any, client_for: Any) -> None:
    """/api/embed and /api/embeddings run on the pooling pipeline: one vector
    per input, in order, the same vector for the same text, the counts."""
    client, _, engine = await make_client(FakeEngine(kind="embed"), warmup=False)
    oc = client_for(client)
    r = await oc.embed(model="fake", input=["alpha", "beta", "alpha"])
    assert len(r.embeddings) == 3 and len(r.embeddings[0]) == engine.embed_dims
    assert r.embeddings[0] == r.embeddings[2] != r.embeddings[1]
    assert r.prompt_eval_count and r.prompt_eval_count > 0
    one = await oc.embed(model="fake", input="alpha")
    assert one.embeddings == [r.embeddings[0]]
    assert (await oc.embed(model="fake", input="")).embeddings == []
    legacy = await client.post("/api/embeddings", json={"model": "fake", "prompt": "alpha"})
    assert legacy.status == 200, await legacy.text()
    assert (await legacy.json())["embedding"] == r.embeddings[0]
    with pytest.raises(ollama.ResponseError) as chat:
        await oc.chat(model="fake", messages=HI)
    assert chat.value.status_code == 400 and "embedding model" in chat.value.error
