"""Who is asking: the callers file, API keys and the OpenAI `user` field.

Why this module exists: the core (batching/) shares the engine fairly between
named callers and holds each to its own limits; something has to put a name on
every request. That is this module, in one of three modes:

* a callers file (`--callers FILE`, TOML, read with the standard library's
  tomllib): every caller has its own bearer key; a request's key names it, a
  request without a known key gets 401. SIGHUP reloads the file; a bad file
  keeps the old callers (server/app.py logs why).
* one API key (`--api-key-file` or SLUICE_API_KEY): one caller, `default`.
* no keys: the OpenAI `user` field names the caller, for at most
  `MAX_USER_NAMES` distinct names (first come); requests without one are
  `default`, and names past the bound or unfit for a metric label count as
  one caller, `other`, so a client cannot grow the metrics or the core's
  per-caller state without limit.

Keys are compared with `hmac.compare_digest` against every key (no early exit,
so the time does not say which key almost matched) and never logged or
printed: `CallerTable` keeps them out of its repr.

The engine's prefix cache is isolated per caller (`CallerDirectory.cache_salt`)
whenever keys name callers: every request carries vLLM's `cache_salt`, which
vLLM mixes into the hash of a prompt's first KV block (so of every block after
it), and requests with different salts never share a cached block. Without it,
caller B learns from `cache_read_input_tokens` (or from its TTFT) whether
caller A sent a prompt. Callers of one `cache_group` share a salt, so a team's
common system prompt still caches across its keys. The salt is an HMAC-SHA256
of the caller's (or group's) name under a secret drawn at random when the
process starts; never the key, and not the name itself, which vLLM may write
out (KV events, a KV connector's store). A per-process secret costs nothing:
vLLM's prefix cache lives in the engine's memory and dies with the process,
a SIGHUP reload keeps every salt (a secret derived from the file would reset
every caller's cache on each edit), and a caller whose key is rotated keeps
its cache. Only a KV connector that persists blocks across restarts
(LMCache, disk offload) loses its hits at a restart. In open mode (no keys)
the `user` field is the client's own claim, so there is nothing to isolate:
no salt, as with `--shared-prefix-cache`.

The file:

    [callers.chat]
    key = "sk-chat-..."
    weight = 4                   # share of service while backlogged (default 1)
    max_concurrency = 16         # generations in the engine at once
    [callers.batch]
    key = "sk-batch-..."
    max_queued = 200             # waiting requests beyond max_concurrency: 429 past it
    tokens_per_minute = 2000000  # prompt + generated tokens; 429 past it
    adapters = ["alpha", "beta"] # LoRA adapters it may use and see (absent: all)
    default_adapter = "alpha"    # what a request naming the base model runs on
    cache_group = "team-a"       # shares the engine's prefix cache with this group
    models = ["chat", "embed"]   # served models it may use and see (absent: all)
    background = true            # all its requests are background work (default false)
    tokens_per_day = 50000000    # budgets: prompt + generated tokens per UTC day, across
    engine_seconds_per_day = 3600.0  # models; engine seconds too; and per month:
    tokens_per_month = 1000000000    # tokens_per_month, engine_seconds_per_month

`adapters` and `default_adapter` name adapters given with --lora-modules (the
list may also name the base model, to allow it too); server/engines/lora.py rule 4 says
what a caller gets for the others: 404 for an adapter outside its list, 403 for
the base model when its list does not name it. `models` names served models
(with --models, server/engines/registry.py rule 2): one outside it, and its
adapters, is a 404 as for an unknown name. A name that is not configured
is a start-up (or reload) error. Fair share is per model: each model's
engine is its own resource with its own core, so a caller's share on one
model says nothing of its share on another.

The four budget keys (batching/budgets.py) are a caller's totals across
every model, per UTC day (from 00:00) and per calendar month (from the 1st):
past one, its requests get 429 `insufficient_quota` with Retry-After at the
reset, and its batches pause until then. A SIGHUP reload applies new budgets
and keeps what each caller has spent.

Caller names (and `cache_group` names) are 1-64 characters of letters,
digits, `_`, `-` and `.` (they become metric labels and log fields).

It imports no aiohttp and stands below what holds it: the settings
(`CallerTable`, read once at start), the app's state (the `CALLERS` key) and
the shell, whose middleware (server/http/middleware.py) reads the headers
and asks it who is asking.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import stat
import tomllib
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batching import DEFAULT_CALLER, Budget, CallerPolicy, Callers
from server.engines.lora import OPEN_ACCESS, AdapterAccess

__all__ = [
    "MAX_USER_NAMES",
    "OTHER_CALLER",
    "USER_LABEL",
    "CallerDirectory",
    "CallerTable",
    "CallersError",
    "bearer_token",
    "load_callers",
    "same_key",
    "world_readable",
]

OTHER_CALLER = "other"
DEFAULT_POLICY = CallerPolicy(DEFAULT_CALLER)
# Distinct `user` names tracked without a callers file. Each is a caller of its
# own (fair share, metrics series); 64 is far more than the teams sharing one
# workstation card, and small enough for a per-caller series set in Prometheus.
MAX_USER_NAMES = 64
# The metric label of every caller that a `user` field named (open mode): the
# name is the client's own string, so it never becomes a label of its own.
USER_LABEL = "user"

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_FIELDS = {
    "key",
    "weight",
    "max_concurrency",
    "max_queued",
    "tokens_per_minute",
    "adapters",
    "default_adapter",
    "cache_group",
    "models",
    "background",
    # A caller's budget (batching/budgets.py): whole tokens, and engine seconds.
    "tokens_per_day",
    "engine_seconds_per_day",
    "tokens_per_month",
    "engine_seconds_per_month",
}


class CallersError(ValueError):
    """A callers file that cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class CallerTable:
    """A loaded callers file: the core's policies and the keys that name callers."""

    policies: Callers
    keys: tuple[tuple[bytes, str], ...] = field(repr=False)  # (key, caller name)
    # Each caller's LoRA adapter rules (server/engines/lora.py rule 4); absent: no restriction.
    access: tuple[tuple[str, AdapterAccess], ...] = ()
    # Each caller's cache_group (it shares the prefix cache); absent: its own.
    groups: tuple[tuple[str, str], ...] = ()
    # Each caller's budget (batching/budgets.py); absent: none.
    budgets: tuple[tuple[str, Budget], ...] = ()

    def budget_table(self) -> dict[str, Budget]:
        return dict(self.budgets)

    def access_for(self, name: str) -> AdapterAccess:
        return next((a for n, a in self.access if n == name), OPEN_ACCESS)

    def group_for(self, name: str) -> str | None:
        return next((g for n, g in self.groups if n == name), None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.policies.policies)

    def identify(self, token: str) -> str | None:
        """The caller whose key `token` is, or None. Compares against every key."""
        given = token.encode()
        found: str | None = None
        for key, name in self.keys:
            if hmac.compare_digest(given, key) and found is None:
                found = name
        return found


