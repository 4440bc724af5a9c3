"""Split a Qwen3 thinking model's output into reasoning and answer text.

Sluice streams text deltas itself instead of running vLLM's serving layer.
Requests with tools go through vLLM's own parsers (server/engines/vllm_parsers.py);
the rest, nearly every request, through this copy of vLLM 0.32's ``qwen3``
reasoning parser (vllm/parser/qwen3.py, a state machine), kept because it
costs about 0.1 us per delta against vLLM's 10 us (measured, demo tokenizer,
one token per delta). tests/unit/test_vllm_parsers.py holds the two to the same
whole-output split. With thinking enabled, the parser *starts in reasoning*:
Qwen3's chat template may already put ``<think>`` in the prompt, so the output
often begins inside the thought with no start tag. Transitions, as in vLLM
with tool parsing off:

* reasoning: ``<think>`` is dropped; ``</think>`` is dropped and switches to
  content; ``<tool_call>`` ends reasoning implicitly and stays in the content.
* content: a stray ``</think>`` is dropped; ``<think>`` is ordinary text.

Output that never closes its thought is all reasoning, with no content (vLLM
returns ``content: null`` then). A tag may arrive split over several deltas,
so the splitter holds back a trailing fragment that could still become a tag
and releases it on the next delta or at ``finish()``. The incremental output,
concatenated, always equals ``split_reasoning`` of the whole text.

Only used for requests with thinking enabled; with it off, all text is content.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ReasoningSplitter", "split_reasoning"]

THINK_START: Final = "<think>"
THINK_END: Final = "</think>"
TOOL_CALL_START: Final = "<tool_call>"

_REASONING_TAGS: Final = (THINK_START, THINK_END, TOOL_CALL_START)
_CONTENT_TAGS: Final = (THINK_END,)


class ReasoningSplitter:
    """Incremental splitter for one choice: ``feed(delta) -> (reasoning, content)``."""

    __slots__ = ("_held", "_in_reasoning")

    def __init__(self, *, thinking: bool = True) -> None:
        self._in_reasoning = thinking
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    def feed(self, delta: str) -> tuple[str, str]:
        """The reasoning and content text this delta releases (either may be "")."""
        text = self._held + delta if self._held else delta
        self._held = ""
        # Fast path: no tag can start in this delta.
        if "<" not in text:
            return (text, "") if self._in_reasoning else ("", text)
        reasoning: list[str] = []
        content: list[str] = []
        at = 0
        end = len(text)
        while at < end:
            out = reasoning if self._in_reasoning else content
            lt = text.find("<", at)
            if lt < 0:
                out.append(text[at:])
                break
            if lt > at:
                out.append(text[at:lt])
            tags = _REASONING_TAGS if self._in_reasoning else _CONTENT_TAGS
            for tag in tags:
                if text.startswith(tag, lt):
                    at = lt + len(tag)
                    if tag == THINK_END:
                        self._in_reasoning = False
                    elif tag == TOOL_CALL_START:
                        self._in_reasoning = False
                        content.append(tag)
                    break
            else:
                rest = text[lt:]
                if any(tag.startswith(rest) for tag in tags):
                    self._held = rest  # may still become a tag
                    break
                out.append("<")
                at = lt + 1
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Release a held fragment at the end of the output: it was not a tag."""
        held, self._held = self._held, ""
        return (held, "") if self._in_reasoning else ("", held)


def split_reasoning(text: str, *, thinking: bool = True) -> tuple[str | None, str | None]:
    """Whole-output split, as vLLM's non-streaming ``extract_reasoning``.

    Returns ``(reasoning, content)``, each ``None`` when empty (vLLM's JSON
    then has ``content: null``). With ``thinking`` off: ``(None, text)``.
    """
    if not thinking:
        return None, text
    splitter = ReasoningSplitter()
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2) or None, (c1 + c2) or None
