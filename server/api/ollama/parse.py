"""Ollama's API, pure: request bodies into the internal requests.

Why this module exists: /api/chat and /api/generate run on the one chat
pipeline (callers, the backlog, tools, thinking, structured output, metrics,
drain, abort); only the translations differ, and they are kept here, free of
aiohttp and vLLM, so they are tested on their own
(tests/unit/test_protocol_ollama.py). Shapes as Ollama's api/types.go and
docs/api.md (v0.32) and the `ollama` Python client's types read them. What
is accepted and ignored follows server/wire/ignored.py's rule (listed there
and in docs/ollama.md):

1. Model names. Ollama's clients send ``name:tag``. A served name without a
   tag is listed as ``name:latest`` (output.py ``listed_name``) and a request
   names it ``name`` or ``name:latest``; an exact served name wins, so a
   model served as ``qwen3:14b`` is that name. Any other tag is an unknown
   model (404). Every answer echoes ``model`` as the client sent it, as
   Ollama does.
2. ``stream`` defaults to true (newline-delimited JSON).
3. ``think``: true / false is Qwen3's thinking switch; a level (low, medium,
   high, max) turns it on and is noted as ignored; absent: the server's
   default (``--default-thinking``), as on the other APIs.
4. ``format``: ``"json"`` constrains the answer to a JSON object, a JSON
   schema object to that schema; ``""`` or absent: none.
5. ``options``: ``num_predict`` (0 or less: no limit but the context; more:
   a ceiling, lowered to the server's cap and the room the context leaves),
   ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``stop``, ``seed``,
   ``repeat_penalty`` (vLLM's ``repetition_penalty``), ``presence_penalty``,
   ``frequency_penalty``, and vLLM's ``ignore_eos``, checked with the chat
   API's ranges and named ``options.X`` in a refusal; ``num_ctx`` must be
   within the served context (``check_num_ctx``, once the engine's context
   is known): a request that fits is served in the engine's context, one
   that asks for more is a 400. The other options Ollama knows are accepted
   and ignored. Integral floats count as integers (Ollama's Go reader
   truncates JSON numbers into integer options).
6. ``messages``: roles system, user, assistant, tool (any case: Ollama
   lowercases them); ``content`` a string; an assistant's ``thinking`` is
   its past reasoning and its ``tool_calls`` carry ``arguments`` as an object
   (JSON text is taken too); a call without an ``id`` gets
   ``call_<message>_<call>``; a tool message's ``tool_name`` is its ``name``
   and ``tool_call_id`` the call it answers. ``tools`` are OpenAI's shape
   (server/wire/tools.py), offered with tool choice ``auto``.
7. Refused with a 400 naming the field, because dropping it changes the
   answer: ``images`` (a text-only model), generate's ``suffix`` (fill in
   the middle) and ``context`` (Sluice never returns one), and
   ``_debug_render_only``; ``raw`` with ``template`` or ``system``
   (Ollama's own rule).
8. generate: ``prompt`` (after ``system``, when given) goes through the
   chat template as one user turn. ``raw: true`` sends the prompt as it is;
   ``template`` is rendered here (``render_template``: the part of Go's
   template language Ollama's documentation uses) and sent as it renders.
   With either, thinking is not split and ``format`` constrains from the
   first token.
9. An empty ``messages`` / ``prompt`` is Ollama's "load the model" request:
   answered at once (the model is always loaded).
10. ``logprobs`` and ``top_logprobs`` (0 to the server's ``--max-logprobs``)
    are honoured.
11. ``keep_alive`` on chat and generate: how long the model stays loaded
    after the request, as Ollama reads it: a number of seconds or a Go
    duration (``"5m"``, ``"1h30m"``, ``"0"``); a negative one keeps it
    loaded for good. A plain number in a string (``"-1"``, ``"300"``) is
    taken as seconds too. The endpoint sets it as the model's idle time
    where the model is loaded on demand (server/engines/registry.py rule 7);
    a model loaded at start stays loaded whatever it says.

Bodies and stream lines going back: server/api/ollama/output.py.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, cast

import orjson

from server.api.openai_chat.parse import _sampling
from server.errors import SluiceError
from server.wire.fields import (
    MISSING,
    bad,
    get,
    get_bool,
    get_int,
    get_model,
    get_str,
    load_object,
    objects,
    show,
    type_name,
    unsupported,
)
from server.wire.ignored import Ignored, Notes
from server.wire.request import (
    ChatRequest,
    Constraint,
    Limits,
    Message,
    Role,
    Sampling,
    ToolCall,
    ToolChoice,
)
from server.wire.structured import json_schema
from server.wire.tools import function_of, parse_tools

__all__ = [
    "EmbedRequest",
    "OllamaRequest",
    "check_num_ctx",
    "ollama_probe",
    "parse_chat",
    "parse_embed",
    "parse_embeddings",
    "parse_generate",
    "parse_show",
    "render_template",
    "served_name",
]

LATEST: Final = ":latest"
_THINK_LEVELS: Final = ("low", "medium", "high", "max")
_ROLES: Final = ("system", "user", "assistant", "tool")
# Ollama's option -> the sampling field it sets (the chat API's reader).
_SAMPLING_OPTIONS: Final = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "ignore_eos": "ignore_eos",
}
_OPTION_OF: Final = {v: k for k, v in _SAMPLING_OPTIONS.items()}
_INT_OPTIONS: Final = frozenset({"top_k", "seed", "num_predict", "num_ctx"})
# Top-level fields read here; any other is noted as ignored (keep_alive,
# truncate and shift among them, under their own labels).
_SHARED: Final = frozenset(
    {"model", "stream", "format", "options", "think", "logprobs", "top_logprobs", "keep_alive"}
)
_CHAT: Final = _SHARED | {"messages", "tools"}
_GENERATE: Final = _SHARED | {
    "prompt",
    "system",
    "template",
    "raw",
    "images",
    "suffix",
    "context",
    "_debug_render_only",
}
_MESSAGE_KEYS: Final = frozenset(
    {"role", "content", "thinking", "images", "tool_calls", "tool_name", "tool_call_id"}
)


@dataclass(frozen=True, slots=True)
class OllamaRequest:
    """An /api/chat or /api/generate body, read.

    ``chat`` is what the pipeline runs (its ``model`` the name as sent, until
    the endpoint resolves the served one); ``text``: a raw or templated
    generate's prompt, sent to the engine as it is (``chat.messages`` then
    holds it as one user turn, for the record only); ``load``: an empty
    ``messages`` / ``prompt`` (rule 9).
    """

    name: str
    chat: ChatRequest
    generate: bool = False
    text: str | None = None
    load: bool = False
    num_ctx: int | None = None
    keep_alive: float | None = None  # seconds (negative: for good); None: not sent


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    """An /api/embed (or the older /api/embeddings) body, read: the texts to
    embed, in order. ``legacy``: /api/embeddings, one ``prompt``, answered as
    ``{"embedding": [...]}``."""

    name: str
    inputs: tuple[str, ...]
    truncate: bool = True
    dimensions: int | None = None
    legacy: bool = False
    ignored: tuple[Ignored, ...] = field(default=(), compare=False)


# ---------------------------------------------------------------------------
# Names and probes.


def served_name(name: str, known: Callable[[str], bool]) -> str:
    """The served name an Ollama client's ``name`` stands for (rule 1): the
    name itself when served, else without its ``:latest`` tag when that is
    served; else the name as sent (the model check then answers 404)."""
    if known(name) or not name.endswith(LATEST):
        return name
    base = name[: -len(LATEST)]
    return base if known(base) else name


def ollama_probe(accept: str, user_agent: str) -> bool:
    """Whether ``/`` answers Ollama's probe ("Ollama is running") rather than
    the status page: an Ollama client says so in its User-Agent (``ollama/``
    of the Go client and CLI, ``ollama-python/``, ``ollama-js/``), and any
    other client that accepts no HTML (the Go client's ``HEAD /`` sends
    ``Accept: application/json``). A browser, and a client that accepts
    anything (``*/*``: curl, the test clients), gets the page."""
    if user_agent.lower().startswith("ollama"):
        return True
    if not accept:
        return False
    kinds = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    return not kinds & {"text/html", "text/*", "*/*"}


def check_num_ctx(num_ctx: int | None, max_model_len: int) -> None:
    """Rule 5: ``options.num_ctx`` within the served context, or a 400 saying it."""
    if num_ctx is not None and num_ctx > max_model_len:
        raise bad(
            "options.num_ctx",
            f"'options.num_ctx' asks for a context of {num_ctx} tokens; this server's "
            f"model is served with {max_model_len} (its --max-model-len): ask for at "
            f"most {max_model_len}, or leave num_ctx out",
        )


# ---------------------------------------------------------------------------
# Shared fields.


def _no_images(obj: dict[str, Any], param: str) -> None:
    value = get(obj, "images")
    if value is not MISSING and value != []:
        raise unsupported(param, f"'{param}' (images, on this text-only model)")


def _think(obj: dict[str, Any], default: bool, notes: Notes) -> bool:
    value = get(obj, "think")
    if value is MISSING:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value in _THINK_LEVELS:
        notes.note("think")  # a level: on, the level itself ignored (rule 3)
        return True
    raise bad(
        "think",
        f"'think' must be a boolean or one of {', '.join(_THINK_LEVELS)}; got {show(value)}",
    )


def _format(obj: dict[str, Any]) -> Constraint | None:
    value = get(obj, "format")
    if value is MISSING or value == "":
        return None
    if value == "json":
        return Constraint("json_object", param="format")
    if isinstance(value, dict):
        return json_schema(value, "format")
    raise bad("format", f"'format' must be \"json\" or a JSON schema object; got {show(value)}")


def _option_int(value: Any) -> Any:
    """An integer option as Ollama's Go reader takes it: an integral float too."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _options(obj: dict[str, Any], notes: Notes) -> tuple[dict[str, Any], Any, int | None]:
    """``options`` as the chat API's sampling fields, ``num_predict`` (MISSING
    when absent) and ``num_ctx``; unknown options noted (rule 5)."""
    value = get(obj, "options")
    if value is MISSING:
        return {}, MISSING, None
    if not isinstance(value, dict):
        raise bad("options", f"'options' must be an object, got {type_name(value)}")
    shared: dict[str, Any] = {}
    num_predict: Any = MISSING
    num_ctx: int | None = None
    for key, raw in value.items():
        if raw is None:
            continue
        item = _option_int(raw) if key in _INT_OPTIONS else raw
        if key in _SAMPLING_OPTIONS:
            shared[_SAMPLING_OPTIONS[key]] = item
        elif key == "num_predict":
            num_predict = get_int({key: item}, key, None, param="options.num_predict")
        elif key == "num_ctx":
            num_ctx = int(get_int({key: item}, key, None, lo=1, param="options.num_ctx"))
        else:
            notes.note(f"options.{key}")
    return shared, num_predict, num_ctx


def _max_tokens(num_predict: Any, limits: Limits) -> int | None:
    """``num_predict`` as a ceiling (rule 5); absent: the server's default."""
    if num_predict is MISSING:
        return limits.default_max_tokens
    n = int(num_predict)
    if n <= 0:
        return None
    return min(n, limits.max_tokens_cap or n)


