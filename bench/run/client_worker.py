"""A long-lived process that runs vLLM's benchmark client, unmodified, job after job.

Why it exists: importing `vllm.benchmarks.serve` costs about 6.5 s of CPU on the
2-core machines; a full run has ~80 client runs, so a fresh process per run
would spend ~9 minutes importing, on the cores the servers need. A worker
imports once and then calls the client's own `main` (through bench/run/vllm_client.py)
for each job. The mixed-load scenario runs three workers at once, so its three
classes of requests start together instead of after three staggered imports.

Protocol (one JSON object per line): stdin gets `{"argv": [...], "log": path}`;
the worker's original stdout gets `{"rc": int, "error": str | null}` when the
job is done. During a job, fds 1 and 2 point at the job's log file (the client
and vLLM's loggers print there). The first line on stdout is `{"ready": true}`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path


def _run(argv: list[str], log: str) -> tuple[int, str | None]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vllm_client  # bench/run/vllm_client.py

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        try:
            rc = vllm_client.main(argv)
            err = None
        except BaseException as e:
            traceback.print_exc()
            rc, err = 1, f"{type(e).__name__}: {e}"
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)
    return rc, err


def main() -> int:
    # The control channel is a private copy of stdout: jobs redirect fd 1.
    ctrl = os.fdopen(os.dup(1), "w", buffering=1)
    with contextlib.redirect_stdout(sys.stderr):
        import vllm.benchmarks.serve  # noqa: F401 (the slow import, once)
    ctrl.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        rc, err = _run(list(job["argv"]), str(job["log"]))
        ctrl.write(json.dumps({"rc": rc, "error": err}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
