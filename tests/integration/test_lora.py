"""LoRA adapters on the real engine: one server (module scope: an engine start
costs ~25 s of CI) with two demo adapters and a callers file, through the
official `openai` and `anthropic` clients.

The demo adapters are random (`sluice make-demo-adapter`, seeds 1 and 2), so
what is tested is what an adapter must change: greedy output on an adapter
differs from the base and from the other adapter and repeats exactly; every
API runs on the adapter it names (Messages and Responses give chat's text for
the same conversation); the listing, 404 and 403 follow server/engines/lora.py rule 4;
the access line and the metrics name the adapter. A bad adapter at start-up
is one line and exit 2, before any engine starts.

Budgets (issue 52) share this server, the suite's one with a callers file: a
caller past its tokens_per_day gets 429 `insufficient_quota` with Retry-After
while another is served, and its batch pauses at the budget and completes
after the reset, each custom_id once. The module's budget day is `DAY`
seconds (SLUICE_BUDGET_DAY_SECONDS, a test's short clock), so a reset comes
within the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.engines.demo.lora_adapter import write_demo_adapter
from tests.support import ROOT, SluiceProcess
from tests.unit.test_lora import FILE

# The module's server may take minutes to start on a loaded machine (see `server`).
pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MODEL = "sluice-demo"
# The unit tests' callers file: all (every adapter), support (alpha, its default), sql (beta).
CALLERS = FILE
# ... and a caller with a budget: one request spends its day (batching/budgets.py).
METERED = '[callers.metered]\nkey = "sk-metered"\ntokens_per_day = 1\n'
DAY = 20.0  # seconds in a budget day on this server (SLUICE_BUDGET_DAY_SECONDS)
PROMPT = "The quick brown fox"
ASK: Any = [{"role": "user", "content": "Write about the sea."}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alpha": write_demo_adapter(root / "alpha", seed=1),
        "beta": write_demo_adapter(root / "beta", seed=2),
    }


@pytest.fixture(scope="module")
def server(
    demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path]
) -> Iterator[SluiceProcess]:
    tmp = tmp_path_factory.mktemp("lora")
    callers = tmp / "callers.toml"
    callers.write_text(CALLERS + METERED)
    callers.chmod(0o600)
    args = [
        "--log-format",
        "plain",
        "--callers",
        str(callers),
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "2",
        "--lora-modules",
        *(f"{name}={path}" for name, path in adapters.items()),
    ]
    proc = SluiceProcess(
        args,
        cache_dir=demo_cache_root,
        log_path=tmp / "sluice.log",
        env={"SLUICE_BUDGET_DAY_SECONDS": str(DAY)},
    )
    # A longer wait than the default 240 s: on the shared 2-core machine the
    # engine's worker process took 155 s just to start (its import starved).
    with proc.running(timeout=480) as p:
        try:
            yield p
        finally:
            for c in _CLIENTS.values():
                c.close()
            _CLIENTS.clear()


# One client per API and key for the module, closed with the server (an
# unclosed client's socket is a ResourceWarning, an error under -W error).
_CLIENTS: dict[tuple[str, str], Any] = {}


def client(server: SluiceProcess, key: str = "sk-all") -> openai.OpenAI:
    if ("openai", key) not in _CLIENTS:
        _CLIENTS["openai", key] = openai.OpenAI(
            base_url=server.base + "/v1", api_key=key, max_retries=0
        )
    c: openai.OpenAI = _CLIENTS["openai", key]
    return c


def anthropic_client(server: SluiceProcess, key: str) -> anthropic.Anthropic:
    if ("anthropic", key) not in _CLIENTS:
        _CLIENTS["anthropic", key] = anthropic.Anthropic(
            base_url=server.base, api_key=key, max_retries=0
        )
    c: anthropic.Anthropic = _CLIENTS["anthropic", key]
    return c


def complete(server: SluiceProcess, model: str, key: str = "sk-all") -> str:
    out = client(server, key).completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0
    )
    return out.choices[0].text


def chat(server: SluiceProcess, model: str) -> str:
    out = client(server).chat.completions.create(
        model=model, messages=ASK, max_tokens=12, temperature=0
    )
    assert out.model == model
    return out.choices[0].message.content or ""


def test_greedy_output_is_the_adapters_own_and_repeats(server: SluiceProcess) -> None:
    base, alpha, beta = (complete(server, m) for m in (MODEL, "alpha", "beta"))
    assert len({base, alpha, beta}) == 3, (base, alpha, beta)
    assert complete(server, "alpha") == alpha
    assert complete(server, "beta") == beta
    assert complete(server, MODEL) == base


def test_every_api_runs_on_the_adapter_it_names(server: SluiceProcess) -> None:
    text = chat(server, "alpha")
    assert text != chat(server, MODEL)
    resp = client(server).responses.create(
        model="alpha", input=ASK, max_output_tokens=12, temperature=0
    )
    assert resp.model == "alpha" and resp.output_text == text
    ac = anthropic_client(server, "sk-all")
    msg = ac.messages.create(
        model="alpha",
        max_tokens=12,
        messages=ASK,
        thinking={"type": "disabled"},
        extra_body={"temperature": 0},
    )
    assert msg.model == "alpha"
    assert "".join(b.text for b in msg.content if b.type == "text") == text


def test_listing_per_caller(server: SluiceProcess) -> None:
    def listed(key: str) -> list[tuple[str, str | None]]:
        return [(m.id, getattr(m, "parent", None)) for m in client(server, key).models.list()]

    assert listed("sk-all") == [(MODEL, None), ("alpha", MODEL), ("beta", MODEL)]
    assert listed("sk-support") == [(MODEL, None), ("alpha", MODEL)]
    assert listed("sk-sql") == [(MODEL, None), ("beta", MODEL)]


def test_a_callers_default_adapter_runs_requests_for_the_base(server: SluiceProcess) -> None:
    assert complete(server, MODEL, key="sk-support") == complete(server, "alpha")


def test_404_and_403(server: SluiceProcess) -> None:
    for key, model in (("sk-all", "gamma"), ("sk-support", "beta")):
        with pytest.raises(openai.NotFoundError) as nf:
            complete(server, model, key=key)
        assert nf.value.code == "model_not_found"
    with pytest.raises(openai.PermissionDeniedError) as pd:
        client(server, "sk-sql").chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert pd.value.code == "model_not_allowed"
    ac = anthropic_client(server, "sk-sql")
    with pytest.raises(anthropic.PermissionDeniedError):
        ac.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(model="alpha", max_tokens=2, messages=ASK)


def adapter_requests(server: SluiceProcess, adapter: str) -> float:
    text = httpx.get(server.base + "/metrics", timeout=5).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "sluice_requests_total" and s.labels.get("adapter") == adapter
    )


def test_the_access_line_and_the_metrics_name_the_adapter(server: SluiceProcess) -> None:
    before = adapter_requests(server, "beta")
    complete(server, "beta", key="sk-sql")
    assert adapter_requests(server, "beta") == before + 1
    line = (
        f"caller=sql model={MODEL} adapter=beta endpoint=completions class=interactive status=200"
    )
    assert line in server.tail(20000)


def spend_the_day(server: SluiceProcess) -> openai.RateLimitError:
    """`metered`'s requests until one is refused for its budget (each one
    served spends the day; a reset between two may serve one more)."""
    metered = client(server, "sk-metered")
    with pytest.raises(openai.RateLimitError) as refused:
        for _ in range(3):
            metered.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    return refused.value


def test_a_caller_past_its_tokens_per_day_gets_429_insufficient_quota(
    server: SluiceProcess,
) -> None:
    err = spend_the_day(server)
    assert err.status_code == 429
    assert err.code == "insufficient_quota" and err.type == "insufficient_quota"
    assert 1 <= int(err.response.headers["retry-after"]) <= DAY + 1
    assert chat(server, MODEL)  # another caller is served


def test_a_batch_pauses_at_the_budget_and_completes_after_the_reset(
    server: SluiceProcess,
) -> None:
    metered = client(server, "sk-metered")
    spend_the_day(server)
    reset = (time.time() // DAY + 1) * DAY
    body: Any = {"model": MODEL, "messages": ASK, "max_tokens": 2, "temperature": 0}
    lines = [
        {"custom_id": f"m{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(3)
    ]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    f = metered.files.create(file=("in.jsonl", data), purpose="batch")
    batch = metered.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while time.time() < reset - 2:  # paused: nothing done before the reset
        counts = metered.batches.retrieve(batch.id).request_counts
        assert counts is None or counts.completed + counts.failed == 0, counts
        time.sleep(0.5)
    end = time.monotonic() + 240
    while (batch := metered.batches.retrieve(batch.id)).status not in (
        "completed",
        "failed",
        "expired",
        "cancelled",
    ):
        assert time.monotonic() < end, batch
        time.sleep(0.5)
    assert batch.status == "completed" and time.time() >= reset, batch
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 0)
    assert batch.output_file_id is not None
    out = [json.loads(x) for x in metered.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["m0", "m1", "m2"]
    assert {x["response"]["status_code"] for x in out} == {200}


def start_error(args: list[str], cache_root: Path) -> str:
    """`sluice serve ARGS` that must exit 2 before any engine starts: its one error line."""
    out = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--port", "1", *args],
        cwd=ROOT,
        env={**os.environ, "SLUICE_CACHE_DIR": str(cache_root), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    return errors[0]


def test_a_bad_static_adapter_is_one_line_at_start(demo_cache_root: Path) -> None:
    # The process end to end (the other start-up refusals are unit tests of
    # parse_serve_args: tests/unit/test_cli_flags.py).
    line = start_error(["--enable-lora", "--lora-modules", "x=/nonexistent"], demo_cache_root)
    assert "LoRA adapter 'x': /nonexistent is not a directory" in line