def _sampling_of(
    shared: dict[str, Any], limits: Limits, max_tokens: int | None, logprobs: int | None
) -> Sampling:
    """The chat API's sampling reader on the options, its refusals renamed
    to the option the client sent (``options.repeat_penalty``)."""
    try:
        return _sampling(shared, limits, max_tokens, logprobs)
    except SluiceError as err:
        option = _OPTION_OF.get(err.param or "")
        if option is not None:
            err.message = err.message.replace(f"'{err.param}'", f"'options.{option}'")
            err.param = f"options.{option}"
        raise


def _logprobs(obj: dict[str, Any], limits: Limits) -> int | None:
    want = get_bool(obj, "logprobs", False)
    top = int(get_int(obj, "top_logprobs", 0, lo=0, hi=limits.max_logprobs))
    return top if want else None


@dataclass(frozen=True, slots=True)
class _Common:
    """What chat and generate read alike."""

    sampling: Sampling
    stream: bool
    num_ctx: int | None


def _common(
    obj: dict[str, Any], limits: Limits, notes: Notes, *, from_start: bool = False
) -> _Common:
    shared, num_predict, num_ctx = _options(obj, notes)
    sampling = _sampling_of(
        shared, limits, _max_tokens(num_predict, limits), _logprobs(obj, limits)
    )
    constraint = _format(obj)
    if constraint is not None and from_start:
        constraint = dataclasses.replace(constraint, from_start=True)
    sampling = dataclasses.replace(sampling, constraint=constraint)
    return _Common(sampling, get_bool(obj, "stream", True), num_ctx)


