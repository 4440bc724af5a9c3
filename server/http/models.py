"""A request's model: which served model it names, and a hold on it until it ends.

Why this module exists: every API resolves its request's `model` the same way
(the registry's rules: server/engines/registry.py rules 2-3, with the caller's
`models` and `adapters` lists from the callers file), and every request that
uses a model must keep it loaded while it does: an on-demand model is loaded
for it, bounded by --load-timeout, and is not unloaded under it. `use_model`
does both and records the model on the request (`MODEL`); the request
middleware (server/http/middleware.py) gives the hold back as the request
ends, whatever happens, with `release_model`.
"""

from __future__ import annotations

from aiohttp import web

from server.engines.interface import Service
from server.engines.lora import Adapter
from server.engines.registry import ModelEntry
from server.state import CALLER, CALLERS, LOADER, MODEL, MODELS

__all__ = ["hold_model", "release_model", "use_model"]


async def use_model(
    request: web.Request, model: str, serves: Service | None = "generate"
) -> tuple[ModelEntry, Adapter | None]:
    """The served model and LoRA adapter (None: its base weights) a request's
    `model` runs on for its caller, loaded; or the refusal: 404 for a name the
    caller may not see, 403 for a base model its `adapters` list leaves out,
    400 for a model that does not serve `serves` (None: any, as the tokenizer
    routes take), 503 with Retry-After for a load that failed or did not
    finish within --load-timeout."""
    access = request.app[CALLERS].access(request.get(CALLER))
    entry, adapter = request.app[MODELS].resolve(model, access, serves)
    await hold_model(request, entry)
    return entry, adapter


async def hold_model(request: web.Request, entry: ModelEntry) -> None:
    """Hold `entry` for the request, loaded (see `use_model`; no name check)."""
    held = request.get(MODEL)
    if held is entry:
        return
    if held is not None:  # one model per request: give the other back first
        release_model(request)
    await request.app[LOADER].acquire(entry)
    request[MODEL] = entry


def release_model(request: web.Request) -> None:
    """Give back the request's hold on its model, if it took one."""
    entry = request.get(MODEL)
    if entry is not None:
        del request[MODEL]
        request.app[LOADER].release(entry)
