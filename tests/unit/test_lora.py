"""LoRA adapters above the engine (server/engines/lora.py, the callers file's adapter
fields, the pipeline's adapter plumbing), with the fake engine: the rules of the
module's docstring, each API's 404 and 403, the caller's /v1/models, and that
the adapter reaches the engine, the group key and the result cache key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.callers import CallersError, parse_callers
from server.engines.lora import (
    Adapter,
    AdapterAccess,
    AdapterRegistry,
    check_adapter_dir,
    choose,
)
from server.errors import SluiceError

pytestmark = pytest.mark.timeout(30)

ALPHA = Adapter("alpha", "/adapters/alpha", 1, "fake")
BETA = Adapter("beta", "/adapters/beta", 2, "fake")


def registry() -> AdapterRegistry:
    return AdapterRegistry("fake", (ALPHA, BETA), base_path="/models/fake")


def refusal(fn: Any, *args: Any) -> tuple[int, str | None]:
    with pytest.raises(SluiceError) as info:
        fn(*args)
    return info.value.status, info.value.code


# --------------------------------------------------------------- the registry


def test_resolve_base_adapter_and_unknown() -> None:
    r = registry()
    assert r.resolve("fake") is None and r.resolve("/models/fake") is None
    assert r.resolve("alpha") is ALPHA
    assert refusal(r.resolve, "gamma") == (404, "model_not_found")


def test_registry_refuses_a_duplicate_a_base_name_and_a_reused_id() -> None:
    r = registry()
    with pytest.raises(ValueError, match="twice"):
        r.add(Adapter("alpha", "/x", 3, "fake"))
    with pytest.raises(ValueError, match="base model"):
        r.add(Adapter("fake", "/x", 3, "fake"))
    with pytest.raises(ValueError, match="given before"):
        r.add(Adapter("gamma", "/x", 2, "fake"))
    r.remove("beta")
    assert r.next_id() == 3  # never reused, even after a removal


def test_from_modules_numbers_from_one_and_keeps_a_named_parent() -> None:
    class Module:
        def __init__(self, name: str, path: str, base: str | None = None) -> None:
            self.name, self.path, self.base_model_name = name, path, base

    r = AdapterRegistry.from_modules(
        "fake",
        [Module("a", "/a"), Module("b", "/b", "/models/fake"), Module("c", "/c", "other")],
        base_path="/models/fake",
    )
    assert [(a.name, a.id, a.parent) for a in r.adapters] == [
        ("a", 1, "fake"),
        ("b", 2, "/models/fake"),
        ("c", 3, "fake"),  # a parent that is not the base is not kept, as in vLLM
    ]


# ------------------------------------------------------------ a caller's rules


def test_open_access_reaches_everything() -> None:
    r, open_ = registry(), AdapterAccess()
    assert choose(r, open_, "fake") is None
    assert choose(r, open_, "beta") is BETA


def test_an_adapter_outside_the_list_is_a_404_like_an_unknown_name() -> None:
    r, only_alpha = registry(), AdapterAccess(frozenset({"alpha"}))
    assert choose(r, only_alpha, "alpha") is ALPHA
    assert refusal(choose, r, only_alpha, "beta") == (404, "model_not_found")
    assert refusal(choose, r, only_alpha, "gamma") == (404, "model_not_found")
    assert r.visible(only_alpha) == (ALPHA,)


def test_the_base_model_is_403_for_a_restricted_caller_unless_listed_or_defaulted() -> None:
    r = registry()
    assert refusal(choose, r, AdapterAccess(frozenset({"alpha"})), "fake") == (
        403,
        "model_not_allowed",
    )
    assert choose(r, AdapterAccess(frozenset({"alpha", "fake"})), "fake") is None
    defaulted = AdapterAccess(frozenset({"alpha", "beta"}), "beta")
    assert choose(r, defaulted, "fake") is BETA
    assert choose(r, defaulted, "/models/fake") is BETA
    assert choose(r, defaulted, "alpha") is ALPHA


# ---------------------------------------------------------- the callers file

FILE = """
[callers.support]
key = "sk-support"
adapters = ["alpha"]
default_adapter = "alpha"
[callers.sql]
key = "sk-sql"
adapters = ["beta"]
[callers.all]
key = "sk-all"
"""


def test_callers_file_adapter_fields() -> None:
    table = parse_callers(FILE, adapters=["alpha", "beta"], base="fake")
    assert table.access_for("support") == AdapterAccess(frozenset({"alpha"}), "alpha")
    assert table.access_for("sql") == AdapterAccess(frozenset({"beta"}))
    assert table.access_for("all") == AdapterAccess()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ('adapters = ["gamma"]', "callers.x.adapters: 'gamma' is not a configured LoRA adapter"),
        ('adapters = "alpha"', "callers.x.adapters must be a list"),
        ('default_adapter = "fake"', "callers.x.default_adapter: 'fake' is not a configured"),
        ('adapters = ["beta"]\ndefault_adapter = "alpha"', "'alpha' is not in its adapters"),
    ],
)
def test_callers_file_adapter_errors_are_one_line(fields: str, message: str) -> None:
    text = f'[callers.x]\nkey = "k"\n{fields}\n'
    with pytest.raises(CallersError, match=message) as info:
        parse_callers(text, adapters=["alpha", "beta"], base="fake")
    assert "\n" not in str(info.value)


# ------------------------------------------------------- an adapter directory


def write_adapter(path: Path, r: int = 8, peft: str = "LORA", weights: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": peft, "r": r}))
    if weights:
        (path / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    return path


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, "is not a directory"),
        (lambda p: p.mkdir(), "has no adapter_config.json"),
        (lambda p: write_adapter(p, peft="IA3"), "not a LoRA adapter"),
        (lambda p: write_adapter(p, r=32), "rank 32 is above --max-lora-rank 16"),
        (lambda p: write_adapter(p, weights=False), "has no adapter_model.safetensors"),
    ],
)
def test_check_adapter_dir_names_the_cause(tmp_path: Path, setup: Any, message: str) -> None:
    path = tmp_path / "a"
    setup(path)
    with pytest.raises(ValueError, match=message) as info:
        check_adapter_dir("a", str(path), 16)
    assert str(info.value).startswith("LoRA adapter 'a': ")


def test_check_adapter_dir_accepts_a_lora_within_the_rank(tmp_path: Path) -> None:
    check_adapter_dir("a", str(write_adapter(tmp_path / "a", r=16)), 16)


# -------------------------------------------------------------- over HTTP

CHAT = "/v1/chat/completions"


def chat(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def lora_client(make_client: Any, callers: str | None = None, **kw: Any) -> Any:
    extra: dict[str, Any] = {}
    if callers is not None:
        table = parse_callers(callers, adapters=["alpha", "beta"], base="fake")
        extra = {"caller_table": table, "callers": table.policies}
    return await make_client(adapters=(ALPHA, BETA), warmup=False, **extra, **kw)


async def test_each_request_reaches_the_engine_on_its_adapter(make_client: Any) -> None:
    client, _, engine = await lora_client(make_client)
    for model in ("alpha", "fake", "beta"):
        resp = await client.post(CHAT, json=chat(model))
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["model"] == model
    resp = await client.post(
        "/v1/completions", json={"model": "beta", "prompt": "x", "max_tokens": 2}
    )
    assert resp.status == 200, await resp.text()
    assert list(engine.adapters.values()) == ["alpha", None, "beta", "beta"]
    text = await (await client.get("/metrics")).text()
    by_adapter = {
        (s.labels["endpoint"], s.labels["adapter"]): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "sluice_requests_total"
    }
    assert by_adapter == {
        ("chat", "alpha"): 1,
        ("chat", ""): 1,
        ("chat", "beta"): 1,
        ("completions", "beta"): 1,
    }


async def test_dedupe_and_the_result_cache_keep_adapters_apart(make_client: Any) -> None:
    client, _, engine = await lora_client(
        make_client, result_cache_ttl=60.0, default_thinking=False
    )
    for model in ("alpha", "beta", "alpha", "fake"):
        resp = await client.post(CHAT, json=chat(model, temperature=0))
        assert resp.status == 200, await resp.text()
    # The second alpha is a cache hit; beta and the base each ran once.
    assert sorted(engine.adapters.values(), key=str) == sorted(["alpha", "beta", None], key=str)


async def test_unknown_model_is_404_in_each_apis_shape(make_client: Any) -> None:
    client, _, _ = await lora_client(make_client)
    resp = await client.post(CHAT, json=chat("gamma"))
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "model_not_found"
    body = {"model": "gamma", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 404
    assert (await resp.json())["error"]["type"] == "not_found_error"
    resp = await client.post("/v1/responses", json={"model": "gamma", "input": "hi"})
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "model_not_found"


async def test_callers_see_and_use_their_own_adapters(make_client: Any) -> None:
    client, _, engine = await lora_client(make_client, FILE)

    async def listed(key: str) -> list[tuple[str, Any]]:
        resp = await client.get("/v1/models", headers=bearer(key))
        return [(m["id"], m["parent"]) for m in (await resp.json())["data"]]

    assert await listed("sk-all") == [("fake", None), ("alpha", "fake"), ("beta", "fake")]
    assert await listed("sk-support") == [("fake", None), ("alpha", "fake")]
    # The base model on support's key runs on its default adapter.
    resp = await client.post(CHAT, json=chat("fake"), headers=bearer("sk-support"))
    assert resp.status == 200, await resp.text()
    assert list(engine.adapters.values()) == ["alpha"]
    resp = await client.post(CHAT, json=chat("beta"), headers=bearer("sk-support"))
    assert resp.status == 404
    resp = await client.post(CHAT, json=chat("fake"), headers=bearer("sk-sql"))
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "model_not_allowed"
    body = {"model": "fake", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post("/v1/messages", json=body, headers={"x-api-key": "sk-sql"})
    assert resp.status == 403
    assert (await resp.json())["error"]["type"] == "permission_error"


async def test_sighup_reload_checks_adapter_names(make_client: Any, tmp_path: Path) -> None:
    from server.app import reload_callers
    from server.state import CALLERS

    path = tmp_path / "callers.toml"
    path.write_text(FILE)
    client, app, _ = await lora_client(make_client, FILE, callers_file=path)
    path.write_text(FILE.replace('adapters = ["beta"]', 'adapters = ["alpha", "fake"]'))
    assert await reload_callers(app)
    resp = await client.post(CHAT, json=chat("fake"), headers=bearer("sk-sql"))
    assert resp.status == 200, await resp.text()  # the base is in its list now
    path.write_text(FILE.replace('adapters = ["beta"]', 'adapters = ["gamma"]'))
    assert not await reload_callers(app)  # an unknown adapter keeps the old callers
    assert app[CALLERS].access("sql").adapters == frozenset({"alpha", "fake"})
