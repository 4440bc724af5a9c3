"""Stored responses for /v1/responses: bounded, in memory, each readable by its maker only.

Why this module exists: OpenAI's Responses API keeps a response (``store``
defaults to true) so that GET /v1/responses/{id} reads it back and a later
request continues it with ``previous_response_id``. Sluice keeps them in
memory, bounded by count and by bytes, oldest dropped first, and lost on
restart: a local server's clients (Codex CLI, the Agents SDK) either send
``store: false`` and the whole history, or continue the response they just
got, so a few thousand recent ones are what matters. A response belongs to
the caller that made it (the key's caller; ``None`` on a server without
keys, where everything is open): anyone else sees a 404, as for an id that
was never there, so ids do not leak across callers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from server.wire.request import Message

__all__ = ["MAX_BYTES", "MAX_COUNT", "ResponseStore", "StoredResponse"]

# Defaults: 2,000 responses, 64 MiB. A coding agent's turn is ~50-200 KB
# with its history, so the byte cap binds first there (a few hundred turns);
# short chats hit the count cap.
MAX_COUNT: Final = 2000
MAX_BYTES: Final = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: its owner, its JSON body, and the conversation it ends."""

    owner: str | None
    body: bytes
    conversation: tuple[Message, ...]
    size: int


def _size(body: bytes, conversation: Sequence[Message]) -> int:
    """Bytes charged against the cap: the body and the conversation's text.

    An upper bound: a chain of responses shares its history's strings."""
    text = sum(
        len(m.content) + sum(len(c.arguments) + len(c.name) for c in m.tool_calls)
        for m in conversation
    )
    return len(body) + text


class ResponseStore:
    """Responses by id, oldest dropped past ``max_count`` or ``max_bytes``."""

    def __init__(self, max_count: int = MAX_COUNT, max_bytes: int = MAX_BYTES) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(
        self, response_id: str, owner: str | None, body: bytes, conversation: Sequence[Message]
    ) -> bool:
        """Keep a response; False when it alone exceeds the byte cap (not kept)."""
        entry = StoredResponse(owner, body, tuple(conversation), _size(body, conversation))
        if entry.size > self.max_bytes:
            return False
        self._drop(response_id)
        self._items[response_id] = entry
        self.bytes += entry.size
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))
        return True

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """The response when it is there and ``owner`` made it."""
        entry = self._items.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, response_id: str, owner: str | None) -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._items.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
