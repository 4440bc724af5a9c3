"""The internal door: how a batch line enters this app as its caller's request.

Why this module exists: a batch line's result must be exactly the body its
synchronous endpoint answers, under the same limits, dedupe, watchdog and
fair share (issue 42). So the Batch API's runner
(server/api/openai_batches/runner.py) sends each line as an HTTP request to
this same app, through a Unix socket in a private directory (mode 0700, the
socket 0600) opened on the app's runner beside the public socket. A request
there carrying the process's random secret (`DOOR_HEADER`) is the caller named
by `CALLER_HEADER`, and a line of the batch `BATCH_HEADER` names (`BATCH_LINE`,
its id, for the usage record: server/operations/usage.py): background work
(batching/classes.py rule 1, which raises its priority; the body stays the
client's); server/http/middleware.py refuses the header anywhere else.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from aiohttp import web

__all__ = ["BATCH_HEADER", "BATCH_LINE", "CALLER_HEADER", "DOOR", "DOOR_HEADER", "Door"]

DOOR_HEADER: Final = "x-sluice-door"
CALLER_HEADER: Final = "x-sluice-caller"
BATCH_HEADER: Final = "x-sluice-batch"  # the line's batch id, for its usage record
# Set by the middleware at the door: the batch id of a batch line ("" if unnamed).
BATCH_LINE = web.RequestKey("batch_line", str)


@dataclass(frozen=True, slots=True)
class Door:
    """The internal door: its socket's path and the secret a line carries."""

    path: Path
    secret: str

    @classmethod
    def make(cls) -> Door:
        where = Path(tempfile.mkdtemp(prefix="sluice-door-"))  # mode 0700
        return cls(where / "door.sock", secrets.token_urlsafe(32))

    def admits(self, secret: str | None) -> bool:
        return secret is not None and secrets.compare_digest(secret, self.secret)

    async def open(self, runner: web.BaseRunner) -> web.UnixSite:
        """The door's site on the app's runner (beside the public socket)."""
        site = web.UnixSite(runner, str(self.path))
        await site.start()
        os.chmod(self.path, 0o600)
        return site

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()


DOOR = web.AppKey("door", Door)  # the batch lines' way in
