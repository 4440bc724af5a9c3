"""Claude Code's opening /v1/messages request, rebuilt from published captures.

Sources (shapes, not text): the wire capture of Claude Code v2.1.69 at
qntx.sbvh.nl/research/claude-api-wire-format.html (POST /v1/messages?beta=true;
headers anthropic-version 2023-06-01 and a long anthropic-beta list; body
model, messages, system, tools, metadata.user_id, max_tokens 32000, thinking
adaptive, context_management, output_config.effort, stream true) and the
claudish project's PROTOCOL_SPECIFICATION.md (system as text blocks, the first
"You are Claude Code...", cache_control ephemeral on system, on the last
user block and on the last tool; x-api-key auth; tools with draft-07
input_schemas). The prose is ours and shorter: the demo model has 8,192
positions, Claude Code's real system prompt alone is about 15,000 tokens.
"""

from __future__ import annotations

from typing import Any

EPHEMERAL = {"type": "ephemeral"}
DRAFT7 = "http://json-schema.org/draft-07/schema#"

HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
    "fine-grained-tool-streaming-2025-05-14,context-management-2025-06-27,"
    "prompt-caching-scope-2026-01-05,effort-2025-11-24",
    "anthropic-dangerous-direct-browser-access": "true",
    "x-app": "cli",
    "User-Agent": "claude-cli/2.1.69 (external, cli)",
}
PATH = "/v1/messages?beta=true"

_GUIDE = (
    "You are an interactive CLI tool that helps users with software engineering tasks. "
    "Use the instructions below and the tools available to you to assist the user. "
    "Be concise: answer in fewer than four lines unless asked for detail. "
    "Use the TodoWrite tool to plan multi-step work and mark items done as you go. "
    "Prefer editing existing files to creating new ones. Never commit unless asked. "
    "When you run a non-trivial bash command, say what it does and why. "
    "Follow the conventions of the code around you; check that a library is used "
    "before assuming it is available. After a change, run the project's lint and "
    "type checks if you know them. "
)


def _schema(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
        "$schema": DRAFT7,
    }


_S = {"type": "string"}
_N = {"type": "number"}
_B = {"type": "boolean"}

TOOLS: list[dict[str, Any]] = [
    {
        "name": "Task",
        "description": "Launch a new agent for a complex task.",
        "input_schema": _schema(
            {"description": _S, "prompt": _S, "subagent_type": _S},
            ["description", "prompt", "subagent_type"],
        ),
    },
    {
        "name": "Bash",
        "description": "Run a bash command in a persistent shell.",
        "input_schema": _schema(
            {"command": _S, "timeout": _N, "description": _S, "run_in_background": _B}, ["command"]
        ),
    },
    {
        "name": "Glob",
        "description": "Find files by glob pattern.",
        "input_schema": _schema({"pattern": _S, "path": _S}, ["pattern"]),
    },
    {
        "name": "Grep",
        "description": "Search file contents with ripgrep.",
        "input_schema": _schema(
            {
                "pattern": _S,
                "path": _S,
                "glob": _S,
                "output_mode": {
                    "type": "string",
                    "enum": ["content", "files_with_matches", "count"],
                },
                "-i": _B,
                "-n": _B,
            },
            ["pattern"],
        ),
    },
    {
        "name": "ExitPlanMode",
        "description": "Leave plan mode with a plan.",
        "input_schema": _schema({"plan": _S}, ["plan"]),
    },
    {
        "name": "Read",
        "description": "Read a file from the local filesystem.",
        "input_schema": _schema({"file_path": _S, "offset": _N, "limit": _N}, ["file_path"]),
    },
    {
        "name": "Edit",
        "description": "Replace an exact string in a file.",
        "input_schema": _schema(
            {
                "file_path": _S,
                "old_string": _S,
                "new_string": _S,
                "replace_all": {"type": "boolean", "default": False},
            },
            ["file_path", "old_string", "new_string"],
        ),
    },
    {
        "name": "Write",
        "description": "Write a file to the local filesystem.",
        "input_schema": _schema({"file_path": _S, "content": _S}, ["file_path", "content"]),
    },
    {
        "name": "NotebookEdit",
        "description": "Replace a cell in a Jupyter notebook.",
        "input_schema": _schema(
            {
                "notebook_path": _S,
                "cell_id": _S,
                "new_source": _S,
                "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]},
            },
            ["notebook_path", "new_source"],
        ),
    },
    {
        "name": "WebFetch",
        "description": "Fetch a URL and process its content.",
        "input_schema": _schema(
            {"url": {"type": "string", "format": "uri"}, "prompt": _S}, ["url", "prompt"]
        ),
    },
    {
        "name": "TodoWrite",
        "description": "Create and manage a structured task list.",
        "input_schema": _schema(
            {
                "todos": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "content": _S,
                            "status": {
                                "type": "string",
                                "enum": ["pending", "in_progress", "completed"],
                            },
                            "activeForm": _S,
                        },
                        "required": ["content", "status", "activeForm"],
                        "additionalProperties": False,
                    },
                }
            },
            ["todos"],
        ),
    },
    {
        "name": "WebSearch",
        "description": "Search the web.",
        "input_schema": _schema(
            {
                "query": {"type": "string", "minLength": 2},
                "allowed_domains": {"type": "array", "items": _S},
            },
            ["query"],
        ),
        "cache_control": EPHEMERAL,
    },
]


def request(model: str, *, max_tokens: int = 32000) -> dict[str, Any]:
    """The body, for the served `model` (Claude Code sends ANTHROPIC_MODEL)."""
    return {
        "model": model,
        "max_tokens": max_tokens,
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.69; cc_entrypoint=cli",
            },
            {
                "type": "text",
                "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": EPHEMERAL,
            },
            {
                "type": "text",
                "text": _GUIDE * 6 + "\n<env>\nWorking directory: /home/ann/app\n"
                "Is directory a git repo: Yes\nPlatform: linux\n</env>",
                "cache_control": EPHEMERAL,
            },
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "<system-reminder>\nAs you answer the user's questions, "
                        "you can use the following context: the project uses pytest."
                        "\n</system-reminder>",
                    },
                    {
                        "type": "text",
                        "text": "The test in tests/test_app.py fails; find out why.",
                        "cache_control": EPHEMERAL,
                    },
                ],
            }
        ],
        "tools": TOOLS,
        "metadata": {
            "user_id": "user_0784b260bff170af_account_261d5434-c8c2-431f-b07d-2e480cd4622f"
            "_session_b4e5aaaa-9a3e-47c4-84ad-3a70f38c676e"
        },
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "temperature": 1,
        "stream": True,
    }
