"""The vLLM parser adapter on crafted model text: calls, content, reasoning, streamed or not.

The parsers are vLLM's own (hermes + qwen3) on the demo model's tokenizer;
no engine runs. Streams are fed in arbitrary text splits, and what the
``openai`` client's stream helper assembles from our SSE frames must equal
the non-streamed answer.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from server.api.openai_chat.parse import parse_chat
from server.api.openai_chat.stream import ChatStream
from server.engines.reasoning_split import split_reasoning
from server.engines.vllm_parsers import (
    JsonEscaper,
    OutputParsers,
    RequestParsing,
    check_constraint,
    check_names,
    forced_constraint,
    reasoning_parsers,
    to_structured_outputs,
    tool_parsers,
)
from server.errors import SluiceError
from server.wire.output import Parsed, ParsedDelta
from server.wire.request import ChatRequest, Limits

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "clock"}},
]
CALL_W = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def parsers(demo_model_dir: Path) -> OutputParsers:
    from transformers import AutoTokenizer

    return OutputParsers(AutoTokenizer.from_pretrained(demo_model_dir))


def request(thinking: bool = False, **fields: Any) -> ChatRequest:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": thinking},
        **fields,
    }
    return parse_chat(orjson.dumps(body), Limits())


def feed(rp: RequestParsing, deltas: Sequence[str]) -> tuple[list[ParsedDelta], bool]:
    sp = rp.stream()
    out = [sp.feed(d, finished=i == len(deltas) - 1) for i, d in enumerate(deltas)]
    return out, sp.called


def assembled(rp: RequestParsing, deltas: Sequence[str], reason: str = "stop") -> Any:
    """Our SSE frames for a stream, assembled by the openai client's own helper."""
    enc = ChatStream(request_id="r", created=1, model="m")
    frames = [enc.first(0)]
    out, called = feed(rp, deltas)
    for d in out:
        if d.reasoning:
            frames.append(enc.reasoning(0, d.reasoning))
        if d.content:
            frames.append(enc.content(0, d.content))
        if d.tool_calls:
            frames.append(enc.tool_calls(0, d.tool_calls))
    frames.append(enc.finish(0, rp.finish_reason(reason, called)))
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for frame in frames:
        payload = orjson.loads(frame.removeprefix(b"data: "))
        state.handle_chunk(ChatCompletionChunk.model_validate(payload))
    return state.current_completion_snapshot.choices[0]


def calls(parsed: Parsed) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def stream_calls(choice: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def splits(text: str, cuts: set[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


# -- tool_choice auto -----------------------------------------------------------------


def test_several_calls(parsers: OutputParsers) -> None:
    rp = parsers.for_request(request())
    parsed = rp.parse(CALL_W + "\n" + CALL_T)
    assert calls(parsed) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert parsed.content is None and parsed.reasoning is None
    ids = [c.id for c in parsed.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("chatcmpl-tool-") for i in ids)
    assert rp.finish_reason("stop", called=True) == "tool_calls"


def test_text_then_call(parsers: OutputParsers) -> None:
    parsed = parsers.for_request(request()).parse("Let me look.\n" + CALL_W)
    assert parsed.content == "Let me look.\n"
    assert calls(parsed) == [("get_weather", {"city": "Paris", "days": 2})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
        "<tool_call>\nnot json\n</tool_call>",
        'Sure: <tool_call>{"name": "get_weather", "arguments": {"city": "P',  # cut by max_tokens
        CALL_W + "\n<tool_call>\n{broken}\n</tool_call>",  # one bad call spoils all, as in vLLM
    ],
)
def test_malformed_call_is_content(parsers: OutputParsers, text: str) -> None:
    rp = parsers.for_request(request())
    assert rp.parse(text) == Parsed(None, text)
    assert rp.finish_reason("stop", called=False) == "stop"


def test_plain_text_with_tools(parsers: OutputParsers) -> None:
    assert parsers.for_request(request()).parse("Hello <b>") == Parsed(None, "Hello <b>")


def test_thinking_then_call(parsers: OutputParsers) -> None:
    rp = parsers.for_request(request(thinking=True))
    parsed = rp.parse("plan it</think>\n\nOK. " + CALL_W)
    assert parsed.reasoning == "plan it"
    assert parsed.content == "\n\nOK. "
    assert calls(parsed) == [("get_weather", {"city": "Paris", "days": 2})]
    # A call inside the thought ends it (Qwen3's implicit end).
    parsed = rp.parse("plan it" + CALL_T)
    assert parsed.reasoning == "plan it" and calls(parsed) == [("get_time", {})]


def test_parallel_false_keeps_the_first_call(parsers: OutputParsers) -> None:
    rp = parsers.for_request(request(parallel_tool_calls=False))
    assert calls(rp.parse(CALL_W + CALL_T)) == [("get_weather", {"city": "Paris", "days": 2})]
    choice = assembled(rp, [CALL_W, CALL_T])
    assert stream_calls(choice) == [("get_weather", {"city": "Paris", "days": 2})]


def test_tool_choice_none_leaves_text(parsers: OutputParsers) -> None:
    rp = parsers.for_request(request(tool_choice="none"))
    assert rp.parse(CALL_W) == Parsed(None, CALL_W)
    out, called = feed(rp, [CALL_W[:5], CALL_W[5:]])
    assert "".join(d.content for d in out) == CALL_W and not called


def test_call_split_across_deltas(parsers: OutputParsers) -> None:
    text = "One moment." + CALL_W + "\n" + CALL_T
    rp = parsers.for_request(request())
    # Cut inside the tags, the name and the arguments.
    cut = [text.index("tool_") + 2, text.index("get_w") + 3, text.index("Par") + 2]
    out, called = feed(rp, splits(text, set(cut)))
    assert called
    announced = [t for d in out for t in d.tool_calls if t.id is not None]
    assert [(t.index, t.name) for t in announced] == [(0, "get_weather"), (1, "get_time")]
    choice = assembled(rp, splits(text, set(cut)))
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "One moment."
    assert stream_calls(choice) == calls(rp.parse(text))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), thinking=st.booleans())
