"""A tool result must answer a call made earlier in the conversation (issue 64).

The rule is server/wire/tools.py's ``check_tool_results``, run by each
chat-shaped API's parser (Responses: after the stored conversation of
``previous_response_id`` is joined). These tests go through the parsers, as
a body would: a result for a call never made is a 400 naming its id and the
field it came from, in each API's own path; what OpenAI's and Anthropic's
APIs accept stays accepted (several results in a turn, in any order, a call
answered turns later). The batch APIs reuse the parsers: such a line is that
line's error. Ollama's API stays lenient. The HTTP side, through the official
clients: tests/unit/test_tool_results_http.py.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.api.anthropic_batches.parse import parse_create
from server.api.anthropic_messages.parse import parse_messages
from server.api.ollama.parse import parse_chat as parse_ollama
from server.api.openai_batches.parse import LineError, check_line
from server.api.openai_chat.parse import parse_chat
from server.api.openai_responses.parse import parse_responses
from server.errors import SluiceError
from server.wire.request import Limits, Message, ToolCall
from server.wire.tools import check_tool_results

LIMITS = Limits()
ASK = {"role": "user", "content": "weather?"}


# ---------------------------------------------------------------------------
# One conversation in each API's shape: an assistant turn making `calls`,
# then one result per id of `results`, in that order.


def chat_body(calls: list[str], results: list[str]) -> dict[str, Any]:
    made = [{"id": c, "type": "function", "function": {"name": "f"}} for c in calls]
    return {
        "model": "m",
        "messages": [
            ASK,
            {"role": "assistant", "content": "on it", "tool_calls": made},
            *({"role": "tool", "tool_call_id": r, "content": "ok"} for r in results),
        ],
    }


def messages_body(calls: list[str], results: list[str]) -> dict[str, Any]:
    made = [{"type": "tool_use", "id": c, "name": "f", "input": {}} for c in calls]
    answers = [{"type": "tool_result", "tool_use_id": r, "content": "ok"} for r in results]
    return {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            ASK,
            {"role": "assistant", "content": [{"type": "text", "text": "on it"}, *made]},
            {"role": "user", "content": answers},
        ],
    }


def responses_body(calls: list[str], results: list[str]) -> dict[str, Any]:
    return {
        "model": "m",
        "input": [
            ASK,
            *(
                {"type": "function_call", "call_id": c, "name": "f", "arguments": "{}"}
                for c in calls
            ),
            *({"type": "function_call_output", "call_id": r, "output": "ok"} for r in results),
        ],
    }


def _chat(body: dict[str, Any]) -> Any:
    return parse_chat(orjson.dumps(body), LIMITS)


def _messages(body: dict[str, Any]) -> Any:
    return parse_messages(orjson.dumps(body), LIMITS)


def _responses(body: dict[str, Any]) -> Any:
    return parse_responses(orjson.dumps(body), LIMITS)


# Each API: its body, its parser, and the path of the j-th result's id when
# `calls` calls were made.
Api = tuple[
    Callable[[list[str], list[str]], dict[str, Any]],
    Callable[[dict[str, Any]], Any],
    Callable[[int, int], str],
]
APIS: dict[str, Api] = {
    "chat": (chat_body, _chat, lambda calls, j: f"messages[{2 + j}].tool_call_id"),
    "messages": (
        messages_body,
        _messages,
        lambda calls, j: f"messages[2].content[{j}].tool_use_id",
    ),
    "responses": (responses_body, _responses, lambda calls, j: f"input[{1 + calls + j}].call_id"),
}

IDS = st.lists(
    st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=40),
    min_size=1,
    max_size=6,
    unique=True,
)


@pytest.mark.parametrize("api", sorted(APIS))
@given(data=st.data(), ids=IDS)
def test_results_of_calls_made_in_any_order_pass_and_a_missing_call_is_named(
    api: str, data: st.DataObject, ids: list[str]
) -> None:
    build, parse, path = APIS[api]
    order = data.draw(st.permutations(ids), label="results")
    parse(build(ids, order))  # any order of the results of calls made: accepted
    gone = data.draw(st.sampled_from(ids), label="call removed")
    with pytest.raises(SluiceError) as err:
        parse(build([c for c in ids if c != gone], order))
    param = path(len(ids) - 1, order.index(gone))
    assert err.value.status == 400
    assert err.value.param == param
    assert f'"{gone}"' in err.value.message and param in err.value.message


@pytest.mark.parametrize("api", sorted(APIS))
def test_a_result_before_its_call_is_refused(api: str) -> None:
    """The call must come earlier: the same id made only after the result is a 400."""
    build, parse, path = APIS[api]
    body = build(["c1"], ["c1"])
    again = build(["c2"], ["c1"])
    key = "input" if api == "responses" else "messages"
    # The result first, then the turn that makes the call.
    body[key] = [*again[key], *body[key][1:]]
    with pytest.raises(SluiceError) as err:
        parse(body)
    assert err.value.param == path(1, 0)


@pytest.mark.parametrize("api", sorted(APIS))
def test_a_call_answered_turns_later_and_twice_is_accepted(api: str) -> None:
    """A result for a call two turns back, and a second result for one call
    (lenient: neither OpenAI nor Anthropic documents refusing it)."""
    build, parse, _ = APIS[api]
    first = build(["c1", "c2"], ["c2"])
    later = build(["c3"], ["c3", "c1", "c3"])
    key = "input" if api == "responses" else "messages"
    first[key] = [*first[key], *later[key]]
    parse(first)


def test_the_wire_rule_names_the_fallback_and_cuts_a_long_id() -> None:
    """A message without a field of its own (a stored turn) is named by the
    fallback; a long id is repeated only in part."""
    long = "x" * 300
    with pytest.raises(SluiceError) as err:
        check_tool_results([Message("tool", "ok", tool_call_id=long)], "previous_response_id")
    assert err.value.param == "previous_response_id"
    assert "x" * 120 in err.value.message and long not in err.value.message
    made = Message("assistant", "", tool_calls=(ToolCall(long, "f", "{}"),))
    check_tool_results([made, Message("tool", "ok", tool_call_id=long)])


def test_responses_checks_after_the_stored_conversation_is_joined() -> None:
    """A previous response's call may be answered by this turn's input; a
    call neither made is named by its input field."""
    stored = (
        Message("user", "weather?"),
        Message("assistant", "", tool_calls=(ToolCall("c1", "f", "{}"),)),
    )
    follow = {"model": "m", "previous_response_id": "resp_1", "instructions": "be brief"}
    ok = _responses(
        {**follow, "input": [{"type": "function_call_output", "call_id": "c1", "output": "ok"}]}
    )
    assert [m.role for m in ok.with_history(stored).messages] == [
        "system",
        "user",
        "assistant",
        "tool",
    ]
    unknown = {"type": "function_call_output", "call_id": "c9", "output": "ok"}
    nope = _responses({**follow, "input": [{"role": "user", "content": "and?"}, unknown]})
    with pytest.raises(SluiceError) as err:
        nope.with_history(stored)
    assert err.value.param == "input[1].call_id" and '"c9"' in err.value.message
    # Without previous_response_id the same input is refused at once.
    with pytest.raises(SluiceError):
        _responses({"model": "m", "input": [unknown]})


def test_ollama_stays_lenient() -> None:
    """Ollama's server checks no ids, and its tool messages may carry none."""
    body = {
        "model": "m",
        "messages": [
            ASK,
            {"role": "tool", "content": "ok", "tool_call_id": "never-made"},
            {"role": "tool", "content": "ok", "tool_name": "f"},
        ],
    }
    req = parse_ollama(orjson.dumps(body), LIMITS)
    assert req.chat.messages[1].tool_call_id == "never-made"


