"""Request parsing: every refusal is a 400 naming its field; valid bodies parse exactly."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from server.api.openai_chat.parse import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    check_context,
    parse_chat,
    parse_completion,
)
from server.errors import SluiceError
from server.wire.request import (
    ChatRequest,
    CompletionRequest,
    Limits,
    Message,
    Sampling,
    ToolCall,
)

LIMITS = Limits()
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatRequest:
    return parse_chat(orjson.dumps({"model": "m", "messages": USER, **fields}), LIMITS)


def completion(**fields: Any) -> CompletionRequest:
    return parse_completion(orjson.dumps({"model": "m", "prompt": "hi", **fields}), LIMITS)


def refused(parse: Any, body: bytes, limits: Limits = LIMITS) -> SluiceError:
    with pytest.raises(SluiceError) as info:
        parse(body, limits)
    err = info.value
    assert err.status == 400
    assert err.body()["error"]["type"] == "invalid_request_error"
    return err


# -- bodies that are not JSON objects ------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b"nope", b"\xff\xfe", b'{"model": "\xc3"}', b'"\\ud800"', b"[]", b"1", b"null"],
)
@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_malformed_body_is_400(parse: Any, body: bytes) -> None:
    err = refused(parse, body)
    assert err.code == "invalid_json"
    assert err.param is None


# -- valid bodies --------------------------------------------------------------------


def test_minimal_chat_defaults() -> None:
    req = chat()
    assert req == ChatRequest(
        model="m",
        messages=(Message("user", "hi"),),
        sampling=Sampling(),
        enable_thinking=True,
        chat_template_kwargs=(("enable_thinking", True),),
    )
    assert req.sampling.max_tokens is None
    assert not req.logprobs
    assert not req.sampling.deterministic


def test_full_chat() -> None:
    req = chat(
        messages=[
            {"role": "system", "content": "sys"},
            {"role": "developer", "content": "dev", "name": "d"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f"}}],
            },
            {"role": "tool", "content": "out", "tool_call_id": "x"},
        ],
        max_tokens=100,
        max_completion_tokens=50,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.1,
        n=3,
        stop=["a", "b", "a"],
        stop_token_ids=[7, 7, 8],
        seed=42,
        presence_penalty=-1,
        frequency_penalty=2,
        repetition_penalty=1.1,
        logprobs=True,
        top_logprobs=5,
        user="u",
        stream=True,
        stream_options={"include_usage": True},
        ignore_eos=True,
        priority=-3,
        chat_template_kwargs={"enable_thinking": False, "z": [1], "a": {"b": 2}},
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        min_tokens=5,
        # No tools, plain text: as if absent.
        tools=[],
        tool_choice="auto",
        response_format={"type": "text"},
        parallel_tool_calls=True,
        # Ignored extras an OpenAI client may send.
        store=False,
        metadata={"k": "v"},
        logit_bias={},
        modalities=["text"],
        best_of=3,
    )
    assert req.messages == (
        Message("system", "sys"),
        Message("developer", "dev", "d"),
        Message("user", "a\nb"),
        Message("assistant", "", tool_calls=(ToolCall("x", "f", "{}"),)),
        Message("tool", "out", tool_call_id="x"),
    )
    assert req.sampling == Sampling(
        max_tokens=50,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.1,
        n=3,
        stop=("a", "b"),
        stop_token_ids=(7, 8),
        seed=42,
        presence_penalty=-1.0,
        frequency_penalty=2.0,
        repetition_penalty=1.1,
        logprobs=5,
        ignore_eos=True,
        min_tokens=5,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    assert req.stream and req.include_usage
    assert req.priority == -3 and req.user == "u"
    assert req.enable_thinking is False
    assert req.chat_template_kwargs == (
        ("a", {"b": 2}),
        ("enable_thinking", False),
        ("z", [1]),
    )
    assert req.template_kwargs() == {"a": {"b": 2}, "enable_thinking": False, "z": [1]}
    assert req.logprobs and req.top_logprobs == 5
    assert req.sampling.deterministic


def test_nulls_mean_absent() -> None:
    nulls = dict.fromkeys(
        [
            "max_tokens",
            "temperature",
            "top_p",
            "n",
            "stop",
            "seed",
            "logprobs",
            "top_logprobs",
            "user",
            "stream",
            "stream_options",
            "chat_template_kwargs",
            "tools",
            "tool_choice",
            "response_format",
        ]
    )
    assert chat(**nulls) == chat()


def test_logprobs_zero_top() -> None:
    assert chat(logprobs=True).sampling.logprobs == 0
    assert chat(logprobs=False, top_logprobs=0).sampling.logprobs is None


def test_top_k_and_seed_spellings_normalised() -> None:
    assert chat(top_k=-1).sampling.top_k == 0
    assert chat(top_k=0).sampling.top_k == 0
    assert chat(seed=-1).sampling.seed is None


def test_greedy_normalises_like_vllm() -> None:
    s = chat(temperature=0, top_p=0.5, top_k=3, min_p=0.2).sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.0, 1.0, 0, 0.0)
    assert s.deterministic
    assert s.fingerprint() == chat(temperature=0.0).sampling.fingerprint()


def test_fingerprint_separates_outputs() -> None:
    base = chat(seed=1).sampling.fingerprint()
    assert hash(base) == hash(chat(seed=1, temperature=1).sampling.fingerprint())
    assert base != chat(seed=2).sampling.fingerprint()
    assert base != chat(seed=1, n=2).sampling.fingerprint()
    assert base != chat(seed=1, stop="x").sampling.fingerprint()
    assert base != chat(seed=1, max_tokens=9).sampling.fingerprint()


def test_thinking_default_from_limits() -> None:
    off = Limits(default_enable_thinking=False)
    body = orjson.dumps({"model": "m", "messages": USER})
    assert parse_chat(body, off).enable_thinking is False
    body = orjson.dumps({"model": "m", "messages": USER, "chat_template_kwargs": {"x": 1}})
    req = parse_chat(body, off)
    assert req.chat_template_kwargs == (("enable_thinking", False), ("x", 1))


def test_limit_defaults_apply() -> None:
    limits = Limits(
        default_max_tokens=64,
        sampling_defaults=(("temperature", 0.6), ("top_p", 0.95), ("top_k", 20)),
    )
    req = parse_chat(orjson.dumps({"model": "m", "messages": USER}), limits)
    assert req.sampling.max_tokens == 64
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k) == (0.6, 0.95, 20)
    req = parse_chat(orjson.dumps({"model": "m", "messages": USER, "top_k": 0}), limits)
    assert req.sampling.top_k == 0
    with pytest.raises(ValueError, match="unknown"):
        Limits(sampling_defaults=(("nope", 1.0),))


def test_completion_prompts_and_defaults() -> None:
    assert completion().prompts == ("hi",)
    assert completion().sampling.max_tokens == COMPLETION_DEFAULT_MAX_TOKENS
    assert completion(max_tokens=None).sampling.max_tokens is None
    assert completion(prompt=["a", "b"]).prompts == ("a", "b")
    assert completion(prompt=[1, 2, 3]).prompts == ((1, 2, 3),)
    assert completion(prompt=[[1], [2, 3]]).prompts == ((1,), (2, 3))
    assert completion(prompt=["a", [2, 3]]).prompts == ("a", (2, 3))
    req = completion(logprobs=0, echo=False, stream=True, stream_options={"include_usage": False})
    assert req.sampling.logprobs == 0 and req.stream and not req.include_usage
    assert completion(echo=True).echo
    assert completion(logprobs=20).sampling.logprobs == 20
    capped = parse_completion(b'{"model":"m","prompt":"x"}', Limits(max_tokens_cap=8))
    assert capped.sampling.max_tokens == 8


# -- refusals: (fields, param) -------------------------------------------------------

COMMON_BAD: list[tuple[dict[str, Any], str]] = [
    ({"model": None}, "model"),
    ({"model": ""}, "model"),
    ({"model": 3}, "model"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.0001}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 9}, "n"),
    ({"n": True}, "n"),
    ({"n": 2.0}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": False}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"include_stop_str_in_output": 0}, "include_stop_str_in_output"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"priority": 1.5}, "priority"),
    ({"priority": True}, "priority"),
    ({"user": 5}, "user"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {}}, "stream_options"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    # Recognised but not honoured.
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    # vLLM's prompt_logprobs: bounded, a non-negative integer, not with a stream.
    ({"prompt_logprobs": 21}, "prompt_logprobs"),  # --max-logprobs: 20
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": "1"}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"best_of": 2}, "best_of"),
    ({"modalities": ["text", "audio"]}, "modalities"),
]


@pytest.mark.parametrize(("fields", "param"), COMMON_BAD)
@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_common_refusals(parse: Any, fields: dict[str, Any], param: str) -> None:
    base = (
        {"model": "m", "messages": USER} if parse is parse_chat else {"model": "m", "prompt": "x"}
    )
    err = refused(parse, orjson.dumps({**base, **fields}))
    assert err.param == param, err.message
    assert param.split(".", maxsplit=1)[0] in err.message or err.code == "unsupported"


CHAT_BAD: list[tuple[dict[str, Any], str]] = [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role"),  # unhashable
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ({"messages": [*USER, {"role": "user", "content": None}]}, "messages[1].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
    # An array's items are read in order: the first item's error is named first.
    ({"messages": [{"role": "robot", "content": "x"}, 5]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
    ),
    # Chat's parts are "text" only: Responses' part types and refusals are not text here.
    (
        {"messages": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]},
        "messages[0].content[0].type",
    ),
    (
        {"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]},
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
    (
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
        "messages[0].tool_calls[0].function",
    ),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
]


@pytest.mark.parametrize(("fields", "param"), CHAT_BAD)
def test_chat_refusals(fields: dict[str, Any], param: str) -> None:
    err = refused(parse_chat, orjson.dumps({"model": "m", "messages": USER, **fields}))
    assert err.param == param, err.message


COMPLETION_BAD: list[tuple[dict[str, Any], str]] = [
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": {}}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": ["a", 5]}, "prompt[1]"),
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": [[1], [1.5]]}, "prompt[1]"),
    ({"prompt": [True, False]}, "prompt[0]"),
    ({"prompt": ["x"] * 65}, "prompt"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),  # only an echo answers the prompt alone
    ({"echo": True, "max_tokens": -1}, "max_tokens"),
    ({"suffix": "end"}, "suffix"),
]


def test_vllms_prompt_logprobs_extension() -> None:
    """Chat and completions take vLLM's prompt_logprobs: the engine computes the
    larger of it and an echo's logprobs; 0 with a stream is accepted and unused."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = parse_chat(orjson.dumps({**chat, "prompt_logprobs": 2}), Limits())
    assert (req.prompt_logprobs, req.sampling.prompt_logprobs) == (2, 2)
    assert req.variant() != parse_chat(orjson.dumps(chat), Limits()).variant()
    streamed = parse_chat(orjson.dumps({**chat, "prompt_logprobs": 0, "stream": True}), Limits())
    assert (streamed.prompt_logprobs, streamed.sampling.prompt_logprobs) == (None, None)
    base = {"model": "m", "prompt": [1, 2, 3]}
    req = parse_completion(orjson.dumps({**base, "prompt_logprobs": 0}), Limits())
    assert (req.prompt_logprobs, req.sampling.prompt_logprobs, req.echo) == (0, 0, False)
    both = {**base, "echo": True, "logprobs": 3, "prompt_logprobs": 1}
    req = parse_completion(orjson.dumps(both), Limits())
    assert (req.prompt_logprobs, req.sampling.prompt_logprobs, req.sampling.logprobs) == (1, 3, 3)
    assert parse_completion(orjson.dumps({**base, "prompt_logprobs": 7}), Limits(max_logprobs=7))


