"""The models file (`sluice serve --models FILE`): which models one Sluice serves, read once.

Why this module exists: a workstation serves a chat model beside an embedding
model and a reranker, or two chat models of which one is loaded when asked
for (issue 30). One TOML file (the standard library's tomllib) says which; this
module reads it into plain values and says in one line what is wrong with it.
It knows no vLLM: each table's engine flags come out as the command line
`sluice serve` would take, and server/cli.py parses that with vLLM's own
argument definitions, so every engine flag works here as on the command line,
spelt the same. The file:

    memory-budget = "16GiB"       # optional: what the models may take together
                                  # (default: the card's memory; on CPU NUMA node 0's)

    [models.chat]                 # the name clients put in `model`
    model = "Qwen/Qwen3-14B"      # vLLM's --model: a path or hub id (absent: the
                                  # offline demo model, on a machine without a GPU)
    load = "start"                # "start" (default) or "on-demand"
    quantization = "fp8"          # any engine flag of `sluice serve`, without "--":
    max-model-len = 16384         #   a value, true/false for a switch, a list for
    gpu-memory-utilization = 0.45 #   several values, a table for a JSON one
    enable-prefix-caching = true

    [models.coder]
    model = "/srv/models/Qwen3-Coder-30B-A3B"
    load = "on-demand"            # started by its first request
    unload-after = "10m"          # unloaded after 10 idle minutes (default 5m; 0: never)
    gpu-memory-utilization = 0.45

Rules:

1. Keys are spelt as the flags (`max-model-len`); `max_model_len` is the same
   key, and giving both is an error. A key that is neither Sluice's (`load`,
   `unload-after`, `essential`) nor an engine flag is an error naming it, and so is a
   server-wide flag (`port`, `window-ms`: the command line's) and
   `served-model-name` (the table's name is the served name).
2. Values become arguments: a string or number `--key value`; `true` the
   switch, `false` its `--no-` form where the flag has one (else nothing: the
   switch is off); a list `--key a b`; a table one JSON argument (vLLM's
   `--hf-overrides`, `--compilation-config`). A list of tables (`lora-modules`
   in vLLM's JSON form) is one JSON argument per table.
3. `unload-after` is Ollama's keep_alive in seconds or a duration ("90s",
   "10m", "1h30m"), except that 0 means never (Ollama's 0 unloads at once);
   it applies to on-demand models only. Default: 5 minutes, Ollama's.
3a. `essential = true`: a model without which the server is of no use. When
   its engine dies past its restart budget (or cannot start again) the whole
   process exits 1, for systemd to restart (server/engines/restarts.py rule
   5). Default false: one model's failure leaves the others serving.
4. Names are 1-128 characters: letters, digits and `_ . - : / @ +`, starting
   with a letter or digit (a name becomes a metric label and a log field).
5. The file is read once, at start: a change is a restart (server/cli.py says why
   there is no reload on SIGHUP).
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.engines.registry import Load

__all__ = [
    "DEFAULT_UNLOAD_AFTER",
    "Flags",
    "ModelTable",
    "ModelsError",
    "ModelsFile",
    "load_models",
    "parse_duration",
    "parse_models",
    "parse_size",
]

# Ollama's default keep_alive: a model unloads after five idle minutes.
DEFAULT_UNLOAD_AFTER = 300.0

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@+\-]{0,127}")
_SLUICE_KEYS = frozenset({"load", "unload-after", "essential"})
_TOP_KEYS = frozenset({"memory-budget", "models"})
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class ModelsError(ValueError):
    """A models file that cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class ModelTable:
    """One `[models.NAME]` table: Sluice's keys, and its engine flags as argv."""

    name: str
    load: Load
    unload_after: float
    argv: tuple[str, ...]
    # Its engine's final failure stops the process (server/engines/restarts.py rule 5).
    essential: bool = False

    @property
    def where(self) -> str:
        return f"[models.{_quoted(self.name)}]"


@dataclass(frozen=True, slots=True)
class ModelsFile:
    tables: tuple[ModelTable, ...]
    memory_budget: int | None = None  # bytes; None: the device's total


@dataclass(frozen=True, slots=True)
class Flags:
    """What server/cli.py knows of `sluice serve`'s flags (names without "--")."""

    model: Callable[[str], bool]  # a flag a model table may give (an engine flag or one of
    # the per-model Sluice flags: parsers, thinking, LoRA modules)
    server: Callable[[str], bool]  # a server-wide flag (the command line's only)
    negatable: Callable[[str], bool]  # has a --no- form


def _quoted(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def parse_duration(where: str, value: Any) -> float:
    """Seconds from a number or a duration string ("90s", "10m", "1h30m"); >= 0."""
    if isinstance(value, bool):
        raise ModelsError(f'{where} must be seconds or a duration such as "10m", got {value}')
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and value and _DURATION.sub("", value.strip()) == "":
        seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION.findall(value.strip()))
    else:
        raise ModelsError(
            f'{where} must be seconds or a duration such as "90s", "10m", "1h30m", got {value!r}'
        )
    if not seconds >= 0 or seconds == float("inf"):
        raise ModelsError(f"{where} must be >= 0 (0: never), got {value!r}")
    return seconds


