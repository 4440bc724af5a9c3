"""lm-evaluation-harness itself against Sluice (issue 51): `lm_eval --model
local-completions` on a small local multiple-choice task, scored by
loglikelihood, with its default `auto` tokenizer backend (which probes
/tokenizer_info and /tokenize, then sends token-id prompts with echo,
logprobs 1 and max_tokens 1). It finishes and prints its table, and each
choice's loglikelihood is the one the prompt's logprobs give."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import SluiceProcess

pytestmark = pytest.mark.engine

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


def test_lm_eval_multiple_choice(sluice_server: SluiceProcess, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _task(tasks)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "OPENAI_API_KEY": "none",
    }
    args = (
        f"model=sluice-demo,base_url={sluice_server.base}/v1/completions,"
        "num_concurrent=2,max_retries=1"
    )
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
    # Its table, with the task's accuracy.
    assert "sluice_tiny_mc" in run.stdout and "acc" in run.stdout, run.stdout
    (samples,) = out.rglob("samples_sluice_tiny_mc_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == len(QUESTIONS)
    for row in rows:
        # One (loglikelihood, is_greedy) per choice: real values, not the
        # zeros a missing prompt logprob would sum to.
        lls = [float(r[0][0]) for r in row["resps"]]
        assert len(lls) == 3
        assert all(ll < 0 for ll in lls), lls