def _chat_request(
    name: str,
    messages: tuple[Message, ...],
    common: _Common,
    thinking: bool,
    notes: Notes,
    tools: tuple[Any, ...] = (),
) -> ChatRequest:
    return ChatRequest(
        model=name,
        messages=messages,
        sampling=common.sampling,
        stream=common.stream,
        enable_thinking=thinking,
        chat_template_kwargs=(("enable_thinking", thinking),),
        tools=tools,
        tool_choice=ToolChoice("auto" if tools else "none"),
        ignored=notes.done(),
    )


# ---------------------------------------------------------------------------
# Chat.


def _tool_calls(value: Any, where: str, turn: int) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (rule 6)."""
    if not isinstance(value, list):
        raise bad(where, f"'{where}' must be an array")
    calls = []
    for j, (at, call) in enumerate(objects(value, where)):
        fn, name = function_of(call, at)
        args = get(fn, "arguments")
        if args is MISSING:
            text = "{}"
        elif isinstance(args, dict):
            text = orjson.dumps(args).decode()
        elif isinstance(args, str):
            text = args
        else:
            raise bad(
                f"{at}.function.arguments",
                f"'{at}.function.arguments' must be an object (or JSON text of one)",
            )
        call_id = get_str(call, "id", param=f"{at}.id") or f"call_{turn}_{j}"
        calls.append(ToolCall(call_id, name, text))
    return tuple(calls)


def _message(i: int, where: str, msg: dict[str, Any], notes: Notes) -> Message:
    role = msg.get("role")
    if not isinstance(role, str) or role.lower() not in _ROLES:
        raise bad(
            f"{where}.role", f"'{where}.role' must be one of {', '.join(_ROLES)}; got {show(role)}"
        )
    role = role.lower()
    _no_images(msg, f"{where}.images")
    notes.extra_keys(msg, _MESSAGE_KEYS, "messages[].")
    content = get_str(msg, "content", param=f"{where}.content") or ""
    thinking = get_str(msg, "thinking", param=f"{where}.thinking")
    tool_name = get_str(msg, "tool_name", param=f"{where}.tool_name")
    call_id = get_str(msg, "tool_call_id", param=f"{where}.tool_call_id")
    calls = get(msg, "tool_calls")
    if calls is not MISSING and role != "assistant":
        raise bad(f"{where}.tool_calls", f"'{where}.tool_calls' is only allowed for assistant")
    if thinking and role != "assistant":
        notes.note("messages[].thinking")
    if role != "tool":
        for key, value in (("tool_name", tool_name), ("tool_call_id", call_id)):
            if value:
                notes.note(f"messages[].{key}")
    return Message(
        role=cast(Role, role),
        content=content,
        name=tool_name if role == "tool" else None,
        tool_calls=() if calls is MISSING else _tool_calls(calls, f"{where}.tool_calls", i),
        tool_call_id=call_id if role == "tool" else None,
        reasoning=thinking if role == "assistant" and thinking else None,
    )


def _messages(obj: dict[str, Any], notes: Notes) -> tuple[Message, ...]:
    value = get(obj, "messages")
    if value is MISSING:
        return ()
    if not isinstance(value, list):
        raise bad("messages", f"'messages' must be an array, got {type_name(value)}")
    # Lenient on tool results, unlike chat, Responses and Messages
    # (server/wire/tools.py's check_tool_results is not run): Ollama's own
    # server checks no ids, and its clients' tool messages may carry only
    # ``tool_name``, or an id of a call whose own id the client left out.
    return tuple(
        _message(i, where, msg, notes) for i, (where, msg) in enumerate(objects(value, "messages"))
    )


def parse_chat(body: bytes, limits: Limits) -> OllamaRequest:
    """An /api/chat body, or a 400 SluiceError naming the field."""
    obj = load_object(body)
    name = get_model(obj)
    notes = Notes("ollama")
    messages = _messages(obj, notes)
    tools = get(obj, "tools")
    parsed_tools = parse_tools({"tools": tools})[0] if tools is not MISSING else ()
    thinking = _think(obj, limits.default_enable_thinking, notes)
    common = _common(obj, limits, notes)
    notes.extra_keys(obj, _CHAT)
    chat = _chat_request(name, messages, common, thinking, notes, parsed_tools)
    return OllamaRequest(
        name, chat, load=not messages, num_ctx=common.num_ctx, keep_alive=keep_alive(obj)
    )


# ---------------------------------------------------------------------------
# Generate.


def _refuse(obj: dict[str, Any]) -> None:
    """Rule 7's refusals of a generate body."""
    _no_images(obj, "images")
    if get_str(obj, "suffix"):
        raise unsupported("suffix", "'suffix' (fill in the middle)")
    context = get(obj, "context")
    if context is not MISSING and context != []:
        raise unsupported(
            "context", "'context' (Sluice returns none: send the history to /api/chat)"
        )
    if get(obj, "_debug_render_only") not in (MISSING, False):
        raise unsupported("_debug_render_only", "'_debug_render_only'")


