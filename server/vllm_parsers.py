"""vLLM's own tool-call and reasoning parsers, and its structured outputs, behind one adapter.

vLLM has moved these several times (``vllm/entrypoints/openai/tool_parsers``,
then ``vllm/tool_parsers``, ``vllm/reasoning`` and the unified ``vllm/parser``
of 0.32), so this module is the only place in Sluice that knows where they
live; ``setup.cfg`` bounds vLLM to the 0.32 series it was written against.
What it offers is Sluice-shaped and frozen:

* ``OutputParsers(tokenizer)``: built once per engine; ``for_request(req)``
  gives one request's ``RequestParsing``;
* ``RequestParsing.parse(text)``: a finished choice as ``Parsed`` (reasoning,
  content, tool calls with id, name and arguments as JSON text);
* ``RequestParsing.stream()``: per choice, text deltas (and their token ids)
  in, ``ParsedDelta`` out: reasoning, content and ``ToolCallDelta`` values (the
  id, type and name first, then argument fragments: the shape the ``openai``
  client's stream helpers assemble);
* ``forced_constraint(req)``: the constraint that holds a forced call;
  ``to_structured_outputs`` / ``check_constraint``: a constraint as the
  engine's ``StructuredOutputsParams``, the latter with the engine's own
  check as a 400.

``tool_choice: auto`` (and ``none``) run vLLM's composed ``Parser`` (hermes
tool parser + qwen3 reasoning parser, as ``vllm serve --tool-call-parser
hermes --reasoning-parser qwen3`` composes them). A forced call (``required``
or a named function) is held by a plain JSON-schema constraint, vLLM's own
(``get_json_schema_from_tools``): the parameters schema for a named call, an
array of ``{"name", "parameters"}`` for ``required``. Measured on the demo
model (25 runs each, a schema of two enums, a boolean and a maxLength-8
string, disable_any_whitespace on): plain schema 23/25 valid for a named call
and 23/25 for ``required`` with ``parallel_tool_calls: false``, against 21/25
and 21/25 for vLLM's structural tag even at strict level ``parameter``, whose
JSON ignores disable_any_whitespace and wanders in whitespace; at vLLM's
default strict level the tag leaves the arguments free and 0/17 were valid.
The remaining failures were raw control characters inside maxLength strings,
which xgrammar lets through and strict JSON parsers refuse: forced-call
arguments are therefore passed through ``JsonEscaper``, streamed or not.
The reasoning split of a forced call still comes from vLLM's parser (run
with ``tool_choice: none``); the engine's own reasoning parser
(``--reasoning-parser qwen3``) makes the constraint start after ``</think>``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Final

import orjson
from vllm import SamplingParams
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMClientError
from vllm.parser import ParserManager
from vllm.renderers.chat_utils import make_tool_call_id
from vllm.sampling_params import StructuredOutputsParams
from vllm.tool_parsers.streaming import (
    extract_named_tool_call_streaming,
    extract_required_tool_call_streaming,
)
from vllm.tool_parsers.utils import get_json_schema_from_tools

from server.errors import SluiceError
from server.protocol.responses import FinishReason, Parsed, ParsedDelta, ToolCallDelta
from server.protocol.types import ChatRequest, Constraint, ToolCall

__all__ = [
    "JsonEscaper",
    "OutputParsers",
    "RequestParsing",
    "StreamParser",
    "check_constraint",
    "forced_constraint",
    "to_structured_outputs",
]

# vLLM's parsers read only these fields of the request; they need a message
# to construct one, never its text.
_PLACEHOLDER_MESSAGES: Final = [{"role": "user", "content": ""}]


EMPTY: Final = ParsedDelta()


class JsonEscaper:
    """Escape raw control characters inside the strings of a streamed JSON text.

    xgrammar 0.x lets U+0000-U+001F through inside ``maxLength`` strings
    (measured on the demo model: 4 of 50 forced calls), which strict JSON
    parsers, the ``openai`` client's among them, refuse. Outside strings
    they are JSON whitespace and stay. Feed the fragments in order.
    """

    __slots__ = ("_escaped", "_in_string")

    def __init__(self) -> None:
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> str:
        out: list[str] = []
        in_string, escaped = self._in_string, self._escaped
        for ch in text:
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                elif ch < " ":
                    out.append(f"\\u{ord(ch):04x}")
                    continue
            elif ch == '"':
                in_string = True
            out.append(ch)
        self._in_string, self._escaped = in_string, escaped
        return "".join(out)


def _escaped(text: str) -> str:
    return JsonEscaper().feed(text)


# ---------------------------------------------------------------------------
# Structured outputs.


def _vllm_tools(req: ChatRequest) -> ChatCompletionRequest:
    """The request as vLLM's parsers and schema helpers read it."""
    choice: Any = req.tool_choice.mode
    if choice == "function":
        choice = {"type": "function", "function": {"name": req.tool_choice.name}}
    return ChatCompletionRequest(
        model=req.model,
        messages=_PLACEHOLDER_MESSAGES,
        tools=[t.as_dict() for t in req.tools] or None,
        tool_choice=choice if req.tools else None,
        parallel_tool_calls=req.parallel_tool_calls,
    )