def test_any_split_assembles_to_the_whole(
    parsers: OutputParsers, data: st.DataObject, thinking: bool
) -> None:
    text = ("hmm</think>\n\n" if thinking else "") + "Sure. " + CALL_W + "\n" + CALL_T
    cuts = data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12))
    rp = parsers.for_request(request(thinking=thinking))
    whole = rp.parse(text)
    choice = assembled(rp, splits(text, cuts))
    assert stream_calls(choice) == calls(whole)
    assert choice.message.content == whole.content
    assert getattr(choice.message, "reasoning", None) == whole.reasoning


# -- forced calls -----------------------------------------------------------------------


def test_forced_constraints() -> None:
    named = forced_constraint(
        request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert named is not None and json.loads(named.value) == WEATHER
    assert named.param == "tools"
    # A function without parameters still gets an object.
    assert named != forced_constraint(
        request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    )
    required = forced_constraint(request(tool_choice="required"))
    assert required is not None
    schema = json.loads(required.value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    one = forced_constraint(request(tool_choice="required", parallel_tool_calls=False))
    assert one is not None and json.loads(one.value)["maxItems"] == 1
    assert forced_constraint(request()) is None
    assert forced_constraint(request(tool_choice="none")) is None


def test_named_call(parsers: OutputParsers) -> None:
    rp = parsers.for_request(
        request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    text = '{"city":"Pa\x0bris","days":3}'  # a raw control character, as xgrammar lets through
    parsed = rp.parse(text)
    assert calls(parsed) == [("get_weather", {"city": "Pa\x0bris", "days": 3})]
    assert parsed.content is None
    assert rp.finish_reason("stop", called=True) == "stop"  # a named call stops, as in OpenAI
    choice = assembled(rp, splits(text, {3, 12, 13, 20}))
    assert stream_calls(choice) == calls(parsed)
    assert choice.finish_reason == "stop"


def test_required_calls(parsers: OutputParsers) -> None:
    rp = parsers.for_request(request(tool_choice="required"))
    text = (
        '[{"name":"get_weather","parameters":{"city":"R\x01ome"}},'
        '{"name":"get_time","parameters":{}}]'
    )
    parsed = rp.parse(text)
    assert calls(parsed) == [("get_weather", {"city": "R\x01ome"}), ("get_time", {})]
    choice = assembled(rp, splits(text, {5, 30, 44, 60}))
    assert choice.finish_reason == "tool_calls"
    assert stream_calls(choice) == calls(parsed)
    big = '[{"name":"get_time","parameters":{"n":123456789012345678901234567890}}]'
    assert calls(rp.parse(big)) == [("get_time", {"n": 123456789012345678901234567890})]


def test_forced_call_in_thinking_mode(parsers: OutputParsers) -> None:
    rp = parsers.for_request(
        request(thinking=True, tool_choice={"type": "function", "function": {"name": "get_time"}})
    )
    parsed = rp.parse("which clock?</think>{}")
    assert parsed.reasoning == "which clock?" and calls(parsed) == [("get_time", {})]
    choice = assembled(rp, ["which ", "clock?</th", "ink>{", "}"])
    assert choice.message.reasoning == "which clock?"
    assert stream_calls(choice) == [("get_time", {})]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("choice", "text", "expected"),
    [
        ("required", '[{"name":"get_weather","parameters":{"city":"Ro', []),
        ("required", "[", []),
        (
            "required",
            '[{"name":"get_time","parameters":{}} ,\n{"name":"get_weather","parameters":{"ci',
            [("get_time", {})],
        ),
        (
            "required",
            '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{}}',
            [("get_time", {}), ("get_weather", {})],
        ),
        (NAMED, '{"city":"Ro', []),
        (NAMED, " ", []),
    ],
)
def test_cut_forced_call_keeps_the_complete_calls(
    parsers: OutputParsers, choice: Any, text: str, expected: list[tuple[str, Any]]
) -> None:
    """Cut by max_tokens: the calls closed before the cut, never the raw JSON as content."""
    rp = parsers.for_request(request(tool_choice=choice))
    parsed = rp.parse(text)
    assert calls(parsed) == expected and parsed.content is None
    assert rp.finish_reason("length", called=bool(expected)) == "length"
    # A stream announces what it read as it goes; its finish says the last may be cut.
    streamed = assembled(rp, splits(text, {len(text) // 2}), reason="length")
    assert streamed.finish_reason == "length" and not streamed.message.content


# -- structured outputs -------------------------------------------------------------------


def test_to_structured_outputs() -> None:
    def so(**fields: Any) -> Any:
        req = request(**fields)
        assert req.sampling.constraint is not None
        return to_structured_outputs(req.sampling.constraint)

    assert so(response_format={"type": "json_object"}).json_object is True
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert json.loads(so(response_format=rf).json) == schema
    assert so(structured_outputs={"regex": "a+"}).regex == "a+"
    assert so(structured_outputs={"choice": ["y", "n"]}).choice == ["y", "n"]
    assert so(guided_grammar="root ::= 'a'").grammar == "root ::= 'a'"


def test_engine_check_is_a_400(demo_model_dir: Path, parsers: OutputParsers) -> None:
    from vllm.config import ModelConfig, StructuredOutputsConfig

    from server.errors import SluiceError

    engine = {
        "model_config": ModelConfig(model=str(demo_model_dir), max_model_len=512),
        "config": StructuredOutputsConfig(backend="xgrammar"),
        "tokenizer": parsers._tokenizer,
    }
    good = request(response_format={"type": "json_object"}).sampling.constraint
    assert good is not None
    assert check_constraint(good, **engine).json_object is True
    bad_schema = {"type": "object", "properties": {"a": {"type": "strin"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}}
    for fields, param in [
        ({"response_format": rf}, "response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
    ]:
        constraint = request(**fields).sampling.constraint
        assert constraint is not None
        with pytest.raises(SluiceError) as info:
            check_constraint(constraint, **engine)
        assert info.value.status == 400 and info.value.param == param


# -- the JSON escaper ------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


def _raw(value: Any) -> str:
    """JSON text with control characters left raw in strings, as xgrammar may emit."""
    raw = {"n": "\n", "t": "\t", "r": "\r"}

    def unescape(m: re.Match[str]) -> str:
        # One escape at a time, left to right, so an escaped backslash before
        # an `n` (the key `\\n`) stays what it is.
        esc = m.group(1)
        if esc in raw:
            return raw[esc]
        if esc.startswith("u") and int(esc[1:], 16) < 0x20:
            return chr(int(esc[1:], 16))
        return m.group(0)

    return re.sub(r"\\(u[0-9a-f]{4}|.)", unescape, json.dumps(value))


@settings(max_examples=300, deadline=None)
@given(value=JSON, data=st.data())
def test_escaper_makes_strict_json(value: Any, data: st.DataObject) -> None:
    raw = _raw(value)
    cuts = data.draw(st.sets(st.integers(0, len(raw)), max_size=6))
    esc = JsonEscaper()
    out = "".join(esc.feed(piece) for piece in splits(raw, cuts))
    assert json.loads(out) == value  # strict: no raw control characters left
    assert json.loads(raw, strict=False) == value


def test_escaper_leaves_whitespace_between_tokens() -> None:
    assert JsonEscaper().feed('{\n\t"a":\t"b\tc"\n}') == '{\n\t"a":\t"b\\u0009c"\n}'


# -- the reasoning split agrees with vLLM's qwen3 parser ------------------------------------

PIECES = ["<think>", "</think>", "<", "</", "<thi", "</thi", "nk>", ">", "a", " ", "\n", "é"]


@settings(max_examples=300, deadline=None)
@given(
    text=st.one_of(
        st.lists(st.sampled_from(PIECES), max_size=12).map("".join), st.text(max_size=40)
    )
)
def test_reasoning_split_matches_vllm(parsers: OutputParsers, text: str) -> None:
    """server/engines/reasoning_split.py (the no-tools hot path: 0.1 us per delta against
    vLLM's 10 us) splits a whole output exactly as vLLM's qwen3 parser does."""
    no_tools = parse_chat(
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}), Limits()
    )
    parsed = parsers.for_request(no_tools).parse(text)
    assert (parsed.reasoning or None, parsed.content or None) == split_reasoning(text)
    assert parsed.tool_calls == ()


# -- other parsers (--tool-call-parser, --enable-auto-tool-choice) ---------------------

QWEN3_CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


def test_qwen3_coder_parser_reads_its_own_format(demo_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    coder = OutputParsers(AutoTokenizer.from_pretrained(demo_model_dir), tool_parser="qwen3_coder")
    rp = coder.for_request(request())
    parsed = rp.parse("Let me look. " + QWEN3_CODER_CALL)
    assert calls(parsed) == [("get_weather", {"city": "Paris", "days": 2})]
    assert parsed.content == "Let me look."  # (the parser strips it)


def test_the_default_hermes_parser_does_not_read_qwen3_coder(parsers: OutputParsers) -> None:
    """What --tool-call-parser changes: hermes leaves this format as content."""
    assert parsers.for_request(request()).parse(QWEN3_CODER_CALL) == Parsed(None, QWEN3_CODER_CALL)


def test_a_parser_the_tokenizer_cannot_serve_is_refused(demo_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    with pytest.raises(TypeError, match="llama3_json"):  # vLLM's start-up check
        OutputParsers(AutoTokenizer.from_pretrained(demo_model_dir), tool_parser="llama3_json")


def test_without_auto_tool_choice_auto_is_a_400(demo_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    manual = OutputParsers(AutoTokenizer.from_pretrained(demo_model_dir), auto_tools=False)
    with pytest.raises(SluiceError) as err:
        manual.for_request(request())
    assert err.value.status == 400 and err.value.param == "tool_choice"
    assert "--enable-auto-tool-choice" in str(err.value)
    # A forced call needs no tool parser: it still works, and so does none.
    rp = manual.for_request(request(tool_choice="required"))
    assert calls(rp.parse('[{"name":"get_time","parameters":{}}]')) == [("get_time", {})]
    assert manual.for_request(request(tool_choice="none")).parse(CALL_T).content == CALL_T


def test_parser_names_are_vllms_registries() -> None:
    names = tool_parsers()
    assert {"hermes", "qwen3_coder", "llama3_json", "mistral"} <= set(names)
    assert {"qwen3", "deepseek_r1"} <= set(reasoning_parsers())
    check_names("qwen3_coder", "deepseek_r1")
    with pytest.raises(ValueError, match=r"--tool-call-parser 'nope'.*hermes"):
        check_names("nope", "qwen3")
    with pytest.raises(ValueError, match="--reasoning-parser 'nope'"):
        check_names("hermes", "nope")


def test_a_request_without_tools_reads_no_calls(demo_model_dir: Path) -> None:
    """Under another --reasoning-parser every request comes here; one without
    tools keeps a call-shaped text as content (vLLM reads no tool_choice as auto)."""
    from transformers import AutoTokenizer

    granite = OutputParsers(
        AutoTokenizer.from_pretrained(demo_model_dir), reasoning_parser="granite"
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    rp = granite.for_request(parse_chat(orjson.dumps(body), Limits()))
    text = "Here is my thought process: hm Here is my response: " + CALL_T
    parsed = rp.parse(text)
    assert parsed.tool_calls == () and parsed.content is not None and CALL_T in parsed.content
    assert parsed.reasoning is not None and "hm" in parsed.reasoning
