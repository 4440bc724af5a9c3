"""Several models in one Sluice on the real engine (issue 30): two demo chat
models from one models file, one loaded at start and one on demand, and a third
whose load fails (its weights are missing: the config resolves at start, the
engine fails as it loads them). One Sluice for the module.

The `openai` client talks to both models through one base URL; the on-demand
model's engine core process appears with its first request and goes when it
has been idle for its `unload-after`, or when the other on-demand model needs
its room (the budget holds chat and one of them)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support import SluiceProcess

pytestmark = pytest.mark.engine

# Small KV caches (the demo model's 1 KiB per token) and eager mode (no
# torch.compile: a start in about 12 s, not 18-40): three engines share this
# machine's memory and two cores.
MODELS = """
memory-budget = {budget}

[models.chat]                     # no `model`: the offline demo model
kv-cache-memory-bytes = 67108864
max-model-len = 4096
enforce-eager = true

[models.spare]
load = "on-demand"
unload-after = "4s"
kv-cache-memory-bytes = 67108864
max-model-len = 4096
enforce-eager = true

[models.broken]
model = "{broken}"
load = "on-demand"
kv-cache-memory-bytes = 67108864
max-model-len = 4096
enforce-eager = true
"""


KV = 67108864  # each model's kv-cache-memory-bytes


@pytest.fixture(scope="module")
def models_server(
    demo_model_dir: Path, demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SluiceProcess]:
    tmp = tmp_path_factory.mktemp("models")
    broken = tmp / "no-weights"  # the demo model's config and tokenizer, no weights
    shutil.copytree(demo_model_dir, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    path = tmp / "models.toml"
    # Room for chat and one on-demand model, not both: a load unloads the other.
    weights = sum(f.stat().st_size for f in demo_model_dir.glob("*.safetensors"))
    budget = 2 * (KV + weights) + KV // 2
    path.write_text(MODELS.format(broken=broken, budget=budget))
    with SluiceProcess(
        ["--models", str(path), "--log-format", "plain", "--load-timeout", "200"],
        cache_dir=demo_cache_root,
        log_path=tmp / "sluice.log",
    ).running() as proc:
        yield proc


def _cards(server: SluiceProcess) -> dict[str, dict[str, Any]]:
    r = httpx.get(server.base + "/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    return {c["id"]: c for c in r.json()["data"]}


@pytest.fixture
def client(models_server: SluiceProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=models_server.base + "/v1", api_key="unused", timeout=300
    ) as c:  # closed: an open socket left to the collector is a warning, an error here
        yield c


def _ask(client: openai.OpenAI, model: str) -> str:
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4
    )
    assert out.model == model
    return out.choices[0].message.content or ""


def _until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.25)


def test_one_front_two_engines_one_loaded_on_its_first_request(
    models_server: SluiceProcess, client: openai.OpenAI
) -> None:
    cards = _cards(models_server)
    assert {k: v["state"] for k, v in cards.items()} == {
        "chat": "loaded",
        "spare": "unloaded",
        "broken": "unloaded",
    }
    assert len(models_server.engine_core_pids()) == 1  # only the start model's
    _ask(client, "chat")
    # The on-demand model: the request waits while its engine starts.
    _ask(client, "spare")
    assert _cards(models_server)["spare"]["state"] == "loaded"
    assert len(models_server.engine_core_pids()) == 2
    assert "model loaded" in models_server.tail(200_000)
    with pytest.raises(openai.NotFoundError):
        _ask(client, "nope")


def test_an_idle_on_demand_model_unloads_and_its_engine_process_goes(
    models_server: SluiceProcess, client: openai.OpenAI
) -> None:
    _ask(client, "spare")
    assert len(models_server.engine_core_pids()) == 2
    _until(lambda: _cards(models_server)["spare"]["state"] == "unloaded", 60, "idle unload")
    # Its engine core process (and the memory it held) is gone; chat serves on.
    _until(lambda: len(models_server.engine_core_pids()) == 1, 30, "engine process gone")
    _ask(client, "chat")
    metrics = httpx.get(models_server.base + "/metrics", timeout=30).text
    assert 'sluice_model_unloads_total{model="spare"}' in metrics


def test_a_load_that_fails_is_a_clear_503_and_the_others_keep_serving(
    models_server: SluiceProcess, client: openai.OpenAI
) -> None:
    """`spare` loaded and idle, then `broken`: there is room for one of them, so
    `spare` (the least recently used idle on-demand model) unloads first; then
    `broken`'s load fails and chat serves on."""
    _ask(client, "spare")
    r = httpx.post(
        models_server.base + "/v1/chat/completions",
        json={"model": "broken", "messages": [{"role": "user", "content": "Hi"}]},
        timeout=300,
    )
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "model_load_failed" and "broken" in err["message"]
    assert int(r.headers["Retry-After"]) >= 1
    assert _cards(models_server)["broken"]["state"] == "failed"
    log = models_server.tail(400_000)
    assert "model load failed" in log
    assert "why=room for broken" in log  # spare made room
    assert _cards(models_server)["spare"]["state"] == "unloaded"
    _ask(client, "chat")
    assert httpx.get(models_server.base + "/health", timeout=30).status_code == 200
