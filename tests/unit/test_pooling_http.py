"""/v1/embeddings and /v1/rerank through the app and the core (issue 30), a
FakeEngine with a pooling kind behind them: the bodies a client reads (checked
with the `openai` package's models), what reached the engine, and the core's
part (the window coalescing many requests into one batch, dedupe, admission's
413, cancel on disconnect, drain). tests/integration/test_pooling.py runs the
same endpoints on the real engine.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse
from prometheus_client.parser import text_string_to_metric_families

from batching import DEFAULT_CALLER, CallerPolicy, Callers
from server.state import MODELS, RUNTIME, Phase
from tests.fakes import FakeEngine
from tests.support import until

pytestmark = pytest.mark.timeout(30)

EMB = "/v1/embeddings"
CHAT = "/v1/chat/completions"


def embedder(**kw: Any) -> FakeEngine:
    return FakeEngine(kind="embed", **kw)


def ids(text: str) -> tuple[int, ...]:
    """FakeEngine.tokenize_pooling's ids for `text`."""
    return tuple(b % 200 + 1 for b in text.encode())


async def error(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    body: dict[str, Any] = (await resp.json())["error"]
    return body


async def test_embeddings_shape_order_usage_and_base64(make_client: Any) -> None:
    client, _, engine = await make_client(engine=embedder(), warmup=False)
    texts = ["alpha", "be", "gamma ray"]
    resp = await client.post(EMB, json={"model": "fake", "input": texts})
    assert resp.status == 200, await resp.text()
    body = CreateEmbeddingResponse.model_validate(await resp.json())
    assert body.model == "fake" and [d.index for d in body.data] == [0, 1, 2]
    assert body.usage.prompt_tokens == body.usage.total_tokens == sum(map(len, texts))
    for d, t in zip(body.data, texts, strict=True):
        assert np.allclose(d.embedding, engine.vector(ids(t)), atol=1e-7)
    b64 = await (await client.post(EMB, json={"input": texts, "encoding_format": "base64"})).json()
    for d, t in zip(b64["data"], texts, strict=True):
        vec = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert np.array_equal(vec, engine.vector(ids(t)))


async def test_token_arrays_and_one_string(make_client: Any) -> None:
    client, _, engine = await make_client(engine=embedder(), warmup=False)
    for inp, want in (
        ("hi", [ids("hi")]),
        ([5, 6, 7], [(5, 6, 7)]),
        ([[1], [2, 3]], [(1,), (2, 3)]),
    ):
        resp = await client.post(EMB, json={"input": inp})
        assert resp.status == 200, await resp.text()
        data = (await resp.json())["data"]
        assert len(data) == len(want)
        for d, w in zip(data, want, strict=True):
            assert np.allclose(d["embedding"], engine.vector(w))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": 3}, "input"),
        ({"input": [1.5]}, "input[0]"),
        ({"input": ["a", 2]}, "input[1]"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a", "dimensions": 4}, "dimensions"),
        ({}, "input"),
    ],
)
async def test_bad_embeddings_are_400_naming_the_field(
    make_client: Any, body: dict[str, Any], param: str
) -> None:
    client, _, engine = await make_client(engine=embedder(), warmup=False)
    err = await error(await client.post(EMB, json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert engine.pooled == []


async def test_dimensions_on_a_matryoshka_model(make_client: Any) -> None:
    client, _, _ = await make_client(engine=embedder(matryoshka=True), warmup=False)
    resp = await client.post(EMB, json={"input": "abc", "dimensions": 4})
    [d] = (await resp.json())["data"]
    assert len(d["embedding"]) == 4


async def test_past_the_context_is_a_400_unless_truncation_is_asked(make_client: Any) -> None:
    client, _, _ = await make_client(engine=embedder(), warmup=False)
    long = list(range(1, 300))  # FakeEngine's context: 256 tokens
    err = await error(await client.post(EMB, json={"input": [long]}), 400)
    assert "maximum context length" in err["message"]
    resp = await client.post(EMB, json={"input": [long], "truncate_prompt_tokens": 10})
    assert resp.status == 200 and (await resp.json())["usage"]["prompt_tokens"] == 10


async def test_the_wrong_kind_of_model_is_a_400_naming_it(make_client: Any) -> None:
    client, _, _ = await make_client(engine=FakeEngine(), warmup=False)  # a chat model
    err = await error(await client.post(EMB, json={"model": "fake", "input": "x"}), 400)
    assert "'fake'" in err["message"] and "generative model" in err["message"]
    assert err["code"] == "wrong_model_kind"
    err = await error(await client.post("/v1/rerank", json={"query": "q", "documents": ["d"]}), 400)
    assert err["code"] == "wrong_model_kind"
    client, _, _ = await make_client(engine=embedder(), warmup=False)
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    err = await error(await client.post(CHAT, json=chat), 400)
    assert "'fake'" in err["message"] and "embedding model" in err["message"]


async def test_unknown_model_is_a_404(make_client: Any) -> None:
    client, _, _ = await make_client(engine=embedder(), warmup=False)
    await error(await client.post(EMB, json={"model": "nope", "input": "x"}), 404)


async def test_the_window_coalesces_many_requests_into_one_batch(make_client: Any) -> None:
    client, app, engine = await make_client(
        engine=embedder(), window=0.2, adaptive=False, release_lone=False, warmup=False
    )
    core = app[MODELS].default.driver.core
    bodies = [{"input": f"doc {i}"} for i in range(8)] + [{"input": ["x1", "x2"]}]
    tasks = [asyncio.create_task(client.post(EMB, json=b)) for b in bodies]
    await until(lambda: core.queued_requests == 10, what="all inputs queued")
    assert engine.pooled == []  # the window holds them
    resps = await asyncio.gather(*tasks)
    assert all(r.status == 200 for r in resps)
    metrics = await (await client.get("/metrics")).text()
    (sizes,) = [f for f in text_string_to_metric_families(metrics) if f.name == "sluice_batch_size"]
    got = {s.name: s.value for s in sizes.samples}
    assert (got["sluice_batch_size_count"], got["sluice_batch_size_sum"]) == (1, 10)
    assert len(engine.pooled) == 10


async def test_identical_inputs_waiting_together_share_one_engine_request(
    make_client: Any,
) -> None:
    client, _, engine = await make_client(
        engine=embedder(), window=0.05, adaptive=False, release_lone=False, warmup=False
    )
    a, b = await asyncio.gather(
        client.post(EMB, json={"input": ["same", "same"]}),
        client.post(EMB, json={"input": "same"}),
    )
    va = [d["embedding"] for d in (await a.json())["data"]]
    vb = [d["embedding"] for d in (await b.json())["data"]]
    assert va == [vb[0], vb[0]]
    assert len(engine.pooled) == 1
    # Another task, or another size, is another engine request.
    await client.post("/v1/rerank", json={"query": "same", "documents": ["same"]})
    assert len(engine.pooled) >= 2


async def test_too_many_inputs_at_once_is_a_413(make_client: Any) -> None:
    client, app, engine = await make_client(
        engine=embedder(), max_pending_requests=50, max_pending_tokens=500, warmup=False
    )
    err = await error(await client.post(EMB, json={"input": ["x"] * 51}), 413)
    assert err["code"] == "too_many_inputs" and err["param"] == "input"
    err = await error(await client.post(EMB, json={"input": ["y" * 40] * 20}), 413)
    assert err["code"] == "too_many_tokens"
    assert engine.pooled == [] and app[MODELS].default.driver.core.pending_requests == 0
    resp = await client.post(EMB, json={"input": ["x"] * 50})
    assert resp.status == 200


async def test_a_callers_limits_bound_one_request(make_client: Any) -> None:
    callers = Callers((CallerPolicy(DEFAULT_CALLER, max_queued=3, max_concurrency=1),))
    client, _, engine = await make_client(engine=embedder(), callers=callers, warmup=False)
    err = await error(await client.post(EMB, json={"input": list("abcde")}), 413)
    assert "at most 4" in err["message"] and engine.pooled == []
    resp = await client.post(EMB, json={"input": list("abcd")})
    assert resp.status == 200, await resp.text()


async def test_a_client_that_leaves_stops_its_engine_requests(make_client: Any) -> None:
    gate = asyncio.Event()
    client, app, engine = await make_client(engine=embedder(first_output=gate), warmup=False)
    task = asyncio.create_task(
        client.post(EMB, json={"input": ["a", "b", "c"]}, headers={"x-request-id": "gone"})
    )
    await until(lambda: len(engine.held) == 3, what="three inputs in the engine")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: len(engine.aborted) == 3, what="three aborts")
    assert all(r.startswith("gone") for r in engine.aborted)
    await until(app[MODELS].default.driver.idle.is_set, what="driver idle")
    assert app[MODELS].default.driver.core.pending_requests == 0


async def test_rerank_on_an_embedding_model_scores_by_cosine(make_client: Any) -> None:
    client, _, engine = await make_client(engine=embedder(), warmup=False)
    docs = ["one", "two", "three", "four"]
    for path in ("/v1/rerank", "/rerank"):
        resp = await client.post(path, json={"query": "q", "documents": docs, "top_n": 3})
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        q = engine.vector(ids("q")).astype(np.float64)
        want = {i: float(np.dot(q, engine.vector(ids(d)))) for i, d in enumerate(docs)}
        order = sorted(want, key=lambda i: want[i], reverse=True)[:3]
        assert [r["index"] for r in body["results"]] == order
        for r in body["results"]:
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-6)
            assert r["document"]["text"] == docs[r["index"]]
        assert body["usage"]["prompt_tokens"] == len("q") + sum(map(len, docs))