def parse_generate(body: bytes, limits: Limits) -> OllamaRequest:
    """An /api/generate body, or a 400 SluiceError naming the field."""
    obj = load_object(body)
    name = get_model(obj)
    _refuse(obj)
    notes = Notes("ollama")
    prompt = get_str(obj, "prompt") or ""
    system = get_str(obj, "system") or ""
    template = get_str(obj, "template") or ""
    raw = get_bool(obj, "raw", False)
    if raw and (template or system):
        raise bad("raw", "raw mode does not support template, system, or context")
    text = prompt if raw else render_template(template, system, prompt) if template else None
    if text is not None:
        # Raw and templated prompts are the client's: no thinking split (rule 8).
        if get(obj, "think") is not MISSING:
            _think(obj, False, Notes("ollama"))  # checked, then ignored
            notes.note("think")
        thinking = False
    else:
        thinking = _think(obj, limits.default_enable_thinking, notes)
    common = _common(obj, limits, notes, from_start=text is not None)
    notes.extra_keys(obj, _GENERATE)
    turn = (Message("system", system),) if system else ()
    messages = (*turn, Message("user", prompt))
    chat = _chat_request(name, messages, common, thinking, notes)
    return OllamaRequest(
        name,
        chat,
        generate=True,
        text=text,
        load=not prompt,
        num_ctx=common.num_ctx,
        keep_alive=keep_alive(obj),
    )


