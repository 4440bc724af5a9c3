"""LoRA adapters: which fine-tunes this server runs, and which one a request means.

Why this module exists: one base model serves several LoRA fine-tunes (one per
team or task), and every API (chat, completions, Responses, Messages) must turn
the request's `model` into the same answer: the base weights, one adapter, or a
refusal in the API's own shape. That answer is made here and nowhere else
(`AdapterRegistry.resolve`, then `choose` for the caller's own rules); the engine
adapter (server/engines/vllm_adapter.py) is the one place that turns an `Adapter` into vLLM's
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
6. A runtime load (`POST /v1/load_lora_adapter`, server/api/lora_admin/endpoint.py) takes
   only a directory under `--lora-root` once symlinks and `..` are resolved
   (`under_root`: a path outside is a 403, so the admin key cannot read the
   rest of the disk through the engine), and so must every file in it that
   Sluice or vLLM reads (`ADAPTER_FILES`: a config or weights linked to a file
   elsewhere is a 403 too); a path the OS refuses (a NUL byte, a name too long)
   is a 400. It is checked before vLLM sees it: rule 5, then `check_base`:
   PEFT's `base_model_name_or_path` is compared with the served model's names
   (its last path part, case aside, so a hub id `Qwen/Qwen3-14B` fits a local
   `/srv/models/Qwen3-14B`), but a mismatch is only a warning: names say
   little (`Qwen/Qwen3-14B` is served as `/srv/models/qwen3-14b-fp8` or
   `...-AWQ`, the demo model from its directory), and vLLM loads such
   adapters. Rule 7's shapes decide whether an adapter fits.
7. `check_shapes`: every LoRA tensor in the safetensors header (a few KB read,
   no weights) fits the base model (`ModelShapes`, from its config): the
   layer exists, A's input width and B's output height are the projection's.
   vLLM itself finds a misfit only when it copies the weights into its slots.
8. Files are read as regular files only, opened without blocking (a FIFO in
   the config's place would hang the thread) and within a bound
   (`MAX_CONFIG_BYTES`, the safetensors header's `_MAX_HEADER`), so a config
   that is `/dev/zero` or a gigabyte costs nothing.
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from server.errors import SluiceError

__all__ = [
    "OPEN_ACCESS",
    "Adapter",
    "AdapterAccess",
    "AdapterRegistry",
    "ModelShapes",
    "adapter_rank",
    "check_adapter_dir",
    "check_base",
    "check_shapes",
    "choose",
    "model_not_found",
    "read_config",
    "under_root",
]

# PEFT's file names: the config and the weights (`save_pretrained` writes both),
# as vLLM 0.32 reads them (vllm/lora/peft_helper.py, lora_model.py: safetensors
# first, then .bin or .pt).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
# Every file of an adapter directory that Sluice or vLLM reads (rule 6).
ADAPTER_FILES = (ADAPTER_CONFIG, *ADAPTER_WEIGHTS)
# A PEFT adapter_config.json is about 1 KB (long target_modules lists: tens of
# KB); anything larger is not one (rule 8).
MAX_CONFIG_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Adapter:
    """One LoRA adapter the engine may run (rule 1)."""

    name: str
    path: str
    id: int
    parent: str


@dataclass(frozen=True, slots=True)
class AdapterAccess:
    """One caller's adapter rules (rule 4), and the served models it may use
    (server/engines/registry.py rule 2); the default is no restriction."""

    adapters: frozenset[str] | None = None  # None: every adapter and the base model
    default_adapter: str | None = None  # what a request naming the base model runs on
    models: frozenset[str] | None = None  # served models it may see; None: every one

    def sees(self, name: str) -> bool:
        return self.adapters is None or name in self.adapters

    def sees_model(self, name: str) -> bool:
        return self.models is None or name in self.models


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
    """A PEFT LoRA directory's rank `r`; ValueError naming the cause (rule 5),
    also for what the OS refuses (a path too long, no permission)."""
    try:
        if not path.is_dir():
            raise ValueError(f"{path} is not a directory")
        config = read_config(path)
        if not any((path / w).is_file() for w in ADAPTER_WEIGHTS):
            raise ValueError(f"{path} has no {ADAPTER_WEIGHTS[0]}")
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    config_file = path / ADAPTER_CONFIG
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"{config_file}: not a LoRA adapter (peft_type must be LORA)")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{config_file}: r must be an integer >= 1, got {rank!r}")
    return rank


def _open_regular(file: Path) -> BinaryIO:
    """`file` opened for reading if it is a regular file (rule 8): opened
    without blocking, then checked, so a FIFO swapped in cannot hang the read."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{file} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_config(path: Path) -> dict[str, Any]:
    """The directory's adapter_config.json as an object, read within
    MAX_CONFIG_BYTES (rule 8); ValueError naming the cause (OSError passes)."""
    file = path / ADAPTER_CONFIG
    try:
        with _open_regular(file) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"{path} has no {ADAPTER_CONFIG}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{file} is larger than {MAX_CONFIG_BYTES} bytes: not a PEFT config")
    try:
        config = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{file}: cannot read it: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a LoRA adapter (peft_type must be LORA)")
    return config


