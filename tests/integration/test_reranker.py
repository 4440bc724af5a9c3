"""A cross-encoder on the real engine (issue 30): the demo's reranker sibling
(`sluice serve --convert classify`: the demo backbone with a one-label head,
server/engines/demo/model.py) under vLLM's pooling runner, one Sluice for the
module, driven over plain HTTP in vLLM's rerank shape, with vLLM's own server
on the same checkpoint and flags as the reference for the scores.

The head is random, so what is tested is what the front must keep: every
document scored once as its pair with the query, as vLLM's score server builds
it, the results in vLLM's order and shape, the same scores as vLLM's server.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from server.engines.demo.model import build_demo_model, default_demo_dir
from tests.support import SluiceProcess, vllm_on_demo

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MODEL = "sluice-demo-reranker"  # server/cli.py demo_name
FLAGS = ["--convert", "classify"]
QUERY = "a small cat"
DOCS = ["a kitten", "stock prices fell", "the cat sat on the mat", "rain", "cats and dogs"]
ATOL = 2e-3  # bf16 weights: two servers' batches may differ in the last bits


@pytest.fixture(scope="module")
def server(demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("reranker") / "sluice.log"
    with SluiceProcess(
        ["--log-format", "plain", *FLAGS], cache_dir=demo_cache_root, log_path=log
    ).running() as proc:
        yield proc.base


def rerank(base: str, path: str = "/v1/rerank", **body: Any) -> dict[str, Any]:
    resp = httpx.post(base + path, json={"model": MODEL, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_in_vllms_shape(server: str, path: str) -> None:
    body = rerank(server, path, query=QUERY, documents=DOCS)
    results = body["results"]
    assert body["model"] == MODEL and body["id"].startswith("score-")
    assert sorted(r["index"] for r in results) == list(range(len(DOCS)))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    # A one-label cross-encoder's score goes through a sigmoid: in (0, 1).
    assert all(0.0 < s < 1.0 for s in scores)
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in results)
    # One pair prompt per document: each holds the query's tokens and its own.
    assert body["usage"]["prompt_tokens"] > len(DOCS) * 2
    # A document's score does not depend on its neighbours.
    alone = rerank(server, path, query=QUERY, documents=[DOCS[2]])["results"][0]
    (same,) = [r for r in results if r["index"] == 2]
    assert alone["relevance_score"] == pytest.approx(same["relevance_score"], abs=ATOL)


def test_top_n_objects_and_no_documents(server: str) -> None:
    full = rerank(server, query=QUERY, documents=DOCS)["results"]
    top = rerank(
        server,
        query=QUERY,
        documents=[{"text": d} for d in DOCS],
        top_n=2,
        return_documents=False,
    )["results"]
    assert [r["index"] for r in top] == [r["index"] for r in full[:2]]
    assert all("document" not in r for r in top)


def test_what_a_reranker_does_not_serve_is_a_400_naming_it(server: str) -> None:
    with (
        openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0) as client,
        pytest.raises(openai.BadRequestError) as err,
    ):
        client.embeddings.create(model=MODEL, input="x")
    assert MODEL in str(err.value) and "reranker" in str(err.value)
    resp = httpx.post(server + "/v1/rerank", json={"query": QUERY, "documents": []})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "documents"


@pytest.fixture(scope="module")
def vllm_server(demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # The directory `sluice serve --convert classify` built under the same cache root.
    model_dir = build_demo_model(default_demo_dir(demo_cache_root, reranker=True), reranker=True)
    with vllm_on_demo(model_dir, MODEL, FLAGS, tmp_path_factory.mktemp("vllm")) as url:
        yield url


def test_the_same_scores_as_vllms_own_server(server: str, vllm_server: str) -> None:
    # (vLLM 0.32's server takes documents as strings only; Sluice also takes
    # Jina's and Cohere's `{"text": ...}` objects, test_top_n_objects_and_no_documents.)
    for docs in (DOCS, DOCS[1:3]):
        ours = rerank(server, query=QUERY, documents=docs)
        want = rerank(vllm_server, query=QUERY, documents=docs)
        assert [r["index"] for r in ours["results"]] == [r["index"] for r in want["results"]]
        assert np.allclose(
            [r["relevance_score"] for r in ours["results"]],
            [r["relevance_score"] for r in want["results"]],
            atol=ATOL,
        )
        assert ours["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
