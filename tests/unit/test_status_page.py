"""The status page wired into the app (server/http/status_page.py): routes, key,
and snapshots of the live app, with the fake engine."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

from batching import DEFAULT_CALLER, AdmissionState
from batching.pressure import EngineStats
from server.app import drain, on_admission
from server.http.status_page import engine_label, snapshot
from server.state import STATUS
from tests.fakes import FakeEngine
from tests.unit.test_scale_capacity import dp_stat_loggers

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_page_and_its_files_are_served_with_a_strict_policy(make_client: Any) -> None:
    client, _, _ = await make_client()
    r = await client.get("/")
    assert r.status == 200 and r.content_type == "text/html"
    assert "static/status.js" in await r.text()
    csp = r.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "connect-src 'self'" in csp
    for path, kind in [
        ("/static/status.js", "javascript"),
        ("/static/status.css", "text/css"),
        ("/static/vendor/uplot/uPlot.iife.min.js", "javascript"),
        ("/static/vendor/uplot/uPlot.min.css", "text/css"),
        ("/static/favicon.svg", "image/svg"),
    ]:
        r = await client.get(path)
        assert r.status == 200, path
        assert kind in r.content_type, (path, r.content_type)
    assert (await client.get("/static/../app.py")).status in (403, 404)


async def test_status_json_describes_the_server(make_client: Any) -> None:
    client, app, _ = await make_client()
    app[STATUS].sample()
    r = await client.get("/status.json")
    assert r.status == 200 and r.headers["Cache-Control"] == "no-store"
    doc = orjson.loads(await r.read())
    assert doc["info"]["model"] == "fake"
    assert doc["info"]["engine"] == engine_label()
    assert doc["info"]["thresholds"]["host_shed_available_mib"] == 1024
    assert doc["state"] == "ok"
    assert len(doc["series"]["t"]) >= 1


@pytest.mark.parametrize("key", ["k-123"])
async def test_status_json_is_behind_the_key_the_page_is_not(make_client: Any, key: str) -> None:
    client, app, _ = await make_client(api_key=key)
    app[STATUS].sample()
    assert (await client.get("/")).status == 200
    assert (await client.get("/static/status.js")).status == 200
    r = await client.get("/status.json")
    assert r.status == 401
    assert (await r.json())["error"]["code"] == "invalid_api_key"
    assert (await client.get("/status.json?key=k-123")).status == 401  # never in a URL
    r = await client.get("/status.json", headers={"Authorization": f"Bearer {key}"})
    assert r.status == 200


async def test_snapshot_counts_what_was_served(make_client: Any) -> None:
    engine = FakeEngine(
        stats_value=EngineStats(kv_cache_usage=0.4, running=3, waiting=1, preemptions_total=0)
    )
    client, app, _ = await make_client(engine=engine)
    snapshot(app)  # drain what warm-up left
    for _ in range(2):
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status == 200
    r = await client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
    assert r.status == 404
    snap = snapshot(app)
    assert snap.requests == 3  # finished requests, whatever their status
    assert snap.generated_tokens == 8
    assert snap.prompt_tokens > 0  # only the two answered
    assert len(snap.ttft) == 2 and all(0 < t < 5 for t in snap.ttft)
    assert sum(snap.batch_sizes) == 2
    assert (snap.engine_running, snap.engine_waiting, snap.kv_cache_usage) == (3, 1, 0.4)
    assert snap.gpu_free_bytes is None and snap.host_available_bytes is None  # no watchdog
    # Both answered requests were the default caller's: prompt + 2 x 4 generated each.
    assert set(snap.callers) == {DEFAULT_CALLER}
    assert snap.callers[DEFAULT_CALLER] == snap.prompt_tokens + 2 * snap.generated_tokens
    assert snap.backlog == 0  # measured (nothing held), not "not measured"
    # Requests per adapter: all three on the base weights, named by the model.
    assert snap.adapters == {"fake": 3}
    again = snapshot(app)
    assert again.ttft == () and again.batch_sizes == ()  # drained


async def test_the_state_follows_admission_and_drain(make_client: Any) -> None:
    client, app, _ = await make_client()
    assert snapshot(app).state == "ok"
    on_admission(app, AdmissionState.SHEDDING)
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status == 503
    snap = snapshot(app)
    assert snap.state == "shedding"
    assert sum(snap.refusals.values()) >= 1
    on_admission(app, AdmissionState.OK)
    await drain(app, timeout=1.0)
    snap = snapshot(app)
    assert snap.state == "draining" and "503" in snap.reason


async def test_the_sampler_runs_in_the_apps_task_group(make_client: Any) -> None:
    client, app, _ = await make_client()
    await client.post("/v1/chat/completions", json=CHAT)
    sampler = app[STATUS]
    for _ in range(300):
        if len(sampler.columns["t"]) >= 2:
            break
        await asyncio.sleep(0.01)
    assert len(sampler.columns["t"]) >= 2
    assert sampler.marks[0].state in ("starting", "ok")


async def test_snapshot_carries_each_data_parallel_rank(make_client: Any) -> None:
    """Per-rank stats replayed through vLLM's per-engine logger adapter (as
    AsyncLLM builds it for --data-parallel-size 2) reach the page's snapshot."""
    box, adapter = dp_stat_loggers()
    for rank, (running, waiting, kv) in enumerate(((120, 3, 0.75), (100, 0, 0.25))):
        stats = SchedulerStats(
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            kv_cache_usage=kv,
            prefix_cache_stats=PrefixCacheStats(),
        )
        adapter.record(stats, None, engine_idx=rank)
    _, app, _ = await make_client(engine=FakeEngine(stats_value=box.get()))
    snap = snapshot(app)
    assert (snap.engine_running, snap.engine_waiting, snap.kv_cache_usage) == (220, 3, 0.5)
    assert [(r.running, r.waiting, r.kv_cache_usage) for r in snap.ranks] == [
        (120, 3, 0.75),
        (100, 0, 0.25),
    ]
    # One rank: the engine's numbers are the rank's, and no rank series.
    _, app, _ = await make_client(engine=FakeEngine())
    assert snapshot(app).ranks == ()
