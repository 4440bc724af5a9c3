"""Runtime LoRA loading above the engine (server/api/lora_admin/endpoint.py, server/engines/lora.py
rules 6-7, the CLI's --allow-runtime-lora checks), with the fake engine: the
routes exist only when allowed, only the admin key opens them, only paths under
--lora-root load, a bad adapter is a 400 naming the cause and changes nothing,
and unloading lets queued and running work finish."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from server.callers import parse_callers
from server.cli import parse_serve_args
from server.engines.demo.lora_adapter import write_demo_adapter
from server.engines.demo.model import ARCHITECTURE, write_safetensors
from server.engines.lora import Adapter, ModelShapes, check_shapes
from server.state import MODELS
from tests.fakes import FakeEngine
from tests.support import until

pytestmark = pytest.mark.timeout(30)

LOAD, UNLOAD, CHAT = "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/chat/completions"
ADMIN = {"Authorization": "Bearer sk-admin"}
ALPHA = Adapter("alpha", "/adapters/alpha", 1, "fake")


def write_adapter(path: Path, r: int = 8, base: str | None = "fake") -> Path:
    """A LoRA directory that passes the config checks (its weights are not read)."""
    path.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"peft_type": "LORA", "r": r}
    if base is not None:
        config["base_model_name_or_path"] = base
    (path / "adapter_config.json").write_text(json.dumps(config))
    (path / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    return path


async def admin_client(make_client: Any, root: Path, **kw: Any) -> Any:
    kw.setdefault("warmup", False)
    return await make_client(
        allow_runtime_lora=True,
        lora_root=root,  # pytest's tmp_path is resolved already
        admin_key="sk-admin",
        max_lora_rank=8,
        **kw,
    )


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def refused(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    error: dict[str, Any] = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}  # the OpenAI shape
    return error


# ------------------------------------------------------------ route gating


@pytest.mark.parametrize("keys", [{}, {"api_key": "sk-caller"}])
async def test_the_routes_are_unknown_without_allow_runtime_lora(
    make_client: Any, tmp_path: Path, keys: dict[str, Any]
) -> None:
    write_adapter(tmp_path / "a")
    client, _, engine = await make_client(warmup=False, **keys)
    body = {"lora_name": "a", "lora_path": str(tmp_path / "a")}
    for path in (LOAD, UNLOAD):
        await refused(await client.post(path, json=body, headers=ADMIN), 404)
    assert engine.loaded == []


# ------------------------------------------------------------ the admin key


async def test_only_the_admin_key_opens_the_routes(make_client: Any, tmp_path: Path) -> None:
    table = parse_callers('[callers.team]\nkey = "sk-team"\n', base="fake")
    client, _, engine = await admin_client(
        make_client, tmp_path, caller_table=table, callers=table.policies
    )
    body = {"lora_name": "a", "lora_path": str(write_adapter(tmp_path / "a"))}
    for headers, status in (
        ({}, 401),
        ({"Authorization": "Bearer sk-wrong"}, 401),
        ({"Authorization": "sk-admin"}, 401),  # not a bearer token
        ({"x-api-key": "sk-admin"}, 401),
        ({"Authorization": "Bearer sk-team"}, 403),  # a caller's key
    ):
        for path in (LOAD, UNLOAD):
            error = await refused(await client.post(path, json=body, headers=headers), status)
            assert error["type"] == (
                "authentication_error" if status == 401 else "permission_error"
            )
    assert engine.loaded == []
    resp = await client.post(LOAD, json=body, headers=ADMIN)
    assert resp.status == 200, await resp.text()
    # The admin key is not a caller's: it does not open the generation routes.
    await refused(await client.post(CHAT, json=chat("a"), headers=ADMIN), 401)


async def test_an_api_key_does_not_open_them_either(make_client: Any, tmp_path: Path) -> None:
    client, _, _ = await admin_client(make_client, tmp_path, api_key="sk-caller")
    body = {"lora_name": "a", "lora_path": str(write_adapter(tmp_path / "a"))}
    resp = await client.post(LOAD, json=body, headers={"Authorization": "Bearer sk-caller"})
    assert (await refused(resp, 403))["code"] == "admin_key_required"


# ------------------------------------------------------------ the root


async def test_only_paths_under_the_root_load(make_client: Any, tmp_path: Path) -> None:
    root = tmp_path / "root"
    inside = write_adapter(root / "a")
    outside = write_adapter(tmp_path / "outside")
    (root / "link").symlink_to(outside)
    client, _, engine = await admin_client(make_client, root)
    for path in (str(outside), "../outside", str(root / "a" / ".." / ".." / "outside"), "link"):
        resp = await client.post(LOAD, json={"lora_name": "x", "lora_path": path}, headers=ADMIN)
        error = await refused(resp, 403)
        assert (error["code"], error["param"]) == ("path_not_allowed", "lora_path"), path
    assert engine.loaded == []
    # A relative path is taken from the root; the engine gets the resolved one.
    resp = await client.post(LOAD, json={"lora_name": "x", "lora_path": "a"}, headers=ADMIN)
    assert resp.status == 200, await resp.text()
    assert [a.path for a in engine.loaded] == [str(inside)]


# ---------------------------------------------------- bodies and bad adapters


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"lora_name": "x", "lora_path": "missing"}, "is not a directory"),
        ({"lora_name": "x", "lora_path": "empty"}, "has no adapter_config.json"),
        ({"lora_name": "x", "lora_path": "r16"}, "rank 16 is above --max-lora-rank 8"),
        ({"lora_name": "fake", "lora_path": "good"}, "conflicts with a served base model"),
        ({"lora_name": "alpha", "lora_path": "good"}, "has already been loaded"),
        ({"lora_name": "x"}, "Both 'lora_name' and 'lora_path' must be provided"),
        ({"lora_name": 3, "lora_path": "good"}, "'lora_name' must be a string"),
        ({"lora_name": "x", "lora_path": "good", "is_3d_lora_weight": True}, "not supported"),
    ],
)
async def test_a_bad_load_is_a_400_naming_the_cause_and_changes_nothing(
    make_client: Any, tmp_path: Path, body: dict[str, Any], says: str
) -> None:
    (tmp_path / "empty").mkdir()
    write_adapter(tmp_path / "r16", r=16)
    write_adapter(tmp_path / "good")
    client, _, engine = await admin_client(make_client, tmp_path, adapters=(ALPHA,))
    error = await refused(await client.post(LOAD, json=body, headers=ADMIN), 400)
    assert says in error["message"]
    assert engine.loaded == []
    resp = await client.get("/v1/models")
    assert [m["id"] for m in (await resp.json())["data"]] == ["fake", "alpha"]
    assert (await client.post(CHAT, json=chat("alpha"))).status == 200


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("bad\0name", "null byte"),
        ("x" * 300, "File name too long"),
        ("a/" + "y" * 300 + "/b", "File name too long"),
    ],
)
async def test_a_path_the_os_refuses_is_a_400(
    make_client: Any, tmp_path: Path, path: str, says: str
) -> None:
    """Path.resolve and is_dir raise ValueError (a NUL byte) and OSError (a
    component over NAME_MAX): a 400 naming lora_path, not a 500."""
    write_adapter(tmp_path / "a")
    client, _, engine = await admin_client(make_client, tmp_path)
    body = {"lora_name": "x", "lora_path": path}
    error = await refused(await client.post(LOAD, json=body, headers=ADMIN), 400)
    assert error["param"] == "lora_path" and says in error["message"], error
    assert engine.loaded == []
    assert (await client.post(LOAD, json={**body, "lora_path": "a"}, headers=ADMIN)).status == 200


async def test_a_file_symlinked_outside_the_root_is_403(make_client: Any, tmp_path: Path) -> None:
    """Every file the checks or vLLM read (config, weights) must resolve under
    the root, not only the directory: a directory of links to an adapter
    elsewhere, or a config linked to /dev/zero, is refused before any read."""
    root = tmp_path / "root"
    outside = write_demo_adapter(tmp_path / "outside", seed=1)
    links = root / "links"
    links.mkdir(parents=True)
    for f in outside.iterdir():
        (links / f.name).symlink_to(f)
    zero = write_adapter(root / "zero")
    (zero / "adapter_config.json").unlink()
    (zero / "adapter_config.json").symlink_to("/dev/zero")
    weights = write_adapter(root / "weights")
    (weights / "adapter_model.safetensors").unlink()
    (weights / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    # A link that stays inside the root is fine.
    inside = write_adapter(root / "inside-target")
    (root / "inside").mkdir()
    for f in inside.iterdir():
        (root / "inside" / f.name).symlink_to(f)
    client, _, engine = await admin_client(make_client, root)
    for name in ("links", "zero", "weights"):
        body = {"lora_name": name, "lora_path": name}
        error = await refused(await client.post(LOAD, json=body, headers=ADMIN), 403)
        assert (error["code"], error["param"]) == ("path_not_allowed", "lora_path"), name
        assert "outside --lora-root" in error["message"]
    assert engine.loaded == []
    body = {"lora_name": "inside", "lora_path": "inside"}
    assert (await client.post(LOAD, json=body, headers=ADMIN)).status == 200


async def test_the_config_is_read_with_a_bound(make_client: Any, tmp_path: Path) -> None:
    """A config that is not a regular file (a FIFO would block the read) or is
    larger than any PEFT config is a 400, read no further than the bound."""
    huge = write_adapter(tmp_path / "huge")
    (huge / "adapter_config.json").write_bytes(b" " * (2 * 1024 * 1024) + b"{}")
    fifo = write_adapter(tmp_path / "fifo")
    (fifo / "adapter_config.json").unlink()
    os.mkfifo(fifo / "adapter_config.json")
    client, _, engine = await admin_client(make_client, tmp_path)
    for name, says in (("huge", "larger than"), ("fifo", "not a regular file")):
        body = {"lora_name": name, "lora_path": name}
        error = await refused(await client.post(LOAD, json=body, headers=ADMIN), 400)
        assert says in error["message"], error
    assert engine.loaded == []


async def test_the_demo_adapter_loads_on_a_path_served_demo_model(
    make_client: Any, tmp_path: Path
) -> None:
    """`make-demo-adapter` names the base `sluice-demo`; served from its
    directory the model's names are the path. Shapes decide, not names: it
    loads, and the success text and the log say the names differ."""
    model = str(tmp_path / "models" / "demo")
    adapter = write_demo_adapter(tmp_path / "root" / "a", seed=1)
    client, _, engine = await admin_client(
        make_client, tmp_path / "root", model_name=model, model_path=model
    )
    resp = await client.post(LOAD, json={"lora_name": "a", "lora_path": "a"}, headers=ADMIN)
    assert resp.status == 200, await resp.text()
    text = await resp.text()
    assert text.startswith("Success: LoRA adapter 'a' added successfully.")
    assert "'sluice-demo'" in text and model in text
    assert [a.path for a in engine.loaded] == [str(adapter)]


async def test_a_base_named_otherwise_loads_with_a_warning(
    make_client: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fine-tune of `Qwen/Qwen3-14B` on a base served as `/srv/models/qwen3-14b-fp8`:
    the engine's shape check (server/engines/vllm_adapter.py, real engine:
    tests/integration/test_lora_runtime.py) decides; the name is a warning."""
    write_adapter(tmp_path / "other", base="Qwen/Qwen3-14B")
    client, _, engine = await admin_client(
        make_client,
        tmp_path,
        model_name="qwen",
        model_path="/srv/models/qwen3-14b-fp8",
    )
    with caplog.at_level(logging.WARNING, logger="sluice.lora"):
        resp = await client.post(LOAD, json={"lora_name": "o", "lora_path": "other"}, headers=ADMIN)
    assert resp.status == 200, await resp.text()
    text = await resp.text()
    assert "Warning" in text and "'Qwen/Qwen3-14B'" in text and "/srv/models/qwen3-14b-fp8" in text
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert getattr(record, "fields", {})["base_model_name_or_path"] == "Qwen/Qwen3-14B"
    assert [a.name for a in engine.loaded] == ["o"]


