"""The demo LoRA adapter's files (server/engines/demo/lora_adapter.py): deterministic bytes
per seed and rank, PEFT's layout, and what the start-up check accepts."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from server.__main__ import main
from server.engines.demo.lora_adapter import write_demo_adapter
from server.engines.demo.model import ARCHITECTURE
from server.engines.lora import adapter_rank, check_adapter_dir

pytestmark = pytest.mark.timeout(30)

FILES = ("adapter_config.json", "adapter_model.safetensors")


def digests(path: Path) -> dict[str, str]:
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in FILES}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    one = digests(write_demo_adapter(tmp_path / "a", seed=1))
    assert digests(write_demo_adapter(tmp_path / "b", seed=1)) == one
    two = digests(write_demo_adapter(tmp_path / "c", seed=2))
    assert two["adapter_config.json"] == one["adapter_config.json"]
    assert two["adapter_model.safetensors"] != one["adapter_model.safetensors"]


def test_the_bytes_are_pinned(tmp_path: Path) -> None:
    # Same on every machine: a change of recipe shows here, not as a flaky
    # output difference in the integration tests.
    got = digests(write_demo_adapter(tmp_path / "a", seed=1))
    assert got == PINNED


PINNED = {
    "adapter_config.json": "c2b977967d45fdf347bb54439d159c613ba78f279d1a9a2a4309143568d0e85e",
    "adapter_model.safetensors": "bcdf8d19edce3a26d1e34d88c1f003e3bf4fe3c393fa31e756bf6803357f1445",
}


def header(path: Path) -> dict[str, dict[str, object]]:
    """A safetensors file's header (its tensors' dtypes and shapes), read as
    the format defines it: a little-endian u64 length, then JSON."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    head: dict[str, dict[str, object]] = json.loads(raw[8 : 8 + size])
    head.pop("__metadata__", None)
    return head


def test_peft_layout_for_the_demo_model(tmp_path: Path) -> None:
    path = write_demo_adapter(tmp_path / "a", seed=3, rank=4)
    tensors = header(path / "adapter_model.safetensors")
    a = ARCHITECTURE
    hidden, hd = a["hidden_size"], a["head_dim"]
    assert len(tensors) == a["num_hidden_layers"] * 4
    p = "base_model.model.model.layers.1.self_attn."
    assert tensors[p + "q_proj.lora_A.weight"]["shape"] == [4, hidden]
    assert tensors[p + "q_proj.lora_B.weight"]["shape"] == [a["num_attention_heads"] * hd, 4]
    assert tensors[p + "v_proj.lora_B.weight"]["shape"] == [a["num_key_value_heads"] * hd, 4]
    assert {t["dtype"] for t in tensors.values()} == {"BF16"}
    assert adapter_rank(path) == 4
    check_adapter_dir("a", str(path), 16)


def test_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-demo-adapter", str(tmp_path / "x"), "--seed", "1", "--rank", "8"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "x")
    assert digests(tmp_path / "x") == digests(write_demo_adapter(tmp_path / "y", seed=1))
    with pytest.raises(SystemExit) as info:
        main(["make-demo-adapter", str(tmp_path / "z"), "--rank", "0"])
    assert info.value.code == 2


def test_base_names_the_model_it_is_for(tmp_path: Path) -> None:
    """--base NAME goes into base_model_name_or_path; the default is the name
    `sluice serve` serves the demo model as (server/cli.py)."""
    from server.cli import DEMO_MODEL_NAME

    assert main(["make-demo-adapter", str(tmp_path / "d")]) == 0
    config = json.loads((tmp_path / "d" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == DEMO_MODEL_NAME
    assert main(["make-demo-adapter", str(tmp_path / "p"), "--base", "/srv/models/demo"]) == 0
    config = json.loads((tmp_path / "p" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "/srv/models/demo"
