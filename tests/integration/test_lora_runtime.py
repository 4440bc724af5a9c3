"""Runtime LoRA load and unload on the real engine (server/api/lora_admin/endpoint.py): one
server (module scope: an engine start costs ~25 s) with --allow-runtime-lora,
a --lora-root of demo adapters made by `python -m server make-demo-adapter`,
an admin key file and a caller key, through httpx and the official `openai`
client.

What is tested is what an operator relies on: a loaded adapter is listed and
changes greedy output (repeatably), an unloaded one is a 404; a bad adapter is
a 400 naming the cause while a loaded one keeps its exact output; a path
outside the root is a 403; no admin key is a 401 and a caller's key a 403; and
work queued in Sluice's backlog or running in the engine when its adapter is
unloaded finishes on that adapter (two engine slots, eight streams).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.engines.demo.model import write_safetensors
from tests.support import ROOT, SluiceProcess, metric

pytestmark = pytest.mark.engine

MODEL = "sluice-demo"
ADMIN_KEY, CALLER_KEY = "sk-admin-test", "sk-caller-test"
PROMPT = "The quick brown fox"
# Long enough that a stream is still running when the unload arrives (the demo
# model makes a few hundred tokens a second on this CPU), short enough for CI.
LONG = 96
SLOTS = 2  # --max-num-seqs
# Streams in the unload test. The engine's queue may take, beside the SLOTS running,
# --backlog-feed-steps (1 here) x the free slots plus a spare of at most SLOTS that
# earlier tests' under-fed steps leave (batching/room.py rule 2): at most 2 x SLOTS
# before the engine's first step report. Four times the slots leaves some surely
# held in Sluice's backlog, whatever the spare is.
STREAMS = 4 * SLOTS


def make_adapter(dest: Path, seed: int, *extra: str) -> Path:
    """`sluice make-demo-adapter`, the command a user runs."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "make-demo-adapter",
            str(dest),
            "--seed",
            str(seed),
            *extra,
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return dest


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-root")
    make_adapter(root / "alpha", 1)
    make_adapter(root / "beta", 2)
    make_adapter(root / "gamma", 3)
    make_adapter(root / "rank16", 4, "--rank", "16")
    # A fine-tune whose config names another base, with the demo model's shapes.
    make_adapter(root / "other-base", 5, "--base", "Qwen/Qwen3-14B")
    # The demo model's names, but a tensor of the wrong width.
    misfit = make_adapter(root / "misfit", 6)
    with (misfit / "adapter_model.safetensors").open("wb") as f:
        a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        write_safetensors(f, {a: ((8, 512), b"\0" * 2 * 8 * 512)})
    return root


@pytest.fixture(scope="module")
def server(
    demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory, root: Path
) -> Iterator[SluiceProcess]:
    tmp = tmp_path_factory.mktemp("lora-runtime")
    for name, key in (("admin.key", ADMIN_KEY), ("caller.key", CALLER_KEY)):
        (tmp / name).write_text(key + "\n")
        (tmp / name).chmod(0o600)
    args = [
        "--log-format",
        "plain",
        "--api-key-file",
        str(tmp / "caller.key"),
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "2",
        "--max-num-seqs",
        str(SLOTS),
        "--no-dedupe",  # identical greedy streams each run (the unload test)
        "--backlog-feed-steps",
        "1",  # the unload test's streams wait in Sluice's backlog, not vLLM's queue
        "--allow-runtime-lora",
        "--lora-root",
        str(root),
        "--admin-key-file",
        str(tmp / "admin.key"),
        "--lora-modules",
        f"alpha={root / 'alpha'}",
    ]
    with SluiceProcess(args, cache_dir=demo_cache_root, log_path=tmp / "sluice.log").running() as p:
        yield p


def admin(
    server: SluiceProcess, path: str, body: dict[str, Any], key: str = ADMIN_KEY
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base}/v1/{path}", json=body, headers=headers, timeout=60)


