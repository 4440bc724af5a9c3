"""What the five APIs accept and ignore: one rule, one record (docs/DESIGN.md principle 10).

Why this module exists: clients add fields, blocks and tool types every few
weeks (coding agents most of all), and a parser that refuses whatever it does
not know turns each client release into an outage (issue 26). So every parser
follows one rule:

1. Malformed input (a wrong type, a value out of range, a broken structure)
   is a 400 naming the field (server/wire/fields.py), as before.
2. Input this server does not know, or knows and cannot honour but may
   ignore without changing what the client relies on, is accepted and
   ignored, and the parser notes it here: each note names the API, a
   ``field`` label and the client's own spelling. server/operations/ignored_log.py
   logs each (api, field) once per process at info and counts every one in
   ``sluice_ignored_fields_total{api,field}``.
3. Input this server cannot honour and whose loss would change the answer
   (a forced hosted tool, an image on a text-only model) stays a 400.

The ``field`` label is bounded: a name listed in ``KNOWN`` for that API
(docs/apis.md, "What the APIs accept", lists the same names, docs/ollama.md
Ollama's, checked by tests/unit/test_ignored_fields.py), else ``other``; never a string the client
chose. Paths are written without indices: ``tools[].defer_loading``, a tool
of a type this server does not offer as ``tools[type=web_search]``.

Pure code: no aiohttp, no vLLM, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = ["KNOWN", "OTHER", "Api", "Ignored", "Notes"]

Api = Literal["chat", "completions", "responses", "messages", "ollama", "embeddings", "rerank"]
OTHER: Final = "other"
# The client's spelling of an unknown field, as logged: bounded in length.
_NAME_CHARS: Final = 80

# Per API, the fields known to be accepted and ignored, each with why.
# Everything a parser honours is not listed; everything else it meets is OTHER.
KNOWN: Final[Mapping[Api, Mapping[str, str]]] = {
    "chat": {
        "store": "OpenAI's own storage of completions",
        "metadata": "tags for OpenAI's dashboard",
        "prompt_cache_key": "OpenAI's cache routing; vLLM caches prefixes by content",
        "safety_identifier": "OpenAI's abuse tracking",
        "reasoning_effort": "Qwen3's template has a switch, not an effort "
        "(chat_template_kwargs.enable_thinking is the switch)",
        "verbosity": "a hint OpenAI's models are trained on",
        "web_search_options": "a hosted search this server does not run",
    },
    "completions": {
        "store": "OpenAI's own storage of completions",
        "metadata": "tags for OpenAI's dashboard",
        "prompt_cache_key": "OpenAI's cache routing; vLLM caches prefixes by content",
        "safety_identifier": "OpenAI's abuse tracking",
    },
    "responses": {
        "include": "extra output OpenAI can attach (encrypted reasoning, search results)",
        "prompt_cache_key": "OpenAI's cache routing; vLLM caches prefixes by content",
        "prompt_cache_retention": "OpenAI's cache lifetime",
        "safety_identifier": "OpenAI's abuse tracking",
        "truncation": "Sluice never truncates input; a prompt over the context is a 400",
        "max_tool_calls": "Sluice runs no tools itself",
        "stream_options": "obfuscation padding of stream events",
        "client_metadata": "Codex's per-turn tags",
        "context_management": "server-side compaction",
        "text.verbosity": "a hint OpenAI's models are trained on",
        "reasoning.summary": "reasoning goes back whole, not summarised",
        "reasoning.generate_summary": "reasoning goes back whole, not summarised",
        "input[type=reasoning]": "a past turn's thinking is not rendered (Qwen3's template "
        "drops it before the last user turn)",
        "tools[].defer_loading": "every tool is shown to the model",
        "tools[].format": "a custom tool's grammar: its input is free text",
        "tools[type=web_search]": "a hosted tool this server does not run",
        "tools[type=web_search_preview]": "a hosted tool this server does not run",
        "tools[type=file_search]": "a hosted tool this server does not run",
        "tools[type=code_interpreter]": "a hosted tool this server does not run",
        "tools[type=image_generation]": "a hosted tool this server does not run",
        "tools[type=mcp]": "a hosted tool this server does not run",
        "tools[type=computer_use_preview]": "a hosted tool this server does not run",
        "tools[type=local_shell]": "an OpenAI-model tool with its own call items",
        "tools[type=shell]": "an OpenAI-model tool with its own call items",
        "tools[type=apply_patch]": "an OpenAI-model tool with its own call items",
        "tools[type=tool_search]": "a hosted tool this server does not run",
    },
    "messages": {
        "context_management": "server-side clearing of old thinking and tool results",
        "output_config.effort": "Qwen3's template has a switch, not an effort",
        "service_tier": "Anthropic's processing tiers",
        "cache_control": "prompt caching: vLLM caches prefixes by content",
        "thinking.display": "thinking goes back whole",
        "system[].cache_control": "prompt caching: vLLM caches prefixes by content",
        "messages[].content[].cache_control": "prompt caching: vLLM caches prefixes by content",
        "messages[].content[].citations": "citations of documents this server does not take",
        "tool_result.content[type=tool_reference]": "every tool is shown to the model, "
        "so a tool search's result adds nothing",
        "tools[].cache_control": "prompt caching: vLLM caches prefixes by content",
        "tools[].defer_loading": "every tool is shown to the model",
        "tools[].strict": "tool inputs are parsed, not constrained",
        "tools[].eager_input_streaming": "tool inputs stream as they are parsed",
        "tools[].input_examples": "examples Anthropic's models are trained on",
        # Anthropic's server tools, without their version date.
        "tools[type=web_search]": "a server tool this server does not run",
        "tools[type=web_fetch]": "a server tool this server does not run",
        "tools[type=code_execution]": "a server tool this server does not run",
        "tools[type=tool_search_tool_regex]": "a server tool this server does not run",
        "tools[type=tool_search_tool_bm25]": "a server tool this server does not run",
        "tools[type=bash]": "an Anthropic-model tool: its schema is not given",
        "tools[type=text_editor]": "an Anthropic-model tool: its schema is not given",
        "tools[type=computer]": "an Anthropic-model tool: its schema is not given",
        "tools[type=memory]": "an Anthropic-model tool: its schema is not given",
    },
    "ollama": {
        "keep_alive": "on the embedding routes, which this server refuses (chat and "
        "generate set the model's idle unload)",
        "think": "a level (low, medium, high, max) turns Qwen3's thinking on: its "
        "template has a switch, not levels; with raw or template, thinking is not split",
        "truncate": "Sluice never truncates: a prompt over the context is a 400",
        "shift": "no context shift: an answer stops at the context (done_reason length)",
        "options.num_keep": "a context-shift setting of Ollama's runner",
        "options.typical_p": "a llama.cpp sampler vLLM does not have",
        "options.repeat_last_n": "vLLM's repetition penalty covers the whole sequence",
        "options.tfs_z": "a llama.cpp sampler vLLM does not have",
        "options.mirostat": "a llama.cpp sampler vLLM does not have",
        "options.mirostat_tau": "a llama.cpp sampler vLLM does not have",
        "options.mirostat_eta": "a llama.cpp sampler vLLM does not have",
        "options.penalize_newline": "a llama.cpp sampler setting vLLM does not have",
        "options.numa": "a load-time setting of Ollama's runner: vLLM's are its engine flags",
        "options.num_batch": "a load-time setting of Ollama's runner: vLLM's are its engine flags",
        "options.num_gpu": "a load-time setting of Ollama's runner: vLLM's are its engine flags",
        "options.main_gpu": "a load-time setting of Ollama's runner: vLLM's are its engine flags",
        "options.low_vram": "a load-time setting of Ollama's runner: vLLM's are its engine flags",
        "options.f16_kv": "a load-time setting of Ollama's runner: vLLM's are its engine flags",
        "options.logits_all": "a load-time setting of Ollama's runner",
        "options.vocab_only": "a load-time setting of Ollama's runner",
        "options.use_mmap": "a load-time setting of Ollama's runner: vLLM's are its engine flags",
        "options.use_mlock": "a load-time setting of Ollama's runner",
        "options.embedding_only": "a load-time setting of Ollama's runner",
        "options.num_thread": "a load-time setting of Ollama's runner: vLLM's are its engine flags",
        "options.draft_num_predict": "speculative decoding is an engine flag in vLLM",
    },
    # The pooling APIs (server/api/pooling/parse.py; docs/pooling.md lists these).
    "embeddings": {
        "request_id": "vLLM's own request id; Sluice names every request itself",
        "cache_salt": "Sluice salts the prefix cache per caller itself",
        "mm_processor_kwargs": "multimodal processing: the inputs here are text",
    },
    "rerank": {
        "request_id": "vLLM's own request id; Sluice names every request itself",
        "cache_salt": "Sluice salts the prefix cache per caller itself",
        "mm_processor_kwargs": "multimodal processing: the documents here are text",
        "instruction": "a score template's variable: like vLLM's server without "
        "--chat-template, none is applied",
        "chat_template_kwargs": "a score template's variables: like vLLM's server without "
        "--chat-template, none is applied",
        "rank_fields": "Cohere's fields of structured documents: documents here are text",
        "max_chunks_per_doc": "Cohere's chunking: a document past the context is a 400",
    },
}


@dataclass(frozen=True, slots=True)
class Ignored:
    """One accepted-and-ignored piece of a request: its label and the client's spelling."""

    field: str
    name: str


class Notes:
    """The ignored pieces of one request, noted by its parser (rule 2).

    A parser makes one, passes it down, and puts ``items`` on the request it
    builds; nothing here does I/O.
    """

    __slots__ = ("_known", "items")

    def __init__(self, api: Api) -> None:
        self._known = KNOWN[api]
        self.items: list[Ignored] = []

    def note(self, path: str) -> None:
        """``path`` was accepted and ignored: counted under its own name when
        this API lists it, else under ``other``."""
        label = path if path in self._known else OTHER
        self.items.append(Ignored(label, path[:_NAME_CHARS]))

    def extra_keys(self, obj: dict[str, Any], honoured: Iterable[str], where: str = "") -> None:
        """Each key of ``obj`` outside ``honoured`` (JSON null counts as
        absent), noted as ``where`` + key."""
        known = honoured if isinstance(honoured, frozenset | set) else frozenset(honoured)
        for key, value in obj.items():
            if value is not None and key not in known:
                self.note(f"{where}{key}")

    def done(self) -> tuple[Ignored, ...]:
        return tuple(self.items)
