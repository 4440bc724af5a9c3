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

Run it from the checkout's root (it imports ``bench.locust_mix``; Locust puts
the working directory on the path). Options of its own (flags, or
SLUICE_LOCUST_* in the environment): ``--model`` (default: the server's first
model), ``--max-tokens`` (128), ``--summary-words``, ``--analysis-words``.

The seeds' sizes are 240 words for a summary and 12,000 (about 24k tokens on
the demo model) for an analysis. A size not given is fitted to the model's
context (issue 64): ``max_model_len`` from ``GET /v1/models``, less
``--max-tokens`` and the chat template, at a measured tokens-per-word with a
margin (bench/locust_mix.py), so that a small ``--max-model-len`` does not fail
the long requests; the seeds' sizes where they fit. A size given is used as
given. The sizes are logged once at the start of the run. Locust is an extra of
the bench (``pip install -e .[locust]``), not a dependency of Sluice.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, cast

import orjson
import requests
from locust import HttpUser, between, events, task
from locust.argument_parser import LocustArgumentParser
from locust.env import Environment

from bench.locust_mix import (
    ANALYSIS_LEAD,
    ANALYSIS_WORDS,
    SUMMARY_LEAD,
    SUMMARY_WORDS,
    context_of,
    sizes_for,
    text,
)

logger = logging.getLogger(__name__)

FAQ = (
    "How do I return an item?",
    "When will my order ship?",
    "How do I get an invoice?",
    "Can I change my delivery address?",
    "Which payment methods do you accept?",
)


@events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]
def _options(parser: LocustArgumentParser) -> None:
    parser.add_argument("--model", default="", env_var="SLUICE_LOCUST_MODEL")
    parser.add_argument("--max-tokens", type=int, default=128, env_var="SLUICE_LOCUST_MAX_TOKENS")
    # No default: not given, fitted to the served context (_size_to_context).
    parser.add_argument("--summary-words", type=int, env_var="SLUICE_LOCUST_SUMMARY_WORDS")
    parser.add_argument("--analysis-words", type=int, env_var="SLUICE_LOCUST_ANALYSIS_WORDS")


@events.test_start.add_listener  # type: ignore[untyped-decorator]
def _size_to_context(environment: Environment, **_: Any) -> None:
    """The run's sizes, before any user starts, logged once: fitted to the
    served context for any not given."""
    opts = environment.parsed_options
    if opts is None:  # Locust as a library, with no options: the seeds' sizes.
        return
    max_tokens: int = opts.max_tokens
    summary: int | None = opts.summary_words
    analysis: int | None = opts.analysis_words
    context, source = None, "sizes given"
    if summary is None or analysis is None:
        context, source = _served_context(environment.host or "", opts.model)
    sizes = sizes_for(context, max_tokens, summary=summary, analysis=analysis)
    opts.summary_words, opts.analysis_words = sizes.summary, sizes.analysis
    logger.info(
        "Mix sizes: summary %d words, analysis %d words, max_tokens %d (%s)",
        sizes.summary,
        sizes.analysis,
        max_tokens,
        source,
    )


def _served_context(host: str, model: str) -> tuple[int | None, str]:
    """The model's context from GET /v1/models, and a line on where the sizes
    came from (None: the server did not say, the seeds' sizes stand)."""
    try:
        r = requests.get(f"{host.rstrip('/')}/v1/models", timeout=30)
        r.raise_for_status()
        context = context_of(orjson.loads(r.content), model)
    except (requests.RequestException, orjson.JSONDecodeError) as e:
        return None, f"the seeds' sizes: GET /v1/models failed: {e}"
    if context is None:
        return None, "the seeds' sizes: GET /v1/models gives no max_model_len"
    return context, f"fitted to max_model_len {context} tokens from GET /v1/models"


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
        # Set by _size_to_context before the users start.
        summary, analysis = (
            getattr(opts, "summary_words", None),
            getattr(opts, "analysis_words", None),
        )
        self.summary_words: int = SUMMARY_WORDS if summary is None else summary
        self.analysis_words: int = ANALYSIS_WORDS if analysis is None else analysis
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
        self._chat("summary", SUMMARY_LEAD + text(self.summary_words, self.rng), None)

    @task(10)
    def analysis(self) -> None:
        self._chat("analysis", ANALYSIS_LEAD + text(self.analysis_words, self.rng), None)

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