def _int(where: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CallersError(f"{where} must be an integer >= {low}")
    return value


def _positive(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise CallersError(f"{where} must be a number > 0")
    return float(value)


class _Known:
    """The model names a callers file may give: the adapters, and the served
    models (the one base model with --model; every model with --models)."""

    def __init__(
        self, adapters: Collection[str], base: str | None, models: Collection[str] = ()
    ) -> None:
        self.adapters = frozenset(adapters)
        self.base = base
        self.models = frozenset(models) or frozenset({base} if base else ())

    def adapter(self, where: str, value: Any, *, base_too: bool = False) -> str:
        ok = self.adapters | (self.models if base_too else set())
        if not isinstance(value, str) or value not in ok:
            have = ", ".join(sorted(self.adapters)) or "none"
            raise CallersError(
                f"{where}: {value!r} is not a configured LoRA adapter (--lora-modules: {have})"
            )
        return value

    def model(self, where: str, value: Any) -> str:
        if not isinstance(value, str) or value not in self.models:
            have = ", ".join(sorted(self.models)) or "none"
            raise CallersError(f"{where}: {value!r} is not a served model ({have})")
        return value


def _access(where: str, spec: dict[str, Any], known: _Known) -> AdapterAccess:
    names = spec.get("adapters")
    allowed = None
    if names is not None:
        if not isinstance(names, list):
            raise CallersError(f"{where}.adapters must be a list of adapter names")
        allowed = frozenset(known.adapter(f"{where}.adapters", n, base_too=True) for n in names)
    default = spec.get("default_adapter")
    if default is not None:
        default = known.adapter(f"{where}.default_adapter", default)
        if allowed is not None and default not in allowed:
            raise CallersError(f"{where}.default_adapter {default!r} is not in its adapters")
    models = spec.get("models")
    if models is not None:
        if not isinstance(models, list):
            raise CallersError(f"{where}.models must be a list of served model names")
        models = frozenset(known.model(f"{where}.models", n) for n in models)
    return AdapterAccess(allowed, default, models)


def _group(where: str, spec: dict[str, Any]) -> str | None:
    group = spec.get("cache_group")
    if group is None:
        return None
    if not isinstance(group, str) or not _NAME.fullmatch(group):
        raise CallersError(
            f"{where}.cache_group must be a name: 1-64 letters, digits, '_', '-' or '.'"
        )
    return group


def _budget(where: str, spec: dict[str, Any]) -> Budget:
    def tokens(f: str) -> int | None:
        return _int(f"{where}.{f}", spec[f], 1) if f in spec else None

    def seconds(f: str) -> float | None:
        return _positive(f"{where}.{f}", spec[f]) if f in spec else None

    return Budget(
        tokens_per_day=tokens("tokens_per_day"),
        engine_seconds_per_day=seconds("engine_seconds_per_day"),
        tokens_per_month=tokens("tokens_per_month"),
        engine_seconds_per_month=seconds("engine_seconds_per_month"),
    )


def _caller(name: str, spec: Any) -> tuple[CallerPolicy, str]:
    where = f"callers.{name}"
    if not _NAME.fullmatch(name):
        raise CallersError(f"{where}: a name is 1-64 letters, digits, '_', '-' or '.'")
    if not isinstance(spec, dict):
        raise CallersError(f"{where} must be a table")
    unknown = set(spec) - _FIELDS
    if unknown:
        raise CallersError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    key = spec.get("key")
    if not isinstance(key, str) or not key.strip():
        raise CallersError(f"{where}.key must be a non-empty string")
    weight = _positive(f"{where}.weight", spec.get("weight", 1))
    limits = {
        f: _int(f"{where}.{f}", spec[f], low)
        for f, low in (("max_concurrency", 1), ("max_queued", 0), ("tokens_per_minute", 1))
        if f in spec
    }
    background = spec.get("background", False)
    if not isinstance(background, bool):
        raise CallersError(f"{where}.background must be true or false")
    try:
        policy = CallerPolicy(name, weight, **limits, background=background)
    except ValueError as exc:
        raise CallersError(str(exc)) from exc
    return policy, key.strip()


def parse_callers(
    text: str,
    *,
    adapters: Collection[str] = (),
    base: str | None = None,
    models: Collection[str] = (),
) -> CallerTable:
    """A callers file's text to a table; CallersError says what is wrong.

    `adapters` and `base`: the configured LoRA adapter names and the base
    model's name, which `adapters` and `default_adapter` may give; `models`:
    the served models' names with --models (`models` and `adapters` may name
    them; without, only `base`)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CallersError(f"not valid TOML: {exc}") from exc
    extra = set(doc) - {"callers"}
    if extra:
        raise CallersError(f"unknown top-level key(s) {', '.join(sorted(extra))}")
    table = doc.get("callers")
    if not isinstance(table, dict) or not table:
        raise CallersError("no callers: add at least one [callers.NAME] table")
    policies: list[CallerPolicy] = []
    keys: list[tuple[bytes, str]] = []
    access: list[tuple[str, AdapterAccess]] = []
    groups: list[tuple[str, str]] = []
    budgets: list[tuple[str, Budget]] = []
    seen: dict[str, str] = {}
    known = _Known(adapters, base, models)
    for name, spec in table.items():
        policy, key = _caller(name, spec)
        if key in seen:
            raise CallersError(f"callers.{name}.key is also the key of callers.{seen[key]}")
        seen[key] = name
        policies.append(policy)
        keys.append((key.encode(), name))
        rules = _access(f"callers.{name}", spec, known)
        if rules != OPEN_ACCESS:
            access.append((name, rules))
        if (group := _group(f"callers.{name}", spec)) is not None:
            groups.append((name, group))
        if (budget := _budget(f"callers.{name}", spec)).limited:
            budgets.append((name, budget))
    return CallerTable(
        Callers(tuple(policies)), tuple(keys), tuple(access), tuple(groups), tuple(budgets)
    )


def load_callers(
    path: Path,
    *,
    adapters: Collection[str] = (),
    base: str | None = None,
    models: Collection[str] = (),
) -> CallerTable:
    """Read and parse a callers file (blocking: call it on a thread once serving)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CallersError(f"callers file {path}: cannot read it: {exc}") from exc
    try:
        return parse_callers(text, adapters=adapters, base=base, models=models)
    except CallersError as exc:
        raise CallersError(f"callers file {path}: {exc}") from exc


def bearer_token(authorization: str) -> str:
    """The token of an `Authorization: Bearer ...` header, else ""."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def same_key(token: str, key: str | None) -> bool:
    """`token` is `key` (both non-empty), compared in constant time."""
    return bool(token and key) and hmac.compare_digest(token.encode(), str(key).encode())


def world_readable(path: Path) -> bool:
    """True when users other than the owner and group may read the file (its keys)."""
    try:
        return bool(path.stat().st_mode & stat.S_IROTH)
    except OSError:
        return False


class CallerDirectory:
    """The app's current way of naming callers (the table is swapped on SIGHUP)."""

    def __init__(
        self, table: CallerTable | None, api_key: str | None, *, shared_cache: bool = False
    ) -> None:
        self.table = table
        self._api_key = None if api_key is None else api_key.encode()
        self._users: set[str] = set()
        # The prefix cache's isolation (see the module docstring): off in open
        # mode and with --shared-prefix-cache. The secret lives as long as the
        # process, as the engine's cache does.
        self.isolated = not shared_cache and not self.open
        self._secret = secrets.token_bytes(32)
        self._salts: dict[str, str] = {}

    @property
    def open(self) -> bool:
        """No keys at all: anyone may call, and `user` names the caller."""
        return self.table is None and self._api_key is None

    def authenticate(self, authorization: str) -> str | None:
        """The caller named by an Authorization header; None means 401.

        Only for a directory that is not open.
        """
        token = bearer_token(authorization)
        return self.identify(token) if token else None

    def identify(self, token: str) -> str | None:
        """The caller whose key is `token` (a bearer token or an `x-api-key`); None: 401."""
        token = token.strip()
        if self.table is not None:
            return self.table.identify(token)
        assert self._api_key is not None
        return DEFAULT_CALLER if hmac.compare_digest(token.encode(), self._api_key) else None

    def policy(self, caller: str | None) -> CallerPolicy:
        """A caller's policy in the current table (SIGHUP swaps it); without a
        callers file, or for no caller, the default policy."""
        if self.table is None or caller is None:
            return DEFAULT_POLICY
        return self.table.policies.get(caller)

    def access(self, caller: str | None) -> AdapterAccess:
        """A caller's LoRA adapter rules (no callers file: no restriction)."""
        if self.table is None or caller is None:
            return OPEN_ACCESS
        return self.table.access_for(caller)

    def cache_salt(self, caller: str | None) -> str | None:
        """The prefix-cache salt of a caller's requests (vLLM's cache_salt), or
        None for the shared cache: its cache_group's, else its own name's."""
        if not self.isolated or caller is None:
            return None
        group = self.table.group_for(caller) if self.table is not None else None
        scope = f"group\0{group}" if group is not None else f"caller\0{caller}"
        salt = self._salts.get(scope)
        if salt is None:
            # 128 bits of an HMAC-SHA256, hex: within vLLM's 128 characters, and
            # none of the characters it forbids (@, /, backslash, NUL).
            digest = hmac.new(self._secret, scope.encode(), hashlib.sha256).hexdigest()
            salt = self._salts[scope] = digest[:32]
        return salt

    def label(self, caller: str) -> str:
        """A caller's metric label: its name when keys name callers (configured
        names only), else `default` or, for every `user` name, USER_LABEL."""
        return caller if not self.open or caller == DEFAULT_CALLER else USER_LABEL

    def from_user(self, user: str | None) -> str:
        """An open directory's caller for a request's `user` field (bounded)."""
        if not user:
            return DEFAULT_CALLER
        if user in self._users:
            return user
        if len(self._users) >= MAX_USER_NAMES or not _NAME.fullmatch(user):
            return OTHER_CALLER
        self._users.add(user)
        return user