def check_adapter_dir(name: str, path: str, max_rank: int) -> None:
    """Rule 5 for one adapter; ValueError with a one-line message naming it."""
    try:
        rank = adapter_rank(Path(path))
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {name!r}: {exc}") from None
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")


# -- runtime loading (rules 6-8) ---------------------------------------------


def _outside(path: str) -> SluiceError:
    return SluiceError(
        f"lora_path {path!r} is outside --lora-root",
        status=403,
        param="lora_path",
        code="path_not_allowed",
    )


def under_root(root: Path, path: str) -> Path:
    """`path` (relative ones are taken from `root`) resolved, if it and every
    adapter file in it (`ADAPTER_FILES`) lie under `root` (resolved once at
    start-up); else a 403 (rule 6). Blocking (it reads the file system);
    OSError and ValueError (a NUL byte, a name too long) pass to the caller."""
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root):
        raise _outside(path)
    for name in ADAPTER_FILES:
        file = resolved / name
        if os.path.lexists(file) and not file.resolve().is_relative_to(root):
            raise _outside(f"{path}/{name}")
    return resolved


def check_base(path: Path, base_names: Iterable[str]) -> str | None:
    """Rule 6: the base model the adapter's `base_model_name_or_path` names when
    that is not one of the served model's names (after `adapter_rank` accepted
    the directory): the caller warns, it does not refuse. None when it fits or
    names none (PEFT leaves it out when the base was built in memory)."""
    named = read_config(path).get("base_model_name_or_path")
    if not named or _tail(str(named)) in {_tail(n) for n in base_names if n}:
        return None
    return str(named)


def _tail(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].casefold()


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """What a LoRA must fit: the base model's layer count and projection sizes
    (a Llama/Qwen-style decoder's config.json fields)."""

    layers: int
    hidden: int
    q_out: int  # num_attention_heads x head_dim
    kv_out: int  # num_key_value_heads x head_dim
    intermediate: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShapes | None:
        """From a Hugging Face config (vLLM's `hf_config`); None when it lacks a field."""
        get = functools.partial(getattr, config)
        try:
            hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
            head_dim = int(get("head_dim", None) or hidden // heads)
            kv = int(get("num_key_value_heads", None) or heads)
            return cls(
                int(get("num_hidden_layers")),
                hidden,
                heads * head_dim,
                kv * head_dim,
                int(get("intermediate_size")),
            )
        except (AttributeError, TypeError, ValueError):
            return None

    def linear(self, module: str) -> tuple[int, int] | None:
        """A projection's (in, out) features; None for a module not checked."""
        h, q, kv, i = self.hidden, self.q_out, self.kv_out, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }.get(module)


# PEFT's tensor names: ...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.weight]
_LORA_TENSOR = re.compile(r"\.layers\.(\d+)\.(?:.*\.)?(\w+)\.lora_([AB])(?:\.weight)?$")
# A safetensors header larger than this is not a LoRA's (the demo adapter's is
# 2 KB; thousands of tensors stay well under 1 MB).
_MAX_HEADER = 16 * 2**20


def _safetensors_shapes(file: Path) -> dict[str, list[int]]:
    with _open_regular(file) as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if not 0 < size <= _MAX_HEADER:
            raise ValueError(f"{file}: not a safetensors file")
        try:
            header = json.loads(f.read(size))
        except ValueError:
            raise ValueError(f"{file}: not a safetensors file") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: not a safetensors file")
    return {
        k: list(v.get("shape", []))
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict)
    }


def check_shapes(path: Path, shapes: ModelShapes) -> None:
    """Rule 7 for a directory `adapter_rank` accepted; ValueError naming the
    first tensor that does not fit. Only safetensors weights are read (a
    pickled adapter_model.bin cannot be read cheaply; vLLM checks it)."""
    file = path / ADAPTER_WEIGHTS[0]
    if not file.is_file():
        return
    for name, shape in _safetensors_shapes(file).items():
        m = _LORA_TENSOR.search(name)
        if m is None:
            continue
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if layer >= shapes.layers:
            raise ValueError(
                f"{file.name}: {name} is for layer {layer}; the base model has {shapes.layers}"
            )
        features = shapes.linear(module)
        if features is None or len(shape) != 2:
            continue
        # A is r x in, B is out x r.
        want, got = (features[0], shape[1]) if half == "A" else (features[1], shape[0])
        if got != want:
            raise ValueError(
                f"{file.name}: {name} has shape {shape}, which does not fit the base "
                f"model's {module} ({features[0]} in, {features[1]} out)"
            )
