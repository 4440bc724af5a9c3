"""bench/locustfile.py (issue 51) run headless by Locust itself against the
demo model for 30 s: the seeds' mix goes through, and besides Locust's own
whole-response entries it reports TTFT at the first token and tokens per
second, per class, in its statistics."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, SluiceProcess

pytestmark = pytest.mark.engine


def test_locustfile_reports_ttft(sluice_server: SluiceProcess, tmp_path: Path) -> None:
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
            sluice_server.base,
            "--csv",
            str(prefix),
            "--html",
            str(tmp_path / "report.html"),
            # The demo model on two cores: a short mix, every class in 30 s.
            "--summary-words",
            "60",
            "--analysis-words",
            "400",
            "--max-tokens",
            "16",
            "--stop-timeout",
            "20",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    with (tmp_path / "run_stats.csv").open() as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    # The whole responses, Locust's own entry (POST), and the first tokens.
    faq = rows[("POST", "faq")]
    assert int(faq["Request Count"]) > 0 and int(faq["Failure Count"]) == 0
    ttft = rows[("TTFT", "faq")]
    # Every answer had a first token (one still streaming when the run ended
    # has its TTFT and not yet its whole response).
    assert int(faq["Request Count"]) <= int(ttft["Request Count"]) <= int(faq["Request Count"]) + 4
    # A first token comes before the whole answer.
    assert 0 < float(ttft["Median Response Time"]) <= float(faq["Median Response Time"])
    assert int(rows[("TPS", "faq")]["Request Count"]) > 0
    assert (tmp_path / "report.html").stat().st_size > 0
