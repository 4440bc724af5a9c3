"""The HTTP surface: which path runs what.

Why this module exists: one table of routes, at the top of the house beside
the app (server/app.py): it imports every API (server/api/) and the shell they
all use (server/http/), so neither of those imports the other upward. The generation endpoints are
the pipeline (server/http/pipeline.py) with their API's preparation
(server/api/*/endpoint.py), the pooling ones its pooling twin
(server/api/pooling/endpoint.py); the rest (models, probes, metrics, tokenizer,
and `/`, which serves the status page to a browser and Ollama's probe to its
clients) are small enough to live here. Authentication and error bodies are middleware
(server/http/middleware.py), so no handler checks a key, formats an error or
assigns a request id (`request[REQUEST_ID]`, set for every route).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from server.api.anthropic_batches import endpoint as message_batches
from server.api.anthropic_messages.endpoint import count_tokens, prepare_messages
from server.api.ollama import endpoint as ollama
from server.api.ollama.output import PROBE
from server.api.ollama.parse import ollama_probe
from server.api.openai_batches import endpoint as batches
from server.api.openai_chat.endpoint import prepare_chat, prepare_completion, read_body
from server.api.openai_chat.output import models_body
from server.api.openai_chat.parse import parse_chat
from server.api.openai_responses.endpoint import delete_response, get_response, post_responses
from server.api.pooling.endpoint import prepare_embeddings, prepare_rerank
from server.engines.registry import ModelEntry
from server.engines.registry import State as ModelState
from server.errors import SluiceError
from server.http.models import hold_model, use_model
from server.http.pipeline import (
    check_accepting,
    generation_endpoint,
    json_response,
    pooling_endpoint,
)
from server.http.status_page import index
from server.operations.metrics import CONTENT_TYPE
from server.state import CALLER, CALLERS, METRICS, MODELS, RUNTIME, SETTINGS, Phase
from server.wire.fields import load_object

__all__ = ["add_routes"]


async def models(request: web.Request) -> web.Response:
    """The caller's own list (server/engines/registry.py rule 2, lora.py rule 4):
    the models it may use, loaded or not (with --models each card says its
    state), then their adapters it may use."""
    registry = request.app[MODELS]
    access = request.app[CALLERS].access(request.get(CALLER))
    visible = registry.visible(access)
    adapters = [(a.name, a.path, a.parent) for e in visible for a in e.adapters.visible(access)]
    if not request.app[SETTINGS].several:
        info = registry.default.engine.info
        body = models_body(
            [registry.default.name],
            created=info.created,
            max_model_len=info.max_model_len or None,
            adapters=adapters,
        )
        return json_response(body)
    body = models_body(
        [e.name for e in visible],
        created=registry.default.engine.info.created,
        adapters=adapters,
        cards={e.name: _card(e) for e in visible},
    )
    return json_response(body)


def _card(entry: ModelEntry) -> dict[str, object]:
    """A model's own fields on its /v1/models card, with several models."""
    info = entry.engine.info
    card: dict[str, object] = {
        "created": info.created,
        "state": entry.state.value,
        "kind": entry.spec.kind,
        "load": entry.spec.load.value,
    }
    if max_len := info.max_model_len or entry.spec.max_model_len:
        card["max_model_len"] = max_len
    return card


