"""Frozen value types of a validated request, and the server's parsing limits.

Everything downstream (batching, the engine adapter, dedupe) sees these and
never the client's JSON; they are built only by ``server/api/openai_chat/parse.py``
and its helpers (``server/wire/tools.py``, ``server/wire/structured.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson

from server.wire.ignored import Ignored

__all__ = [
    "DEFAULTABLE",
    "ChatRequest",
    "CompletionRequest",
    "Constraint",
    "Limits",
    "Message",
    "Role",
    "Sampling",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "merge_system",
]

# Fields a model's generation_config may default (vLLM's --generation-config),
# with OpenAI's defaults.
DEFAULTABLE: Final = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}

Role = Literal["system", "user", "assistant", "tool", "developer"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Server-wide bounds and defaults for request parsing (built once at start-up).

    ``max_tokens_cap`` is usually the model context; ``default_max_tokens``
    ``None`` means "the rest of the context", resolved by ``check_context``
    after tokenizing. ``sampling_defaults`` holds the model's
    generation_config defaults (e.g. Qwen3: temperature 0.6, top_p 0.95,
    top_k 20), used where a request omits the field, as vLLM does.
    ``max_prompts`` bounds a batched /v1/completions ``prompt`` list, which is
    otherwise an unbounded fan-out (prompts x n sequences).
    """

    max_n: int = 8
    max_stop: int = 4
    max_logprobs: int = 20
    max_tokens_cap: int | None = None
    default_max_tokens: int | None = None
    default_enable_thinking: bool = True
    max_prompts: int = 64
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    # With several models (--models), each model's own, by the names a request
    # may give for it (its name, its LoRA adapters'): its generation defaults
    # and thinking default differ. Empty with one model: these fields are its.
    models: tuple[tuple[str, Limits], ...] = ()

    def __post_init__(self) -> None:
        for name, _ in self.sampling_defaults:
            if name not in DEFAULTABLE:
                raise ValueError(f"sampling_defaults: unknown field {name!r}")

    def for_model(self, model: str) -> Limits:
        """The limits of the model a request names (these, for an unknown name:
        the model check refuses it after parsing)."""
        for name, limits in self.models:
            if name == model:
                return limits
        return self


@dataclass(frozen=True, slots=True)
class Constraint:
    """A structured-output constraint on the generated text: exactly one kind.

    The engine's ``StructuredOutputsParams`` in Sluice's terms. ``kind``
    ``json``: ``value`` is a JSON schema as JSON text; ``json_object``: any
    JSON object; ``regex`` / ``grammar``: ``value`` is the pattern or the
    grammar (EBNF or Lark); ``choice``: one of ``choices``, verbatim. Text,
    not dicts, so the value is hashable and frozen for dedupe. ``param`` names
    the request field it came from, for errors; it is not part of the value.
    ``from_start``: the constraint holds from the first generated token (a raw
    completion); otherwise, with the engine's reasoning parser, it starts
    after the thinking ends (chat).
    """

    kind: Literal["json", "json_object", "regex", "grammar", "choice"]
    value: str = ""
    choices: tuple[str, ...] = ()
    param: str = field(default="response_format", compare=False)
    from_start: bool = False


