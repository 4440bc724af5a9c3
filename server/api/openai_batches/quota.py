"""The bytes each caller keeps on disk, and the one check that bounds them.

Why this module exists: issue 50. --batch-disk-per-caller was checked against
a sum read before an upload was written, so concurrent uploads of one caller
all passed it. Here each write reserves its bytes first, in one step that
checks and counts together (nothing awaits in between, so no other coroutine
can slip past), and every path that writes a caller's bytes goes through it:
an upload, a Message Batch's input file (server/api/openai_batches/runner.py
`Batches.store`), and a batch's output and error files (counted, never
refused: a batch's results are always written; `Quota.add`). Pure: the
runner loads it once from the files' rows and keeps it as they change.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Quota"]


class Quota:
    """Bytes per owner (None: no caller, the open server's) against one
    `limit` each, counted by file: the files kept and the uploads being written."""

    def __init__(self, limit: int, files: Iterable[tuple[str, str | None, int]] = ()) -> None:
        self.limit = limit
        self._used: dict[str | None, int] = {}
        self._files: dict[str, tuple[str | None, int]] = {}  # id -> (owner, bytes)
        for file_id, owner, size in files:
            self.add(file_id, owner, size)

    def used(self, owner: str | None) -> int:
        return self._used.get(owner, 0)

    def take(self, file_id: str, owner: str | None, n: int) -> bool:
        """Reserve `n` more bytes of `owner`'s file `file_id` if they fit under
        the limit; False (and nothing reserved) if they do not."""
        if self.used(owner) + n > self.limit:
            return False
        self.add(file_id, owner, n)
        return True

    def add(self, file_id: str, owner: str | None, n: int) -> None:
        """Count `n` more bytes of `file_id` whether or not they fit (a batch's results)."""
        _, size = self._files.get(file_id, (owner, 0))
        self._files[file_id] = (owner, size + n)
        self._used[owner] = self.used(owner) + n

    def shrink(self, file_id: str, n: int) -> None:
        """`n` of the bytes reserved for `file_id` were not needed."""
        owner, size = self._files.get(file_id, (None, 0))
        n = min(n, size)
        if n > 0:
            self._files[file_id] = (owner, size - n)
            self._used[owner] = self.used(owner) - n

    def drop(self, file_id: str) -> None:
        """`file_id` is gone (deleted, or its upload refused): its bytes are free."""
        owner, size = self._files.pop(file_id, (None, 0))
        left = self.used(owner) - size
        if left > 0:
            self._used[owner] = left
        else:
            self._used.pop(owner, None)