# A Go duration (time.ParseDuration): signed, one or more number-unit pairs.
_UNIT: Final = {
    "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0,
}  # fmt: skip
# One number-unit pair; the longer units first, so "ms" is not read as "m".
_PAIR: Final = r"(\d+(?:\.\d*)?|\.\d+)(" + "|".join(sorted(_UNIT, key=len, reverse=True)) + ")"
_PART: Final = re.compile(_PAIR)
_DURATION: Final = re.compile(rf"([+-]?)(?:{_PAIR})+")


def keep_alive(obj: dict[str, Any]) -> float | None:
    """Rule 11: ``keep_alive`` in seconds (negative: for good), None when absent,
    or a 400 naming it."""
    value = get(obj, "keep_alive")
    if value is MISSING or value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return float(text)  # "-1", "300": seconds, as the number would be
        except ValueError:
            pass
        m = _DURATION.fullmatch(text)
        if m is not None:
            seconds = sum(float(n) * _UNIT[u] for n, u in _PART.findall(text))
            return -seconds if m.group(1) == "-" else seconds
    raise bad(
        "keep_alive",
        '\'keep_alive\' must be a number of seconds or a duration such as "5m" or "1h30m"',
    )


# The actions of a template: {{ X }}, {{- X }} and {{ X -}} trim the
# whitespace before / after them, as in Go's text/template.
_ACTION: Final = re.compile(r"\{\{(-\s)?\s*(.*?)\s*(\s-)?\}\}", re.S)
_FIELDS: Final = (".System", ".Prompt", ".Response")