@dataclass(frozen=True, slots=True)
class Sampling:
    """Everything that shapes the generated tokens of one request.

    ``logprobs``: ``None`` = off, ``0`` = the sampled token's logprob only,
    ``k`` = plus the top k alternatives; ``prompt_logprobs`` the same for the
    prompt's tokens (vLLM's prompt_logprobs: an echo with logprobs, lm-eval's
    loglikelihood). ``top_k`` 0 means disabled (vLLM
    0.32's spelling; -1 is normalised to 0). With temperature 0, top_p, top_k
    and min_p are normalised to their neutral values as vLLM does, so that
    greedy requests that differ only there share a fingerprint.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    constraint: Constraint | None = None
    prompt_logprobs: int | None = None

    @property
    def deterministic(self) -> bool:
        """Same input, same output: greedy, or seeded."""
        return self.temperature == 0 or self.seed is not None

    def fingerprint(self) -> tuple[Any, ...]:
        """A hashable of every field that affects the output (for dedupe)."""
        return (
            self.max_tokens,
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.n,
            self.stop,
            self.stop_token_ids,
            self.seed,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.logprobs,
            self.ignore_eos,
            self.min_tokens,
            self.skip_special_tokens,
            self.include_stop_str_in_output,
            self.constraint,
            self.prompt_logprobs,
        )


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call (an OpenAI ``tools[i]`` of type function).

    ``parameters`` is the JSON schema of the arguments as JSON text, in the
    client's key order (the chat template renders it as given); ``None``
    when the client gave none.
    """

    name: str
    parameters: str | None = None
    description: str | None = None
    strict: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI tool object as vLLM's server hands it to the chat template
        (its ``model_dump``: ``description`` and ``parameters`` always present,
        null when not given), so the prompt is the one vLLM's server renders."""
        function: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "parameters": None if self.parameters is None else orjson.loads(self.parameters),
        }
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``tool_choice``: ``none``, ``auto``, ``required``, or ``function`` naming one tool."""

    mode: Literal["none", "auto", "required", "function"] = "none"
    name: str | None = None

    @property
    def forced(self) -> bool:
        """The model must call a tool (``required`` or a named function)."""
        return self.mode in ("required", "function")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call of a function: in an assistant message of the history, or generated.

    ``arguments`` is JSON text, as OpenAI carries it.
    """

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message, text only; list-of-parts content is joined with newlines.

    An assistant message may carry ``tool_calls`` and ``reasoning`` (a past
    turn's thinking, which the chat template renders as it renders thoughts);
    a ``tool`` message answers the call ``tool_call_id``. ``param`` names the
    request field that id came from (``messages[3].tool_call_id``,
    ``input[2].call_id``), for the error of ``server/wire/tools.py``'s
    ``check_tool_results``; like ``Constraint.param`` it is not part of the value.
    """

    role: Role
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning: str | None = None
    param: str | None = field(default=None, compare=False)

    def template_dict(self) -> dict[str, Any]:
        """The message in OpenAI's shape, as vLLM's renderer parses it for the
        chat template (it turns tool-call arguments into objects, and text that
        is no JSON object into ``{}``, so that a bad call in the history does
        not fail every later turn)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning is not None:
            # vLLM's renderer hands it to the template as reasoning_content too.
            out["reasoning"] = self.reasoning
        return out


def merge_system(messages: tuple[Message, ...]) -> tuple[Message, ...]:
    """Every system message's text appended, in order, to the first message
    (made a system message when it is not one), joined with "" as vLLM's
    /v1/messages merges them: for a chat template that refuses a system
    message after the first (vLLM's probe, server/engines/vllm_adapter.py)."""
    systems = [m for m in messages if m.role == "system"]
    if not systems or (len(systems) == 1 and messages[0].role == "system"):
        return messages
    head = Message("system", "".join(m.content for m in systems))
    return (head, *(m for m in messages if m.role != "system"))


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated /v1/chat/completions request.

    ``chat_template_kwargs`` is the request's object as sorted items, always
    holding the resolved ``enable_thinking`` so the template and the reasoning
    splitter agree; ``template_kwargs()`` gives it back as a dict. The three
    chat-shaped APIs (chat, Responses, Messages) all build one.
    """

    model: str
    messages: tuple[Message, ...]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    # OpenAI's processing tier as asked: "flex" makes the request background
    # work (batching/classes.py rule 1); any other string is the default tier.
    service_tier: str | None = None
    user: str | None = None
    enable_thinking: bool = True
    chat_template_kwargs: tuple[tuple[str, Any], ...] = field(default=())
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    # vLLM's prompt_logprobs extension as asked (None: not): the prompt's
    # tokens' logprobs and top k, in the body (sampling.prompt_logprobs is
    # what the engine computes).
    prompt_logprobs: int | None = None
    # What the parser accepted and ignored (server/wire/ignored.py): not
    # part of the request's value, so not of equality or dedupe.
    ignored: tuple[Ignored, ...] = field(default=(), compare=False)

    @property
    def logprobs(self) -> bool:
        return self.sampling.logprobs is not None

    @property
    def top_logprobs(self) -> int:
        return self.sampling.logprobs or 0

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the chat template, ``tools`` included when given."""
        kwargs = dict(self.chat_template_kwargs)
        if self.tools:
            kwargs["tools"] = [t.as_dict() for t in self.tools]
        return kwargs

    def variant(self) -> tuple[Any, ...]:
        """Besides the prompt tokens and ``sampling.fingerprint()`` (which holds
        the output constraint), everything that shapes the answer, for dedupe
        and the result cache: the thinking split, and the tools, which decide
        a forced call's constraint and how the output is read into calls."""
        return (
            self.enable_thinking,
            self.tools,
            self.tool_choice,
            self.parallel_tool_calls,
            self.prompt_logprobs,
        )


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated /v1/completions request; a prompt is text or token ids."""

    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    service_tier: str | None = None  # as in ChatRequest
    user: str | None = None
    echo: bool = False
    # An echo with max_tokens 0: the prompt alone (with its logprobs), no output.
    prompt_only: bool = False
    prompt_logprobs: int | None = None  # as in ChatRequest
    ignored: tuple[Ignored, ...] = field(default=(), compare=False)
