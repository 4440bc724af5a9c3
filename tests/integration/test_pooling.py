"""Embeddings and rerank on the real engine (issue 30): the demo model served by
vLLM's pooling runner (`--runner pooling --convert embed`) beside the demo chat
model, from one models file, one Sluice for the module; real clients nobody
here wrote (the `openai` client, for both models through one base URL,
LangChain's `OpenAIEmbeddings`, plain HTTP for rerank), and vLLM's own server
with the same engine flags as the reference for the vectors and scores.

The demo model's weights are random, so what is tested is what a pooling front
must keep: the vectors are the engine's (equal to vLLM's server's within float
tolerance, equal between float and base64, between a text and its token ids,
between clients), a rerank's scores are the cosine similarities of those
vectors, in order; bad input is a 400 (or 413) in OpenAI's error shape.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from langchain_openai import OpenAIEmbeddings

from tests.support import SluiceProcess, vllm_on_demo

# An engine start takes minutes on a loaded machine; two start here.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MODEL = "sluice-demo-embed"  # the demo model under the pooling runner (server/cli.py demo_name)
POOLING = ["--runner", "pooling", "--convert", "embed"]
CHAT = "chat"  # the demo chat model beside it
# The embedding model first: a request that names no model (vLLM's rerank shape
# allows it) goes to the first. Its engine flags are `sluice serve`'s demo
# defaults, eager, as vLLM's server gets them (tests/support.py vllm_on_demo); the
# chat model is small and eager too (no torch.compile: a start in about 12 s).
MODELS = f"""
[models.{MODEL}]
runner = "pooling"
convert = "embed"
enforce-eager = true

[models.{CHAT}]
kv-cache-memory-bytes = 67108864
max-model-len = 4096
enforce-eager = true
"""
TEXTS = ["The quick brown fox", "jumps over the lazy dog", "a", "Sluice serves embeddings."]
QUERY = "a fox in the woods"
DOCS = ["The quick brown fox", "stock prices fell sharply", "a red fox", "rain again today"]
# bf16 weights, float32 pooling: two servers may batch the same input with
# different neighbours, which moves the last bits of a bf16 matmul.
ATOL = 2e-3


@pytest.fixture(scope="module")
def server(demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("pooling")
    (tmp / "models.toml").write_text(MODELS)
    with SluiceProcess(
        ["--log-format", "plain", "--models", str(tmp / "models.toml")],
        cache_dir=demo_cache_root,
        log_path=tmp / "sluice.log",
    ).running() as proc:
        yield proc.base


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def vectors(client: openai.OpenAI, inputs: Any, **kw: Any) -> np.ndarray:
    """The vectors as a client reads them: with no `encoding_format` the `openai`
    client asks for base64 and decodes it; asked for base64 explicitly, it hands
    over the strings, which a caller decodes as OpenAI documents (little-endian
    float32)."""
    resp = client.embeddings.create(model=MODEL, input=inputs, **kw)
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    rows: list[Any] = [
        np.frombuffer(base64.b64decode(e), dtype="<f4") if isinstance(e, str) else e
        for e in (d.embedding for d in resp.data)
    ]
    if kw.get("encoding_format") == "base64":
        assert all(isinstance(d.embedding, str) for d in resp.data)
    return np.array(rows, dtype=np.float32)


def test_openai_client_float_and_base64(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    f = np.array([d.embedding for d in floats.data], dtype=np.float32)
    assert f.shape == (len(TEXTS), 256)  # the demo model's hidden size
    # The embed pooler normalizes: unit vectors.
    assert np.allclose(np.linalg.norm(f, axis=1), 1.0, atol=1e-3)
    # The client's default asks for base64 and decodes it itself.
    b = vectors(client, TEXTS)
    explicit = vectors(client, TEXTS, encoding_format="base64")
    assert np.array_equal(b, explicit)
    assert np.allclose(f, b, atol=ATOL)
    # Different texts, different vectors.
    assert not np.allclose(f[0], f[1], atol=0.05)


def test_an_embeddings_batch(client: openai.OpenAI) -> None:
    """Issue 42: an embeddings batch through /v1/files and /v1/batches (its
    chat batches are tests/integration/test_batches.py's): each line's vectors
    are the endpoint's own, as a direct request gets them."""
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": MODEL, "input": text, "encoding_format": "float"},
        }
        for i, text in enumerate(TEXTS)
    ]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    upload = client.files.create(file=("embed.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in (
        "completed",
        "failed",
        "expired",
        "cancelled",
    ):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts is not None
    assert batch.request_counts.completed == len(TEXTS) and batch.output_file_id is not None
    out = {
        x["custom_id"]: x["response"]
        for x in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())
    }
    assert sorted(out) == sorted(f"e{i}" for i in range(len(TEXTS)))
    direct = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    got = out["e1"]["body"]
    assert out["e1"]["status_code"] == 200 and got["object"] == "list"
    assert np.allclose(got["data"][0]["embedding"], direct.data[0].embedding, atol=ATOL)


