"""Runtime LoRA loading: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Why this module exists: a team's new fine-tune should go live without a
restart, as with vLLM's server (VLLM_ALLOW_RUNTIME_LORA_UPDATING), but on a
shared workstation loading is an operator's act, not a caller's: whoever holds
the admin key may make the engine read files, so the routes are guarded here
and nowhere else.

Rules:

1. The routes exist only with `--allow-runtime-lora` (server/cli.py then
   insists on --enable-lora, --lora-root and --admin-key-file). Without it
   they are unknown paths: a 404 like any other, as vLLM's server answers
   without its environment variable.
2. Only the admin key opens them (`Authorization: Bearer <key>`, compared in
   constant time): no key or an unknown one is a 401; a caller's key (or the
   --api-key key) is a 403, so an operator sees at once which key was sent.
   The caller-key middleware lets these two paths through to this check.
3. The bodies and answers are vLLM 0.32's (vllm/entrypoints/serve/lora/:
   `LoadLoRAAdapterRequest` lora_name, lora_path, load_inplace,
   is_3d_lora_weight; `UnloadLoRAAdapterRequest` lora_name, lora_int_id):
   200 with its plain-text "Success: ..." line; 400 for a missing field, a
   name that is the base model's, or one already loaded without load_inplace;
   404 for unloading a name not loaded. Errors in the OpenAI shape.
4. A load is checked before the engine reads it (server/engines/lora.py rules 5-8:
   the path and every adapter file in it under --lora-root or 403; a path the
   OS refuses, the directory, its rank or its tensor shapes wrong: 400 naming
   the cause), then loaded into the engine (vLLM's own errors are a 400 too),
   and only then registered: a refused load changes nothing, and the adapters
   already loaded keep serving. A config naming another base model is loaded
   when its shapes fit, with a warning in the log and in the success text.
5. Unloading finishes the work already admitted on the adapter: the name
   leaves the registry at once (new requests get 404, /v1/models drops it),
   while requests queued in Sluice's backlog or running in the engine carry
   their `Adapter` value and run to the end on it. The engine keeps the
   weights in its CPU cache (--max-cpu-loras, least recently used out), as
   vLLM's own unload does, so the queued ones need no reload. Deterministic
   results cached for the name (--result-cache-ttl) are dropped.
6. Loads and unloads run one at a time (one lock): two loads of one name
   cannot both pass the "already loaded" check.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from server.callers import bearer_token, same_key
from server.engines.lora import Adapter, adapter_rank, check_base, under_root
from server.errors import SluiceError
from server.http.middleware import LOAD_PATH, UNLOAD_PATH
from server.state import CALLERS, METRICS, MODELS, RESULTS, SETTINGS
from server.wire.fields import load_object

__all__ = ["add_admin_routes", "check_admin"]

log = logging.getLogger("sluice.lora")

_LOCK = web.AppKey("lora_admin_lock", asyncio.Lock)  # rule 6


def check_admin(request: web.Request) -> None:
    """Rule 2: return if the request carries the admin key, else 401 or 403."""
    token = bearer_token(request.headers.get("Authorization", ""))
    if same_key(token, request.app[SETTINGS].admin_key):
        return
    request.app[METRICS].reject("auth")
    callers = request.app[CALLERS]
    if token and not callers.open and callers.identify(token) is not None:
        raise SluiceError(
            "this endpoint needs the admin key (--admin-key-file); a caller's key does not open it",
            status=403,
            code="admin_key_required",
        )
    raise SluiceError("invalid or missing admin key", status=401, code="invalid_api_key")


def _text(obj: dict[str, Any], name: str) -> str:
    value = obj.get(name, "")
    if not isinstance(value, str):
        raise SluiceError(f"'{name}' must be a string", param=name)
    return value


def _flag(obj: dict[str, Any], name: str) -> bool:
    value = obj.get(name, False)
    if not isinstance(value, bool):
        raise SluiceError(f"'{name}' must be a boolean", param=name)
    return value


def _success(text: str) -> web.Response:
    # vLLM answers a bare string with a 200; text/plain says what it is.
    return web.Response(text=text, content_type="text/plain")


async def load(request: web.Request) -> web.Response:
    check_admin(request)
    obj = load_object(await request.read())
    name, path = _text(obj, "lora_name"), _text(obj, "lora_path")
    inplace = _flag(obj, "load_inplace")
    if _flag(obj, "is_3d_lora_weight"):
        raise SluiceError(
            "is_3d_lora_weight (MoE expert adapters) is not supported", param="is_3d_lora_weight"
        )
    if not name or not path:
        raise SluiceError("Both 'lora_name' and 'lora_path' must be provided.")
    app = request.app
    # The one model's (--allow-runtime-lora is refused with --models).
    model, settings = app[MODELS].default, app[SETTINGS]
    registry = model.adapters
    if registry.is_base(name):
        raise SluiceError(
            f"The lora adapter '{name}' conflicts with a served base model.", param="lora_name"
        )
    assert settings.lora_root is not None  # the CLI's check (rule 1)
    async with app[_LOCK]:
        old = registry.get(name)
        if old is not None and not inplace:
            raise SluiceError(
                f"The lora adapter '{name}' has already been loaded. If you want to load "
                "the adapter in place, set 'load_inplace' to True.",
                param="lora_name",
            )
        try:
            directory, other_base = await asyncio.to_thread(
                _check_dir,
                settings.lora_root,
                path,
                settings.max_lora_rank,
                (settings.model_name, settings.model_path),
            )
        except (OSError, ValueError) as exc:
            # ValueError: a cause named by server/engines/lora.py, or a path the OS
            # refuses (a NUL byte); OSError: a name too long, no permission.
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise SluiceError(
                f"LoRA adapter {name!r}: {why}", param="lora_path", code="invalid_adapter"
            ) from None
        # Parent: the served name, as for a static adapter without base_model_name.
        adapter = Adapter(name, str(directory), registry.next_id(), registry.base)
        await model.engine.load_adapter(adapter)  # a SluiceError (400) changes nothing
        if old is not None:
            if old.path == adapter.path:
                # vLLM's own warning: its prefix cache keys blocks by name and path.
                log.warning(
                    "LoRA adapter reloaded in place from the same path; prefix-cache "
                    "blocks of its old weights may be reused: load changed weights "
                    "from a new path",
                    extra={"fields": {"adapter": name, "path": adapter.path}},
                )
            registry.remove(name)
            app[RESULTS].clear()
        registry.add(adapter)
    fields = {"adapter": name, "path": adapter.path, "id": adapter.id}
    log.info("LoRA adapter loaded", extra={"fields": fields})
    text = f"Success: LoRA adapter '{name}' added successfully."
    if other_base is not None:
        # Rule 4: its shapes fit (the engine's check passed); only the name differs.
        served = ", ".join(sorted({settings.model_name, settings.model_path} - {""}))
        warning = (
            f"its adapter_config.json names base model {other_base!r}, not the one "
            f"served ({served}); loaded because its tensor shapes fit"
        )
        log.warning(
            "LoRA adapter loaded on a base named otherwise: %s",
            warning,
            extra={"fields": {**fields, "base_model_name_or_path": other_base}},
        )
        text += f" Warning: {warning}."
    return _success(text)


def _check_dir(
    root: Path, path: str, max_rank: int, base_names: tuple[str, str]
) -> tuple[Path, str | None]:
    """server/engines/lora.py rules 5-6 for a runtime load (blocking: on a thread): the
    directory resolved under the root, and the other base its config names, if any."""
    directory = under_root(root, path)
    rank = adapter_rank(directory)
    if rank > max_rank:
        raise ValueError(f"rank {rank} is above --max-lora-rank {max_rank}")
    return directory, check_base(directory, base_names)


async def unload(request: web.Request) -> web.Response:
    check_admin(request)
    obj = load_object(await request.read())
    name = _text(obj, "lora_name")
    int_id = obj.get("lora_int_id")  # vLLM's optional field: checked, then unused
    if int_id is not None and (isinstance(int_id, bool) or not isinstance(int_id, int)):
        raise SluiceError("'lora_int_id' must be an integer", param="lora_int_id")
    if not name:
        raise SluiceError("'lora_name' needs to be provided to unload a LoRA adapter.")
    app = request.app
    async with app[_LOCK]:
        adapter = app[MODELS].default.adapters.remove(name)
        if adapter is None:
            raise SluiceError(
                f"The lora adapter '{name}' cannot be found.",
                status=404,
                param="lora_name",
                code="adapter_not_found",
            )
        app[RESULTS].clear()  # rule 5: no cached result outlives its adapter's name
    log.info("LoRA adapter unloaded", extra={"fields": {"adapter": name, "id": adapter.id}})
    return _success(f"Success: LoRA adapter '{name}' removed successfully.")


def add_admin_routes(app: web.Application) -> None:
    """Rule 1: the two routes, only with --allow-runtime-lora."""
    if not app[SETTINGS].allow_runtime_lora:
        return
    app[_LOCK] = asyncio.Lock()
    app.router.add_post(LOAD_PATH, load)
    app.router.add_post(UNLOAD_PATH, unload)
