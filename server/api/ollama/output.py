"""Ollama's API, pure: answers back into Ollama's bodies and stream lines.

Why this module exists: the other half of server/api/ollama/parse.py, kept
apart so each stays small. Shapes as Ollama's api/types.go writes them and
the `ollama` Python client's types read them:

1. A stream is newline-delimited JSON (``application/x-ndjson``): one object
   per engine output that releases text (the first always, so the first line
   goes out with the first token), then a final object with ``done: true``,
   ``done_reason`` (``stop`` or ``length``) and the counts and durations.
   The per-output chat line is spliced from prebuilt bytes, as
   server/api/openai_chat/stream.py does for chat; a line with thinking, tool
   calls or logprobs is built whole.
2. Durations are nanoseconds: ``total_duration`` from the request's arrival
   to its end, ``load_duration`` its wait in Sluice's queue (the model is
   always loaded: what is left of Ollama's load time is the wait before the
   engine takes the request), ``prompt_eval_duration`` from then to the
   first token, ``eval_duration`` from the first token to the end.
   ``prompt_eval_count`` is the prompt's tokens, ``eval_count`` the answer's.
3. Tool calls go out whole, ``arguments`` an object (Ollama's shape, not a
   JSON string), in the line of the output that ends the answer: a streamed
   call is assembled from its deltas and sent once its arguments parse
   (``CallAssembly``); one whose arguments never parse (cut by the length
   limit) is dropped, as the whole-body parser drops it.
4. ``created_at`` is RFC 3339 in UTC with microseconds; time is an argument.
5. An error after the stream started is one more line, ``{"error": "..."}``,
   as Ollama writes it; before, the middleware's JSON body with the status.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from server.errors import SluiceError
from server.wire.output import TokenLogprob, ToolCallDelta
from server.wire.request import ToolCall
from server.wire.tools import arguments_object

__all__ = [
    "NDJSON",
    "PROBE",
    "CallAssembly",
    "Clock",
    "Metrics",
    "ModelEntry",
    "OllamaStream",
    "answer_body",
    "done_reason",
    "embed_body",
    "embeddings_body",
    "listed_name",
    "load_body",
    "logprobs_list",
    "ps_body",
    "show_body",
    "tags_body",
    "tool_calls_list",
]

NDJSON: Final = "application/x-ndjson"
# What Ollama answers on GET and HEAD / (its clients' "is it up?").
PROBE: Final = "Ollama is running"
# ps: a model that never unloads (Ollama's keep_alive -1 shows "Forever").
_FOREVER_S: Final = 100 * 365 * 86400


def listed_name(served: str) -> str:
    """The name a served model is listed under (parse.py rule 1)."""
    return served if ":" in served else f"{served}:latest"


def done_reason(engine_reason: str | None) -> str:
    """Ollama's ``done_reason`` for the engine's finish (a tool call is ``stop``)."""
    return "length" if engine_reason == "length" else "stop"


class Clock:
    """``created_at`` stamps (rule 4), the formatted second kept between calls."""

    __slots__ = ("_head", "_sec")

    def __init__(self) -> None:
        self._sec = -1
        self._head = ""

    def __call__(self, now: float) -> str:
        sec = int(now)
        if sec != self._sec:
            self._sec, self._head = sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        return f"{self._head}.{int((now - sec) * 1e6):06d}Z"


@dataclass(frozen=True, slots=True)
class Metrics:
    """The counts and durations (seconds here, nanoseconds on the wire) of rule 2."""

    total: float
    load: float
    prompt_eval: float
    eval: float
    prompt_eval_count: int
    eval_count: int

    @classmethod
    def of(
        cls, total: float, queued: float, first_token: float | None, prompt: int, answer: int
    ) -> Metrics:
        """From the seconds since arrival: at the end (``total``), in the queue
        (``queued``) and at the first token (None: none came)."""
        first = total if first_token is None else min(first_token, total)
        queued = min(queued, first)
        return cls(total, queued, first - queued, total - first, prompt, answer)

    def as_dict(self) -> dict[str, int]:
        return {
            "total_duration": _ns(self.total),
            "load_duration": _ns(self.load),
            "prompt_eval_count": self.prompt_eval_count,
            "prompt_eval_duration": _ns(self.prompt_eval),
            "eval_count": self.eval_count,
            "eval_duration": _ns(self.eval),
        }


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def tool_calls_list(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Calls in Ollama's shape: ``arguments`` an object (rule 3)."""
    return [
        {
            "id": c.id,
            "function": {"index": i, "name": c.name, "arguments": arguments_object(c.arguments)},
        }
        for i, c in enumerate(calls)
    ]


