"""bench/locustfile.py (issue 51) run headless by Locust itself against the
demo model for 30 s: the seeds' mix goes through, and besides Locust's own
whole-response entries it reports TTFT at the first token and tokens per
second, per class, in its statistics.

Issue 64: with no size flags the long classes fit the served context. The
file's server is served at a 1,024-token context (its own start: the shared
server's 40,960 tokens would hide the issue, and the other files' tests need
that context), where the seeds' 12,000-word analysis was a 400 each time."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import ROOT, SluiceProcess

pytestmark = pytest.mark.engine

CONTEXT = 1024  # --max-model-len


@pytest.fixture(scope="module")
def small_context(
    demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SluiceProcess]:
    with SluiceProcess(
        ["--max-model-len", str(CONTEXT), "--log-format", "plain"],
        cache_dir=demo_cache_root,
        log_path=tmp_path_factory.mktemp("locust") / "sluice.log",
    ).running() as proc:
        yield proc


def _locust(
    server: SluiceProcess, tmp_path: Path, *flags: str
) -> tuple[subprocess.CompletedProcess[str], dict[tuple[str, str], dict[str, str]]]:
    """Locust headless for 30 s (the demo model on two cores: a short run), the
    users' last requests let finish; its run and its statistics by (type, name)."""
    prefix = tmp_path / "run"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(ROOT / "bench" / "locustfile.py"),
            "--headless",
            "--users",
            "4",
            "--spawn-rate",
            "4",
            "--run-time",
            "30s",
            "--host",
            server.base,
            "--csv",
            str(prefix),
            "--html",
            str(tmp_path / "report.html"),
            "--stop-timeout",
            "30",
            *flags,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode in (0, 1), run.stderr[-3000:]  # 1: some request failed
    with (tmp_path / "run_stats.csv").open() as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    return run, rows


def test_locustfile_reports_ttft_and_fits_the_context(
    small_context: SluiceProcess, tmp_path: Path
) -> None:
    """The seeds' mix with no size flags (short answers: every class in 30 s):
    the long classes fitted to the 1,024-token context, every request of every
    class answered, and TTFT reported at the first token. One run for both
    checks (issue 64: they were two runs of 30 s each)."""
    run, rows = _locust(small_context, tmp_path, "--max-tokens", "16")
    for name in ("faq", "summary", "analysis"):
        row = rows[("POST", name)]
        assert int(row["Request Count"]) > 0, (name, run.stderr[-3000:])
        assert int(row["Failure Count"]) == 0, (name, run.stderr[-3000:])
    assert run.returncode == 0, run.stderr[-3000:]
    # The sizes chosen, logged once per run.
    chosen = [line for line in run.stderr.splitlines() if "max_model_len" in line]
    assert len(chosen) == 1 and f"{CONTEXT} tokens" in chosen[0], run.stderr[-3000:]
    # The whole responses, Locust's own entry (POST), and the first tokens.
    faq = rows[("POST", "faq")]
    ttft = rows[("TTFT", "faq")]
    # Every answer had a first token (one still streaming when the run ended
    # has its TTFT and not yet its whole response).
    assert int(faq["Request Count"]) <= int(ttft["Request Count"]) <= int(faq["Request Count"]) + 4
    # A first token comes before the whole answer.
    assert 0 < float(ttft["Median Response Time"]) <= float(faq["Median Response Time"])
    assert int(rows[("TPS", "faq")]["Request Count"]) > 0
    assert (tmp_path / "report.html").stat().st_size > 0