def test_a_text_and_its_token_ids_embed_the_same(client: openai.OpenAI, server: str) -> None:
    ids = httpx.post(server + "/tokenize", json={"model": MODEL, "prompt": TEXTS[0]}).json()
    tokens = ids["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    by_text = vectors(client, TEXTS[0])
    by_ids = vectors(client, [tokens])
    one_list = vectors(client, tokens)  # one token array, not a list of them
    assert np.allclose(by_text, by_ids, atol=ATOL) and np.allclose(by_ids, one_list, atol=ATOL)


def test_langchain_openai_embeddings(client: openai.OpenAI, server: str) -> None:
    # check_embedding_ctx_length=False: send the texts (its default tokenizes
    # them with tiktoken's OpenAI vocabulary, which is not this model's and
    # needs a download).
    with httpx.Client(timeout=60) as http:
        lc = OpenAIEmbeddings(
            model=MODEL,
            base_url=server + "/v1",
            api_key="unused",  # type: ignore[arg-type]
            check_embedding_ctx_length=False,
            max_retries=0,
            http_client=http,
        )
        docs = np.array(lc.embed_documents(TEXTS), dtype=np.float32)
        query = np.array(lc.embed_query(QUERY), dtype=np.float32)
    assert np.allclose(docs, vectors(client, TEXTS), atol=ATOL)
    assert np.allclose(query, vectors(client, QUERY)[0], atol=ATOL)


def test_ollamas_clients_embed_the_same(client: openai.OpenAI, server: str) -> None:
    """Ollama's API on the same model (issue 31): the `ollama` client's embed,
    LangChain's OllamaEmbeddings and the older /api/embeddings give the
    vectors /v1/embeddings gives."""
    import ollama
    from langchain_ollama import OllamaEmbeddings

    ours = vectors(client, TEXTS)
    oc = ollama.Client(host=server)
    try:
        r = oc.embed(model=MODEL, input=TEXTS)
        assert np.allclose(np.array(r.embeddings, dtype=np.float32), ours, atol=ATOL)
        assert r.prompt_eval_count and r.prompt_eval_count >= len(TEXTS)
        legacy = oc.embeddings(model=MODEL, prompt=TEXTS[0])
        assert np.allclose(np.array(legacy.embedding, dtype=np.float32), ours[0], atol=ATOL)
    finally:
        oc._client.close()
    lc = OllamaEmbeddings(model=MODEL, base_url=server)
    try:
        docs = np.array(lc.embed_documents(TEXTS), dtype=np.float32)
    finally:
        lc._client._client.close()  # the ollama.Client it keeps and never closes
    assert np.allclose(docs, ours, atol=ATOL)


def test_the_pages_examples_run(server: str) -> None:
    """docs/pooling.md's Python and curl examples, on this module's server (its
    model is the page's; tests/integration/test_docs_examples.py runs the other
    pages' on the shared chat server)."""
    from tests.docpages import ROOT
    from tests.integration.test_docs_examples import check_curl, curl_blocks, run_python

    page = ROOT / "docs/pooling.md"
    run_python(page, server)
    curls = curl_blocks(on=(page,))
    assert len(curls) >= 2  # embeddings and rerank
    for block in curls:
        check_curl(block, server)


def _cosines(query: np.ndarray, docs: np.ndarray) -> np.ndarray:
    q = query.astype(np.float64)
    d = docs.astype(np.float64)
    return np.asarray((d @ q) / (np.linalg.norm(d, axis=1) * np.linalg.norm(q)))


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_over_plain_http(client: openai.OpenAI, server: str, path: str) -> None:
    resp = httpx.post(
        server + path, json={"model": MODEL, "query": QUERY, "documents": DOCS}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCS)))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in results)
    assert body["usage"]["prompt_tokens"] > len(DOCS)
    # A bi-encoder's score: the cosine of the query's and the document's vectors.
    want = _cosines(vectors(client, QUERY)[0], vectors(client, DOCS))
    got = np.array([s for _, s in sorted((r["index"], r["relevance_score"]) for r in results)])
    assert np.allclose(got, want, atol=ATOL)
    # top_n and return_documents.
    top = httpx.post(
        server + path,
        json={"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False},
        timeout=60,
    ).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in results[:2]]
    assert all("document" not in r for r in top)