async def test_an_engine_load_error_is_a_400_and_the_loaded_keep_serving(
    make_client: Any, tmp_path: Path
) -> None:
    engine = FakeEngine(load_error="size mismatch for lora_a")
    client, _, _ = await admin_client(make_client, tmp_path, engine=engine, adapters=(ALPHA,))
    body = {"lora_name": "x", "lora_path": str(write_adapter(tmp_path / "x"))}
    error = await refused(await client.post(LOAD, json=body, headers=ADMIN), 400)
    assert "size mismatch" in error["message"] and error["code"] == "adapter_load_failed"
    await refused(await client.post(CHAT, json=chat("x")), 404)
    assert (await client.post(CHAT, json=chat("alpha"))).status == 200


async def test_load_serve_unload(make_client: Any, tmp_path: Path) -> None:
    client, _, engine = await admin_client(make_client, tmp_path, adapters=(ALPHA,))
    path = write_adapter(tmp_path / "x")
    resp = await client.post(LOAD, json={"lora_name": "x", "lora_path": str(path)}, headers=ADMIN)
    assert resp.status == 200
    assert await resp.text() == "Success: LoRA adapter 'x' added successfully."
    [loaded] = engine.loaded
    assert (loaded.name, loaded.id, loaded.parent) == ("x", 2, "fake")  # ids never reused
    models = (await (await client.get("/v1/models")).json())["data"]
    assert [(m["id"], m["parent"]) for m in models] == [
        ("fake", None),
        ("alpha", "fake"),
        ("x", "fake"),
    ]
    assert (await client.post(CHAT, json=chat("x"))).status == 200
    assert list(engine.adapters.values()) == ["x"]
    resp = await client.post(UNLOAD, json={"lora_name": "x"}, headers=ADMIN)
    assert resp.status == 200
    assert await resp.text() == "Success: LoRA adapter 'x' removed successfully."
    assert (await refused(await client.post(CHAT, json=chat("x")), 404))["code"] == (
        "model_not_found"
    )
    error = await refused(await client.post(UNLOAD, json={"lora_name": "x"}, headers=ADMIN), 404)
    assert error["message"] == "The lora adapter 'x' cannot be found."
    # In place: the name again, a new id.
    body = {"lora_name": "alpha", "lora_path": str(path), "load_inplace": True}
    assert (await client.post(LOAD, json=body, headers=ADMIN)).status == 200
    assert [(a.name, a.id) for a in engine.loaded] == [("x", 2), ("alpha", 3)]


