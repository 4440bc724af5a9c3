"""Stored responses' policy for /v1/responses: what is kept, dropped and visible.

Why this module exists: OpenAI's Responses API keeps a response (``store``
defaults to true) so that GET /v1/responses/{id} reads it back and a later
request continues it with ``previous_response_id``. Sluice keeps them in the
state database (server/operations/state_db.py) so that they outlive a
restart; this module is the pure part, no I/O, time as an argument:

1. A response is charged its body plus its conversation's text; one larger
   than ``max_bytes`` alone is not kept.
2. Past ``max_count`` responses or ``max_bytes`` bytes, the oldest go first.
3. A response older than ``retention`` seconds (by its creation time) is
   gone: invisible at once, and deleted by the next sweep.
4. A response belongs to the caller that made it (the key's caller; ``None``
   on a server without keys, where everything is open): anyone else sees a
   404, as for an id that was never there, so ids do not leak across callers.

``ResponseStore`` holds the index (id, owner, time, size: a few bytes each);
the bodies and conversations are in the database. ``encode_conversation`` and
``decode_conversation`` are the conversation's bytes there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from server.wire.request import Message, ToolCall

__all__ = [
    "MAX_BYTES",
    "MAX_COUNT",
    "RETENTION",
    "ResponseStore",
    "StoredResponse",
    "decode_conversation",
    "encode_conversation",
    "size_of",
]

# Defaults: 2,000 responses, 64 MiB, 30 days (OpenAI's retention). A coding
# agent's turn is ~50-200 KB with its history, so the byte cap binds first
# there (a few hundred turns); short chats hit the count cap.
MAX_COUNT: Final = 2000
MAX_BYTES: Final = 64 * 1024 * 1024
RETENTION: Final = 30 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: its owner, its JSON body, and the conversation it ends."""

    owner: str | None
    body: bytes
    conversation: tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class _Entry:
    owner: str | None
    created: float
    size: int


def size_of(body: bytes, conversation: Sequence[Message]) -> int:
    """Bytes charged against the cap (rule 1): the body and the conversation's
    text. An upper bound: a chain of responses shares its history's strings."""
    text = sum(
        len(m.content) + sum(len(c.arguments) + len(c.name) for c in m.tool_calls)
        for m in conversation
    )
    return len(body) + text


class ResponseStore:
    """The index of stored responses, oldest first (the module's rules)."""

    def __init__(
        self, max_count: int = MAX_COUNT, max_bytes: int = MAX_BYTES, retention: float = RETENTION
    ) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.retention = retention
        self._items: OrderedDict[str, _Entry] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def admit(
        self, response_id: str, owner: str | None, size: int, created: float
    ) -> tuple[str, ...] | None:
        """Record a response; the ids dropped to make room (rule 2), or None
        when it alone exceeds the byte cap (rule 1: not kept)."""
        if size > self.max_bytes:
            return None
        self._drop(response_id)
        self._items[response_id] = _Entry(owner, created, size)
        self.bytes += size
        dropped = []
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            oldest = next(iter(self._items))
            self._drop(oldest)
            dropped.append(oldest)
        return tuple(dropped)

    def load(self, rows: Iterable[tuple[str, str | None, float, int]], now: float) -> list[str]:
        """The index from the database's rows (oldest first); the ids to delete
        there: expired, or past today's caps."""
        gone: list[str] = []
        for response_id, owner, created, size in rows:
            if self._expired(created, now):
                gone.append(response_id)
                continue
            dropped = self.admit(response_id, owner, size, created)
            gone.extend((response_id,) if dropped is None else dropped)
        return gone

    def visible(self, response_id: str, owner: str | None, now: float) -> bool:
        """There, made by ``owner`` and not past its retention (rules 3, 4)."""
        entry = self._items.get(response_id)
        return entry is not None and entry.owner == owner and not self._expired(entry.created, now)

    def expired(self, now: float) -> tuple[str, ...]:
        """The ids past their retention (rule 3), oldest first."""
        out = []
        for response_id, entry in self._items.items():
            if not self._expired(entry.created, now):
                break  # oldest first: the rest are younger
            out.append(response_id)
        return tuple(out)

    def forget(self, ids: Iterable[str]) -> None:
        for response_id in ids:
            self._drop(response_id)

    def _expired(self, created: float, now: float) -> bool:
        return now - created >= self.retention

    def _drop(self, response_id: str) -> None:
        entry = self._items.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size


def encode_conversation(conversation: Sequence[Message]) -> bytes:
    """A conversation as JSON: one object per message, only the fields set."""
    out: list[dict[str, Any]] = []
    for m in conversation:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [[c.id, c.name, c.arguments] for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning is not None:
            d["reasoning"] = m.reasoning
        out.append(d)
    return orjson.dumps(out)


def decode_conversation(data: bytes) -> tuple[Message, ...]:
    return tuple(
        Message(
            d["role"],
            d["content"],
            name=d.get("name"),
            tool_calls=tuple(ToolCall(*c) for c in d.get("tool_calls", ())),
            tool_call_id=d.get("tool_call_id"),
            reasoning=d.get("reasoning"),
        )
        for d in orjson.loads(data)
    )