def forced_constraint(req: ChatRequest) -> Constraint | None:
    """The constraint that makes a forced call valid (``None``: no forced call).

    vLLM's own schema: a named call's parameters schema, or for
    ``required`` an array of ``{"name", "parameters"}`` objects (at most one
    with ``parallel_tool_calls: false``). It replaces any response_format,
    as in vLLM: the answer is the call.
    """
    return _forced(req, _vllm_tools(req))


def _forced(req: ChatRequest, vreq: ChatCompletionRequest) -> Constraint | None:
    if not req.tools or not req.tool_choice.forced:
        return None
    schema = get_json_schema_from_tools(vreq.tool_choice, vreq.tools, vreq.parallel_tool_calls)
    return Constraint("json", orjson.dumps(schema).decode(), param="tools")


def to_structured_outputs(constraint: Constraint | None) -> StructuredOutputsParams | None:
    """``constraint`` as the engine's ``StructuredOutputsParams`` (unchecked)."""
    if constraint is None:
        return None
    kind = constraint.kind
    if kind == "json":
        return StructuredOutputsParams(json=constraint.value)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "regex":
        return StructuredOutputsParams(regex=constraint.value)
    if kind == "grammar":
        return StructuredOutputsParams(grammar=constraint.value)
    return StructuredOutputsParams(choice=list(constraint.choices))


def check_constraint(
    constraint: Constraint, *, model_config: Any, config: Any, tokenizer: Any
) -> StructuredOutputsParams:
    """``constraint`` as ``StructuredOutputsParams``, checked as the engine will check it.

    ``model_config`` and ``config`` are the engine's (``AsyncLLM.model_config``,
    ``.vllm_config.structured_outputs_config``). The check is vLLM's own
    (``SamplingParams.verify``: for xgrammar the schema, regex or grammar
    must compile), so a bad one is a 400 naming its field now instead of a
    failed generation once queued. It compiles (under a millisecond for a
    small schema, measured; a regex compile runs under vLLM's timeout): call
    it from a worker thread.
    """
    params = to_structured_outputs(constraint)
    assert params is not None
    probe = SamplingParams(max_tokens=1, structured_outputs=replace(params))
    try:
        probe.verify(model_config, None, config, tokenizer)
    except (VLLMClientError, ValueError, TypeError) as exc:
        raise SluiceError(
            f"'{constraint.param}' cannot be used as a constraint: {exc}",
            status=400,
            param=constraint.param,
            code="invalid_value",
        ) from None
    return params


# ---------------------------------------------------------------------------
# Parsing the output.


class OutputParsers:
    """vLLM's composed parser class for one engine's tokenizer.

    Raises TypeError when the tokenizer lacks what the parsers need (vLLM's
    start-up check), e.g. a model without Qwen3's ``<think>`` tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tool_parser: str = "hermes",
        reasoning_parser: str | None = "qwen3",
    ) -> None:
        self._tokenizer = tokenizer
        self._parser_cls = ParserManager.get_parser(
            tool_parser_name=tool_parser,
            reasoning_parser_name=reasoning_parser,
            enable_auto_tools=True,
            tokenizer=tokenizer,
        )

    def for_request(self, req: ChatRequest) -> RequestParsing:
        """Parsing for one request (once per request; its choices share it)."""
        return RequestParsing(self._parser_cls, self._tokenizer, req)


class RequestParsing:
    """One request's parsing: whole choices, or a stream state per choice."""

    __slots__ = (
        "_cls",
        "_constraint",
        "_forced",
        "_kwargs",
        "_name",
        "_parallel",
        "_tokenizer",
        "_vreq",
    )

    def __init__(self, parser_cls: Any, tokenizer: Any, req: ChatRequest) -> None:
        self._cls = parser_cls
        self._tokenizer = tokenizer
        self._kwargs = {"chat_template_kwargs": {"enable_thinking": req.enable_thinking}}
        self._forced = req.tool_choice.mode if req.tools and req.tool_choice.forced else None
        self._name = req.tool_choice.name
        self._parallel = req.parallel_tool_calls
        vreq = _vllm_tools(req)
        self._constraint = _forced(req, vreq)
        if self._forced is not None:
            # vLLM's parser only splits off the reasoning; the call is ours to read.
            vreq.tool_choice = "none"
        self._vreq = vreq

    def _parser(self, tools: Any) -> Any:
        return self._cls(self._tokenizer, tools, **self._kwargs)

    @property
    def forced(self) -> str | None:
        """``required`` or ``function`` for a forced call, else None."""
        return self._forced

    @property
    def constraint(self) -> Constraint | None:
        """What holds a forced call (``forced_constraint``); None: no forced call."""
        return self._constraint

    def finish_reason(self, engine_reason: str | None, called: bool) -> FinishReason:
        """The choice's finish reason, as vLLM and OpenAI give it: ``tool_calls``
        when calls came back and generation stopped on its own, except for a
        named call (``stop``); ``length`` when cut by ``max_tokens``."""
        if engine_reason == "length":
            return "length"
        return "tool_calls" if called and self._forced != "function" else "stop"

    def parse(self, text: str, token_ids: Sequence[int] = ()) -> Parsed:
        """A finished choice's text, split and its calls read.

        ``auto``: a call the hermes parser cannot read leaves the whole text
        as content. A forced call that is not valid JSON (cut by
        ``max_tokens``) comes back as content too, with no calls.
        """
        vreq = self._vreq
        parser = self._parser(vreq.tools)
        reasoning, content, calls = parser.parse(
            text, vreq, enable_auto_tools=True, model_output_token_ids=list(token_ids)
        )
        if self._forced is None:
            found = tuple(
                ToolCall(c.id or make_tool_call_id(), c.name, c.arguments) for c in calls or ()
            )
            if not self._parallel:
                found = found[:1]
            return Parsed(reasoning, content, found)
        forced = self._forced_calls(content or "")
        if forced is None:
            return Parsed(reasoning, content)
        return Parsed(reasoning, None, forced)

    def _forced_calls(self, text: str) -> tuple[ToolCall, ...] | None:
        # strict=False: raw control characters in strings (see JsonEscaper).
        try:
            value = json.loads(text, strict=False)
        except ValueError:
            return None
        if self._forced == "function":
            assert self._name is not None
            if not isinstance(value, dict):
                return None
            return (ToolCall(make_tool_call_id(), self._name, _escaped(text.strip())),)
        if not isinstance(value, list) or not value:
            return None
        calls = []
        for item in value:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            # json, not orjson: the parsed value may hold integers beyond 64 bits.
            args = json.dumps(item.get("parameters", {}), ensure_ascii=False, separators=(",", ":"))
            calls.append(ToolCall(make_tool_call_id(), item["name"], args))
        return tuple(calls)

    def stream(self) -> StreamParser:
        """A fresh stream state for one choice."""
        return StreamParser(self)


