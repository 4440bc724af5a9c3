"""The HTTP surface: which path runs what.

Why this module exists: one table of routes. The generation endpoints are
the pipeline (server/http/pipeline.py) with their endpoint's preparation
(server/api/openai_chat/endpoint.py and the other APIs'), the pooling ones
its pooling twin (server/api/pooling/endpoint.py); the rest (models, probes, metrics, tokenizer) are
small enough to live here. Authentication and error bodies are middleware
(server/http/middleware.py), so no handler checks a key, formats an error or
assigns a request id (`request[REQUEST_ID]`, set for every route).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from server.api.anthropic_messages.endpoint import count_tokens, prepare_messages
from server.api.openai_chat.endpoint import check_model, prepare_chat, prepare_completion, read_body
from server.api.openai_chat.output import models_body
from server.api.openai_chat.parse import parse_chat
from server.api.openai_responses.endpoint import delete_response, get_response, prepare_responses
from server.api.pooling.endpoint import prepare_embeddings, prepare_rerank
from server.errors import SluiceError
from server.http.pipeline import (
    check_accepting,
    generation_endpoint,
    json_response,
    pooling_endpoint,
)
from server.operations.metrics import CONTENT_TYPE
from server.state import ADAPTERS, CALLER, CALLERS, ENGINE, METRICS, RUNTIME, SETTINGS, Phase
from server.wire.fields import load_object

__all__ = ["add_routes"]


async def models(request: web.Request) -> web.Response:
    info = request.app[ENGINE].info
    # The caller's own list: the adapters it may use (server/engines/lora.py rule 4).
    access = request.app[CALLERS].access(request.get(CALLER))
    body = models_body(
        [request.app[SETTINGS].model_name],
        created=info.created,
        max_model_len=info.max_model_len or None,
        adapters=[(a.name, a.path, a.parent) for a in request.app[ADAPTERS].visible(access)],
    )
    return json_response(body)


async def health(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    if rt.phase is Phase.DEAD or request.app[ENGINE].errored:
        raise SluiceError(
            f"engine dead: {rt.engine_error or 'errored'}",
            status=503,
            retry_after=5,
            code="engine_dead",
        )
    return json_response(orjson.dumps({"status": "ok", "phase": rt.phase.value}))


async def hello(request: web.Request) -> web.Response:
    """Claude Code's preconnect: it sends ``HEAD /api/hello`` to its
    ANTHROPIC_BASE_URL as it starts (and periodically) to open a connection,
    and reads nothing back; answered, not a 404 in every session's log."""
    return json_response(b"{}")


async def ready(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    if not rt.ready:
        why = rt.phase.value if rt.phase is not Phase.READY else rt.admission.name.lower()
        raise SluiceError(f"not ready: {why}", status=503, retry_after=5, code="not_ready")
    return json_response(orjson.dumps({"status": "ready"}))


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM-compatible /tokenize: {"prompt"} or {"messages"}; "model" is optional."""
    check_accepting(request)
    obj = load_object(await read_body(request))
    model = obj.get("model") or request.app[SETTINGS].model_name
    if not isinstance(model, str):
        raise SluiceError("'model' must be a string", param="model")
    check_model(request, model, serves=None)  # every model has a tokenizer
    engine = request.app[ENGINE]
    if "messages" in obj:
        req = parse_chat(orjson.dumps({**obj, "model": model}), request.app[RUNTIME].limits)
        ids = (await engine.tokenize_chat([(req.messages, req.template_kwargs())]))[0]
    else:
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise SluiceError("'prompt' must be a string", param="prompt")
        ids = (await engine.tokenize_prompts([prompt]))[0]
    body = orjson.dumps(
        {"count": len(ids), "max_model_len": engine.info.max_model_len, "tokens": ids}
    )
    return json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    check_accepting(request)
    obj = load_object(await read_body(request))
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise SluiceError("'tokens' must be a list of token ids", param="tokens")
    body = orjson.dumps({"prompt": request.app[ENGINE].detokenize(tokens)})
    return json_response(body)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", generation_endpoint("chat", prepare_chat))
    app.router.add_post("/v1/completions", generation_endpoint("completions", prepare_completion))
    # OpenAI Responses (server/api/openai_responses/endpoint.py).
    app.router.add_post("/v1/responses", generation_endpoint("responses", prepare_responses))
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    # Anthropic Messages (server/api/anthropic_messages/endpoint.py).
    app.router.add_post("/v1/messages", generation_endpoint("messages", prepare_messages))
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    # Pooling models (server/api/pooling/endpoint.py): OpenAI's embeddings, and
    # rerank at every path vLLM's server gives it.
    app.router.add_post("/v1/embeddings", pooling_endpoint("embeddings", prepare_embeddings))
    rerank = pooling_endpoint("rerank", prepare_rerank)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/api/hello", hello)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
