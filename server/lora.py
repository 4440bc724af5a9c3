"""LoRA adapters: which fine-tunes this server runs, and which one a request means.

Why this module exists: one base model serves several LoRA fine-tunes (one per
team or task), and every API (chat, completions, Responses, Messages) must turn
the request's `model` into the same answer: the base weights, one adapter, or a
refusal in the API's own shape. That answer is made here and nowhere else
(`AdapterRegistry.resolve`, then `choose` for the caller's own rules); the engine
adapter (server/engine.py) is the one place that turns an `Adapter` into vLLM's
`LoRARequest`. Nothing here imports vLLM.

Rules:

1. An adapter is a frozen `Adapter` value: its name (what clients put in
   `model`), its directory, an int id (vLLM's `lora_int_id`: unique, >= 1, never
   reused while the process lives) and its parent, the base model's served name.
2. The registry is built once from the settings (`--lora-modules`, the names
   vLLM's `LoRAParserAction` parsed); `add` and `remove` exist for runtime
   loading, which keeps ids unique by counting on from the last one given.
3. `resolve(model)`: the base model's served name or its path is None (the base
   weights); a registered adapter's name is that adapter; anything else is a 404
   `model_not_found`, the body vLLM's server sends for an unknown model.
4. A caller's own rules (`AdapterAccess`, from the callers file, server/callers.py):
   `adapters` absent means every adapter and the base; present, it names the
   adapters the caller may use and see. An adapter outside it is invisible: a 404
   exactly as for an unknown name, so one team cannot probe another's adapter
   names. The base model is visible to everyone (it is every adapter's parent) but
   a caller with a list may use it only if the list names it: otherwise a 403
   `model_not_allowed`. `default_adapter` (which must be in the list) is what a
   request naming the base model runs on instead.
5. `check_adapter_dir` is the start-up check of a static adapter's directory
   (and later, of a runtime load): PEFT's `adapter_config.json` present and
   readable, a LoRA, its rank `r` within `--max-lora-rank`. The message names
   the cause in one line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.errors import SluiceError

__all__ = [
    "OPEN_ACCESS",
    "Adapter",
    "AdapterAccess",
    "AdapterRegistry",
    "adapter_rank",
    "check_adapter_dir",
    "choose",
    "model_not_found",
]

# PEFT's file names: the config and the weights (`save_pretrained` writes both).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True, slots=True)
class Adapter:
    """One LoRA adapter the engine may run (rule 1)."""

    name: str
    path: str
    id: int
    parent: str


@dataclass(frozen=True, slots=True)
class AdapterAccess:
    """One caller's adapter rules (rule 4); the default is no restriction."""

    adapters: frozenset[str] | None = None  # None: every adapter and the base model
    default_adapter: str | None = None  # what a request naming the base model runs on

    def sees(self, name: str) -> bool:
        return self.adapters is None or name in self.adapters


OPEN_ACCESS = AdapterAccess()


def model_not_found(model: str) -> SluiceError:
    """The 404 for a model (or adapter) this caller cannot see, as vLLM words it."""
    return SluiceError(
        f"The model `{model}` does not exist.",
        status=404,
        param="model",
        code="model_not_found",
    )


class AdapterRegistry:
    """The base model's names and the adapters loaded on it (rules 1-3)."""

    def __init__(self, base: str, adapters: Iterable[Adapter] = (), *, base_path: str = "") -> None:
        self.base = base
        # A request may name the base model by its served name or its path, as today.
        self._base_names = frozenset(n for n in (base, base_path) if n)
        self._by_name: dict[str, Adapter] = {}
        self._last_id = 0
        for a in adapters:
            self.add(a)

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        """Every adapter, in the order they were added (the listing's order)."""
        return tuple(self._by_name.values())

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._by_name)

    def is_base(self, model: str) -> bool:
        return model in self._base_names

    def get(self, name: str) -> Adapter | None:
        return self._by_name.get(name)

    def next_id(self) -> int:
        """The id the next adapter gets (rule 2: never one given before)."""
        return self._last_id + 1

    def add(self, adapter: Adapter) -> None:
        if self.is_base(adapter.name):
            raise ValueError(f"LoRA adapter {adapter.name!r} has the base model's name")
        if adapter.name in self._by_name:
            raise ValueError(f"LoRA adapter {adapter.name!r} is given twice")
        if adapter.id <= self._last_id:
            raise ValueError(f"LoRA adapter {adapter.name!r}: id {adapter.id} was given before")
        self._by_name[adapter.name] = adapter
        self._last_id = adapter.id

    def remove(self, name: str) -> Adapter | None:
        return self._by_name.pop(name, None)

    def resolve(self, model: str) -> Adapter | None:
        """The adapter `model` names, None for the base weights; else a 404 (rule 3)."""
        if model in self._base_names:
            return None
        adapter = self._by_name.get(model)
        if adapter is None:
            raise model_not_found(model)
        return adapter

    def visible(self, access: AdapterAccess) -> tuple[Adapter, ...]:
        """The adapters a caller may see and use (its `/v1/models`)."""
        return tuple(a for a in self._by_name.values() if access.sees(a.name))

    @classmethod
    def from_modules(
        cls, base: str, modules: Sequence[Any], *, base_path: str = ""
    ) -> AdapterRegistry:
        """From vLLM's parsed `--lora-modules` (LoRAModulePath: name, path,
        base_model_name), ids 1, 2, ... in the order given. A module's
        base_model_name is kept as its parent only when it names the base, as
        vLLM's server does; otherwise the parent is the base model."""
        registry = cls(base, base_path=base_path)
        for m in modules:
            named = m.base_model_name
            parent = named if named and registry.is_base(named) else base
            registry.add(Adapter(str(m.name), str(m.path), registry.next_id(), parent))
        return registry


def choose(registry: AdapterRegistry, access: AdapterAccess, model: str) -> Adapter | None:
    """The adapter a caller's request for `model` runs on (rules 3-4), or a refusal."""
    if registry.is_base(model):
        if access.default_adapter is not None:
            adapter = registry.get(access.default_adapter)
            if adapter is None:  # unloaded since the callers file was read
                raise model_not_found(access.default_adapter)
            return adapter
        if access.adapters is not None and registry.base not in access.adapters:
            raise SluiceError(
                f"This key may not use the base model `{model}`; "
                f"name one of its adapters: {', '.join(sorted(access.adapters))}.",
                status=403,
                param="model",
                code="model_not_allowed",
            )
        return None
    if not access.sees(model):
        raise model_not_found(model)
    return registry.resolve(model)


def adapter_rank(path: Path) -> int:
    """A PEFT LoRA directory's rank `r`; ValueError naming the cause (rule 5)."""
    config_file = path / ADAPTER_CONFIG
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory")
    try:
        config = json.loads(config_file.read_bytes())
    except FileNotFoundError:
        raise ValueError(f"{path} has no {ADAPTER_CONFIG}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file}: cannot read it: {exc}") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"{config_file}: not a LoRA adapter (peft_type must be LORA)")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{config_file}: r must be an integer >= 1, got {rank!r}")
    if not any((path / w).is_file() for w in ADAPTER_WEIGHTS):
        raise ValueError(f"{path} has no {ADAPTER_WEIGHTS[0]}")
    return rank


def check_adapter_dir(name: str, path: str, max_rank: int) -> None:
    """Rule 5 for one adapter; ValueError with a one-line message naming it."""
    try:
        rank = adapter_rank(Path(path))
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {name!r}: {exc}") from None
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
