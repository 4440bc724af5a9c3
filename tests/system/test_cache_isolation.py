"""The engine's prefix cache, isolated per caller, on the real engine (issue 28).

Sluice with a callers file (four keys, two of them in one `cache_group`: the
suite's shared `callers_server`) and the demo model, whose engine caches
prefixes by default. Through the official `anthropic` client, whose
`usage.cache_read_input_tokens` is vLLM's count of prompt tokens found in the
prefix cache: caller B sending caller A's prompt reads 0 of it, while A's own
repeat and a group member's request hit.
"""

from __future__ import annotations

import secrets

import anthropic
import pytest

from tests.shared_servers import CALLER_KEYS
from tests.support import SluiceProcess

pytestmark = [pytest.mark.system, pytest.mark.engine]

MODEL = "sluice-demo"
KEYS = CALLER_KEYS


@pytest.fixture
def server(callers_server: SluiceProcess) -> SluiceProcess:
    """The suite's server with a callers file (tests/shared_servers.py), whose
    four callers ann, bob, cyril and dora are this module's, cyril and dora in
    one cache_group."""
    return callers_server


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
