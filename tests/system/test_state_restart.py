"""Stored responses outlive a SIGKILL: a response created with the `openai`
client is read back and continued after Sluice is killed and started again on
the same --state-dir (two engine starts)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support import SluiceProcess

pytestmark = [pytest.mark.engine, pytest.mark.system]

MODEL = "sluice-demo"
NO_THINK: Any = {"effort": "none"}


def _client(proc: SluiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.base + "/v1", api_key="unused", max_retries=0)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in "ZX"


def test_a_stored_response_survives_a_sigkill(demo_cache_root: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    args = ["--state-dir", str(state)]
    first = SluiceProcess(args, cache_dir=demo_cache_root, log_path=tmp_path / "first.log")
    try:
        first.wait_ready()
        made = _client(first).responses.create(
            model=MODEL, input="Say hi.", reasoning=NO_THINK, max_output_tokens=8
        )
        cores = first.engine_core_pids()
        assert cores, first.tail()
        os.kill(first.proc.pid, signal.SIGKILL)  # no drain, no close of the database
        first.proc.wait(30)
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in cores) and time.monotonic() < deadline:
            time.sleep(0.1)  # vLLM's engine core sees its parent die and exits
        for pid in cores:  # if not, it must not outlive the test
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    finally:
        first.stop()
    assert (state / "state.db").exists()

    second = SluiceProcess(args, cache_dir=demo_cache_root, log_path=tmp_path / "second.log")
    with second.running():
        client = _client(second)
        back = client.responses.retrieve(made.id)
        assert back.id == made.id and back.output_text == made.output_text
        more = client.responses.create(
            model=MODEL,
            input="And again.",
            previous_response_id=made.id,
            reasoning=NO_THINK,
            max_output_tokens=8,
        )
        assert more.id != made.id and more.previous_response_id == made.id
        assert more.usage is not None and more.usage.input_tokens > made.usage.input_tokens  # type: ignore[union-attr]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve("resp_" + "0" * 32)
