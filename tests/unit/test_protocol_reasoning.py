"""Qwen3 reasoning split: vLLM 0.32's qwen3 parser semantics, any split of the deltas.

The expected values below were checked against vLLM 0.32's own parser
(vllm/parser/qwen3.py through Qwen3ParserReasoningAdapter, text only) on
thousands of random tag soups, whole and streamed; the cases here pin that
behaviour without importing vLLM.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engines.reasoning_split import ReasoningSplitter, split_reasoning

WHOLE = [
    # (output, reasoning, content)
    ("<think>abc</think>def", "abc", "def"),
    ("abc</think>def", "abc", "def"),  # <think> was in the prompt
    ("abc", "abc", None),  # never closed: all reasoning
    ("", None, None),
    ("</think>", None, None),
    ("<think></think>\n\nanswer", None, "\n\nanswer"),
    ("a</think>b</think>c", "a", "bc"),  # stray </think> in content dropped
    ("a</think>b<think>c", "a", "b<think>c"),  # <think> in content is text
    ("<think>a<think>b</think>c", "ab", "c"),  # <think> inside reasoning dropped
    ("plan<tool_call>{}</tool_call>", "plan", "<tool_call>{}</tool_call>"),
    ("a < b <thin </thin> c</think>x<y", "a < b <thin </thin> c", "x<y"),
    ("r</think", "r</think", None),  # truncated tag is text
    ("r</think>c</thi", "r", "c</thi"),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), WHOLE)
def test_whole_text(text: str, reasoning: str | None, content: str | None) -> None:
    assert split_reasoning(text) == (reasoning, content)


def test_thinking_off_is_all_content() -> None:
    assert split_reasoning("<think>a</think>b", thinking=False) == (None, "<think>a</think>b")
    s = ReasoningSplitter(thinking=False)
    assert s.feed("a</think>b") == ("", "ab")  # stray end tag still dropped
    assert not s.in_reasoning


def test_split_tags_across_deltas() -> None:
    s = ReasoningSplitter()
    out = [s.feed(d) for d in ["<th", "ink>Hmm", ", ok<", "/", "thi", "nk>", "\n\nYes", " <", "b>"]]
    out.append(s.finish())
    assert out == [
        ("", ""),
        ("Hmm", ""),
        (", ok", ""),
        ("", ""),
        ("", ""),
        ("", ""),
        ("", "\n\nYes"),
        ("", " "),
        ("", "<b>"),
        ("", ""),
    ]


def test_held_fragment_released_at_finish() -> None:
    s = ReasoningSplitter()
    assert s.feed("x</thi") == ("x", "")
    assert s.finish() == ("</thi", "")
    assert s.in_reasoning
    s = ReasoningSplitter()
    assert s.feed("x</think>y<") == ("x", "y")
    assert s.finish() == ("", "<")


def test_not_a_tag_released_immediately() -> None:
    s = ReasoningSplitter()
    assert s.feed("a<b") == ("a<b", "")
    assert s.feed("<<</") == ("<<", "")
    assert s.feed("x") == ("</x", "")


PIECES = [
    "<think>",
    "</think>",
    "<tool_call>",
    "<",
    "</",
    "<thi",
    "</thi",
    "nk>",
    ">",
    "a",
    " ",
    "\n",
    "é",
]


@settings(max_examples=400, deadline=None)
@given(
    text=st.one_of(
        st.lists(st.sampled_from(PIECES), max_size=12).map("".join), st.text(max_size=40)
    ),
    data=st.data(),
)
def test_any_split_equals_whole(text: str, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    s = ReasoningSplitter()
    parts = [s.feed(d) for d in deltas]
    parts.append(s.finish())
    reasoning = "".join(r for r, _ in parts)
    content = "".join(c for _, c in parts)
    assert (reasoning or None, content or None) == split_reasoning(text)
