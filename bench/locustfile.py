"""The seeds' Locust load test, for any OpenAI-compatible server (issue 51).

Why this file: teams that come from the write-ups Sluice grew out of check a
server with Locust and a 70/20/10 mix of short FAQ turns, document summaries
and long analyses. This is that mix, streamed, so that the figure that matters
for a chat turn is measured: Locust's own entry per class is the whole
response (to the stream's end: Locust alone would time a stream at its
headers), and two entries of their own sit beside it:

* ``TTFT`` (one per class): milliseconds from sending to the first frame that
  carries a token (content or reasoning), never a frame without one;
* ``TPS`` (one per class): the answer's generated tokens per second after its
  first token, from the server's own usage count (``stream_options``), in
  Locust's "response time" column (Locust has no other numeric column).

Run it headless against Sluice or vLLM's server on the same machine:

    locust -f bench/locustfile.py --headless -u 16 -r 4 -t 5m \\
        --host http://127.0.0.1:8000 --html report.html

Options of its own (flags, or SLUICE_LOCUST_* in the environment):
``--model`` (default: the server's first model), ``--faq-tokens``,
``--summary-words``, ``--analysis-words`` (the seeds' sizes are about 1,200
characters and 85k tokens of context; the default long analysis is 12,000
words, which fits the demo model's context), ``--max-tokens``.
Locust is an extra of the bench (``pip install -e .[locust]``), not a
dependency of Sluice.
"""

from __future__ import annotations

import random
import time
from typing import Any, cast

import orjson
from locust import HttpUser, between, events, task
from locust.argument_parser import LocustArgumentParser
from locust.env import Environment

FAQ = (
    "How do I return an item?",
    "When will my order ship?",
    "How do I get an invoice?",
    "Can I change my delivery address?",
    "Which payment methods do you accept?",
)
WORDS = (
    "contract",
    "party",
    "shall",
    "deliver",
    "goods",
    "within",
    "thirty",
    "days",
    "of",
    "the",
    "order",
    "date",
    "and",
    "payment",
    "is",
    "due",
    "on",
    "receipt",
    "invoice",
    "unless",
    "parties",
    "agree",
    "otherwise",
    "in",
    "writing",
    "supplier",
    "warrants",
    "that",
    "conform",
    "to",
    "specification",
)


@events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]
def _options(parser: LocustArgumentParser) -> None:
    parser.add_argument("--model", default="", env_var="SLUICE_LOCUST_MODEL")
    parser.add_argument("--max-tokens", type=int, default=128, env_var="SLUICE_LOCUST_MAX_TOKENS")
    parser.add_argument(
        "--summary-words", type=int, default=240, env_var="SLUICE_LOCUST_SUMMARY_WORDS"
    )
    parser.add_argument(
        "--analysis-words", type=int, default=12_000, env_var="SLUICE_LOCUST_ANALYSIS_WORDS"
    )


def _text(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _carries_token(delta: dict[str, Any]) -> bool:
    """A delta with generated text: content, or thinking under either name
    (Sluice's and vLLM's ``reasoning_content``, newer vLLM's ``reasoning``)."""
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"))


def _fire(env: Environment, kind: str, name: str, value: float) -> None:
    env.events.request.fire(  # type: ignore[no-untyped-call]
        request_type=kind,
        name=name,
        response_time=value,
        response_length=0,
        exception=None,
        context={},
    )


class ChatUser(HttpUser):
    """One caller of the mix: a streamed chat turn of one of three classes."""

    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.model: str = getattr(opts, "model", "") or self._first_model()
        self.max_tokens: int = getattr(opts, "max_tokens", 128)
        self.summary_words: int = getattr(opts, "summary_words", 240)
        self.analysis_words: int = getattr(opts, "analysis_words", 12_000)
        self.rng = random.Random()

    def _first_model(self) -> str:
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"/v1/models answered {r.status_code}")
                return ""
            models: list[dict[str, Any]] = orjson.loads(r.content)["data"]
            return str(models[0]["id"])

    @task(70)
    def faq(self) -> None:
        self._chat("faq", self.rng.choice(FAQ), 64)

    @task(20)
    def summary(self) -> None:
        doc = _text(self.summary_words, self.rng)
        self._chat("summary", f"Summarize the main points of this contract: {doc}", None)

    @task(10)
    def analysis(self) -> None:
        doc = _text(self.analysis_words, self.rng)
        self._chat("analysis", f"Analyse this document in depth: {doc}", None)

    def _chat(self, name: str, content: str, max_tokens: int | None) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens or self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        first: float | None = None
        tokens = 0
        with self.client.post(
            "/v1/chat/completions", json=body, name=name, stream=True, catch_response=True
        ) as r:
            if r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:200]}")
                return
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                frame = orjson.loads(line[6:])
                if "error" in frame:
                    r.failure(str(frame["error"])[:200])
                    return
                if first is None and any(
                    _carries_token(c.get("delta") or {}) for c in frame.get("choices") or ()
                ):
                    first = time.perf_counter()
                    _fire(self.environment, "TTFT", name, (first - start) * 1000)
                if usage := frame.get("usage"):
                    tokens = int(usage.get("completion_tokens") or 0)
            # Locust times a streamed request at its headers: its entry is the
            # whole answer here, to the stream's last frame.
            meta = cast(dict[str, Any], r.request_meta)
            meta["response_time"] = (time.perf_counter() - start) * 1000
            if first is None:
                r.failure("no token in the answer")
                return
        decode = time.perf_counter() - first
        if tokens > 1 and decode > 0:
            _fire(self.environment, "TPS", name, (tokens - 1) / decode)