def logprobs_list(lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    out = []
    for lp in lps:
        item: dict[str, Any] = {"token": lp.token, "logprob": lp.logprob}
        if lp.top:
            item["top_logprobs"] = [{"token": t, "logprob": v} for t, v in lp.top]
        out.append(item)
    return out


class CallAssembly:
    """A streamed choice's tool-call deltas, put back together (rule 3)."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]

    def add(self, deltas: Sequence[ToolCallDelta]) -> None:
        for d in deltas:
            call = self._calls.setdefault(d.index, ["", "", ""])
            call[0] = d.id or call[0]
            call[1] = d.name or call[1]
            call[2] += d.arguments

    def finish(self) -> tuple[ToolCall, ...]:
        """The calls whose arguments parse, in order; then empty."""
        out = []
        for call_id, name, arguments in (self._calls[i] for i in sorted(self._calls)):
            try:
                orjson.loads(arguments or "{}")
            except orjson.JSONDecodeError:
                continue
            out.append(ToolCall(call_id, name, arguments or "{}"))
        self._calls.clear()
        return tuple(out)


def _message(content: str, thinking: str | None, calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        msg["thinking"] = thinking
    if calls:
        msg["tool_calls"] = tool_calls_list(calls)
    return msg


def _head(name: str, created_at: str) -> dict[str, Any]:
    return {"model": name, "created_at": created_at}


def _answer(
    generate: bool, content: str, thinking: str | None, calls: Sequence[ToolCall]
) -> dict[str, Any]:
    """The answer part of a chat object (``message``) or a generate one
    (``response``, ``thinking``)."""
    if not generate:
        return {"message": _message(content, thinking, calls)}
    out: dict[str, Any] = {"response": content}
    if thinking:
        out["thinking"] = thinking
    if calls:
        out["tool_calls"] = tool_calls_list(calls)
    return out


def answer_body(
    name: str,
    created_at: str,
    *,
    generate: bool,
    content: str,
    thinking: str | None,
    calls: Sequence[ToolCall],
    reason: str,
    metrics: Metrics,
    logprobs: Sequence[TokenLogprob] | None = None,
) -> bytes:
    """A whole (non-streamed) chat or generate answer."""
    body = {
        **_head(name, created_at),
        **_answer(generate, content, thinking, calls),
        "done": True,
        "done_reason": reason,
        **metrics.as_dict(),
    }
    if logprobs is not None:
        body["logprobs"] = logprobs_list(logprobs)
    return orjson.dumps(body)


def load_body(name: str, created_at: str, *, generate: bool) -> bytes:
    """The answer to an empty ``messages`` / ``prompt`` (parse.py rule 9)."""
    answer = {"response": ""} if generate else {"message": _message("", None)}
    return orjson.dumps({**_head(name, created_at), **answer, "done": True, "done_reason": "load"})


class OllamaStream:
    """The lines of one streamed chat or generate answer (rule 1)."""

    __slots__ = ("_clock", "_generate", "_mid", "_name", "_prefix", "_tail")

    def __init__(self, name: str, *, generate: bool) -> None:
        self._name = name
        self._generate = generate
        self._clock = Clock()
        self._prefix = b'{"model":' + orjson.dumps(name) + b',"created_at":"'
        if generate:
            self._mid, self._tail = b'","response":', b',"done":false}\n'
        else:
            self._mid = b'","message":{"role":"assistant","content":'
            self._tail = b'},"done":false}\n'

    def line(
        self,
        now: float,
        content: str,
        thinking: str = "",
        calls: Sequence[ToolCall] = (),
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> bytes:
        """One output's object (``done: false``)."""
        stamp = self._clock(now)
        if not thinking and not calls and logprobs is None:
            return self._prefix + stamp.encode() + self._mid + orjson.dumps(content) + self._tail
        obj = {
            **_head(self._name, stamp),
            **_answer(self._generate, content, thinking, calls),
            "done": False,
        }
        if logprobs is not None:
            obj["logprobs"] = logprobs_list(logprobs)
        return orjson.dumps(obj) + b"\n"

    def done(self, now: float, reason: str, metrics: Metrics) -> bytes:
        """The closing object: ``done``, ``done_reason``, counts and durations."""
        obj = {
            **_head(self._name, self._clock(now)),
            **_answer(self._generate, "", None, ()),
            "done": True,
            "done_reason": reason,
            **metrics.as_dict(),
        }
        return orjson.dumps(obj) + b"\n"

    @staticmethod
    def error(err: SluiceError) -> bytes:
        return orjson.dumps(err.ollama_body()) + b"\n"


# ---------------------------------------------------------------------------
# Models.


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One name a caller may use: the base model or a LoRA adapter on it."""

    served: str
    path: str
    created: float  # epoch seconds: when the engine loaded it
    context_length: int
    parent: str = ""  # an adapter's base model (served name)

    @property
    def name(self) -> str:
        return listed_name(self.served)

    @property
    def digest(self) -> str:
        """A stable 64-hex id (Ollama's CLI prints its first 12 characters)."""
        return hashlib.sha256(f"{self.served}\0{self.path}".encode()).hexdigest()

    def details(self) -> dict[str, Any]:
        return {
            "parent_model": listed_name(self.parent) if self.parent else "",
            "format": "",
            "family": "",
            "families": None,
            "parameter_size": "",
            "quantization_level": "",
        }


def _stamp(epoch: float) -> str:
    return Clock()(epoch)


def tags_body(models: Sequence[ModelEntry]) -> bytes:
    """/api/tags: every model a caller may use."""
    return orjson.dumps(
        {
            "models": [
                {
                    "name": m.name,
                    "model": m.name,
                    "modified_at": _stamp(m.created),
                    "size": 0,
                    "digest": m.digest,
                    "details": m.details(),
                }
                for m in models
            ]
        }
    )


def ps_body(models: Sequence[ModelEntry], now: float) -> bytes:
    """/api/ps: the loaded models (all, always; none expires)."""
    return orjson.dumps(
        {
            "models": [
                {
                    "name": m.name,
                    "model": m.name,
                    "size": 0,
                    "digest": m.digest,
                    "details": m.details(),
                    "expires_at": _stamp(now + _FOREVER_S),
                    "size_vram": 0,
                    "context_length": m.context_length,
                }
                for m in models
            ]
        }
    )


def show_body(model: ModelEntry) -> bytes:
    """/api/show: what Sluice knows of a model. ``model_info`` names the
    architecture ``sluice`` so that the context length sits where Ollama's
    clients look (``<architecture>.context_length``)."""
    modelfile = (
        f"# Served by Sluice (vLLM); Ollama's Modelfile does not apply.\n"
        f"FROM {model.path or model.served}\n"
        f"PARAMETER num_ctx {model.context_length}\n"
    )
    return orjson.dumps(
        {
            "modelfile": modelfile,
            "parameters": f"num_ctx {model.context_length}",
            "template": "",
            "details": model.details(),
            "model_info": {
                "general.architecture": "sluice",
                "sluice.context_length": model.context_length,
            },
            "capabilities": ["completion", "tools", "thinking"],
            "modified_at": _stamp(model.created),
        }
    )


# ---------------------------------------------------------------------------
# Embeddings (served once an embedding model is: the pooling path, issue 30).


def embed_body(name: str, vectors: Sequence[Sequence[float]], metrics: Metrics) -> bytes:
    """/api/embed's answer: one vector per input, in order."""
    m = metrics.as_dict()
    return orjson.dumps(
        {
            "model": name,
            "embeddings": [list(v) for v in vectors],
            "total_duration": m["total_duration"],
            "load_duration": m["load_duration"],
            "prompt_eval_count": m["prompt_eval_count"],
        }
    )


def embeddings_body(vector: Sequence[float]) -> bytes:
    """/api/embeddings' answer (the older route): one vector."""
    return orjson.dumps({"embedding": list(vector)})