def test_echo_with_logprobs_asks_for_the_prompt_s() -> None:
    """lm-eval's loglikelihood request: the echo's prompt logprobs go to the
    engine with the same k; max_tokens 0 is the prompt alone (one engine step)."""
    base = {"model": "m", "prompt": [1, 2, 3], "echo": True, "logprobs": 1}
    req = parse_completion(orjson.dumps({**base, "max_tokens": 1}), Limits())
    assert (req.sampling.prompt_logprobs, req.sampling.max_tokens, req.prompt_only) == (1, 1, False)
    req = parse_completion(orjson.dumps({**base, "max_tokens": 0}), Limits())
    assert (req.sampling.prompt_logprobs, req.sampling.max_tokens, req.prompt_only) == (1, 1, True)
    plain = parse_completion(orjson.dumps({**base, "echo": False}), Limits())
    assert plain.sampling.prompt_logprobs is None


@pytest.mark.parametrize(("fields", "param"), COMPLETION_BAD)
def test_completion_refusals(fields: dict[str, Any], param: str) -> None:
    body = {"model": "m", "prompt": "x", **fields}
    err = refused(parse_completion, orjson.dumps({k: v for k, v in body.items() if v is not None}))
    assert err.param == param, err.message


def test_missing_prompt_code() -> None:
    err = refused(parse_completion, b'{"model": "m"}')
    assert (err.param, err.code) == ("prompt", "missing_required_parameter")
    err = refused(parse_chat, b'{"messages": [{"role": "user", "content": "x"}]}')
    assert (err.param, err.code) == ("model", "missing_required_parameter")