async def test_no_cached_result_outlives_its_adapters_name(
    make_client: Any, tmp_path: Path
) -> None:
    client, _, engine = await admin_client(
        make_client, tmp_path, result_cache_ttl=60.0, default_thinking=False
    )
    body = {"lora_name": "x", "lora_path": str(write_adapter(tmp_path / "x"))}
    greedy = {**chat("x"), "temperature": 0}
    for _ in range(2):  # loaded again under the same name: other weights, maybe
        assert (await client.post(LOAD, json=body, headers=ADMIN)).status == 200
        for _ in range(2):
            assert (await client.post(CHAT, json=greedy)).status == 200
        assert (await client.post(UNLOAD, json={"lora_name": "x"}, headers=ADMIN)).status == 200
    # One generation per load: the second request of each was the cache's.
    assert list(engine.adapters.values()) == ["x", "x"]


async def test_unloading_finishes_queued_and_running_work(make_client: Any, tmp_path: Path) -> None:
    """Rule 5: a request in the engine (its one slot; nothing in it ends, so its own
    queue takes no more: room.py rule 2) and two held in Sluice's backlog all finish
    on the adapter after its unload."""
    gate = asyncio.Event()
    engine = FakeEngine(max_num_seqs=1, first_output=gate)
    client, app, _ = await admin_client(make_client, tmp_path, engine=engine, adapters=(ALPHA,))
    sent = [asyncio.ensure_future(client.post(CHAT, json=chat("alpha")))]
    await until(lambda: len(engine.held) == 1, what="the first request in the engine")
    sent += [asyncio.ensure_future(client.post(CHAT, json=chat("alpha"))) for _ in range(2)]
    await until(
        lambda: app[MODELS].default.driver.core.queued_requests == 2, what="two in the backlog"
    )
    assert len(engine.held) == 1
    resp = await client.post(UNLOAD, json={"lora_name": "alpha"}, headers=ADMIN)
    assert resp.status == 200
    await refused(await client.post(CHAT, json=chat("alpha")), 404)
    gate.set()
    for done in [await s for s in sent]:
        assert done.status == 200, await done.text()
        assert (await done.json())["model"] == "alpha"
    assert list(engine.adapters.values()) == ["alpha"] * 3