async def test_rerank_on_a_cross_encoder_scores_each_pair(make_client: Any) -> None:
    client, _, engine = await make_client(engine=FakeEngine(kind="rerank"), warmup=False)
    resp = await client.post("/v1/rerank", json={"query": "q", "documents": ["a", {"text": "b"}]})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert [p[2].task for p in engine.pooled] == ["classify", "classify"]
    want = [1.0 / (1.0 + sum(ids("q" + d)) % 97) for d in "ab"]
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert got == pytest.approx(dict(enumerate(want)))
    await error(await client.post(EMB, json={"input": "x"}), 400)  # not an embedder


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"documents": ["d"]}, "query"),
        ({"query": "q"}, "documents"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": [1]}, "documents[0]"),
        ({"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ],
)
async def test_bad_rerank_is_a_400_naming_the_field(
    make_client: Any, body: dict[str, Any], param: str
) -> None:
    client, _, _ = await make_client(engine=embedder(), warmup=False)
    err = await error(await client.post("/v1/rerank", json=body), 400)
    assert err["param"] == param


async def test_drain_finishes_pooling_in_flight(make_client: Any) -> None:
    gate = asyncio.Event()
    client, app, engine = await make_client(engine=embedder(first_output=gate), warmup=False)
    task = asyncio.create_task(client.post(EMB, json={"input": ["a", "b"]}))
    await until(lambda: len(engine.held) == 2, what="in the engine")
    app[RUNTIME].phase = Phase.DRAINING
    await error(await client.post(EMB, json={"input": "late"}), 503)
    gate.set()
    resp = await task
    assert resp.status == 200 and len((await resp.json())["data"]) == 2
