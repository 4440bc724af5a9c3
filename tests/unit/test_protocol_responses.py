"""Response bodies and SSE frames: OpenAI's client models accept them, fast == reference."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from server.api.openai_chat.output import chat_completion_body, completion_body, models_body
from server.api.openai_chat.stream import DONE, ChatStream, CompletionStream, sse
from server.wire.output import ChatChoice, CompletionChoice, TokenLogprob, Usage

ODD_TEXTS = [
    "",
    "plain",
    'quote " and \\ backslash',
    "new\nline\r\ttab",
    "\x00\x01\x1f\x7f control",
    "unicode é 漢字 🙂 \u2028\u2029",
    "</think><think>",
    "\ufffd",
    "data: [DONE]\n\n",
]

LOGPROBS = (
    TokenLogprob("Hel", -0.5, (("Hel", -0.5), ("He", -1.25))),
    TokenLogprob("lo 🙂", -math.inf, (("lo 🙂", -math.inf),)),
    TokenLogprob("!", math.nan, ()),
)


def frame_json(frame: bytes) -> Any:
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert b"\n\n" not in frame[:-2]  # one event per frame
    return orjson.loads(frame[6:-2])


def frames(buf: bytes) -> list[Any]:
    assert buf.endswith(b"\n\n")
    return [orjson.loads(part[6:]) for part in buf[:-2].split(b"\n\n")]


# -- whole bodies --------------------------------------------------------------------


def test_chat_completion_body() -> None:
    body = chat_completion_body(
        request_id="abc",
        created=1700000000,
        model="qwen",
        choices=[
            ChatChoice(0, "Hi!", "stop"),
            ChatChoice(1, "Hello", "length", reasoning="thought", logprobs=LOGPROBS),
            ChatChoice(2, None, "length", reasoning="only thinking"),
        ],
        usage=Usage(prompt_tokens=5, completion_tokens=7),
    )
    parsed = ChatCompletion.model_validate(orjson.loads(body))
    assert parsed.id == "chatcmpl-abc"
    assert parsed.object == "chat.completion"
    assert parsed.created == 1700000000
    assert parsed.usage is not None and parsed.usage.total_tokens == 12
    c0, c1, c2 = parsed.choices
    assert (c0.message.role, c0.message.content, c0.finish_reason) == ("assistant", "Hi!", "stop")
    assert c0.logprobs is None
    assert (c2.message.content, c2.finish_reason) == (None, "length")
    raw = orjson.loads(body)
    assert "reasoning" not in raw["choices"][0]["message"]
    assert raw["choices"][1]["message"]["reasoning"] == "thought"
    assert raw["choices"][2]["message"] == {
        "role": "assistant",
        "content": None,
        "reasoning": "only thinking",
    }
    assert c1.logprobs is not None and c1.logprobs.content is not None
    lp = c1.logprobs.content
    assert [t.token for t in lp] == ["Hel", "lo 🙂", "!"]
    assert [t.logprob for t in lp] == [-0.5, -9999.0, -9999.0]  # no inf/NaN in JSON
    assert lp[1].bytes == list("lo 🙂".encode())
    assert [(t.token, t.logprob) for t in lp[0].top_logprobs] == [("Hel", -0.5), ("He", -1.25)]


def test_reasoning_field_name_is_configurable() -> None:
    body = chat_completion_body(
        request_id="x",
        created=1,
        model="m",
        choices=[ChatChoice(0, "a", "stop", reasoning="r")],
        usage=Usage(1, 1),
        reasoning_field="reasoning_content",
    )
    assert orjson.loads(body)["choices"][0]["message"]["reasoning_content"] == "r"


def test_completion_body() -> None:
    body = completion_body(
        request_id="abc",
        created=1,
        model="m",
        choices=[
            CompletionChoice(0, "Hello 🙂!", "length", logprobs=LOGPROBS),
            CompletionChoice(1, "echo+gen", "stop", logprobs=LOGPROBS[:1], text_offset=5),
            CompletionChoice(2, "x", "stop"),
        ],
        usage=Usage(3, 4),
    )
    parsed = Completion.model_validate(orjson.loads(body))
    assert parsed.id == "cmpl-abc" and parsed.object == "text_completion"
    c0, c1, c2 = parsed.choices
    assert c0.logprobs is not None
    assert c0.logprobs.tokens == ["Hel", "lo 🙂", "!"]
    assert c0.logprobs.token_logprobs == [-0.5, -9999.0, -9999.0]
    assert c0.logprobs.top_logprobs == [{"Hel": -0.5, "He": -1.25}, {"lo 🙂": -9999.0}, {}]
    assert c0.logprobs.text_offset == [0, 3, 7]
    assert c1.logprobs is not None and c1.logprobs.text_offset == [5]
    assert c2.logprobs is None and c2.text == "x"
    assert parsed.usage is not None and parsed.usage.total_tokens == 7


def test_models_body() -> None:
    raw = orjson.loads(models_body(["a", "b"], created=5, max_model_len=4096))
    assert raw["object"] == "list"
    models = [Model.model_validate(m) for m in raw["data"]]
    assert [(m.id, m.object, m.created, m.owned_by) for m in models] == [
        ("a", "model", 5, "sluice"),
        ("b", "model", 5, "sluice"),
    ]
    assert raw["data"][0]["max_model_len"] == 4096
    assert "max_model_len" not in orjson.loads(models_body(["a"], created=5))["data"][0]


# -- chat stream ---------------------------------------------------------------------


def chat_stream(**kw: Any) -> ChatStream:
    return ChatStream(request_id='id"\n', created=123, model="qwen/🙂", n=2, **kw)


@pytest.mark.parametrize("text", ODD_TEXTS)
def test_chat_fast_frames_equal_reference(text: str) -> None:
    s = chat_stream()
    for index in (0, 1, 5):  # 5: beyond n, prefix built on demand
        assert s.content(index, text) == sse(s.chunk_dict(index, content=text))
        assert s.reasoning(index, text) == sse(s.chunk_dict(index, reasoning=text))
        assert frame_json(s.content(index, text))["choices"][0]["delta"] == {"content": text}
    assert s.contents([(0, text), (1, text)]) == s.content(0, text) + s.content(1, text)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(),
    index=st.integers(0, 20),
    request_id=st.text(min_size=1),
    model=st.text(min_size=1),
    created=st.integers(0, 2**40),
)
def test_chat_fast_frame_property(
    text: str, index: int, request_id: str, model: str, created: int
) -> None:
    s = ChatStream(request_id=request_id, created=created, model=model)
    fast = s.content(index, text)
    assert fast == sse(s.chunk_dict(index, content=text))
    assert frame_json(fast) == s.chunk_dict(index, content=text)
    assert frame_json(s.reasoning(index, text)) == s.chunk_dict(index, reasoning=text)


def test_chat_stream_sequence_validates() -> None:
    s = chat_stream()
    buf = (
        s.first(0)
        + s.first(1)
        + s.splits([(0, "think", ""), (1, "", "x"), (0, "more", "answer"), (1, "", "")])
        + s.contents([(0, " and"), (1, "y")])
        + s.chunk(0, content="z", logprobs=LOGPROBS[:1])
        + s.finish(0, "stop")
        + s.finish(1, "length")
        + s.usage(Usage(2, 9))
    )
    events = frames(buf)
    chunks = [ChatCompletionChunk.model_validate(e) for e in events]
    assert all(c.id == 'chatcmpl-id"\n' and c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.model == "qwen/🙂" and c.created == 123 for c in chunks)
    first = chunks[0].choices[0]
    assert (first.index, first.delta.role, first.delta.content) == (0, "assistant", "")
    deltas = [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in events[2:8]]
    assert deltas == [
        (0, {"reasoning": "think"}),
        (1, {"content": "x"}),
        (0, {"reasoning": "more"}),
        (0, {"content": "answer"}),
        (0, {"content": " and"}),
        (1, {"content": "y"}),
    ]
    with_lp = chunks[8].choices[0]
    assert with_lp.logprobs is not None and with_lp.logprobs.content is not None
    assert with_lp.logprobs.content[0].token == "Hel"
    assert [(c.choices[0].finish_reason, c.choices[0].delta.content) for c in chunks[9:11]] == [
        ("stop", None),
        ("length", None),
    ]
    assert events[9]["choices"][0]["delta"] == {}
    last = chunks[11]
    assert last.choices == [] and last.usage is not None and last.usage.total_tokens == 11
    assert DONE == b"data: [DONE]\n\n"


def test_chat_stream_reasoning_field() -> None:
    s = chat_stream(reasoning_field="reasoning_content")
    assert frame_json(s.reasoning(0, "r"))["choices"][0]["delta"] == {"reasoning_content": "r"}
    assert s.reasoning(0, "r") == sse(s.chunk_dict(0, reasoning="r"))


# -- completion stream ---------------------------------------------------------------


@pytest.mark.parametrize("text", ODD_TEXTS)
def test_completion_fast_frames_equal_reference(text: str) -> None:
    s = CompletionStream(request_id="c", created=1, model="m", n=1)
    assert s.text(0, text) == sse(s.chunk_dict(0, text))
    assert s.text(3, text) == sse(s.chunk_dict(3, text))
    assert s.texts([(0, text), (3, text)]) == s.text(0, text) + s.text(3, text)


@settings(max_examples=200, deadline=None)
@given(text=st.text(), index=st.integers(0, 20), model=st.text(min_size=1))
def test_completion_fast_frame_property(text: str, index: int, model: str) -> None:
    s = CompletionStream(request_id="r", created=9, model=model)
    fast = s.text(index, text)
    assert fast == sse(s.chunk_dict(index, text))
    assert frame_json(fast) == s.chunk_dict(index, text)


def test_completion_stream_sequence_and_offsets() -> None:
    s = CompletionStream(request_id="c", created=1, model="m", n=2)
    buf = (
        s.text(0, "The prompt ")  # e.g. echo
        + s.texts([(1, "ab"), (0, "x")])
        + s.chunk(0, "Hello 🙂!", logprobs=LOGPROBS)
        + s.chunk(1, "c", logprobs=(TokenLogprob("c", -1.0),), finish_reason="stop")
        + s.finish(0, "length")
        + s.usage(Usage(4, 5))
    )
    events = frames(buf)
    assert [e["object"] for e in events] == ["text_completion"] * 7
    # Completion (non-stream model) requires a finish_reason: check the chunks that have one.
    for e in events[5:6] + events[4:5]:
        Completion.model_validate(e)
    lp = events[3]["choices"][0]["logprobs"]
    assert lp["text_offset"] == [12, 15, 19]  # after "The prompt " + "x"
    assert events[4]["choices"][0]["logprobs"]["text_offset"] == [2]
    assert events[5]["choices"][0] == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": "length",
    }
    assert events[6]["choices"] == [] and events[6]["usage"]["total_tokens"] == 9
