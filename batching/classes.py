"""The request class: interactive or background, decided once, here.

Why this module exists: Sluice runs work no one waits on turn by turn (batch
lines, a client's `service_tier: "flex"`, a caller the callers file marks as
background) beside turns someone is reading as they come (issue 49). Every
rule that treats the two apart (the release order, what the access line, the
span and the metrics say, the tier the response names) must agree on which
is which, so one function decides it.

Rules:

1. A request is background when it is a batch line (OpenAI or Anthropic
   batches, entering through the internal door), when its body asks for
   OpenAI's `service_tier: "flex"`, or when its caller's policy says
   `background` (the callers file). Everything else is interactive. No field
   of a request makes a background caller's work interactive: the callers
   file is the operator's word, the body the client's.
2. A background request's priority is its own plus `BACKGROUND_PRIORITY`
   (2^20, far past any priority a client sends: vLLM's are small integers),
   so order.py rule 1 never lets it pass interactive work of its caller, and
   the priority handed to vLLM (`--engine-priority order`) says the same.
   Within the background class a client's own `priority` still orders.
3. The tier a response names is OpenAI's: `flex` for background, `default`
   for interactive (the `service_tier` of a chat completion, a completion and
   a response, whatever the request asked for).
4. A background request may wait in Sluice's queue `--background-queue-timeout`
   seconds (15 minutes by default: the client timeout OpenAI advises for flex
   work) where an interactive one waits `--queue-timeout` (60 s): interactive
   work goes first by design, so on a busy engine background work waits longer,
   and no one reads it turn by turn (`queue_timeout`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from .callers import CallerPolicy

__all__ = [
    "BACKGROUND_PRIORITY",
    "FLEX",
    "RequestClass",
    "class_priority",
    "is_background",
    "queue_timeout",
    "request_class",
]

# Rule 2: added to a background request's own priority (vLLM's: lower first).
BACKGROUND_PRIORITY: Final = 1 << 20
# OpenAI's name of the tier that runs work "at lower priority" (rule 1).
FLEX: Final = "flex"


class RequestClass(StrEnum):
    """Who waits on a request: someone reading it now, or no one turn by turn."""

    INTERACTIVE = "interactive"
    BACKGROUND = "background"

    @property
    def service_tier(self) -> str:
        """The tier a response names (rule 3)."""
        return FLEX if self is RequestClass.BACKGROUND else "default"


def request_class(
    *, batch_line: bool, service_tier: str | None, caller: CallerPolicy
) -> RequestClass:
    """A request's class (rule 1)."""
    if batch_line or service_tier == FLEX or caller.background:
        return RequestClass.BACKGROUND
    return RequestClass.INTERACTIVE


def class_priority(priority: int, cls: RequestClass) -> int:
    """The priority a request of class `cls` is ordered by (rule 2)."""
    return priority + BACKGROUND_PRIORITY if cls is RequestClass.BACKGROUND else priority


def is_background(priority: int) -> bool:
    """Was a request of this (rule 2) priority background work? A client's own
    priorities are small integers, far from `BACKGROUND_PRIORITY` either way."""
    return priority >= BACKGROUND_PRIORITY // 2


def queue_timeout(cls: RequestClass, interactive: float, background: float) -> float:
    """The seconds a request of class `cls` may wait in the queue (rule 4), of
    --queue-timeout and --background-queue-timeout."""
    return background if cls is RequestClass.BACKGROUND else interactive