def parse_size(where: str, value: Any) -> int:
    """Bytes from an integer or a size string ("16GiB", "512 MiB", "2GB"); > 0."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value.strip())):
        size = int(float(m[1]) * _SIZE_UNITS[(m[2] or "B").lower()])
    else:
        raise ModelsError(f'{where} must be bytes or a size such as "16GiB", got {value!r}')
    if size <= 0:
        raise ModelsError(f"{where} must be > 0, got {value!r}")
    return size


def _normalized(where: str, table: Mapping[str, Any]) -> dict[str, Any]:
    """Rule 1: keys spelt with dashes; the same key twice is an error."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        k = key.replace("_", "-")
        if k in out:
            raise ModelsError(f"{where}: {k!r} is given twice ({key!r} and another spelling)")
        out[k] = value
    return out


def _scalar(where: str, value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise ModelsError(f"{where} must be a string, a number or a table, got {value!r}")


def _argv(where: str, key: str, value: Any, flags: Flags) -> list[str]:
    """Rule 2: one key's value as arguments."""
    flag = f"--{key}"
    if isinstance(value, bool):
        if value:
            return [flag]
        return [f"--no-{key}"] if flags.negatable(key) else []
    if isinstance(value, list):
        if not value:
            raise ModelsError(f"{where}.{key} is an empty list")
        return [flag, *(_scalar(f"{where}.{key}[{i}]", v) for i, v in enumerate(value))]
    if isinstance(value, dict | str | int | float):
        return [flag, _scalar(f"{where}.{key}", value)]
    raise ModelsError(f"{where}.{key}: a value TOML gives here cannot be a flag's ({value!r})")


def _table(name: str, spec: Any, flags: Flags) -> ModelTable:
    where = f"[models.{_quoted(name)}]"
    if not _NAME.fullmatch(name):
        raise ModelsError(
            f"{where}: a model name is 1-128 letters, digits and _ . - : / @ +, "
            "starting with a letter or digit"
        )
    if not isinstance(spec, dict):
        raise ModelsError(f"{where} must be a table")
    items = _normalized(where, spec)
    load_value = items.pop("load", Load.START.value)
    try:
        load = Load(load_value)
    except ValueError:
        raise ModelsError(
            f'{where}.load must be "start" or "on-demand", got {load_value!r}'
        ) from None
    unload_after = DEFAULT_UNLOAD_AFTER if load is Load.ON_DEMAND else 0.0
    if "unload-after" in items:
        if load is not Load.ON_DEMAND:
            raise ModelsError(
                f'{where}.unload-after applies to on-demand models (load = "on-demand"); '
                "a model loaded at start stays"
            )
        unload_after = parse_duration(f"{where}.unload-after", items.pop("unload-after"))
    essential = items.pop("essential", False)
    if not isinstance(essential, bool):
        raise ModelsError(f"{where}.essential must be true or false, got {essential!r}")
    argv: list[str] = []
    for key, value in items.items():
        if key == "served-model-name":
            raise ModelsError(f"{where}: served-model-name: the table's name is the served name")
        if not flags.model(key):
            why = (
                "a server-wide flag: give it on the command line"
                if flags.server(key)
                else "neither a key of the models file (load, unload-after, essential) nor "
                "an engine flag of `sluice serve`"
            )
            raise ModelsError(f"{where}: unknown key {key!r}: {why}")
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            argv += [f"--{key}", *(json.dumps(v) for v in value)]
        else:
            argv += _argv(where, key, value, flags)
    return ModelTable(name, load, unload_after, tuple(argv), essential=essential)


def parse_models(text: str, flags: Flags) -> ModelsFile:
    """A models file's text to its tables; ModelsError says what is wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ModelsError(f"not valid TOML: {exc}") from exc
    doc = _normalized("the file", doc)
    extra = set(doc) - _TOP_KEYS
    if extra:
        raise ModelsError(
            f"unknown top-level key(s) {', '.join(sorted(extra))} "
            "(memory-budget and [models.NAME] tables)"
        )
    models = doc.get("models")
    if not isinstance(models, dict) or not models:
        raise ModelsError("no models: add at least one [models.NAME] table")
    budget = doc.get("memory-budget")
    return ModelsFile(
        tuple(_table(name, spec, flags) for name, spec in models.items()),
        None if budget is None else parse_size("memory-budget", budget),
    )


def load_models(path: Path, flags: Flags) -> ModelsFile:
    """Read and parse a models file (blocking: at start only)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelsError(f"models file {path}: cannot read it: {exc}") from exc
    try:
        return parse_models(text, flags)
    except ModelsError as exc:
        raise ModelsError(f"models file {path}: {exc}") from exc
