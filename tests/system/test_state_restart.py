"""What Sluice holds outlives a SIGKILL: a stored response created with the
`openai` client is read back and continued, and a batch killed mid-way resumes
and completes with each `custom_id` exactly once in its output, after Sluice
is killed and started again on the same --state-dir (two engine starts). The
usage written before the kill is still there, no line of the batch counted
twice, and a caller that spent its day's budget is still refused."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support import SluiceProcess

pytestmark = [pytest.mark.engine, pytest.mark.system]

MODEL = "sluice-demo"
NO_THINK: Any = {"effort": "none"}


CALLERS = """
[callers.main]
key = "sk-main"
[callers.metered]
key = "sk-metered"
tokens_per_day = 1
"""


def _client(proc: SluiceProcess, key: str = "sk-main") -> openai.OpenAI:
    # The Usage API is an admin route in the client: a caller's own key reads its own.
    return openai.OpenAI(base_url=proc.base + "/v1", api_key=key, admin_api_key=key, max_retries=0)


def _count(state: Path, sql: str, key: str) -> int:
    """One number from the state database on disk (what a kill keeps), read only."""
    with contextlib.closing(sqlite3.connect(f"file:{state / 'state.db'}?mode=ro", uri=True)) as db:
        return int(db.execute(sql, (key,)).fetchone()[0])


def _written(state: Path, caller: str) -> int:
    """Requests of `caller` in the usage table."""
    sql = "SELECT COALESCE(SUM(requests), 0) FROM usage_hours WHERE caller = ?"
    return _count(state, sql, caller)


def _lines_written(state: Path, batch_id: str) -> int:
    """A batch's lines with their results."""
    return _count(state, "SELECT COUNT(*) FROM batch_lines WHERE batch_id = ?", batch_id)


def _metered_chat(client: openai.OpenAI) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi."}],
        max_tokens=4,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )


def _batch_requests(client: openai.OpenAI) -> int:
    """Batch lines in the caller's usage (all time), through the openai client."""
    page = client.admin.organization.usage.completions(
        start_time=int(time.time()) - 86400, bucket_width="1d", group_by=["batch"]
    )
    return sum(r.num_model_requests for b in page.data for r in b.results if r.batch)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in "ZX"


LINES = 40


def _batch_file() -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"k{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"Line {i}."}],
                    "max_tokens": 32,
                    "chat_template_kwargs": {"enable_thinking": False},
                },
            }
        ).encode()
        + b"\n"
        for i in range(LINES)
    )


def _until(client: openai.OpenAI, batch_id: str, done: Any, timeout: float) -> Any:
    end = time.monotonic() + timeout
    while not done(batch := client.batches.retrieve(batch_id)):
        assert time.monotonic() < end, f"timed out: {batch}"
        time.sleep(0.2)
    return batch


def test_stored_responses_and_a_batch_survive_a_sigkill(
    demo_cache_root: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    callers = tmp_path / "callers.toml"
    callers.write_text(CALLERS)
    callers.chmod(0o600)
    args = ["--state-dir", str(state), "--batch-lines-in-flight", "4", "--callers", str(callers)]
    first = SluiceProcess(args, cache_dir=demo_cache_root, log_path=tmp_path / "first.log")
    try:
        first.wait_ready()
        client = _client(first)
        made = client.responses.create(
            model=MODEL, input="Say hi.", reasoning=NO_THINK, max_output_tokens=8
        )
        upload = client.files.create(file=("in.jsonl", _batch_file()), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        # The metered caller spends its day's budget; its usage reaches the disk
        # by the ledger's own flush (within its 2 s), not by a read of it.
        _metered_chat(_client(first, "sk-metered"))
        deadline = time.monotonic() + 30
        while _written(state, "metered") < 1:
            assert time.monotonic() < deadline, "the usage was not written"
            time.sleep(0.1)
        # Killed with some lines done and others running.
        _until(client, batch.id, lambda b: b.request_counts.completed >= 4, 120)
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
    # The lines whose results the first life wrote (more may have ended between the
    # last look and the kill): they are not run again, so their usage is the first
    # life's, written or not.
    done_at_kill = _lines_written(state, batch.id)
    assert done_at_kill >= 4

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
        final = ("completed", "failed", "expired", "cancelled")
        done = _until(client, batch.id, lambda b: b.status in final, 240)
        assert done.status == "completed", done
        assert done.request_counts.completed == LINES and done.error_file_id is None
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(f"k{i}" for i in range(LINES))
        assert all(x["response"]["status_code"] == 200 for x in out)
        # Each line's usage once: those the kill caught unwritten (at most its
        # last 2 s) are missing, none is counted twice.
        assert LINES - done_at_kill <= _batch_requests(client) <= LINES
        assert _batch_requests(_client(second, "sk-metered")) == 0  # not its usage
        with pytest.raises(openai.RateLimitError) as over:
            _metered_chat(_client(second, "sk-metered"))
        assert over.value.code == "insufficient_quota"
