"""A benchmark's chat client: one streamed turn timed at its first token, and a
closed-loop caller on a thread of its own.

Why it exists: the benchmark points that time a chat caller beside other work
(bench/points/fault_point.py, batch_point.py, prefix_point.py) read a stream
the same way: TTFT at the first chunk that carries a token (content or
reasoning), never at the role-only first frame; an error event is a failure.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

JSON = {"content-type": "application/json"}
_TOKEN_KEYS = ("content", "reasoning_content", "reasoning")  # a chunk that carries a token


async def stream_chat(
    session: aiohttp.ClientSession,
    base: str,
    body: dict[str, Any],
    headers: Mapping[str, str] | None = None,
) -> tuple[float, str]:
    """One streamed chat completion (`body` with "stream": true, and `headers`
    beside the content type): seconds to its first token, and its text. Raises
    on an error status, an error event or no token at all."""
    t0 = time.perf_counter()
    first = 0.0
    parts: list[str] = []
    async with session.post(
        base + "/v1/chat/completions", data=orjson.dumps(body), headers={**JSON, **(headers or {})}
    ) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            delta = event["choices"][0]["delta"] if event.get("choices") else {}
            piece = "".join(delta.get(k) or "" for k in _TOKEN_KEYS)
            if piece and not first:
                first = time.perf_counter() - t0
            parts.append(piece)
    if not first:
        raise RuntimeError("a turn without a token")
    return first, "".join(parts)


async def first_token(session: aiohttp.ClientSession, base: str, model: str, i: int) -> float:
    """One streamed chat turn of 8 tokens; seconds to its first token. Raises on
    an error status or an error event."""
    body = {
        "model": model,
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": f"Question {i}: why is the sky blue?"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    return (await stream_chat(session, base, body))[0]


@dataclass
class Caller:
    """A closed-loop chat caller on a thread of its own: (start, TTFT) of each
    turn, and the turns that failed."""

    base: str
    model: str
    turns: list[tuple[float, float]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    async def _loop(self) -> None:
        async with aiohttp.ClientSession() as s:
            i = 0
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    self.turns.append((t, await first_token(s, self.base, self.model, i)))
                except (aiohttp.ClientError, RuntimeError) as exc:
                    self.failed.append(f"{t:.1f}: {exc}")
                i += 1

    def __enter__(self) -> Caller:
        self._thread = threading.Thread(target=asyncio.run, args=(self._loop(),))
        self._thread.start()
        return self

    def wait_turns(self, n: int) -> None:
        """Block until the caller has timed `n` turns (looked at every 50 ms)."""
        while len(self.turns) < n:
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
