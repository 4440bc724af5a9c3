"""Response bodies of the pooling APIs: embeddings lists and rerank results.

Why this module exists: vectors and scores in, the bytes vLLM's server sends
out (0.32, vllm/entrypoints/pooling/embed/serving.py and
scoring/serving.py), so a client written against `vllm serve` reads Sluice
unchanged:

* /v1/embeddings: OpenAI's `list` of `embedding` objects in input order,
  each a JSON array of float32 values (what orjson writes for vLLM's NumPy
  path) or, with `encoding_format: base64`, the little-endian float32 bytes
  in base64 (what OpenAI's client decodes with `np.frombuffer(..., float32)`),
  with `usage` counting the input tokens.
* /v1/rerank: `results` sorted by `relevance_score`, highest first (ties
  keep document order), cut to `top_n` when that is set and smaller, each with
  the document's `index` and its `document` (unless `return_documents` is
  false), and `usage`. A bi-encoder's score is the cosine similarity of the
  query's and the document's embeddings, as vLLM's BiEncoderIOProcessor
  computes it; a cross-encoder's is its one output.

Pure code: no aiohttp, no vLLM, no I/O (NumPy for the vectors).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from server.api.pooling.parse import EncodingFormat

__all__ = ["cosine", "embeddings_body", "rerank_body", "score"]

_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def _usage(prompt_tokens: int) -> dict[str, Any]:
    # vLLM's UsageInfo as it dumps it.
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def _base64(vector: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode()


def embeddings_body(
    *,
    request_id: str,
    created: int,
    model: str,
    vectors: Sequence[np.ndarray],
    encoding_format: EncodingFormat,
    prompt_tokens: int,
) -> bytes:
    encode = _base64 if encoding_format == "base64" else np.ascontiguousarray
    body = {
        "id": f"embd-{request_id}",
        "object": "list",
        "created": created,
        "model": model,
        "data": [
            {"index": i, "object": "embedding", "embedding": encode(v)}
            for i, v in enumerate(vectors)
        ],
        "usage": _usage(prompt_tokens),
    }
    return orjson.dumps(body, option=_NUMPY)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity (torch's cosine_similarity: the norms' product floored at 1e-8)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    den = max(float(np.linalg.norm(a64) * np.linalg.norm(b64)), 1e-8)
    return float(np.dot(a64, b64) / den)


def score(data: np.ndarray) -> float:
    """A cross-encoder's relevance: its one output (vLLM's ScoringOutput)."""
    if data.size != 1:
        raise ValueError(f"a cross-encoder's output has one value, got {data.size}")
    return float(data.reshape(-1)[0])


def rerank_body(
    *,
    request_id: str,
    model: str,
    documents: Sequence[str],
    scores: Sequence[float],
    top_n: int,
    return_documents: bool,
    prompt_tokens: int,
) -> bytes:
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if 0 < top_n < len(order):
        order = order[:top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i}
        if return_documents:
            result["document"] = {"text": documents[i], "multi_modal": None}
        result["relevance_score"] = scores[i]
        results.append(result)
    body = {
        "id": f"score-{request_id}",
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        "results": results,
    }
    return orjson.dumps(body)
