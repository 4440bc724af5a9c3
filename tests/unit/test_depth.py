"""Deep nesting is a 400 where the body is parsed, on every API (issue 28).

orjson refuses to encode more than 254 levels, and the parsers re-encode what
they accept (tool parameters, a Messages call's input, a Responses body
translated into chat), so a 300- or 1,000-deep body was a 500. The bound
(server/wire/fields.py `MAX_DEPTH`) is checked once, where a body becomes
an object, for every route; the 400 names the field in the API's own shape,
and the server answers a valid request afterwards.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from server.errors import SluiceError
from server.wire.fields import MAX_DEPTH, check_depth

pytestmark = pytest.mark.timeout(60)


DEEP = "@deep@"


def nest(depth: int) -> dict[str, Any]:
    """An object `depth` levels deep: {"a": {"a": ... {} }}."""
    node: dict[str, Any] = {}
    for _ in range(depth - 1):
        node = {"a": node}
    return node


def deep_body(body: Any, depth: int) -> bytes:
    """`body` with DEEP replaced by an object `depth` levels deep, as JSON text
    (neither orjson nor Python's json encodes 1,000 levels)."""
    deep = b'{"a":' * (depth - 1) + b"{}" + b"}" * (depth - 1)
    return orjson.dumps(body).replace(orjson.dumps(DEEP), deep)


SCHEMA = {"type": "object", "properties": {"x": DEEP}}


USER = [{"role": "user", "content": "hi"}]

# (path, body with DEEP where the nesting goes, the field the 400 names)
CASES: list[tuple[str, Any, str]] = [
    (
        "/v1/chat/completions",
        {
            "model": "fake",
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
        },
        "tools[0].function.parameters",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "fake",
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA},
            },
        },
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        {"model": "fake", "messages": [{"role": "user", "content": DEEP}]},
        "messages[0].content",
    ),
    ("/v1/completions", {"model": "fake", "prompt": "hi", "x": DEEP}, "x"),
    (
        "/v1/completions",
        {"model": "fake", "prompt": "hi", "guided_json": SCHEMA},
        "guided_json",
    ),
    (
        "/v1/responses",
        {"model": "fake", "input": [{"type": DEEP, "role": "user"}]},
        "input[0].type",
    ),
    (
        "/v1/responses",
        {
            "model": "fake",
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "parameters": SCHEMA}],
        },
        "tools[0].parameters",
    ),
    (
        "/v1/responses",
        {"model": "fake", "input": "hi", "metadata": DEEP},
        "metadata",
    ),
    (
        "/v1/messages",
        {
            "model": "fake",
            "max_tokens": 4,
            "messages": USER,
            "tools": [{"name": "f", "input_schema": SCHEMA}],
        },
        "tools[0].input_schema",
    ),
    (
        "/v1/messages",
        {
            "model": "fake",
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": DEEP}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
                },
            ],
        },
        "messages[1].content[0].input",
    ),
    (
        "/v1/messages/count_tokens",
        {
            "model": "fake",
            "messages": USER,
            "tools": [{"name": "f", "input_schema": SCHEMA}],
        },
        "tools[0].input_schema",
    ),
    ("/tokenize", {"prompt": "hi", "x": DEEP}, "x"),
]

VALID = {
    "/v1/chat/completions": {"model": "fake", "messages": USER, "max_tokens": 2},
    "/v1/completions": {"model": "fake", "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": "fake", "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "fake", "max_tokens": 2, "messages": USER},
    "/v1/messages/count_tokens": {"model": "fake", "messages": USER},
    "/tokenize": {"prompt": "hi"},
}


@pytest.mark.parametrize("depth", [300, 1000])
@pytest.mark.parametrize(("path", "body", "field"), CASES)
async def test_a_deep_body_is_a_400_naming_the_field(
    make_client: Any, path: str, body: Any, field: str, depth: int
) -> None:
    client, _, engine = await make_client(default_thinking=False, warmup=False)
    headers = {"Content-Type": "application/json"}
    resp = await client.post(path, data=deep_body(body, depth), headers=headers)
    assert resp.status == 400, await resp.text()
    doc = await resp.json()
    if path.startswith("/v1/messages"):
        assert set(doc) == {"type", "error"} and doc["type"] == "error"
        assert doc["error"]["type"] == "invalid_request_error"
        assert doc["error"]["message"].startswith(field), doc
    else:
        error = doc["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"].startswith(field), error
        assert error["code"] == "too_deep"
    assert f"{MAX_DEPTH} levels" in str(doc)
    assert engine.added == []
    ok = await client.post(path, json=VALID[path])
    assert ok.status == 200, await ok.text()


async def test_the_bound_itself_is_accepted(make_client: Any) -> None:
    """A body exactly MAX_DEPTH levels deep parses (the body is level 1)."""
    client, _, _ = await make_client(default_thinking=False)
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2, "x": nest(MAX_DEPTH - 1)}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    body["x"] = nest(MAX_DEPTH)
    assert (await client.post("/v1/completions", json=body)).status == 400


def test_the_path_is_short_and_arrays_count() -> None:
    deep: list[Any] = []
    for _ in range(9):
        deep = [deep]
    with pytest.raises(SluiceError) as err:
        check_depth({"k": deep}, limit=8)  # the body is level 1, k's array level 2
    assert err.value.param == "k[0][0][0][0][0]..."
    with pytest.raises(SluiceError) as err:
        check_depth({"k": [[[]]]}, limit=3)
    assert err.value.param == "k[0][0]"
    check_depth({"k": [[]]}, limit=3)
    long_key = "k" * 100
    with pytest.raises(SluiceError) as err:
        check_depth({long_key: {"b": {}}}, limit=2)
    assert err.value.param is not None and len(err.value.param) < 60
