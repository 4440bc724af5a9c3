"""A Codex CLI opening request to /v1/responses, rebuilt from Codex's public source.

Shape, per codex-rs (core/src/client_common.rs `ResponsesApiRequest`, the tool
specs in core/src/tools/spec.rs, serialised by serde): `model`,
`instructions` (the base prompt, several KB), `input` (a developer message
with the sandbox permissions, a user message with the AGENTS.md
instructions, one with `<environment_context>`, then the user's prompt; all
as `input_text` parts), a dozen `function` tools (`strict: false`, their
properties in BTreeMap order: alphabetical), `tool_choice: "auto"`,
`parallel_tool_calls`, `reasoning: {effort, summary}`, `store: false`,
`stream: true`, `include: ["reasoning.encrypted_content"]`,
`prompt_cache_key` (the session id) and `text.verbosity`. The texts are
stand-ins of a similar length, written here, not Codex's own.

One field is added: `max_output_tokens` (Codex sends none), so that a
random-weight model on CPU stops after 64 tokens instead of filling the
context.
"""

from __future__ import annotations

from typing import Any

_SECTIONS = (
    "You are a coding agent running in a terminal on the user's computer. You and the user "
    "share one workspace; you read files, run commands and edit code to finish the task.",
    "## Personality\nBe concise, direct and friendly. Report what you did and what is left.",
    "## Planning\nFor tasks with several steps keep a short plan with the update_plan tool: "
    "one step in progress at a time, mark steps done as you finish them.",
    "## Running commands\nUse the shell tool. Prefer rg over grep and fd over find. Set "
    "workdir instead of cd. Read files in chunks of at most 250 lines.",
    "## Editing files\nUse apply_patch for every edit. Keep changes small and in the style of "
    "the surrounding code. Never revert changes you did not make.",
    "## Sandbox and approvals\nCommands run in a sandbox. When a command needs network access "
    "or writes outside the workspace, ask for escalated permissions with a justification.",
    "## Testing\nRun the narrowest test that covers your change first, then widen. Do not fix "
    "unrelated failing tests; mention them in your final message.",
    "## Final answer\nSummarise the change in a few bullet points, cite files with paths and "
    "line numbers, and suggest the next step when there is an obvious one.",
)
INSTRUCTIONS = "\n\n".join(_SECTIONS * 6)  # ~9 KB, the order of Codex's base prompt


def _string(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


def _number(description: str) -> dict[str, Any]:
    return {"type": "number", "description": description}


def _strings(description: str) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "string"}, "description": description}


def _tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> Any:
    return {
        "type": "function",
        "name": name,
        "description": description,
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": dict(sorted(props.items())),
            "required": required,
            "additionalProperties": False,
        },
    }


TOOLS = [
    _tool(
        "shell",
        "Runs a shell command and returns its output.",
        {
            "command": _strings("The command to execute"),
            "workdir": _string("The working directory to execute the command in"),
            "timeout_ms": _number("The timeout for the command in milliseconds"),
            "with_escalated_permissions": {
                "type": "boolean",
                "description": "Whether to request escalated permissions.",
            },
            "justification": _string("Why escalated permissions are needed."),
        },
        ["command"],
    ),
    _tool(
        "exec_command",
        "Runs a command in a PTY, returning output or a session id for ongoing interaction.",
        {
            "cmd": _string("Shell command to execute."),
            "workdir": _string("Working directory."),
            "yield_time_ms": _number("How long to wait for output before yielding."),
            "max_output_tokens": _number("Maximum number of tokens to return."),
        },
        ["cmd"],
    ),
    _tool(
        "write_stdin",
        "Writes characters to an existing exec session and returns recent output.",
        {
            "session_id": _number("Identifier of the running exec session."),
            "chars": _string("Characters to write to stdin."),
            "yield_time_ms": _number("How long to wait for output before yielding."),
        },
        ["session_id"],
    ),
    _tool(
        "update_plan",
        "Updates the task plan: a list of steps, each pending, in_progress or completed.",
        {
            "explanation": _string("Why the plan changed."),
            "plan": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "status": _string("One of: pending, in_progress, completed"),
                        "step": _string("The step."),
                    },
                    "required": ["step", "status"],
                    "additionalProperties": False,
                },
                "description": "The list of steps",
            },
        },
        ["plan"],
    ),
    _tool(
        "apply_patch",
        "Use the apply_patch tool to edit files: a patch in the apply_patch format.",
        {"input": _string("The entire contents of the apply_patch command")},
        ["input"],
    ),
    _tool(
        "view_image",
        "Attach a local image (by filesystem path) to the conversation context.",
        {"path": _string("Local filesystem path to an image file")},
        ["path"],
    ),
    _tool(
        "read_file",
        "Reads a local file with 1-indexed line numbers.",
        {
            "file_path": _string("Absolute path to the file"),
            "offset": _number("The line number to start reading from."),
            "limit": _number("The maximum number of lines to return."),
        },
        ["file_path"],
    ),
    _tool(
        "list_dir",
        "Lists entries in a local directory with simple type labels.",
        {
            "dir_path": _string("Absolute path to the directory to list."),
            "depth": _number("The maximum directory depth to traverse."),
        },
        ["dir_path"],
    ),
    _tool(
        "grep_files",
        "Finds files whose contents match the pattern, most recently modified first.",
        {
            "pattern": _string("Regular expression pattern to search for."),
            "path": _string("Directory or file path to search."),
            "include": _string("Optional glob that limits which files are searched."),
        },
        ["pattern"],
    ),
    _tool(
        "list_mcp_resources",
        "Lists resources provided by MCP servers.",
        {"server": _string("Optional MCP server name."), "cursor": _string("Page cursor.")},
        [],
    ),
    _tool(
        "list_mcp_resource_templates",
        "Lists resource templates provided by MCP servers.",
        {"server": _string("Optional MCP server name."), "cursor": _string("Page cursor.")},
        [],
    ),
    _tool(
        "read_mcp_resource",
        "Read a specific resource from an MCP server given the server name and resource URI.",
        {"server": _string("MCP server name."), "uri": _string("Resource URI to read.")},
        ["server", "uri"],
    ),
]


def _message(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def codex_opening_request(model: str) -> dict[str, Any]:
    """The first request of a Codex session in a small Python repository."""
    return {
        "model": model,
        "instructions": INSTRUCTIONS,
        "input": [
            _message(
                "developer",
                "<permissions instructions>Filesystem sandboxing: workspace-write. Network "
                "access is restricted. Approval policy: on-request.</permissions instructions>",
            ),
            _message(
                "user",
                "# AGENTS.md instructions for /home/dev/project\n\n<INSTRUCTIONS>\nRun "
                "`pytest -q` before committing. Use type hints.\n</INSTRUCTIONS>",
            ),
            _message(
                "user",
                "<environment_context>\n  <cwd>/home/dev/project</cwd>\n  <approval_policy>"
                "on-request</approval_policy>\n  <sandbox_mode>workspace-write</sandbox_mode>\n"
                "  <network_access>restricted</network_access>\n  <shell>bash</shell>\n"
                "</environment_context>",
            ),
            _message("user", "Add a --verbose flag to cli.py and a test for it."),
        ],
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a7c2-4e1b-7d30-9f2a-6b8e1c5d3a47",
        "text": {"verbosity": "medium"},
        "max_output_tokens": 64,
    }