# ------------------------------------------------------------ tensor shapes


def demo_shapes() -> ModelShapes:
    shapes = ModelShapes.from_config(type("Config", (), ARCHITECTURE)())
    assert shapes is not None
    return shapes


def test_the_demo_adapter_fits_the_demo_model(tmp_path: Path) -> None:
    check_shapes(write_demo_adapter(tmp_path / "a", seed=1), demo_shapes())


@pytest.mark.parametrize(
    ("name", "shape", "says"),
    [
        (
            "layers.0.self_attn.q_proj.lora_A.weight",
            (8, 512),
            "does not fit the base model's q_proj",
        ),
        (
            "layers.0.self_attn.v_proj.lora_B.weight",
            (256, 8),
            "does not fit the base model's v_proj",
        ),
        ("layers.7.self_attn.q_proj.lora_A.weight", (8, 256), "for layer 7; the base model has 2"),
    ],
)
def test_a_tensor_that_does_not_fit_is_named(
    tmp_path: Path, name: str, shape: tuple[int, int], says: str
) -> None:
    path = write_adapter(tmp_path / "a")
    with (path / "adapter_model.safetensors").open("wb") as f:
        write_safetensors(
            f, {f"base_model.model.model.{name}": (shape, b"\0" * 2 * shape[0] * shape[1])}
        )
    with pytest.raises(ValueError, match=says):
        check_shapes(path, demo_shapes())


