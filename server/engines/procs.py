"""An engine's processes as /proc shows them: a core and its descendants.

Why this module exists: two parts of the engine's life walk the same tree,
the supervisor (server/engines/supervisor.py: a hung engine's processes are
ended by pid) and the start priority (server/engines/start_priority.py: a
ready engine's processes are raised back to the front's priority). Linux only,
as vLLM's engine processes are.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["alive", "process_tree"]


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants (from /proc's children lists), parents first."""
    out = [pid]
    i = 0
    while i < len(out):
        for listing in Path(f"/proc/{out[i]}/task").glob("*/children"):
            with contextlib.suppress(OSError, ValueError):
                out += [int(k) for k in listing.read_text().split() if int(k) not in out]
        i += 1
    return [p for p in out if alive(p)]


def alive(pid: int) -> bool:
    """Not exited (a zombie counts as gone: it holds no memory)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"
