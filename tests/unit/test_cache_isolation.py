"""Nothing cached for one caller serves another (issue 28), with the fake engine.

* The engine's prefix cache: each caller's requests carry a salt of its own
  (vLLM's `cache_salt`, part of the first block's hash), the same for all of
  its requests and for every caller of one `cache_group`; no salt in open mode
  (anyone may claim any `user` name) or with `--shared-prefix-cache`.
* Sluice's own sharing: dedupe (one generation for identical deterministic
  requests) and the result cache are keyed the same way, so caller B never
  joins or reads caller A's generation.

The real engine's side (B's cache_read_input_tokens for A's prompt is 0):
tests/system/test_cache_isolation.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from server.callers import CallersError, parse_callers
from tests.fakes import FakeEngine
from tests.unit.test_handlers import CHAT, chat

pytestmark = pytest.mark.timeout(30)

# Names and keys that a hex salt cannot contain by chance.
KEYS = {"ann": "sk-ann-pq", "bob": "sk-bob-rs", "cyril": "sk-cyril-tu", "dora": "sk-dora-vw"}
FILE = "".join(
    f'[callers.{name}]\nkey = "{key}"\n'
    + ('cache_group = "team"\n' if name in ("cyril", "dora") else "")
    for name, key in KEYS.items()
)


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


async def with_callers(make_client: Any, **kw: Any) -> Any:
    table = parse_callers(FILE)
    kw.setdefault("warmup", False)
    return await make_client(caller_table=table, callers=table.policies, **kw)


def salts(engine: FakeEngine) -> list[str | None]:
    return [engine.salts[rid] for rid in engine.added]


async def send(client: Any, name: str | None, body: dict[str, Any]) -> None:
    resp = await client.post(CHAT, json=body, headers=bearer(name) if name else {})
    assert resp.status == 200, await resp.text()


async def test_each_caller_has_its_own_salt_and_a_group_shares_one(make_client: Any) -> None:
    client, _, engine = await with_callers(make_client)
    for name in ("ann", "ann", "bob", "cyril", "dora"):
        await send(client, name, chat(max_tokens=2))
    a1, a2, b, c, d = salts(engine)
    assert a1 is not None and a1 == a2  # a caller's own repeats still hit
    assert len({a1, b, c}) == 3  # no caller hits another's blocks
    assert c == d  # a cache_group shares its cache
    for salt in (a1, b, c):
        assert salt is not None and 0 < len(salt) <= 128  # vLLM's bound
        assert not any(part in salt for part in [*KEYS.values(), *KEYS, "team"])


async def test_no_salt_without_keys_or_with_shared_prefix_cache(make_client: Any) -> None:
    client, _, engine = await make_client(warmup=False)
    # Open mode: `user` names a caller but anyone may claim it; nothing to isolate.
    await send(client, None, chat(max_tokens=2, user="alice"))
    client, _, shared = await with_callers(make_client, shared_prefix_cache=True)
    await send(client, "ann", chat(max_tokens=2))
    await send(client, "bob", chat(max_tokens=2))
    assert salts(engine) == [None]
    assert salts(shared) == [None, None]


async def test_one_api_key_is_one_caller_with_one_salt(make_client: Any) -> None:
    client, _, engine = await make_client(api_key="sk-one", warmup=False)
    for _ in range(2):
        resp = await client.post(CHAT, json=chat(max_tokens=2), headers={"x-api-key": "sk-one"})
        assert resp.status == 200
    first, second = salts(engine)
    assert first is not None and first == second and "sk-one" not in first


async def test_identical_requests_share_a_generation_only_within_a_salt(
    make_client: Any,
) -> None:
    """Dedupe: ann and bob send the same greedy request in one window: two
    generations (bob joining ann's would answer bob from ann's work); cyril and
    dora, of one group: one; ann twice: one."""
    client, _, engine = await with_callers(
        make_client, window=0.05, adaptive=False, release_lone=False
    )
    body = chat(temperature=0, max_tokens=3)
    await asyncio.gather(send(client, "ann", body), send(client, "bob", body))
    assert len(engine.added) == 2
    await asyncio.gather(send(client, "cyril", body), send(client, "dora", body))
    assert len(engine.added) == 3
    await asyncio.gather(send(client, "ann", body), send(client, "ann", body))
    assert len(engine.added) == 4


async def test_the_result_cache_answers_only_within_a_salt(make_client: Any) -> None:
    client, _, engine = await with_callers(make_client, result_cache_ttl=60.0)
    body = {"model": "fake", "prompt": "same", "max_tokens": 4, "temperature": 0}
    for name, generations in (("ann", 1), ("ann", 1), ("bob", 2), ("cyril", 3), ("dora", 3)):
        resp = await client.post("/v1/completions", json=body, headers=bearer(name))
        assert resp.status == 200
        assert len(engine.added) == generations, name


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("cache_group = 3", "cache_group must be a name"),
        ('cache_group = "two words"', "cache_group must be a name"),
        ('cache_group = ""', "cache_group must be a name"),
    ],
)
def test_a_bad_cache_group_is_refused(spec: str, says: str) -> None:
    with pytest.raises(CallersError, match=says):
        parse_callers(f'[callers.a]\nkey = "k"\n{spec}\n')
