"""The pooling endpoints: what differs between /v1/embeddings and /v1/rerank.

Why this module exists: the pooling pipeline (server/http/pipeline.py
`pooling_endpoint`) runs every pooling request the same way; an endpoint only
says how its body becomes engine inputs (parse, the model check, the pooling
parameters, tokenization through the engine, each a 400 naming the field) and
how the outputs become its body.

Reranking depends on what the model is, as in vLLM's server: on a
cross-encoder (kind "rerank": vLLM's classify task with one label, such as a
Qwen3-Reranker) each document is one engine input, its pair prompt with the
query, and its score is the model's output; on an embedding model (kind
"embed") the query and each document are embedded, and a document's score is
the cosine similarity of the two vectors (a bi-encoder; the query is one
engine input for all documents).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from aiohttp import web

from server.api.openai_chat.endpoint import read_body
from server.api.pooling.output import cosine, embeddings_body, rerank_body, score
from server.api.pooling.parse import parse_embeddings, parse_rerank
from server.engines.interface import Pooled
from server.http.models import use_model
from server.http.pipeline import PoolJob, Trace
from server.state import METRICS, MODELS

__all__ = ["embed_job", "prepare_embeddings", "prepare_rerank"]

Body = Callable[[Sequence[Pooled]], bytes]


async def embed_job(
    request: web.Request,
    model: str,
    inputs: Sequence[str | Sequence[int]],
    *,
    dimensions: int | None = None,
    use_activation: bool | None = None,
    add_special_tokens: bool = True,
    truncate_prompt_tokens: int | None = None,
    truncation_side: Literal["left", "right"] | None = None,
    priority: int = 0,
    user: str | None = None,
) -> PoolJob:
    """An embedding request's pooling job, whichever API it came in by (this one,
    Ollama's /api/embed and /api/embeddings): the model checked (it must embed),
    each input tokenized by its engine (a 400 naming the field), one engine request
    per input."""
    entry, adapter = await use_model(request, model, serves="embed")
    engine = entry.engine
    params = engine.pooling_params("embed", dimensions, use_activation)
    ids = await engine.tokenize_pooling(
        inputs,
        add_special_tokens=add_special_tokens,
        truncate_prompt_tokens=truncate_prompt_tokens,
        truncation_side=truncation_side,
    )
    return PoolJob(
        model=model,
        entry=entry,
        inputs=tuple(map(tuple, ids)),
        params=(params,) * len(ids),
        variant=("embed", dimensions, use_activation),
        adapter=adapter,
        priority=priority,
        user=user,
    )


async def prepare_embeddings(request: web.Request, tr: Trace) -> tuple[PoolJob, Body]:
    req = parse_embeddings(await read_body(request))
    request.app[METRICS].ignored.record("embeddings", req.ignored)
    model = req.model or request.app[MODELS].default.name
    job = await embed_job(
        request,
        model,
        req.inputs,
        dimensions=req.dimensions,
        use_activation=req.use_activation,
        add_special_tokens=req.add_special_tokens,
        truncate_prompt_tokens=req.truncation.tokens,
        truncation_side=req.truncation.side,
        priority=req.priority,
        user=req.user,
    )
    created = int(time.time())

    def body(outs: Sequence[Pooled]) -> bytes:
        return embeddings_body(
            request_id=tr.rid,
            created=created,
            model=model,
            vectors=[o.data for o in outs],
            encoding_format=req.encoding_format,
            prompt_tokens=tr.prompt_tokens,
        )

    return job, body


async def prepare_rerank(request: web.Request, tr: Trace) -> tuple[PoolJob, Body]:
    req = parse_rerank(await read_body(request))
    request.app[METRICS].ignored.record("rerank", req.ignored)
    model = req.model or request.app[MODELS].default.name
    entry, adapter = await use_model(request, model, serves="rerank")
    engine = entry.engine
    cut = req.truncation
    if engine.info.kind == "rerank":
        params = engine.pooling_params("classify", None, req.use_activation)
        pairs = await engine.tokenize_pairs(
            req.query,
            req.documents,
            params,
            truncate_prompt_tokens=cut.tokens,
            truncation_side=cut.side,
        )
        inputs = tuple(tuple(ids) for ids, _ in pairs)
        per_input = tuple(p for _, p in pairs)
        variant: tuple[object, ...] = ("classify", req.use_activation)

        def scores(outs: Sequence[Pooled]) -> list[float]:
            return [score(o.data) for o in outs]

    else:
        params = engine.pooling_params("embed", None, req.use_activation)
        query_ids, doc_ids = [
            await engine.tokenize_pooling(
                texts, truncate_prompt_tokens=cut.tokens, truncation_side=cut.side, param=param
            )
            for texts, param in (((req.query,), "query"), (req.documents, "documents"))
        ]
        inputs = tuple(map(tuple, (*query_ids, *doc_ids)))
        per_input = (params,) * len(inputs)
        variant = ("embed", None, req.use_activation)

        def scores(outs: Sequence[Pooled]) -> list[float]:
            query: np.ndarray = outs[0].data
            return [cosine(query, o.data) for o in outs[1:]]

    job = PoolJob(
        model=model,
        entry=entry,
        inputs=inputs,
        params=per_input,
        variant=variant,
        param="documents",
        adapter=adapter,
        priority=req.priority,
        user=req.user,
    )

    def body(outs: Sequence[Pooled]) -> bytes:
        return rerank_body(
            request_id=tr.rid,
            model=model,
            documents=req.documents,
            scores=scores(outs),
            top_n=req.top_n,
            return_documents=req.return_documents,
            prompt_tokens=tr.prompt_tokens,
        )

    return job, body
