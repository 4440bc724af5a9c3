"""The benchmark's progress lines, on stderr with the time of day.

Why it exists: the runner, the report's writer and `python -m bench` all tell
the person watching a run what happens, in one format.
"""

from __future__ import annotations

import sys
import time


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