# ------------------------------------------------------------ the CLI
# The first parse in a process imports vLLM: seconds, more on a busy machine.


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ["--allow-runtime-lora", "--lora-root", "{root}", "--admin-key-file", "{key}"],
            "--enable-lora",
        ),
        (["--allow-runtime-lora", "--enable-lora", "--admin-key-file", "{key}"], "--lora-root"),
        (["--allow-runtime-lora", "--enable-lora", "--lora-root", "{root}"], "--admin-key-file"),
        (
            [
                "--enable-lora",
                "--allow-runtime-lora",
                "--lora-root",
                "{root}/none",
                "--admin-key-file",
                "{key}",
            ],
            "is not a directory",
        ),
        (
            [
                "--enable-lora",
                "--allow-runtime-lora",
                "--lora-root",
                "{root}",
                "--admin-key-file",
                "{open}",
            ],
            "readable by other users",
        ),
        (
            [
                "--enable-lora",
                "--allow-runtime-lora",
                "--lora-root",
                "{root}",
                "--admin-key-file",
                "{key}",
                "--api-key-file",
                "{key}",
            ],
            "a caller's key",
        ),
    ],
)
@pytest.mark.timeout(120)
def test_runtime_lora_flags_need_each_other(
    demo_cache_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    says: str,
) -> None:
    key, open_key = tmp_path / "admin.key", tmp_path / "open.key"
    for f, mode in ((key, 0o600), (open_key, 0o644)):
        f.write_text("sk-admin\n")
        f.chmod(mode)
    paths = {"root": str(tmp_path), "key": str(key), "open": str(open_key)}
    with pytest.raises(SystemExit) as exit_:
        parse_serve_args(
            ["--demo-cache-dir", str(demo_cache_root), *(f.format(**paths) for f in flags)], {}
        )
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and says in lines[0], lines


@pytest.mark.timeout(120)
def test_runtime_lora_settings_are_read_once(demo_cache_root: Path, tmp_path: Path) -> None:
    key = tmp_path / "admin.key"
    key.write_text("  sk-admin\n")
    key.chmod(0o600)
    (tmp_path / "root").mkdir()
    s = parse_serve_args(
        [
            "--demo-cache-dir",
            str(demo_cache_root),
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--allow-runtime-lora",
            "--lora-root",
            str(tmp_path / "root" / ".." / "root"),
            "--admin-key-file",
            str(key),
        ],
        {},
    )
    assert (s.allow_runtime_lora, s.admin_key, s.max_lora_rank) == (True, "sk-admin", 8)
    assert s.lora_root == (tmp_path / "root").resolve()
    assert "sk-admin" not in repr(s)
