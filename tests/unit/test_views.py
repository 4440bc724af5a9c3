"""What /status.json and /metrics show to whom (issue 28), with the fake engine.

* /status.json with a caller's key: that caller's own series and totals for
  the rest, no other caller's name and no adapter it may not use; the full
  view with the admin key, or to anyone when no keys are configured.
* /metrics: open unless --metrics-key-file (then its Bearer key only); caller
  labels only for configured names: without keys, the OpenAI `user` field is
  a client's string and never becomes a label.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from server.callers import parse_callers
from server.cli import parse_serve_args
from server.engines.lora import Adapter
from server.state import STATUS

pytestmark = pytest.mark.timeout(30)

ADAPTERS = (Adapter("ann-lora", "/a/ann", 1, "fake"), Adapter("bob-lora", "/a/bob", 2, "fake"))
FILE = """
[callers.ann-team]
key = "sk-ann"
adapters = ["ann-lora", "fake"]

[callers.bob-team]
key = "sk-bob"
adapters = ["bob-lora"]

[callers.carl-team]
key = "sk-carl"
"""
ADMIN = {"Authorization": "Bearer sk-admin"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def served(make_client: Any, **kw: Any) -> Any:
    """A server where each caller ran a request on its own adapter (carl on
    both), sampled twice so that the page's rates exist."""
    table = parse_callers(FILE, adapters=[a.name for a in ADAPTERS], base="fake")
    client, app, _ = await make_client(
        caller_table=table, callers=table.policies, adapters=ADAPTERS, warmup=False, **kw
    )
    app[STATUS].sample()
    for key, model in (
        ("sk-ann", "ann-lora"),
        ("sk-ann", "fake"),
        ("sk-bob", "bob-lora"),
        ("sk-carl", "ann-lora"),
        ("sk-carl", "bob-lora"),
    ):
        resp = await client.post("/v1/chat/completions", json=chat(model), headers=bearer(key))
        assert resp.status == 200, await resp.text()
    app[STATUS].sample()
    return client, app


async def status(client: Any, headers: dict[str, str]) -> tuple[bytes, dict[str, Any]]:
    resp = await client.get("/status.json", headers=headers)
    assert resp.status == 200, await resp.text()
    body = await resp.read()
    return body, orjson.loads(body)


async def test_a_callers_status_shows_its_own_series_and_totals_for_the_rest(
    make_client: Any,
) -> None:
    client, _ = await served(make_client, admin_key="sk-admin")
    body, doc = await status(client, bearer("sk-ann"))
    series = doc["series"]
    assert set(series["callers"]) == {"ann-team", "(other callers)"}
    assert set(series["adapters"]) == {"fake", "ann-lora", "(other adapters)"}
    for name in (b"bob-team", b"carl-team", b"bob-lora", b"sk-"):
        assert name not in body
    # The rest as one total: bob's and carl's service, every adapter's requests.
    full_body, full = await status(client, ADMIN)
    others = full["series"]["callers"]
    assert series["callers"]["(other callers)"][-1] == pytest.approx(
        others["bob-team"][-1] + others["carl-team"][-1], rel=0.01
    )
    assert series["callers"]["ann-team"] == others["ann-team"]
    assert series["req_s"] == full["series"]["req_s"]  # totals stay whole
    # A caller without an adapters list sees every adapter, still no other caller.
    body, doc = await status(client, bearer("sk-carl"))
    assert set(doc["series"]["adapters"]) == {"fake", "ann-lora", "bob-lora"}
    assert b"ann-team" not in body and b"bob-team" not in body
    # The admin key: the full view.
    assert {"ann-team", "bob-team", "carl-team"} <= set(full["series"]["callers"])
    assert b"bob-lora" in full_body


async def test_the_admin_key_opens_the_full_view_and_nothing_more(make_client: Any) -> None:
    client, _ = await served(make_client, admin_key="sk-admin")
    resp = await client.post("/v1/chat/completions", json=chat("fake"), headers=ADMIN)
    assert resp.status == 401  # not a caller's key
    assert (await client.get("/status.json", headers=bearer("sk-wrong"))).status == 401


async def test_without_keys_everyone_gets_the_full_view(make_client: Any) -> None:
    client, app, _ = await make_client(warmup=False)
    app[STATUS].sample()
    resp = await client.post("/v1/chat/completions", json={**chat("fake"), "user": "zed"})
    assert resp.status == 200
    app[STATUS].sample()
    _, doc = await status(client, {})
    assert "zed" in doc["series"]["callers"]


async def test_metrics_labels_only_configured_callers(make_client: Any) -> None:
    """Open mode: `user` names a caller for fair share, but /metrics buckets
    every such name into one `user` label (a client's string never becomes a
    series); configured callers keep their names."""
    client, _, _ = await make_client(warmup=False)
    for user in ("zed", "yan", None):
        body = chat("fake") | ({"user": user} if user else {})
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
    text = await (await client.get("/metrics")).text()
    assert "zed" not in text and "yan" not in text
    assert 'sluice_caller_requests_total{caller="user",status="200"} 2.0' in text
    assert 'sluice_caller_requests_total{caller="default",status="200"} 1.0' in text
    assert 'sluice_caller_service_total{caller="user"}' in text
    assert 'sluice_queue_wait_seconds_count{caller="user"} 2.0' in text
    client, _ = await served(make_client)
    text = await (await client.get("/metrics")).text()
    assert 'sluice_caller_requests_total{caller="bob-team",status="200"} 1.0' in text


async def test_metrics_key(make_client: Any) -> None:
    client, _ = await served(make_client, metrics_key="sk-metrics", admin_key="sk-admin")
    for headers in ({}, bearer("sk-wrong"), bearer("sk-ann"), ADMIN, {"x-api-key": "sk-metrics"}):
        resp = await client.get("/metrics", headers=headers)
        assert resp.status == 401, headers
        assert (await resp.json())["error"]["code"] == "invalid_api_key"
    resp = await client.get("/metrics", headers=bearer("sk-metrics"))
    assert resp.status == 200 and "sluice_requests_total" in await resp.text()
    # The metrics key is not a caller's.
    resp = await client.post(
        "/v1/chat/completions", json=chat("fake"), headers=bearer("sk-metrics")
    )
    assert resp.status == 401


@pytest.mark.timeout(120)
def test_the_key_files_are_read_once_and_each_key_is_its_own(
    demo_cache_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--admin-key-file stands alone now (the full /status.json), and
    --metrics-key-file is read once; neither may be a caller's key, nor the
    other's. (The first parse in a process imports vLLM: seconds.)"""
    files = {}
    for name, key in (("admin", "sk-admin"), ("metrics", "sk-metrics"), ("same", "sk-admin")):
        files[name] = tmp_path / f"{name}.key"
        files[name].write_text(key + "\n")
        files[name].chmod(0o600)
    base = ["--demo-cache-dir", str(demo_cache_root)]
    keys = ["--admin-key-file", str(files["admin"]), "--metrics-key-file", str(files["metrics"])]
    s = parse_serve_args([*base, *keys], {})
    assert (s.admin_key, s.metrics_key, s.allow_runtime_lora) == ("sk-admin", "sk-metrics", False)
    assert "sk-" not in repr(s)
    for flags, says in (
        (["--admin-key-file", str(files["admin"]), "--metrics-key-file", str(files["same"])],
         "holds the admin key"),
        (["--api-key-file", str(files["metrics"]), "--metrics-key-file", str(files["metrics"])],
         "holds a caller's key"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            parse_serve_args([*base, *flags], {})
        assert exit_.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and says in lines[0], lines