def load(server: SluiceProcess, name: str, path: str | Path, **kw: Any) -> httpx.Response:
    return admin(server, "load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, **kw)


def unload(server: SluiceProcess, name: str) -> httpx.Response:
    return admin(server, "unload_lora_adapter", {"lora_name": name})


@pytest.fixture(scope="module")
def api(server: SluiceProcess) -> Iterator[openai.OpenAI]:
    """One client for the module (thread-safe; its sockets closed at the end)."""
    with openai.OpenAI(base_url=server.base + "/v1", api_key=CALLER_KEY, max_retries=0) as c:
        yield c


def complete(api: openai.OpenAI, model: str, max_tokens: int = 16) -> str:
    out = api.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


def listed(api: openai.OpenAI) -> list[tuple[str, str | None]]:
    return [(m.id, getattr(m, "parent", None)) for m in api.models.list()]


def test_load_run_unload_then_404(server: SluiceProcess, api: openai.OpenAI, root: Path) -> None:
    base = complete(api, MODEL)
    resp = load(server, "beta", root / "beta")
    assert resp.status_code == 200, resp.text
    assert resp.text == "Success: LoRA adapter 'beta' added successfully."
    assert ("beta", MODEL) in listed(api)
    beta = complete(api, "beta")
    assert beta != base and beta != complete(api, "alpha")
    assert complete(api, "beta") == beta  # greedy on it repeats
    chat = api.chat.completions.create(
        model="beta", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "beta"
    resp = unload(server, "beta")
    assert resp.status_code == 200, resp.text
    assert resp.text == "Success: LoRA adapter 'beta' removed successfully."
    with pytest.raises(openai.NotFoundError) as nf:
        complete(api, "beta")
    assert nf.value.code == "model_not_found"
    assert "beta" not in dict(listed(api))
    assert unload(server, "beta").status_code == 404
    assert complete(api, MODEL) == base


@pytest.mark.parametrize(
    ("name", "path", "says"),
    [
        ("big", "rank16", "rank 16 is above --max-lora-rank 8"),
        ("misfit", "misfit", "does not fit the base model's q_proj"),
        ("none", "no-such-dir", "is not a directory"),
        ("alpha", "beta", "has already been loaded"),
        (MODEL, "beta", "conflicts with a served base model"),
    ],
)
def test_a_bad_adapter_is_a_400_while_the_loaded_keep_serving(
    server: SluiceProcess, api: openai.OpenAI, root: Path, name: str, path: str, says: str
) -> None:
    alpha, before = complete(api, "alpha"), listed(api)
    resp = load(server, name, root / path)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"
    assert complete(api, "alpha") == alpha
    assert listed(api) == before


def test_a_base_named_otherwise_loads_when_its_shapes_fit(
    server: SluiceProcess, api: openai.OpenAI, root: Path
) -> None:
    """Names do not decide (issue 28): the adapter's config says Qwen/Qwen3-14B,
    its tensors fit the demo model, so it loads with a warning and runs."""
    resp = load(server, "other", root / "other-base")
    assert resp.status_code == 200, resp.text
    assert resp.text.startswith("Success: LoRA adapter 'other' added successfully.")
    assert "Warning" in resp.text and "'Qwen/Qwen3-14B'" in resp.text
    assert complete(api, "other") != complete(api, MODEL)
    assert "LoRA adapter loaded on a base named otherwise" in server.tail(100_000)
    assert unload(server, "other").status_code == 200


def test_a_path_outside_the_root_is_403(
    server: SluiceProcess, api: openai.OpenAI, root: Path
) -> None:
    outside = make_adapter(root.parent / f"{root.name}-outside", 6)
    (root / "escape").symlink_to(outside)
    for path in (outside, root / ".." / outside.name, root / "escape"):
        resp = load(server, "outside", path)
        assert resp.status_code == 403, resp.text
        assert resp.json()["error"]["code"] == "path_not_allowed"
    assert "outside" not in dict(listed(api))


def test_no_admin_key_is_401_and_a_callers_key_403(
    server: SluiceProcess, api: openai.OpenAI, root: Path
) -> None:
    before = listed(api)
    for key, status in (("", 401), ("sk-wrong", 401), (CALLER_KEY, 403)):
        assert load(server, "beta", root / "beta", key=key).status_code == status
        assert admin(
            server, "unload_lora_adapter", {"lora_name": "alpha"}, key=key
        ).status_code == (status)
    assert listed(api) == before


def stream_text(api: openai.OpenAI, model: str, started: threading.Event) -> tuple[str, float]:
    """One greedy stream of LONG tokens; its text and when it ended."""
    parts = []
    stream = api.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            started.set()
            parts.append(chunk.choices[0].text)
    return "".join(parts), time.monotonic()


def streams(api: openai.OpenAI, model: str, n: int) -> tuple[list[Any], list[threading.Event]]:
    pool = ThreadPoolExecutor(n)
    events = [threading.Event() for _ in range(n)]
    futures = [pool.submit(stream_text, api, model, e) for e in events]
    pool.shutdown(wait=False)
    return futures, events


def test_unloading_finishes_queued_and_running_work(
    server: SluiceProcess, api: openai.OpenAI, root: Path
) -> None:
    """Eight streams on two engine slots: two run in the engine, some wait in
    vLLM's queue and some in Sluice's backlog when the adapter is unloaded; all
    finish on it, with the text the same streams give while it stays loaded."""
    assert load(server, "gamma", root / "gamma").status_code == 200
    n = STREAMS
    futures, _ = streams(api, "gamma", n)
    reference = sorted(f.result(timeout=120)[0] for f in futures)
    assert reference[0] != complete(api, MODEL, LONG)

    futures, started = streams(api, "gamma", n)
    deadline = time.monotonic() + 60
    while not (
        any(e.is_set() for e in started) and metric(server.base, "sluice_queue_requests") >= 1
    ):
        assert time.monotonic() < deadline, "no stream running with others in the backlog"
        time.sleep(0.02)
    queued = metric(server.base, "sluice_queue_requests")
    resp = unload(server, "gamma")
    unloaded = time.monotonic()
    assert resp.status_code == 200, resp.text
    with pytest.raises(openai.NotFoundError):
        complete(api, "gamma")
    results = [f.result(timeout=120) for f in futures]
    assert queued >= 1
    # Every stream ended after the unload (none had finished), on gamma's weights.
    assert all(ended > unloaded for _, ended in results)
    assert sorted(text for text, _ in results) == reference