# ---------------------------------------------------------------------------
# The batch APIs: the line (OpenAI) or the request (Anthropic) is refused.


@pytest.mark.parametrize(
    ("url", "body", "param"),
    [
        ("/v1/chat/completions", chat_body(["c1"], ["c1", "c9"]), "body.messages[3].tool_call_id"),
        ("/v1/responses", responses_body(["c1"], ["c9"]), "body.input[2].call_id"),
    ],
)
def test_an_openai_batch_line_with_an_unknown_id_is_that_lines_error(
    url: str, body: dict[str, Any], param: str
) -> None:
    seen: set[str] = set()
    good = {"custom_id": "a", "method": "POST", "url": url, "body": chat_body([], [])}
    if url == "/v1/responses":
        good["body"] = responses_body([], [])
    bad = {"custom_id": "b", "method": "POST", "url": url, "body": body}
    first = check_line(1, orjson.dumps(good), url, seen, LIMITS)
    second = check_line(2, orjson.dumps(bad), url, seen, LIMITS)
    assert not isinstance(first, LineError)
    assert isinstance(second, LineError)
    assert (second.line, second.code, second.param) == (2, "invalid_value", param)
    assert '"c9"' in second.message


def test_an_anthropic_batch_request_with_an_unknown_id_is_named_by_its_index() -> None:
    requests = [
        {"custom_id": "a", "params": messages_body(["c1"], ["c1"])},
        {"custom_id": "b", "params": messages_body(["c1"], ["c9"])},
    ]
    with pytest.raises(SluiceError) as err:
        parse_create(orjson.dumps({"requests": requests}), LIMITS)
    assert err.value.status == 400
    assert err.value.param == "requests.1.params.messages[2].content[0].tool_use_id"
    assert '"c9"' in err.value.message