class StreamParser:
    """One choice's stream: ``feed(text, token_ids, finished=...)`` -> ``ParsedDelta``.

    ``called`` tells whether any tool call was announced, for the finish
    reason (``tool_calls``, as vLLM and OpenAI give it for ``auto`` and
    ``required``; a named call finishes with ``stop``).
    """

    __slots__ = ("_args", "_escapers", "_named", "_owner", "_parser", "_prompt", "called")

    def __init__(self, owner: RequestParsing) -> None:
        self._owner = owner
        self._parser = owner._parser(owner._vreq.tools)
        self._escapers: dict[int, JsonEscaper] = {}
        self._args = ""  # a required call's accumulated text, for vLLM's span scan
        self._named = False  # a named call's id and name went out
        self._prompt: list[int] | None = None
        self.called = False

    def start(self, prompt_token_ids: Sequence[int]) -> None:
        """Give the rendered prompt (vLLM's parser reads where thinking stands)."""
        self._prompt = list(prompt_token_ids)

    def feed(
        self, text: str, token_ids: Sequence[int] = (), *, finished: bool = False
    ) -> ParsedDelta:
        owner = self._owner
        msg = self._parser.parse_delta(
            text, list(token_ids), owner._vreq, prompt_token_ids=self._prompt, finished=finished
        )
        if msg is None:
            return EMPTY
        reasoning = msg.reasoning or ""
        content = msg.content or ""
        if owner._forced is not None:
            calls = self._forced_deltas(content)
            content = ""
        else:
            calls = tuple(
                ToolCallDelta(
                    index=tc.index,
                    id=tc.id,
                    name=tc.function.name if tc.function else None,
                    arguments=(tc.function.arguments or "") if tc.function else "",
                )
                for tc in msg.tool_calls or ()
                if owner._parallel or tc.index == 0
            )
        if calls:
            self.called = True
        if not (reasoning or content or calls):
            return EMPTY
        return ParsedDelta(reasoning, content, calls)

    def _forced_deltas(self, text: str) -> tuple[ToolCallDelta, ...]:
        if not text:
            return ()
        owner = self._owner
        if owner._forced == "function":
            assert owner._name is not None
            if not self._named and not text.strip():
                return ()  # vLLM's helper would announce the call on leading blanks
            msg, self._named = extract_named_tool_call_streaming(
                delta_text=text,
                function_name=owner._name,
                function_name_returned=self._named,
                tool_call_idx=None,
                tool_call_id_type="random",
                tokenizer=owner._tokenizer,
            )
        else:
            previous = self._args
            self._args += text
            msg, _ = extract_required_tool_call_streaming(
                previous_text=previous,
                current_text=self._args,
                tool_call_idx=None,
                tool_call_id_type="random",
            )
        if msg is None:
            return ()
        out = []
        for tc in msg.tool_calls:
            escaper = self._escapers.setdefault(tc.index, JsonEscaper())
            fn = tc.function
            out.append(
                ToolCallDelta(
                    index=tc.index,
                    id=tc.id,
                    name=fn.name if fn else None,
                    arguments=escaper.feed((fn.arguments or "") if fn else ""),
                )
            )
        return tuple(out)
