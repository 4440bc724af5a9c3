"""One non-interactive turn of a coding agent against a server, with its default settings.

Why this exists: each agent is pointed at a server its own way
(docs/coding-agents.md); this module is that list, as code, for the tests. Each runs
in a fresh home folder (no user settings, no login, no history), in an empty
working folder, with what its documentation says a user sets to use another
server, plus the setting of its own that caps its answers' length where it
has one (Claude Code's CLAUDE_CODE_MAX_OUTPUT_TOKENS, Qwen Code's
QWEN_CODE_MAX_OUTPUT_TOKENS; Codex has none): without it Claude Code asks for
32,000 and Qwen Code for 32,000, escalated to 64,000 when an answer is cut.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

from tests.agents.install import CLAUDE_CODE, CODEX, QWEN_CODE, Agent

# The answer's cap, in tokens, for the agents that have a setting for it
# (Codex has none: the server's default applies). The test server's answers
# end after about 8 tokens (tests/integration/test_coding_agents.py): one
# reaches 256 with a chance of (7/8)^256, about 1e-15.
OUTPUT_CAP = 256
PROMPT = "Reply with one short sentence: what is 2 + 2?"


@dataclasses.dataclass(frozen=True, slots=True)
class Turn:
    """What an agent did: its exit code and its standard output and error."""

    returncode: int
    stdout: str
    stderr: str


def _env(home: Path, extra: dict[str, str]) -> dict[str, str]:
    # PATH only from the caller's environment: node for the JavaScript agents.
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        **extra,
    }


def command(
    agent: Agent, exe: Path, base: str, model: str, home: Path
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one turn of ``agent`` against ``base``."""
    home.mkdir(parents=True, exist_ok=True)
    if agent is CLAUDE_CODE:
        env = {
            "ANTHROPIC_BASE_URL": base,
            "ANTHROPIC_API_KEY": "sk-sluice-test",
            "ANTHROPIC_MODEL": model,
            # Claude Code's background calls (titles, summaries) use its small
            # model; it must be one the server has.
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(OUTPUT_CAP),
        }
        return [str(exe), "-p", PROMPT], _env(home, env)
    if agent is CODEX:
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(
            f'model = "{model}"\n'
            'model_provider = "sluice"\n'
            "[model_providers.sluice]\n"
            'name = "Sluice"\n'
            f'base_url = "{base}/v1"\n'
            'wire_api = "responses"\n'
            'env_key = "SLUICE_API_KEY"\n'
        )
        env = {"CODEX_HOME": str(codex_home), "SLUICE_API_KEY": "sk-sluice-test"}
        return [str(exe), "exec", "--skip-git-repo-check", PROMPT], _env(home, env)
    if agent is QWEN_CODE:
        env = {
            "OPENAI_BASE_URL": base + "/v1",
            "OPENAI_API_KEY": "sk-sluice-test",
            "OPENAI_MODEL": model,
            "QWEN_CODE_MAX_OUTPUT_TOKENS": str(OUTPUT_CAP),
        }
        return [str(exe), "-p", PROMPT], _env(home, env)
    raise ValueError(agent.name)


def run_turn(
    agent: Agent, exe: Path, base: str, model: str, home: Path, workdir: Path, timeout: float
) -> Turn:
    args, env = command(agent, exe, base, model, home)
    workdir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        args,
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Turn(done.returncode, done.stdout, done.stderr)
