"""The three coding agents, pinned, and their installation from the npm registry.

Why this exists: the agents change their requests every few weeks, and each
change Sluice's parser did not expect was an outage (issue 26). The suite runs
them as shipped, at pinned versions (bumped by hand: `npm view PACKAGE
version`), or at the newest published ones with `--agents-latest` (or
``SLUICE_AGENTS_LATEST=1``), so a release that breaks Sluice shows in one
command.

Each version is installed once, with npm, into its own folder of the cache,
``$SLUICE_CACHE_DIR/sluice/agents/`` (else ``$XDG_CACHE_HOME`` or
``~/.cache``, as for the demo model), ``PACKAGE@VERSION/``: built in a
temporary folder and renamed into place, so a crash never leaves a half
install that looks complete. The three take about 950 MB (mostly Codex's and
Claude Code's native binaries) and install in about 25 s here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from server.engines.demo.model import default_cache_root

# npm's own install takes ~25 s for the three here; a registry that does not
# answer fails within this instead of hanging the suite.
_NPM_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True, slots=True)
class Agent:
    """One coding agent: its npm package, the version the suite pins, its command."""

    name: str
    package: str
    pinned: str
    command: str
    # A script of the package's own that puts its native binary in place
    # (its postinstall), run here: npm runs no package scripts (below).
    setup: str | None = None


CLAUDE_CODE = Agent(
    "claude-code", "@anthropic-ai/claude-code", "2.1.332", "claude", setup="install.cjs"
)
CODEX = Agent("codex", "@openai/codex", "0.171.0", "codex")
QWEN_CODE = Agent("qwen-code", "@qwen-code/qwen-code", "0.24.4", "qwen")
AGENTS = (CLAUDE_CODE, CODEX, QWEN_CODE)


def cache_dir(env: Mapping[str, str]) -> Path:
    """Where installed agents live: beside the demo model, under ``sluice/agents``."""
    return default_cache_root(env) / "sluice" / "agents"


def latest_version(agent: Agent) -> str:
    """The newest version the npm registry publishes for ``agent``."""
    out = subprocess.run(
        ["npm", "view", agent.package, "version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.strip()


def install(agent: Agent, version: str, root: Path) -> Path:
    """The agent's command, installed at ``version`` under ``root`` if not already."""
    command = Path("node_modules") / ".bin" / agent.command
    return (
        install_package(agent.package, version, root, setup=agent.setup, expect=command) / command
    )


def install_package(
    package: str,
    version: str,
    root: Path,
    *,
    setup: str | None = None,
    expect: Path | None = None,
) -> Path:
    """The folder that holds npm ``package`` at ``version`` (its
    ``node_modules/``), installed under ``root`` if not already: an agent, or
    a client library a test drives (issue 31: the JavaScript ``ollama``).
    ``setup``: a script of the package's own to run after (see below);
    ``expect``: a path under the folder a complete install has."""
    home = root / f"{package.replace('/', '+')}@{version}"
    if (home / ".complete").exists() and (expect is None or (home / expect).exists()):
        return home
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{home.name}.tmp-", dir=root))
    try:
        # --ignore-scripts: npm 11 asks before it runs a package's scripts
        # (allowScripts) and will stop running unapproved ones; the one script
        # an agent needs (Claude Code's, which copies its native binary over
        # a placeholder `bin/claude.exe`) is run explicitly below instead.
        subprocess.run(
            [
                "npm",
                "install",
                "--prefix",
                str(tmp),
                "--no-audit",
                "--no-fund",
                "--no-save",
                "--ignore-scripts",
                "--loglevel=error",
                f"{package}@{version}",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=_NPM_TIMEOUT_S,
            env={**os.environ, "npm_config_update_notifier": "false"},
        )
        if setup is not None:
            subprocess.run(
                ["node", setup],
                cwd=tmp / "node_modules" / package,
                check=True,
                capture_output=True,
                text=True,
                timeout=_NPM_TIMEOUT_S,
            )
        (tmp / ".complete").write_text(version + "\n")
        if home.exists():  # incomplete: moved aside (rename() keeps no non-empty target)
            with contextlib.suppress(OSError):
                home.rename(tmp.with_name(tmp.name + "-old"))
        try:
            tmp.rename(home)
        except OSError:  # another session installed it first
            if not (home / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp.with_name(tmp.name + "-old"), ignore_errors=True)
    return home
