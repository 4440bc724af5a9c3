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

__all__ = ["alive", "process_tree", "stat_fields"]


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
    fields = stat_fields(f"/proc/{pid}/stat")
    return fields is not None and bool(fields) and fields[0] not in "ZX"


def stat_fields(path: str) -> list[str] | None:
    """A /proc stat file's fields after the command, from the state on (proc(5)'s
    field 3 is [0]); None if the process or thread has gone. The command is cut at
    its last closing parenthesis: it may hold spaces and parentheses."""
    try:
        stat = Path(path).read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()