def test_chat_to_the_embedding_model_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 400
    message = str(err.value)
    assert MODEL in message and "embedding model" in message


def test_the_same_client_chats_with_the_other_model(client: openai.OpenAI) -> None:
    """One base URL, two models: the chat model answers a chat turn, and
    embeddings asked of it are the 400 naming it; both are listed."""
    reply = client.chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.model == CHAT and reply.usage is not None
    assert reply.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=CHAT, input="hi")
    assert CHAT in str(err.value) and "generative model" in str(err.value)
    assert {m.id for m in client.models.list()} >= {MODEL, CHAT}


def test_bad_input(client: openai.OpenAI, server: str) -> None:
    def refused(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        resp = httpx.post(server + "/v1/embeddings", json={"model": MODEL, **body}, timeout=120)
        return resp.status_code, resp.json()["error"]

    assert refused({"input": []})[0] == 400
    status, error = refused({"input": [1.5]})
    assert status == 400 and error["param"] == "input[0]"
    status, error = refused({"input": 42})
    assert status == 400 and error["param"] == "input"
    # The demo model is not a Matryoshka model: dimensions is refused, named.
    status, error = refused({"input": "x", "dimensions": 8})
    assert status == 400 and error["param"] == "dimensions"
    # Past the context (40,960 tokens): a 400, never cut short silently...
    long_ids = [7] * 41_000
    status, error = refused({"input": [long_ids]})
    assert status == 400 and "maximum context length" in error["message"]
    # ... unless the client asks for it.
    cut = client.embeddings.create(
        model=MODEL, input=[long_ids], extra_body={"truncate_prompt_tokens": 100}
    )
    assert cut.usage.prompt_tokens == 100
    # 10,000 inputs: more than the server admits at once (--max-pending-requests).
    status, error = refused({"input": ["x"] * 10_000})
    assert status == 413 and error["code"] == "too_many_inputs"


@pytest.fixture(scope="module")
def vllm_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with vllm_on_demo(demo_model_dir, MODEL, POOLING, tmp_path_factory.mktemp("vllm")) as url:
        yield url


def test_the_same_vectors_and_scores_as_vllms_own_server(
    client: openai.OpenAI, vllm_server: str
) -> None:
    with openai.OpenAI(base_url=vllm_server + "/v1", api_key="unused", max_retries=0) as theirs:
        _same_as_vllms(client, theirs, vllm_server)


def _same_as_vllms(client: openai.OpenAI, theirs: openai.OpenAI, vllm_server: str) -> None:
    # (vLLM's server, as OpenAI's API, takes texts or token arrays, not a mix.)
    for inputs in (TEXTS, [[11, 12, 13, 14], [9] * 300]):
        for fmt in ("float", "base64"):
            ours = vectors(client, inputs, encoding_format=fmt)
            want = vectors(theirs, inputs, encoding_format=fmt)
            assert ours.shape == want.shape
            assert np.allclose(ours, want, atol=ATOL), np.abs(ours - want).max()
    body = {"model": MODEL, "query": QUERY, "documents": DOCS}
    ours_r = httpx.post(f"{client.base_url}rerank", json=body, timeout=60).json()
    want_r = httpx.post(vllm_server + "/v1/rerank", json=body, timeout=60).json()
    assert [r["index"] for r in ours_r["results"]] == [r["index"] for r in want_r["results"]]
    assert np.allclose(
        [r["relevance_score"] for r in ours_r["results"]],
        [r["relevance_score"] for r in want_r["results"]],
        atol=ATOL,
    )
    assert ours_r["usage"]["prompt_tokens"] == want_r["usage"]["prompt_tokens"]
