"""Ollama's API, the pure translation (server/api/ollama/parse.py, output.py).

Requests: each field as Ollama's types carry it, into the internal request;
refusals name the field as the client sent it (`options.temperature`); what is
accepted and ignored is noted under its label. Answers: validated with the
`ollama` Python client's own pydantic types, the spliced stream line equal to
the general one, tool calls whole with `arguments` objects, and any chunking
of an answer into engine outputs assembling, line by line, to the whole
answer (hypothesis, through the encoder).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import ollama
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.api.ollama.endpoint import OllamaEncoder
from server.api.ollama.output import (
    CallAssembly,
    Clock,
    Metrics,
    ModelEntry,
    OllamaStream,
    answer_body,
    embed_body,
    embeddings_body,
    listed_name,
    load_body,
    ps_body,
    show_body,
    tags_body,
)
from server.api.ollama.parse import (
    check_num_ctx,
    ollama_probe,
    parse_chat,
    parse_embed,
    parse_embeddings,
    parse_generate,
    parse_show,
    render_template,
    served_name,
)
from server.errors import SluiceError
from server.http.pipeline import Trace
from server.wire.ignored import OTHER, Ignored
from server.wire.output import TokenLogprob, ToolCallDelta
from server.wire.request import Constraint, Limits, Message, ToolCall
from tests.fakes import FakeCompletion

LIMITS = Limits(max_tokens_cap=4096, default_enable_thinking=True)
HI = [{"role": "user", "content": "hi"}]


def chat(**body: Any) -> Any:
    return parse_chat(orjson.dumps({"model": "m", "messages": HI, **body}), LIMITS)


def generate(**body: Any) -> Any:
    return parse_generate(orjson.dumps({"model": "m", "prompt": "hi", **body}), LIMITS)


def refused(fn: Any, **body: Any) -> SluiceError:
    with pytest.raises(SluiceError) as info:
        fn(**body)
    assert info.value.status == 400
    return info.value


def labels(req: Any) -> list[tuple[str, str]]:
    return [(i.field, i.name) for i in req.chat.ignored]


# -- chat ------------------------------------------------------------------------


def test_a_conversation_with_a_tool_turn() -> None:
    req = chat(
        messages=[
            {"role": "SYSTEM", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "thinking": "look it up",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
                    {"id": "c9", "function": {"name": "get_time", "arguments": '{"tz": 1}'}},
                ],
            },
            {"role": "tool", "content": "21 C", "tool_name": "get_weather"},
            {"role": "tool", "content": "noon", "tool_call_id": "c9"},
        ],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
    )
    assert req.chat.messages == (
        Message("system", "Be brief."),
        Message("user", "Weather?"),
        Message(
            "assistant",
            "",
            tool_calls=(
                ToolCall("call_2_0", "get_weather", '{"city":"Rome"}'),
                ToolCall("c9", "get_time", '{"tz": 1}'),
            ),
            reasoning="look it up",
        ),
        Message("tool", "21 C", name="get_weather"),
        Message("tool", "noon", tool_call_id="c9"),
    )
    assert [t.name for t in req.chat.tools] == ["get_weather"]
    assert req.chat.tool_choice.mode == "auto"
    assert req.chat.stream is True and req.load is False and req.generate is False


def test_defaults_and_the_load_request() -> None:
    req = chat()
    assert req.name == "m" and req.chat.enable_thinking is True
    assert req.chat.chat_template_kwargs == (("enable_thinking", True),)
    assert req.chat.sampling.max_tokens is None and req.chat.sampling.constraint is None
    assert chat(messages=[]).load and chat(messages=None).load


def test_options_become_sampling_fields() -> None:
    s = chat(
        options={
            "num_predict": 12,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40.0,  # an integral float: an integer, as Ollama's Go reader takes it
            "min_p": 0.1,
            "stop": ["\n", "user:"],
            "seed": 7,
            "repeat_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "ignore_eos": True,
        }
    ).chat.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (12, 0.5, 0.9, 40, 0.1)
    assert s.stop == ("\n", "user:") and s.seed == 7 and s.ignore_eos
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.1, 0.5, 0.25)


@pytest.mark.parametrize(("num_predict", "want"), [(-1, None), (-2, None), (0, None), (9999, 4096)])
def test_num_predict_is_a_ceiling(num_predict: int, want: int | None) -> None:
    assert chat(options={"num_predict": num_predict}).chat.sampling.max_tokens == want


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"temperature": 9}, "options.temperature"),
        ({"repeat_penalty": 0}, "options.repeat_penalty"),
        ({"top_k": 1.5}, "options.top_k"),
        ({"stop": [1]}, "options.stop"),
        ({"num_predict": "x"}, "options.num_predict"),
        ({"num_ctx": 0}, "options.num_ctx"),
        ([], "options"),
    ],
)
def test_a_bad_option_is_named_as_sent(options: Any, param: str) -> None:
    err = refused(chat, options=options)
    assert err.param == param and f"'{param}'" in err.message


def test_num_ctx_within_the_served_context_or_a_400() -> None:
    req = chat(options={"num_ctx": 2048})
    assert req.num_ctx == 2048
    check_num_ctx(2048, 2048)
    check_num_ctx(None, 8)
    with pytest.raises(SluiceError) as info:
        check_num_ctx(4096, 2048)
    assert info.value.param == "options.num_ctx" and "2048" in info.value.message


def test_unknown_options_and_fields_are_noted_under_their_labels() -> None:
    req = chat(
        options={"num_gpu": 1, "mirostat": 0, "x_new": 1, "num_thread": None},
        keep_alive="5m",
        truncate=True,
        shift=False,
        surprise=1,
    )
    assert labels(req) == [
        ("options.num_gpu", "options.num_gpu"),
        ("options.mirostat", "options.mirostat"),
        (OTHER, "options.x_new"),
        ("truncate", "truncate"),
        ("shift", "shift"),
        (OTHER, "surprise"),
    ]


def test_think_switch_and_levels() -> None:
    assert chat(think=False).chat.enable_thinking is False
    assert chat(think=True).chat.chat_template_kwargs == (("enable_thinking", True),)
    high = chat(think="high")
    assert high.chat.enable_thinking is True and labels(high) == [("think", "think")]
    assert refused(chat, think="hot").param == "think"
    assert refused(chat, think=1).param == "think"


def test_format_json_or_a_schema() -> None:
    assert chat(format="json").chat.sampling.constraint == Constraint("json_object")
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    c = chat(format=schema).chat.sampling.constraint
    assert c is not None and c.kind == "json" and orjson.loads(c.value) == schema
    assert not c.from_start  # chat: after the thinking
    assert chat(format="").chat.sampling.constraint is None
    assert refused(chat, format="yaml").param == "format"


def test_logprobs() -> None:
    assert chat(logprobs=True, top_logprobs=3).chat.sampling.logprobs == 3
    assert chat(logprobs=True).chat.sampling.logprobs == 0
    assert chat(top_logprobs=3).chat.sampling.logprobs is None  # only with logprobs, as Ollama
    assert refused(chat, logprobs=True, top_logprobs=99).param == "top_logprobs"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user", "content": "x", "images": ["aGk="]}], "messages[0].images"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 1}}]}],
            "messages[0].tool_calls[0].function.arguments",
        ),
        ([{"role": "assistant", "tool_calls": [{"function": {}}]}], "messages[0].tool_calls[0]"),
        ("hi", "messages"),
    ],
)
def test_bad_messages_are_named(messages: Any, param: str) -> None:
    assert refused(chat, messages=messages).param.startswith(param)  # type: ignore[union-attr]


def test_empty_images_are_no_images() -> None:
    req = chat(messages=[{"role": "user", "content": "x", "images": []}])
    assert req.chat.messages == (Message("user", "x"),)


# -- generate --------------------------------------------------------------------


def test_generate_is_one_user_turn_after_the_system() -> None:
    req = generate(system="Be brief.", think=False)
    assert req.generate and req.text is None
    assert req.chat.messages == (Message("system", "Be brief."), Message("user", "hi"))
    assert req.chat.enable_thinking is False
    assert generate(prompt="").load and generate(prompt=None).load


def test_raw_is_the_prompt_as_sent_constrained_from_the_start() -> None:
    req = generate(raw=True, prompt="<|im_start|>user\nhi", format="json", think=True)
    assert req.text == "<|im_start|>user\nhi" and req.chat.enable_thinking is False
    c = req.chat.sampling.constraint
    assert c is not None and c.from_start
    assert labels(req) == [("think", "think")]  # not split: the prompt is the client's


def test_template_is_rendered() -> None:
    req = generate(template="{{ .System }}\nUSER: {{ .Prompt }}\nASSISTANT: ", system="S")
    assert req.text == "S\nUSER: hi\nASSISTANT: "


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"raw": True, "system": "s"}, "raw"),
        ({"raw": True, "template": "{{ .Prompt }}"}, "raw"),
        ({"suffix": "return x"}, "suffix"),
        ({"context": [1, 2]}, "context"),
        ({"images": ["aGk="]}, "images"),
        ({"_debug_render_only": True}, "_debug_render_only"),
        ({"template": "{{ range .Messages }}{{ end }}"}, "template"),
    ],
)
def test_generate_refusals(body: dict[str, Any], param: str) -> None:
    assert refused(generate, **body).param == param


@pytest.mark.parametrize(
    ("template", "system", "want"),
    [
        ("{{ if .System }}<s>{{ .System }}</s>{{ end }}[{{ .Prompt }}]", "", "[P]"),
        ("{{ if .System }}<s>{{ .System }}</s>{{ end }}[{{ .Prompt }}]", "S", "<s>S</s>[P]"),
        ("{{ if .System }}A{{ else }}B{{ end }}", "", "B"),
        ("A  {{- .Prompt -}}  \n B", "", "APB"),
        ("{{/* note */}}{{ .Prompt }}", "", "P"),
        ("U: {{ .Prompt }} A: {{ .Response }}</s> dropped {{ .Prompt }}", "", "U: P A: "),
        ("{{ if .Prompt }}U: {{ .Prompt }} A: {{ .Response }}{{ end }}x", "", "U: P A: "),
        ("{{ if .Response }}R{{ end }}{{ .Prompt }}", "", "P"),
        ("no actions", "", "no actions"),
    ],
)
def test_render_template(template: str, system: str, want: str) -> None:
    assert render_template(template, system, "P") == want


@pytest.mark.parametrize("template", ["{{ .Tools }}", "{{ if .System }}x", "{{ end }}", "{{ $x }}"])
def test_render_template_refuses_what_it_does_not_know(template: str) -> None:
    with pytest.raises(SluiceError) as info:
        render_template(template, "", "P")
    assert info.value.param == "template"


# -- names, probes, show, embeddings ----------------------------------------------


def test_served_and_listed_names() -> None:
    served = {"sluice-demo", "qwen3:14b"}
    assert served_name("sluice-demo:latest", served.__contains__) == "sluice-demo"
    assert served_name("sluice-demo", served.__contains__) == "sluice-demo"
    assert served_name("qwen3:14b", served.__contains__) == "qwen3:14b"
    assert served_name("sluice-demo:7b", served.__contains__) == "sluice-demo:7b"  # a 404 later
    assert served_name("other:latest", served.__contains__) == "other:latest"
    assert listed_name("sluice-demo") == "sluice-demo:latest"
    assert listed_name("qwen3:14b") == "qwen3:14b"


@pytest.mark.parametrize(
    ("accept", "agent", "probe"),
    [
        ("application/json", "ollama/0.32.15 (amd64 linux) Go/go1.24", True),  # the CLI's HEAD /
        ("*/*", "ollama-python/0.6.3 (x86_64 linux) Python/3.11", True),
        ("*/*", "ollama-js/0.6.4 (x64 linux Node.js/v20)", True),
        ("application/json", "Go-http-client/1.1", True),
        ("text/plain", "", True),
        ("text/html,application/xhtml+xml,*/*;q=0.8", "Mozilla/5.0", False),  # a browser
        ("*/*", "curl/8.5.0", False),
        ("", "", False),
    ],
)
def test_root_answers_ollamas_probe_to_its_clients(accept: str, agent: str, probe: bool) -> None:
    assert ollama_probe(accept, agent) is probe


def test_show_takes_model_or_name() -> None:
    assert parse_show(b'{"model": "m:latest", "verbose": true}') == "m:latest"
    assert parse_show(b'{"name": "m"}') == "m"
    with pytest.raises(SluiceError):
        parse_show(b"{}")


def test_embed_requests() -> None:
    req = parse_embed(b'{"model": "e", "input": ["a", "b"], "truncate": false, "dimensions": 8}')
    assert (req.inputs, req.truncate, req.dimensions, req.legacy) == (("a", "b"), False, 8, False)
    assert parse_embed(b'{"model": "e", "input": ""}').inputs == ()
    assert parse_embed(b'{"model": "e", "input": "x"}').inputs == ("x",)
    noted = parse_embed(b'{"model": "e", "input": "x", "keep_alive": 0, "options": {"num_ctx": 8}}')
    assert [i.field for i in noted.ignored] == [OTHER, "keep_alive"]
    old = parse_embeddings(b'{"model": "e", "prompt": "x"}')
    assert old.inputs == ("x",) and old.legacy
    for bad in (b'{"model": "e", "input": [1]}', b'{"model": "e", "input": "x", "dimensions": 0}'):
        with pytest.raises(SluiceError):
            parse_embed(bad)


def test_embed_bodies_are_the_clients_types() -> None:
    m = Metrics.of(0.5, 0.1, None, 8, 0)
    body = orjson.loads(embed_body("e", [[0.5, -1.0], [0.0, 2.0]], m))
    res = ollama.EmbedResponse(**body)
    assert res.embeddings == [[0.5, -1.0], [0.0, 2.0]] and res.prompt_eval_count == 8
    assert res.total_duration == 500_000_000
    assert ollama.EmbeddingsResponse(**orjson.loads(embeddings_body([1.5]))).embedding == [1.5]


# -- answers ---------------------------------------------------------------------


def test_metrics_in_nanoseconds() -> None:
    m = Metrics.of(total=2.0, queued=0.25, first_token=0.75, prompt=10, answer=20)
    assert m.as_dict() == {
        "total_duration": 2_000_000_000,
        "load_duration": 250_000_000,
        "prompt_eval_count": 10,
        "prompt_eval_duration": 500_000_000,
        "eval_count": 20,
        "eval_duration": 1_250_000_000,
    }
    assert Metrics.of(1.0, 0.0, None, 1, 0).as_dict()["eval_duration"] == 0


def test_clock_is_rfc3339_utc() -> None:
    assert Clock()(0.25) == "1970-01-01T00:00:00.250000Z"
    clock = Clock()
    assert clock(86400.5) == "1970-01-02T00:00:00.500000Z" and clock(86401.0).endswith("01.000000Z")


CALLS = (ToolCall("c1", "get_weather", '{"city": "Rome"}'), ToolCall("c2", "f", "not json"))


@pytest.mark.parametrize("generate", [False, True])
def test_whole_answers_are_the_clients_types(generate: bool) -> None:
    m = Metrics.of(1.0, 0.1, 0.2, 5, 7)
    lps = (TokenLogprob("a", -0.5, (("a", -0.5), ("b", -1.0))),)
    raw = answer_body(
        "m:latest",
        "2026-01-01T00:00:00.000000Z",
        generate=generate,
        content="hello",
        thinking="hmm",
        calls=CALLS,
        reason="stop",
        metrics=m,
        logprobs=lps,
    )
    body = orjson.loads(raw)
    if generate:
        res: Any = ollama.GenerateResponse(**body)
        assert res.response == "hello" and res.thinking == "hmm"
    else:
        res = ollama.ChatResponse(**body)
        assert res.message.content == "hello" and res.message.thinking == "hmm"
        calls = res.message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            ("get_weather", {"city": "Rome"}),
            ("f", {}),
        ]
        assert body["message"]["tool_calls"][0]["id"] == "c1"
    assert res.done and res.done_reason == "stop" and res.eval_count == 7
    assert res.logprobs[0].top_logprobs[1].token == "b"
    load = orjson.loads(load_body("m", "t", generate=generate))
    assert load["done_reason"] == "load" and load["done"] is True


@given(
    content=st.text(),
    stamp=st.floats(0, 4e9, allow_nan=False),
    generate=st.booleans(),
    name=st.text(min_size=1),
)
def test_the_spliced_line_is_the_general_line(
    content: str, stamp: float, generate: bool, name: str
) -> None:
    spliced = OllamaStream(name, generate=generate).line(stamp, content)
    general = OllamaStream(name, generate=generate).line(stamp, content, logprobs=[])
    want = orjson.loads(general)
    del want["logprobs"]
    assert spliced.endswith(b"\n") and orjson.loads(spliced) == want


def test_the_closing_line_and_an_error_line() -> None:
    enc = OllamaStream("m", generate=False)
    done = orjson.loads(enc.done(1.0, "length", Metrics.of(1.0, 0.0, 0.5, 3, 4)))
    assert done["done"] is True and done["done_reason"] == "length"
    assert done["message"] == {"role": "assistant", "content": ""}
    assert ollama.ChatResponse(**done).eval_count == 4
    err = SluiceError("the engine died", status=503)
    assert enc.error(err) == b'{"error":"the engine died"}\n'


def test_streamed_calls_are_assembled_whole() -> None:
    calls = CallAssembly()
    calls.add([ToolCallDelta(0, "c1", "get_weather", '{"city": "Os')])
    calls.add([ToolCallDelta(0, arguments='lo"}'), ToolCallDelta(1, "c2", "get_time")])
    calls.add([ToolCallDelta(2, "c3", "cut", '{"x": ')])  # never finished: dropped
    assert calls.finish() == (
        ToolCall("c1", "get_weather", '{"city": "Oslo"}'),
        ToolCall("c2", "get_time", "{}"),
    )
    assert calls.finish() == ()


def test_model_lists_are_the_clients_types() -> None:
    base = ModelEntry("sluice-demo", "/m", 0.0, 8192)
    lora = ModelEntry("sql", "/a", 0.0, 8192, parent="sluice-demo")
    tags = ollama.ListResponse(**orjson.loads(tags_body([base, lora])))
    assert [m.model for m in tags.models] == ["sluice-demo:latest", "sql:latest"]
    assert tags.models[1].details.parent_model == "sluice-demo:latest"  # type: ignore[union-attr]
    assert len(tags.models[0].digest or "") == 64
    ps = ollama.ProcessResponse(**orjson.loads(ps_body([base], time.time())))
    assert ps.models[0].context_length == 8192
    assert ps.models[0].expires_at.year > time.gmtime().tm_year + 20  # type: ignore[union-attr]
    show = ollama.ShowResponse(**orjson.loads(show_body(base)))
    assert show.modelinfo == {"general.architecture": "sluice", "sluice.context_length": 8192}
    assert show.capabilities == ["completion", "tools", "thinking"]


# -- any chunking of an answer assembles to the whole answer ------------------------

PIECES = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "Hi", " there", "\n", "é", ""]),
    max_size=16,
)


def _encoder(thinking: bool, generate: bool) -> OllamaEncoder:
    body = {"model": "m", "think": thinking, "stream": True}
    body |= {"prompt": "hi"} if generate else {"messages": HI}
    req = (parse_generate if generate else parse_chat)(orjson.dumps(body), LIMITS)
    return OllamaEncoder(req, req.chat, Trace("r", "ollama_chat", time.monotonic()), str)


@given(
    pieces=PIECES,
    cuts=st.lists(st.integers(0, 200), max_size=8),
    thinking=st.booleans(),
    generate=st.booleans(),
    reason=st.sampled_from(["stop", "length"]),
)
def test_any_chunking_assembles_to_the_whole_answer(
    pieces: list[str], cuts: list[int], thinking: bool, generate: bool, reason: str
) -> None:
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    stream = _encoder(thinking, generate)
    lines = b"".join(
        stream.stream_delta(0, FakeCompletion(0, c, [1], reason if i == len(chunks) - 1 else None))
        for i, c in enumerate(chunks)
    )
    lines += stream.stream_end(_usage())
    objs = [orjson.loads(line) for line in lines.splitlines()]
    assert objs and all(not o["done"] for o in objs[:-1]) and objs[-1]["done"]
    whole_enc = _encoder(thinking, generate)
    whole = orjson.loads(whole_enc.body(whole_enc.choices([text], [[]], [reason]), _usage()))
    if generate:
        got = ["".join(o["response"] for o in objs), "".join(o.get("thinking", "") for o in objs)]
        want = [whole["response"], whole.get("thinking", "")]
    else:
        msgs = [o["message"] for o in objs]
        got = ["".join(m["content"] for m in msgs), "".join(m.get("thinking", "") for m in msgs)]
        want = [whole["message"]["content"], whole["message"].get("thinking", "")]
    assert got == want
    assert objs[-1]["done_reason"] == whole["done_reason"] == reason


def _usage() -> Any:
    from server.wire.output import Usage

    return Usage(3, 4)


def test_an_ignored_item_carries_the_clients_spelling() -> None:
    assert Ignored("truncate", "truncate") in chat(truncate=True).chat.ignored


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (300, 300.0),
        (2.5, 2.5),
        (-1, -1.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("500ms", 0.5),
        ("-1m", -60.0),
        ("0", 0.0),
        ("-1", -1.0),
        ("300", 300.0),
        (None, None),
    ],
)
def test_keep_alive_is_seconds_as_ollama_reads_it(value: Any, seconds: float | None) -> None:
    assert chat(keep_alive=value).keep_alive == seconds
    assert generate(prompt="x", keep_alive=value).keep_alive == seconds
    assert chat().keep_alive is None


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m", "5x", True, [], {}])
def test_a_bad_keep_alive_is_named(value: Any) -> None:
    assert refused(chat, keep_alive=value).param == "keep_alive"
