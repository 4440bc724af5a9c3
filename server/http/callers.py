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

`adapters` and `default_adapter` name adapters given with --lora-modules (the
list may also name the base model, to allow it too); server/engines/lora.py rule 4 says
what a caller gets for the others: 404 for an adapter outside its list, 403 for
the base model when its list does not name it. A name that is not configured
is a start-up (or reload) error.

Caller names are 1-64 characters of letters, digits, `_`, `-` and `.` (they
become metric labels and log fields).
"""

from __future__ import annotations

import hmac
import re
import stat
import tomllib
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batching import DEFAULT_CALLER, CallerPolicy, Callers
from server.engines.lora import OPEN_ACCESS, AdapterAccess

__all__ = [
    "MAX_USER_NAMES",
    "OTHER_CALLER",
    "CallerDirectory",
    "CallerTable",
    "CallersError",
    "load_callers",
    "world_readable",
]

OTHER_CALLER = "other"
# Distinct `user` names tracked without a callers file. Each is a caller of its
# own (fair share, metrics series); 64 is far more than the teams sharing one
# workstation card, and small enough for a per-caller series set in Prometheus.
MAX_USER_NAMES = 64

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_FIELDS = {
    "key",
    "weight",
    "max_concurrency",
    "max_queued",
    "tokens_per_minute",
    "adapters",
    "default_adapter",
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

    def access_for(self, name: str) -> AdapterAccess:
        return next((a for n, a in self.access if n == name), OPEN_ACCESS)

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


class _Known:
    """The model names a callers file may give: the adapters and the base."""

    def __init__(self, adapters: Collection[str], base: str | None) -> None:
        self.adapters = frozenset(adapters)
        self.base = base

    def adapter(self, where: str, value: Any, *, base_too: bool = False) -> str:
        ok = self.adapters | ({self.base} if base_too and self.base else set())
        if not isinstance(value, str) or value not in ok:
            have = ", ".join(sorted(self.adapters)) or "none"
            raise CallersError(
                f"{where}: {value!r} is not a configured LoRA adapter (--lora-modules: {have})"
            )
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
    return AdapterAccess(allowed, default)


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
    weight = spec.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise CallersError(f"{where}.weight must be a number > 0")
    limits = {
        f: _int(f"{where}.{f}", spec[f], low)
        for f, low in (("max_concurrency", 1), ("max_queued", 0), ("tokens_per_minute", 1))
        if f in spec
    }
    try:
        policy = CallerPolicy(name, float(weight), **limits)
    except ValueError as exc:
        raise CallersError(str(exc)) from exc
    return policy, key.strip()


def parse_callers(
    text: str, *, adapters: Collection[str] = (), base: str | None = None
) -> CallerTable:
    """A callers file's text to a table; CallersError says what is wrong.

    `adapters` and `base`: the configured LoRA adapter names and the base
    model's name, which `adapters` and `default_adapter` may give."""
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
    seen: dict[str, str] = {}
    known = _Known(adapters, base)
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
    return CallerTable(Callers(tuple(policies)), tuple(keys), tuple(access))


def load_callers(
    path: Path, *, adapters: Collection[str] = (), base: str | None = None
) -> CallerTable:
    """Read and parse a callers file (blocking: call it on a thread once serving)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CallersError(f"callers file {path}: cannot read it: {exc}") from exc
    try:
        return parse_callers(text, adapters=adapters, base=base)
    except CallersError as exc:
        raise CallersError(f"callers file {path}: {exc}") from exc


def world_readable(path: Path) -> bool:
    """True when users other than the owner and group may read the file (its keys)."""
    try:
        return bool(path.stat().st_mode & stat.S_IROTH)
    except OSError:
        return False


class CallerDirectory:
    """The app's current way of naming callers (the table is swapped on SIGHUP)."""

    def __init__(self, table: CallerTable | None, api_key: str | None) -> None:
        self.table = table
        self._api_key = None if api_key is None else api_key.encode()
        self._users: set[str] = set()

    @property
    def open(self) -> bool:
        """No keys at all: anyone may call, and `user` names the caller."""
        return self.table is None and self._api_key is None

    def authenticate(self, authorization: str) -> str | None:
        """The caller named by an Authorization header; None means 401.

        Only for a directory that is not open.
        """
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.identify(token)

    def identify(self, token: str) -> str | None:
        """The caller whose key is `token` (a bearer token or an `x-api-key`); None: 401."""
        token = token.strip()
        if self.table is not None:
            return self.table.identify(token)
        assert self._api_key is not None
        return DEFAULT_CALLER if hmac.compare_digest(token.encode(), self._api_key) else None

    def access(self, caller: str | None) -> AdapterAccess:
        """A caller's LoRA adapter rules (no callers file: no restriction)."""
        if self.table is None or caller is None:
            return OPEN_ACCESS
        return self.table.access_for(caller)

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
