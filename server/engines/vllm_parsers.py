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

``tool_choice: auto`` (and ``none``) run vLLM's composed ``Parser`` (by
default the hermes tool parser + qwen3 reasoning parser, as ``vllm serve
--tool-call-parser hermes --reasoning-parser qwen3`` composes them; the CLI
takes any name in vLLM's registries: ``tool_parsers``, ``reasoning_parsers``,
``check_names``). A forced call (``required``
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
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Final

import orjson
from vllm import SamplingParams
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMClientError
from vllm.parser import ParserManager
from vllm.reasoning import ReasoningParserManager
from vllm.renderers.chat_utils import make_tool_call_id
from vllm.sampling_params import StructuredOutputsParams
from vllm.tool_parsers import ToolParserManager
from vllm.tool_parsers.streaming import (
    extract_named_tool_call_streaming,
    extract_required_tool_call_streaming,
)
from vllm.tool_parsers.utils import get_json_schema_from_tools

from server.errors import SluiceError
from server.wire.output import FinishReason, Parsed, ParsedDelta, ToolCallDelta
from server.wire.request import ChatRequest, Constraint, ToolCall

__all__ = [
    "JsonEscaper",
    "OutputParsers",
    "RequestParsing",
    "StreamParser",
    "check_constraint",
    "check_names",
    "forced_constraint",
    "reasoning_parsers",
    "to_structured_outputs",
    "tool_parsers",
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


# strict=False: raw control characters in strings (see JsonEscaper).
_DECODER: Final = json.JSONDecoder(strict=False)
_BLANK: Final = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


def _skip(text: str, i: int) -> int:
    m = _BLANK.match(text, i)
    assert m is not None  # the pattern matches the empty string
    return m.end()


def _leading_json(text: str, *, array: bool) -> list[tuple[Any, str]]:
    """The complete JSON values at the start of ``text``, each with its text.

    ``array``: the items of a leading array, up to the first that is not
    complete (a cut); else the one leading value, or none if it is cut.
    """
    i = _skip(text, 0)
    if array:
        if not text.startswith("[", i):
            return []
        i += 1
    out: list[tuple[Any, str]] = []
    while True:
        i = _skip(text, i)
        try:
            value, end = _DECODER.raw_decode(text, i)
        except ValueError:
            return out
        out.append((value, text[i:end]))
        if not array:
            return out
        i = _skip(text, end)
        if not text.startswith(",", i):
            return out
        i += 1


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


def tool_parsers() -> list[str]:
    """The names ``--tool-call-parser`` takes: vLLM's registry (lazy ones included)."""
    return [str(n) for n in ToolParserManager.list_registered()]


def reasoning_parsers() -> list[str]:
    """The names ``--reasoning-parser`` takes: vLLM's registry."""
    return [str(n) for n in ReasoningParserManager.list_registered()]


def check_names(tool_parser: str, reasoning_parser: str) -> None:
    """ValueError naming the choices when either parser is not registered
    (vLLM's own check in ``validate_api_server_args``, after parsing)."""
    for flag, name, names in (
        ("--tool-call-parser", tool_parser, tool_parsers()),
        ("--reasoning-parser", reasoning_parser, reasoning_parsers()),
    ):
        if name not in names:
            raise ValueError(f"invalid {flag} {name!r} (choose from {', '.join(names)})")


class OutputParsers:
    """vLLM's composed parser class for one engine's tokenizer.

    ``tool_parser``, ``reasoning_parser`` and ``auto_tools`` mean what
    ``vllm serve``'s ``--tool-call-parser``, ``--reasoning-parser`` and
    ``--enable-auto-tool-choice`` mean. Without auto tools, ``tool_choice:
    auto`` is refused as vLLM refuses it; forced calls and ``none`` still
    work (a forced call is read by Sluice, not by the tool parser).

    Raises TypeError when the tokenizer lacks what the parsers need (vLLM's
    start-up check), e.g. a model without Qwen3's ``<think>`` tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tool_parser: str = "hermes",
        reasoning_parser: str = "qwen3",
        auto_tools: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._auto = auto_tools
        parser_cls = ParserManager.get_parser(
            tool_parser_name=tool_parser,
            reasoning_parser_name=reasoning_parser or None,
            enable_auto_tools=auto_tools,
            tokenizer=tokenizer,
        )
        if parser_cls is None:  # neither parser: nothing to split or read
            raise TypeError("no --reasoning-parser and no auto tool choice")
        self._parser_cls = parser_cls

    def for_request(self, req: ChatRequest) -> RequestParsing:
        """Parsing for one request (once per request; its choices share it)."""
        if not self._auto and req.tools and req.tool_choice.mode == "auto":
            raise SluiceError(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                status=400,
                param="tool_choice",
                code="invalid_value",
            )
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
        if self._forced is not None or not req.tools:
            # vLLM's parser only splits off the reasoning: the call is ours to
            # read, or there is none to read (vLLM takes no tool_choice as auto).
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

        ``auto``: a call the tool parser cannot read leaves the whole text
        as content. A forced call cut by ``max_tokens`` keeps the calls that
        completed before the cut and drops the incomplete one
        (``_forced_calls``); it never comes back as content.
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
        return Parsed(reasoning, None, self._forced_calls(content or ""))

    def _forced_calls(self, text: str) -> tuple[ToolCall, ...]:
        """A forced call's calls; at a cut, those complete before it.

        The constraint makes the whole output valid JSON unless ``max_tokens``
        cuts it: then the calls that closed before the cut come back and the
        incomplete one is dropped (for a named call, which is one object: no
        call), as ``tool_calls`` with finish reason ``length``. The raw JSON is
        never content: it is the call, not an answer.
        """
        if self._forced == "function":
            assert self._name is not None
            found = _leading_json(text, array=False)
            if not found or not isinstance(found[0][0], dict):
                return ()
            return (ToolCall(make_tool_call_id(), self._name, _escaped(found[0][1])),)
        calls = []
        for item, _ in _leading_json(text, array=True):
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                break  # not a call: the schema held only to a cut inside it
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