def _action_error(action: str) -> SluiceError:
    return unsupported(
        "template",
        f"'template' action {{{{ {action[:40]} }}}} (Sluice renders .System, .Prompt, "
        ".Response, if, else and end; send the prompt already templated with raw: true)",
    )


def render_template(template: str, system: str, prompt: str) -> str:
    """A generate request's ``template`` rendered with its system and prompt
    (rule 8): fields ``.System``, ``.Prompt``, ``.Response``, ``if`` / ``else``
    / ``end`` on them, comments and trim markers. Everything from the first
    ``{{ .Response }}`` on is dropped, as Ollama drops it: the answer goes
    there. Any other action is a 400 naming it."""
    values = {".System": system, ".Prompt": prompt, ".Response": ""}
    out: list[str] = []
    stack: list[bool] = []  # per open if: whether its current branch renders
    pos = 0
    trim_next = False
    for m in _ACTION.finditer(template):
        text = template[pos : m.start()]
        if trim_next:
            text = text.lstrip()
        if m.group(1):
            text = text.rstrip()
        on = all(stack)
        if on:
            out.append(text)
        pos, trim_next = m.end(), bool(m.group(3))
        action = m.group(2)
        if action == ".Response":
            pos = len(template)  # the rest is dropped
            break
        if action in _FIELDS:
            if on:
                out.append(values[action])
        elif action.startswith("if ") and action[3:].strip() in _FIELDS:
            stack.append(bool(values[action[3:].strip()]))
        elif action == "else" and stack:
            stack[-1] = not stack[-1]
        elif action == "end" and stack:
            stack.pop()
        elif not (action.startswith("/*") and action.endswith("*/")):
            raise _action_error(action)
    else:
        if stack:
            raise bad("template", "'template' has an {{ if }} without its {{ end }}")
    if pos < len(template) and all(stack):
        rest = template[pos:]
        out.append(rest.lstrip() if trim_next else rest)
    return "".join(out)


# ---------------------------------------------------------------------------
# Embeddings (served once an embedding model is: the pooling path, issue 30).


def _embed_common(obj: dict[str, Any], notes: Notes) -> None:
    options = get(obj, "options")
    if options is not MISSING:
        if not isinstance(options, dict):
            raise bad("options", f"'options' must be an object, got {type_name(options)}")
        for key, value in options.items():
            if value is not None:
                notes.note(f"options.{key}")


def parse_embed(body: bytes) -> EmbedRequest:
    """An /api/embed body: ``input`` a string or an array of strings (an
    empty string: nothing to embed, as in Ollama), ``truncate`` (default
    true), ``dimensions``."""
    obj = load_object(body)
    name = get_model(obj)
    notes = Notes("ollama")
    value = get(obj, "input")
    if value is MISSING or value == "":
        inputs: tuple[str, ...] = ()
    elif isinstance(value, str):
        inputs = (value,)
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        inputs = tuple(value)
    else:
        raise bad("input", "'input' must be a string or an array of strings")
    dimensions = get_int(obj, "dimensions", None, lo=1)
    _embed_common(obj, notes)
    notes.extra_keys(obj, ("model", "input", "truncate", "dimensions", "options"))
    return EmbedRequest(
        name,
        inputs,
        truncate=get_bool(obj, "truncate", True),
        dimensions=None if dimensions is None else int(dimensions),
        ignored=notes.done(),
    )


def parse_embeddings(body: bytes) -> EmbedRequest:
    """An /api/embeddings body (the older route): one ``prompt``."""
    obj = load_object(body)
    name = get_model(obj)
    notes = Notes("ollama")
    prompt = get_str(obj, "prompt") or ""
    _embed_common(obj, notes)
    notes.extra_keys(obj, ("model", "prompt", "options"))
    return EmbedRequest(name, (prompt,) if prompt else (), legacy=True, ignored=notes.done())


def parse_show(body: bytes) -> str:
    """An /api/show body's model (``model``, or the older ``name``)."""
    obj = load_object(body)
    name = get_str(obj, "model") or get_str(obj, "name", param="name")
    if not name:
        raise SluiceError("'model' is required", param="model", code="missing_required_parameter")
    return name
