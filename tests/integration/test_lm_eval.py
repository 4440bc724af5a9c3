"""lm-evaluation-harness itself against Sluice (issue 51): `lm_eval --model
local-completions` on a small local multiple-choice task, scored by
loglikelihood, with its default `auto` tokenizer backend (which probes
/tokenizer_info and /tokenize, then sends token-id prompts with echo,
logprobs 1 and max_tokens 1). It finishes and prints its table, and each
choice's loglikelihood is the one vLLM's own server gives lm-eval on the same
demo model and flags, to 1e-3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import SluiceProcess, vllm_on_demo

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MODEL = "sluice-demo"

QUESTIONS = [
    ("The sky on a clear day is", [" blue", " green", " loud"], 0),
    ("Two plus two equals", [" four", " seven", " a river"], 0),
    ("Water freezes when it is", [" warm", " cold", " quiet"], 1),
    ("A cat says", [" woof", " meow", " moo"], 1),
]


def _task(root: Path) -> None:
    data = root / "tiny_mc.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    (root / "tiny_mc.yaml").write_text(
        "task: sluice_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )


@pytest.fixture(scope="module")
def vllm_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's own server on the demo model: compiled, as the package's Sluice
    runs (the same graph, so the same numbers), with the tokenizer-info route
    lm-eval's `auto` backend reads (vLLM serves it only behind this flag)."""
    flags = ["--no-enforce-eager", "--enable-tokenizer-info-endpoint"]
    with vllm_on_demo(demo_model_dir, MODEL, flags, tmp_path_factory.mktemp("vllm")) as url:
        yield url


def _lm_eval(base: str, tmp_path: Path) -> tuple[str, list[dict[str, Any]]]:
    """One `lm_eval` run of the tiny task against `base`: its table and samples.

    One request at a time: each prompt is computed alone, in the same batch
    shape on both servers (bf16 on the CPU differs in the last bits between
    batch shapes)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir(parents=True)
    _task(tasks)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "OPENAI_API_KEY": "none",
    }
    args = f"model={MODEL},base_url={base}/v1/completions,num_concurrent=1,max_retries=1"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            args,
            "--include_path",
            str(tasks),
            "--tasks",
            "sluice_tiny_mc",
            "--output_path",
            str(out),
            "--log_samples",
        ],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    (samples,) = out.rglob("samples_sluice_tiny_mc_*.jsonl")
    return run.stdout, [json.loads(line) for line in samples.read_text().splitlines()]


def _loglikelihoods(rows: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """(question, choice): the loglikelihood lm-eval summed from the prompt logprobs."""
    return {(row["doc_id"], i): float(r[0][0]) for row in rows for i, r in enumerate(row["resps"])}


def test_lm_eval_multiple_choice_as_on_vllms_server(
    sluice_server: SluiceProcess, vllm_server: str, tmp_path: Path
) -> None:
    table, rows = _lm_eval(sluice_server.base, tmp_path / "sluice")
    # Its table, with the task's accuracy.
    assert "sluice_tiny_mc" in table and "acc" in table, table
    assert len(rows) == len(QUESTIONS)
    ours = _loglikelihoods(rows)
    # One (loglikelihood, is_greedy) per choice: real values, not the zeros a
    # missing prompt logprob would sum to.
    assert len(ours) == 3 * len(QUESTIONS) and all(ll < 0 for ll in ours.values()), ours
    # The same loglikelihoods as vLLM's own server gives lm-eval, to 1e-3.
    _, theirs_rows = _lm_eval(vllm_server, tmp_path / "vllm")
    theirs = _loglikelihoods(theirs_rows)
    assert ours.keys() == theirs.keys()
    far = {k: (ours[k], theirs[k]) for k in ours if abs(ours[k] - theirs[k]) > 1e-3}
    assert not far, far


# Fields only vLLM's server writes (its own extensions; and its nulls and
# empty lists, which Sluice leaves out); everything else of an answer is compared.
_VLLM_ONLY = frozenset(
    {
        "stop_reason",
        "token_ids",
        "prompt_token_ids",
        "prompt_text",
        "kv_transfer_params",
        "system_fingerprint",
        "service_tier",
        "routed_experts",
        "prompt_logprobs",  # compared on its own, where it was asked
        "id",
        "created",
    }
)
_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("completions", {"prompt": "The sky is", "max_tokens": 2, "logprobs": 1, "echo": True}),
    (
        "completions",
        {"prompt": [[9, 10, 11, 12], [13, 14]], "max_tokens": 0, "logprobs": 2, "echo": True},
    ),
    ("completions", {"prompt": "Two plus two", "max_tokens": 1, "prompt_logprobs": 2}),
    (
        "chat",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 1},
    ),
]


def _close(ours: Any, theirs: Any, where: str) -> None:
    """The same JSON, numbers to 1e-3, vLLM's own extra fields aside."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict), where
        keys = {k for k, v in theirs.items() if k not in _VLLM_ONLY and v not in (None, [], {})}
        assert keys <= ours.keys(), (where, keys - ours.keys())
        for k in keys:
            _close(ours[k], theirs[k], f"{where}.{k}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _close(a, b, f"{where}[{i}]")
    elif isinstance(theirs, float):
        assert ours == pytest.approx(theirs, abs=1e-3), where
    else:
        assert ours == theirs, where


@pytest.mark.parametrize(("api", "body"), _BODIES)
def test_the_same_answer_as_vllms_server(
    sluice_server: SluiceProcess, vllm_server: str, api: str, body: dict[str, Any]
) -> None:
    """Echo with logprobs (text, token-id arrays, max_tokens 0) and vLLM's
    prompt_logprobs extension: Sluice's answer is vLLM's server's, field by
    field, greedy, one request at a time on each."""
    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    sent = {"model": MODEL, "temperature": 0, **body}
    if api == "chat":
        sent["chat_template_kwargs"] = {"enable_thinking": False}
    ours = httpx.post(sluice_server.base + path, json=sent, timeout=120)
    theirs = httpx.post(vllm_server + path, json=sent, timeout=120)
    assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
    a, b = ours.json(), theirs.json()
    _close(a, b, api)
    if "prompt_logprobs" in body:
        pairs = [(a, b)] if api == "chat" else list(zip(a["choices"], b["choices"], strict=True))
        for x, y in pairs:
            _close(x["prompt_logprobs"], y["prompt_logprobs"], "prompt_logprobs")