def test_limits_bound_the_ranges() -> None:
    tight = Limits(max_n=2, max_stop=1, max_logprobs=3, max_tokens_cap=100)
    ok = {"model": "m", "messages": USER}
    for fields, param in [
        ({"n": 3}, "n"),
        ({"stop": ["a", "b"]}, "stop"),
        ({"logprobs": True, "top_logprobs": 4}, "top_logprobs"),
        ({"max_tokens": 101}, "max_tokens"),
    ]:
        err = refused(parse_chat, orjson.dumps({**ok, **fields}), tight)
        assert err.param == param
    assert "[1, 100]" in refused(parse_chat, orjson.dumps({**ok, "max_tokens": 101}), tight).message
    assert parse_chat(orjson.dumps({**ok, "n": 2, "max_tokens": 100}), tight).sampling.n == 2


def test_error_message_names_range_and_truncates_value() -> None:
    err = refused(parse_chat, orjson.dumps({"model": "m", "messages": USER, "n": "x" * 1000}))
    assert "'n' must be an integer in [1, 8]" in err.message
    assert len(err.message) < 120
    err = refused(parse_chat, orjson.dumps({"model": "m", "messages": USER, "top_p": 0}))
    assert "(0, 1]" in err.message


# -- context check -------------------------------------------------------------------


def test_check_context() -> None:
    assert check_context(10, None, 100) == 90
    assert check_context(10, 90, 100) == 90
    assert check_context(10, 5, 100) == 5
    # Above the room left: lowered to it, as vLLM's get_max_tokens does.
    assert check_context(60, 50, 100) == 40
    assert check_context(99, 32000, 100) == 1
    # A prompt that leaves no room is the one refusal.
    for prompt_len in (100, 101):
        with pytest.raises(SluiceError) as info:
            check_context(prompt_len, 5, 100, where="prompt")
        err = info.value
        assert err.status == 400 and err.code == "context_length_exceeded"
        assert err.message.startswith("This model's maximum context length is 100 tokens.")
        assert f"{prompt_len} input tokens" in err.message and err.param == "prompt"
