"""The engine's prefix cache, isolated per caller, on the real engine (issue 28).

Sluice with a callers file (four keys, two of them in one `cache_group`) and
the demo model, whose engine caches prefixes by default. Through the official
`anthropic` client, whose `usage.cache_read_input_tokens` is vLLM's count of
prompt tokens found in the prefix cache: caller B sending caller A's prompt
reads 0 of it, while A's own repeat and a group member's request hit.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.support import SluiceProcess

pytestmark = [pytest.mark.system, pytest.mark.engine]

MODEL = "sluice-demo"
KEYS = {name: f"sk-{name}-{secrets.token_hex(8)}" for name in ("ann", "bob", "cyril", "dora")}
GROUP = ("cyril", "dora")


@pytest.fixture(scope="module")
def server(demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("cache-isolation")
    callers = tmp / "callers.toml"
    callers.write_text(
        "".join(
            f'[callers.{name}]\nkey = "{key}"\n'
            + ('cache_group = "team"\n' if name in GROUP else "")
            for name, key in KEYS.items()
        )
    )
    callers.chmod(0o600)
    args = ["--log-format", "plain", "--callers", str(callers)]
    with SluiceProcess(args, cache_dir=demo_cache_root, log_path=tmp / "sluice.log").running() as p:
        yield p


def client(server: SluiceProcess, name: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base, api_key=KEYS[name], max_retries=0)


def cached(server: SluiceProcess, name: str, system: str) -> int:
    """Prompt tokens of this caller's request found in the prefix cache."""
    with client(server, name) as c:
        msg = c.messages.create(
            model=MODEL,
            max_tokens=2,
            system=system,
            messages=[{"role": "user", "content": "What is the weather?"}],
            thinking={"type": "disabled"},
        )
    return msg.usage.cache_read_input_tokens or 0


def system_prompt() -> str:
    # Fresh per test (nothing from an earlier request can be cached), and long
    # enough to fill several KV blocks.
    return f"[{secrets.token_hex(8)}] You answer questions about the weather. " * 60


def test_another_caller_reads_nothing_of_a_callers_prompt(server: SluiceProcess) -> None:
    system = system_prompt()
    assert cached(server, "ann", system) == 0
    assert cached(server, "ann", system) > 0  # its own repeat hits
    assert cached(server, "bob", system) == 0  # the same prompt from another caller
    assert cached(server, "bob", system) > 0  # ...which then caches for bob alone
    assert cached(server, "cyril", system) == 0  # and not for a third


def test_a_cache_group_shares_its_prefix_cache(server: SluiceProcess) -> None:
    system = system_prompt()
    assert cached(server, "cyril", system) == 0
    assert cached(server, "dora", system) > 0  # the same group
    assert cached(server, "ann", system) == 0  # not in it
