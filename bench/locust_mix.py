"""The Locust mix's texts, and their sizes fitted to the served context (issue 64).

Why it exists: bench/locustfile.py's seed sizes (a 12,000-word analysis, about
24k tokens) are longer than a server run at a small ``--max-model-len``
takes. There every analysis was a 400, and the run's failure count measured the
tool, not the server. With no size given, the locustfile reads the context
from ``GET /v1/models`` (``max_model_len`` on the model's card, from Sluice and
from vLLM's server alike) and shortens each class to fit, keeping the seeds'
sizes where they fit.

Pure functions, with no Locust import: importing Locust monkey-patches the
whole process (gevent), so the unit tests import this module, not the
locustfile. The texts live here too, so that a test can tokenize a request the
locustfile sends.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ANALYSIS_LEAD",
    "ANALYSIS_WORDS",
    "SUMMARY_LEAD",
    "SUMMARY_WORDS",
    "TEMPLATE_TOKENS",
    "TOKENS_PER_WORD",
    "WORDS",
    "Sizes",
    "context_of",
    "sizes_for",
    "text",
    "words_for_context",
]

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
# Each long class's request: its lead-in, then its text.
SUMMARY_LEAD = "Summarize the main points of this contract: "
ANALYSIS_LEAD = "Analyse this document in depth: "

# The seeds' sizes, kept where the context allows.
SUMMARY_WORDS = 240
ANALYSIS_WORDS = 12_000

# Tokens per word of the mix's text, with a margin. Measured on the demo
# model's tokenizer (server/engines/demo/model.py, byte-level BPE) over the
# locustfile's words: 2.03 on average (1 to 4 per word), 1.84-2.23 over 100-word
# texts, 1.91-2.11 over 400-word ones, 2.03-2.04 at 12,000 words. A real
# model's tokenizer splits these common English words less (about one token
# each).
TOKENS_PER_WORD = 2.5

# The chat template and the class's own lead-in ("Analyse this document in
# depth: "): 21-26 tokens with the demo model's (Qwen3's) template; the rest is
# room for a template that adds a system turn.
TEMPLATE_TOKENS = 128


def text(words: int, rng: random.Random) -> str:
    """A document of ``words`` words of the mix's vocabulary."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass(frozen=True)
class Sizes:
    """Words of text in a summary request and in an analysis request."""

    summary: int
    analysis: int


def words_for_context(max_model_len: int, max_tokens: int, words: int) -> int:
    """The words of text a request carries in a context of ``max_model_len``
    tokens: at most ``words``, with room for the chat template and for
    ``max_tokens`` of answer. At least one word (a context too small for even
    that is the caller's to see failing)."""
    room = max_model_len - max_tokens - TEMPLATE_TOKENS
    return max(1, min(words, math.floor(room / TOKENS_PER_WORD)))


def sizes_for(
    max_model_len: int | None,
    max_tokens: int,
    *,
    summary: int | None = None,
    analysis: int | None = None,
) -> Sizes:
    """The sizes a run uses: a size given (a flag or the environment) as
    given, even if too long; the others the seeds' sizes, fitted to
    ``max_model_len`` when the server told it (None: it did not)."""

    def fit(given: int | None, seed: int) -> int:
        if given is not None:
            return given
        if max_model_len is None:
            return seed
        return words_for_context(max_model_len, max_tokens, seed)

    return Sizes(summary=fit(summary, SUMMARY_WORDS), analysis=fit(analysis, ANALYSIS_WORDS))


def context_of(models: Any, model: str = "") -> int | None:
    """``max_model_len`` of ``model`` (the first listed when empty) in a
    ``GET /v1/models`` body; for an adapter (no context of its own), its base
    model's. None when the body does not say (an older server, another API)."""
    cards = models.get("data") if isinstance(models, dict) else None
    if not isinstance(cards, list) or not cards:
        return None
    by_id = {c.get("id"): c for c in cards if isinstance(c, dict)}
    card = by_id.get(model) if model else cards[0]
    if not isinstance(card, dict):
        return None
    length = card.get("max_model_len")
    if length is None and card.get("parent") in by_id:
        length = by_id[card["parent"]].get("max_model_len")
    # bool is an int: not a context.
    if isinstance(length, int) and not isinstance(length, bool) and length > 0:
        return length
    return None