async def health(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    if rt.phase is Phase.DEAD or any(  # one model's death is its own (engines/supervisor.py)
        e.spec.essential and e.state is ModelState.LOADED and e.engine.errored
        for e in request.app[MODELS]
    ):
        raise SluiceError(
            f"engine dead: {rt.engine_error or 'errored'}",
            status=503,
            retry_after=5,
            code="engine_dead",
        )
    return json_response(orjson.dumps({"status": "ok", "phase": rt.phase.value}))


async def root(request: web.Request) -> web.StreamResponse:
    """`/` (GET and HEAD): Ollama's probe, "Ollama is running", for its
    clients (by User-Agent, or an Accept without HTML: server/api/ollama/parse.py
    `ollama_probe`); the status page for a browser and anything else."""
    if ollama_probe(request.headers.get("Accept", ""), request.headers.get("User-Agent", "")):
        return web.Response(text=PROBE)
    return await index(request)


async def hello(request: web.Request) -> web.Response:
    """Claude Code's preconnect: it sends ``HEAD /api/hello`` to its
    ANTHROPIC_BASE_URL as it starts (and periodically) to open a connection,
    and reads nothing back; answered, not a 404 in every session's log."""
    return json_response(b"{}")


async def ready(request: web.Request) -> web.Response:
    """200 while serving and every essential model (the one --model) is
    loaded; the body, and a 503's message, give each model's state."""
    rt = request.app[RUNTIME]
    registry = request.app[MODELS]
    states = {e.name: e.state.value for e in registry}
    down = [e.name for e in registry if e.spec.essential and e.state is not ModelState.LOADED]
    if not rt.ready or down:
        why = rt.phase.value if rt.phase is not Phase.READY else rt.admission.name.lower()
        if rt.ready:
            why = states[down[0]]
        shown = ", ".join(f"{name}: {state}" for name, state in states.items())
        raise SluiceError(
            f"not ready: {why} ({shown})", status=503, retry_after=5, code="not_ready"
        )
    return json_response(orjson.dumps({"status": "ready", "models": states}))


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM-compatible /tokenize: {"prompt"} or {"messages"}; "model" is optional
    (the first served model's tokenizer)."""
    check_accepting(request)
    obj = load_object(await read_body(request))
    model = _model_field(request, obj)
    entry, _ = await use_model(request, model, serves=None)
    engine = entry.engine
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
    """vLLM-compatible /detokenize: {"tokens"}; "model" is optional, as in /tokenize."""
    check_accepting(request)
    obj = load_object(await read_body(request))
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise SluiceError("'tokens' must be a list of token ids", param="tokens")
    if "model" in obj:
        entry, _ = await use_model(request, _model_field(request, obj), serves=None)
    else:  # as before: the served model's tokenizer, whoever asks
        entry = request.app[MODELS].default
        await hold_model(request, entry)
    body = orjson.dumps({"prompt": entry.engine.detokenize(tokens)})
    return json_response(body)


async def tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's /tokenizer_info (behind its --enable-tokenizer-info-endpoint):
    the tokenizer's configuration, special tokens and chat template. Served
    by default here: lm-eval's `auto` tokenizer backend probes it with
    /tokenize, and a template is no secret of a server whose /api/show
    (Ollama's) gives it too. `?model=` picks a model, the first by default."""
    check_accepting(request)
    model = request.query.get("model") or request.app[MODELS].default.name
    entry, _ = await use_model(request, model, serves=None)
    # Its added tokens are keyed by id: JSON names them as strings, as vLLM's does.
    info = entry.engine.tokenizer_info()
    return json_response(orjson.dumps(info, option=orjson.OPT_NON_STR_KEYS))


def _model_field(request: web.Request, obj: dict[str, object]) -> str:
    """A tokenizer route's optional `model`: the first served model when absent."""
    model = obj.get("model") or request.app[MODELS].default.name
    if not isinstance(model, str):
        raise SluiceError("'model' must be a string", param="model")
    return model


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", generation_endpoint("chat", prepare_chat))
    app.router.add_post("/v1/completions", generation_endpoint("completions", prepare_completion))
    # OpenAI Responses (server/api/openai_responses/endpoint.py).
    app.router.add_post("/v1/responses", post_responses)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    # Anthropic Messages (server/api/anthropic_messages/endpoint.py).
    app.router.add_post("/v1/messages", generation_endpoint("messages", prepare_messages))
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    # Anthropic's Message Batches (server/api/anthropic_batches/endpoint.py).
    app.router.add_post("/v1/messages/batches", message_batches.create_batch)
    app.router.add_get("/v1/messages/batches", message_batches.list_batches)
    app.router.add_get("/v1/messages/batches/{batch_id}", message_batches.get_batch)
    app.router.add_delete("/v1/messages/batches/{batch_id}", message_batches.delete_batch)
    app.router.add_post("/v1/messages/batches/{batch_id}/cancel", message_batches.cancel_batch)
    app.router.add_get("/v1/messages/batches/{batch_id}/results", message_batches.batch_results)
    # Ollama's API (server/api/ollama/endpoint.py); `/` answers its probe.
    app.router.add_get("/", root)
    app.router.add_post("/api/chat", generation_endpoint("ollama_chat", ollama.prepare_chat))
    app.router.add_post(
        "/api/generate", generation_endpoint("ollama_generate", ollama.prepare_generate)
    )
    app.router.add_post("/api/embed", pooling_endpoint("ollama_embed", ollama.prepare_embed))
    app.router.add_post(
        "/api/embeddings", pooling_endpoint("ollama_embeddings", ollama.prepare_embeddings)
    )
    app.router.add_get("/api/tags", ollama.tags)
    app.router.add_post("/api/show", ollama.show)
    app.router.add_get("/api/ps", ollama.ps)
    app.router.add_get("/api/version", ollama.version)
    for path, advice in ollama.MANAGEMENT.items():
        app.router.add_route("*", path, ollama.not_managed(advice))
    # Pooling models (server/api/pooling/endpoint.py): OpenAI's embeddings, and
    # rerank at every path vLLM's server gives it.
    app.router.add_post("/v1/embeddings", pooling_endpoint("embeddings", prepare_embeddings))
    rerank = pooling_endpoint("rerank", prepare_rerank)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
    # OpenAI's Files and Batches (server/api/openai_batches/endpoint.py).
    app.router.add_post("/v1/files", batches.upload_file)
    app.router.add_get("/v1/files", batches.list_files)
    app.router.add_get("/v1/files/{file_id}", batches.get_file)
    app.router.add_get("/v1/files/{file_id}/content", batches.file_content)
    app.router.add_delete("/v1/files/{file_id}", batches.delete_file)
    app.router.add_post("/v1/batches", batches.create_batch)
    app.router.add_get("/v1/batches", batches.list_batches)
    app.router.add_get("/v1/batches/{batch_id}", batches.get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", batches.cancel_batch)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/api/hello", hello)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
