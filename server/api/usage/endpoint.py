"""`GET /v1/organization/usage/completions` and `/v1/organization/usage/embeddings`.

Why this module exists: teams sharing the card ask "who used it"; OpenAI's
Usage API is the question's shape their tools (the openai client's
`admin.organization.usage`, dashboards, scripts) already speak. This module
reads OpenAI's query string, decides who sees what, and writes OpenAI's page
from the usage ledger (server/operations/usage.py, queried on the state
database's thread).

Rules:

1. The query is OpenAI's: `start_time` (unix seconds, required), `end_time`
   (exclusive; default now), `bucket_width` `1m` | `1h` | `1d` (default
   `1d`; buckets aligned to UTC minutes, hours, days), `limit` buckets a page
   (1m: default 60, max 1440; 1h: 24, 168; 1d: 7, 31), `page` (the previous
   page's `next_page`), `group_by`, and the filters `models`, `api_key_ids`,
   `project_ids`, `batch` (true: batch lines only; false: the rest). A list
   is the parameter repeated (`group_by=model&group_by=api_key_id`), the
   openai client's brackets (`group_by[]=model`) or a comma list.
2. A caller is both an API key and a project: `api_key_id` and `project_id`
   are the caller's name. `model` is the served model's name, or an
   adapter's for requests that ran on a LoRA adapter (the name the client
   sent). `batch` groups into batch lines and the rest. `user_id`,
   `service_tier` and `api_source` are accepted in `group_by` and stay null
   (Sluice does not track them); a `user_ids` filter is a 400, as Sluice
   cannot apply it.
3. Every bucket of the page's range is in `data`, the empty ones with
   `results: []`, as OpenAI's are. A field not grouped by is null.
4. Each result carries Sluice's own fields beside OpenAI's:
   `engine_seconds` (the requests' share of the engine's step time),
   `kv_block_seconds` (KV-cache blocks held x seconds) and `api` (with
   Sluice's own `group_by=api`: the API the requests came through, as the
   access line names it: `chat`, `completions`, `responses`, `messages`,
   `ollama_chat`, `embeddings`, ...; else null).
5. Who sees what: the admin key (`Authorization: Bearer`, --admin-key-file)
   sees every caller; a caller's key sees only its own rows (the caller
   filter is forced to it); without any keys (open mode, where every other
   endpoint is open too) everything is visible.
6. A bad parameter is a 400 in OpenAI's error shape, naming it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson
from aiohttp import web
from multidict import MultiMapping

from server.errors import SluiceError
from server.http.pipeline import json_response
from server.operations.usage import WIDTHS, UsagePage, UsageQuery, UsageResult
from server.state import ADMIN, CALLER, CALLERS, USAGE

__all__ = ["COMPLETIONS_PATH", "EMBEDDINGS_PATH", "add_usage_routes", "parse_query"]

COMPLETIONS_PATH = "/v1/organization/usage/completions"
EMBEDDINGS_PATH = "/v1/organization/usage/embeddings"

# Rule 1: OpenAI's bucket counts per page, default and most, by width.
_LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}
# Rule 2: what each endpoint may group by; the caller's two names, the rest null.
_GROUPS = {
    "completions": frozenset(
        {
            "project_id",
            "user_id",
            "api_key_id",
            "model",
            "batch",
            "service_tier",
            "api_source",
            "api",
        }
    ),
    "embeddings": frozenset({"project_id", "user_id", "api_key_id", "model", "api"}),
}
_CURSOR = "page_"


def _values(query: MultiMapping[str], name: str) -> list[str] | None:
    """A list parameter (rule 1): repeated, bracketed or comma-separated; None if absent."""
    raw = [*query.getall(name, []), *query.getall(name + "[]", [])]
    if not raw:
        return None
    return [v.strip() for item in raw for v in item.split(",") if v.strip()]


def _int(query: MultiMapping[str], name: str) -> int | None:
    value = query.get(name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise SluiceError(f"'{name}' must be an integer", param=name) from None
    if number < 0:
        raise SluiceError(f"'{name}' must not be negative", param=name)
    return number


def _batch(query: MultiMapping[str]) -> bool | None:
    value = query.get("batch")
    if value is None:
        return None
    if value.lower() not in ("true", "false"):
        raise SluiceError("'batch' must be true or false", param="batch")
    return value.lower() == "true"


def _callers(query: MultiMapping[str], visible: frozenset[str] | None) -> frozenset[str] | None:
    """The caller filter: api_key_ids and project_ids (both: those in both),
    within what the key may see (rule 5)."""
    chosen = visible
    for name in ("api_key_ids", "project_ids"):
        values = _values(query, name)
        if values is not None:
            chosen = frozenset(values) if chosen is None else chosen & frozenset(values)
    return chosen


def parse_query(
    query: MultiMapping[str], kind: str, *, now: float, visible: frozenset[str] | None
) -> tuple[UsageQuery, int]:
    """Rules 1, 2 and 5: the query for one page, and the whole range's end.
    `visible`: the callers the key may see (None: all)."""
    start = _int(query, "start_time")
    if start is None:
        raise SluiceError("'start_time' is required", param="start_time")
    width_name = query.get("bucket_width", "1d")
    if width_name not in WIDTHS:
        raise SluiceError(
            f"'bucket_width' must be one of 1m, 1h, 1d, not {width_name!r}", param="bucket_width"
        )
    width = WIDTHS[width_name]
    end = _int(query, "end_time")
    if end is None:  # up to now, the bucket in progress included
        end = max(int(now) + 1, start + 1)
    if end <= start:
        raise SluiceError("'end_time' must be after 'start_time'", param="end_time")
    default, most = _LIMITS[width_name]
    limit = _int(query, "limit")
    if limit is None:
        limit = default
    if not 1 <= limit <= most:
        raise SluiceError(
            f"'limit' must be 1 to {most} for bucket_width {width_name}", param="limit"
        )
    first = start - start % width
    last = -(-end // width) * width
    cursor = query.get("page")
    if cursor is not None:
        at = cursor.removeprefix(_CURSOR)
        if (
            not cursor.startswith(_CURSOR)
            or not at.isdigit()
            or int(at) % width
            or not first <= int(at) < last
        ):
            raise SluiceError("'page' is not a cursor of this query", param="page")
        first = int(at)
    group_by = _values(query, "group_by") or []
    unknown = sorted(set(group_by) - _GROUPS[kind])
    if unknown:
        raise SluiceError(
            f"'group_by' cannot name {', '.join(unknown)} for {kind}; it takes "
            + ", ".join(sorted(_GROUPS[kind])),
            param="group_by",
        )
    if query.get("user_ids") is not None or query.get("user_ids[]") is not None:
        raise SluiceError(
            "'user_ids' is not supported: Sluice counts usage by caller (api_key_ids)",
            param="user_ids",
        )
    groups = set()
    if {"api_key_id", "project_id"} & set(group_by):
        groups.add("caller")
    groups.update(g for g in group_by if g in ("model", "batch", "api"))
    models = _values(query, "models")
    q = UsageQuery(
        kind=kind,
        start=first,
        end=min(last, first + limit * width),
        width=width,
        group_by=frozenset(groups),
        callers=_callers(query, visible),
        models=None if models is None else frozenset(models),
        batch=_batch(query),
    )
    return q, last


def _result(kind: str, r: UsageResult, group_by: frozenset[str]) -> dict[str, Any]:
    """One result in OpenAI's shape, with Sluice's two fields (rule 4)."""
    out: dict[str, Any] = {
        "object": f"organization.usage.{kind}.result",
        "input_tokens": r.prompt_tokens,
    }
    if kind == "completions":
        out |= {
            "output_tokens": r.completion_tokens,
            "input_cached_tokens": r.cached_tokens,
            "input_uncached_tokens": r.prompt_tokens - r.cached_tokens,
            "input_audio_tokens": 0,
            "output_audio_tokens": 0,
        }
    out |= {
        "num_model_requests": r.requests,
        "project_id": r.caller if "project_id" in group_by else None,
        "user_id": None,
        "api_key_id": r.caller if "api_key_id" in group_by else None,
        "model": r.model,
    }
    if kind == "completions":
        out |= {"batch": r.batch, "service_tier": None, "api_source": None}
    out |= {
        "engine_seconds": round(r.engine_seconds, 6),
        "kv_block_seconds": round(r.block_seconds, 6),
        "api": r.api,
    }
    return out


def render(
    page: UsagePage, kind: str, group_by: Iterable[str], *, has_more: bool, next_at: int
) -> dict[str, Any]:
    """The page in OpenAI's shape (rule 3)."""
    groups = frozenset(group_by)
    return {
        "object": "page",
        "data": [
            {
                "object": "bucket",
                "start_time": b.start,
                "end_time": b.end,
                "results": [_result(kind, r, groups) for r in b.results],
            }
            for b in page.buckets
        ],
        "has_more": has_more,
        "next_page": f"{_CURSOR}{next_at}" if has_more else None,
    }


def _visible(request: web.Request) -> frozenset[str] | None:
    """Rule 5: the callers this request's key may see (None: all)."""
    if request.get(ADMIN) or request.app[CALLERS].open:
        return None
    caller = request.get(CALLER)
    if caller is None:  # the auth middleware names every keyed request's caller
        raise SluiceError("invalid or missing API key", status=401, code="invalid_api_key")
    return frozenset({caller})


def _handler(kind: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        q, last = parse_query(request.query, kind, now=time.time(), visible=_visible(request))
        page = await request.app[USAGE].query(q)
        group_by = _values(request.query, "group_by") or []
        body = render(page, kind, group_by, has_more=q.end < last, next_at=q.end)
        return json_response(orjson.dumps(body))

    return handle


def add_usage_routes(app: web.Application) -> None:
    app.router.add_get(COMPLETIONS_PATH, _handler("completions"))
    app.router.add_get(EMBEDDINGS_PATH, _handler("embeddings"))
