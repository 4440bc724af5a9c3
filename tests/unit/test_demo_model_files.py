"""Fast checks of the demo model's files, without vLLM or torch.

The engine-level proof (vLLM loads it and generates) is in
tests/integration/test_demo_model.py; here we check what can be checked in well
under a second per test: determinism, the atomic/lazy build, that the config,
tokenizer and weights agree with each other, and the chat template's output.
"""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from server.engines.demo import model as demo_model

tokenizers = pytest.importorskip("tokenizers")
jinja2_sandbox = pytest.importorskip("jinja2.sandbox")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_model.build_demo_model(tmp_path_factory.mktemp("demo") / "model")


def _read_json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


# ------------------------------------------------------------ determinism


def test_two_builds_are_byte_identical(tmp_path: Path) -> None:
    a = demo_model.build_demo_model(tmp_path / "a")
    b = demo_model.build_demo_model(tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert set(demo_model.MODEL_FILES) <= set(names)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_files_carry_no_timestamps_or_versions(built: Path) -> None:
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        text = (built / name).read_text()
        assert "transformers_version" not in text
        assert "_commit_hash" not in text


# ------------------------------------------------------------ lazy, atomic build


def test_complete_model_is_not_rebuilt(tmp_path: Path) -> None:
    out = demo_model.build_demo_model(tmp_path / "m")
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert demo_model.build_demo_model(out) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


@pytest.mark.parametrize("damage", ["delete", "truncate", "manifest"])
def test_incomplete_model_is_rebuilt(tmp_path: Path, damage: str) -> None:
    out = demo_model.build_demo_model(tmp_path / "m")
    good = (out / "model.safetensors").read_bytes()
    if damage == "delete":
        (out / "tokenizer.json").unlink()
    elif damage == "truncate":
        (out / "model.safetensors").write_bytes(good[:1000])
    else:
        (out / "sluice-demo-manifest.json").write_text("{not json")
    assert not demo_model.is_complete(out)
    demo_model.build_demo_model(out)
    assert demo_model.is_complete(out)
    assert (out / "model.safetensors").read_bytes() == good


def test_build_leaves_no_temporary_directories(tmp_path: Path) -> None:
    demo_model.build_demo_model(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{}")
    demo_model.build_demo_model(tmp_path / "m")
    # The builders' lock file stays (unlinking it would let a waiter and a
    # newcomer hold two different locks); no directory but the model does.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_a_builder_that_looked_too_early_keeps_the_finished_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two test workers built the model at once: the second had looked (no model
    # yet) before the first renamed its copy into place, then moved that copy
    # aside as stale while the first one's engine loaded it (vLLM then read the
    # vanished path as a hub repo id). A builder re-checks under the lock.
    out = demo_model.build_demo_model(tmp_path / "m")
    inode = out.stat().st_ino
    real_is_complete = demo_model.is_complete
    early_looks = [False]  # the look taken before the other builder finished

    def is_complete(model_dir: Path, *, reranker: bool = False) -> bool:
        if early_looks:
            return early_looks.pop()
        return real_is_complete(model_dir, reranker=reranker)

    writes: list[Path] = []
    monkeypatch.setattr(demo_model, "is_complete", is_complete)
    monkeypatch.setattr(demo_model, "write_demo_model", lambda dest, **_: writes.append(dest))
    assert demo_model.build_demo_model(out) == out
    assert writes == []
    assert out.stat().st_ino == inode


def test_half_written_directory_is_not_complete(tmp_path: Path) -> None:
    # What a crash inside write_demo_model would leave if it wrote in place:
    # every model file present, no manifest yet.
    half = tmp_path / "half"
    half.mkdir()
    demo_model.write_demo_model(half)
    (half / "sluice-demo-manifest.json").unlink()
    assert not demo_model.is_complete(half)


# ------------------------------------------------------------ cache paths


def test_default_cache_root_follows_xdg() -> None:
    assert demo_model.default_cache_root({"XDG_CACHE_HOME": "/x/c", "HOME": "/h"}) == Path("/x/c")
    # Relative XDG values are invalid per the spec and ignored.
    assert demo_model.default_cache_root({"XDG_CACHE_HOME": "rel", "HOME": "/h"}) == Path(
        "/h/.cache"
    )
    assert demo_model.default_cache_root({"HOME": "/h"}) == Path("/h/.cache")


def test_default_demo_dir_is_keyed_by_version_and_recipe() -> None:
    path = demo_model.default_demo_dir(Path("/c"))
    assert path.parent == Path("/c/sluice")
    assert path.name == (
        f"demo-model-v{demo_model.DEMO_MODEL_VERSION}-{demo_model.recipe_digest()[:12]}"
    )


# ------------------------------------------------------------ config and weights


def test_config_is_a_small_qwen3(built: Path) -> None:
    cfg = _read_json(built / "config.json")
    assert cfg["model_type"] == "qwen3"
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] >= 4096
    kv_bytes_per_token = (
        cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    )
    assert kv_bytes_per_token == 1024  # DESIGN.md's "1 KiB per token"


def test_weights_match_config_and_hf_names(built: Path) -> None:
    cfg = _read_json(built / "config.json")
    header, data_start = _safetensors_header(built / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    assert data_start % 8 == 0
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    assert header["model.embed_tokens.weight"]["shape"] == [cfg["vocab_size"], h]
    assert header["model.layers.1.self_attn.k_proj.weight"]["shape"] == [
        cfg["num_key_value_heads"] * hd,
        h,
    ]
    assert "lm_head.weight" not in header  # tied
    assert len(header) == 2 + 11 * cfg["num_hidden_layers"]
    # Tensors tile the data section exactly, all bf16.
    spans = sorted(tuple(t["data_offsets"]) for t in header.values())
    assert spans[0][0] == 0
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert data_start + spans[-1][1] == (built / "model.safetensors").stat().st_size
    for name, t in header.items():
        n = 1
        for dim in t["shape"]:
            n *= dim
        assert t["dtype"] == "BF16"
        assert t["data_offsets"][1] - t["data_offsets"][0] == 2 * n, name


def _tensor(path: Path, name: str) -> bytes:
    header, start = _safetensors_header(path)
    a, b = header[name]["data_offsets"]
    with path.open("rb") as f:
        f.seek(start + a)
        return f.read(b - a)


def test_the_reranker_sibling_is_the_backbone_with_a_one_label_head(
    built: Path, tmp_path: Path
) -> None:
    rr = demo_model.build_demo_model(tmp_path / "reranker", reranker=True)
    cfg = _read_json(rr / "config.json")
    assert cfg["architectures"] == ["Qwen3ForSequenceClassification"]
    assert cfg["id2label"] == {"0": "LABEL_0"}  # one label: vLLM's score API
    header, _ = _safetensors_header(rr / "model.safetensors")
    chat, _ = _safetensors_header(built / "model.safetensors")
    assert header["score.weight"]["shape"] == [1, cfg["hidden_size"]]
    assert set(header) - set(chat) == {"score.weight"}
    # The same backbone, byte for byte; the same tokenizer.
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
        assert _tensor(rr / "model.safetensors", name) == _tensor(built / "model.safetensors", name)
    assert (rr / "tokenizer.json").read_bytes() == (built / "tokenizer.json").read_bytes()
    # Each is complete as itself only: asking for the other kind rebuilds.
    assert demo_model.is_complete(rr, reranker=True) and not demo_model.is_complete(rr)
    assert not demo_model.is_complete(built, reranker=True)
    assert demo_model.default_demo_dir(tmp_path, reranker=True) != demo_model.default_demo_dir(
        tmp_path
    )


def test_bf16_rounding_is_nearest_even() -> None:
    import numpy as np

    values = np.array([1.0, -2.0, 0.02, 1.0 + 2**-8, 1.0 + 3 * 2**-8], dtype=np.float32)
    bits = demo_model.to_bf16(values)
    # 1+2^-8 is a tie between 1.0 and 1+2^-7: rounds to the even one (1.0);
    # 1+3*2^-8 is a tie between 1+2^-7 and 1+2^-6: rounds to 1+2^-6.
    assert bits.tolist() == [0x3F80, 0xC000, 0x3CA4, 0x3F80, 0x3F82]


# ------------------------------------------------------------ tokenizer


def test_tokenizer_matches_config(built: Path) -> None:
    cfg = _read_json(built / "config.json")
    gen = _read_json(built / "generation_config.json")
    tok_cfg = _read_json(built / "tokenizer_config.json")
    tok = tokenizers.Tokenizer.from_file(str(built / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == cfg["vocab_size"]
    im_end = tok.token_to_id("<|im_end|>")
    eot = tok.token_to_id("<|endoftext|>")
    assert cfg["eos_token_id"] == im_end
    assert gen["eos_token_id"] == [im_end, eot]
    assert gen["pad_token_id"] == eot
    assert tok_cfg["eos_token"] == "<|im_end|>"
    assert tok_cfg["pad_token"] == "<|endoftext|>"
    for text, special in demo_model.ADDED_TOKENS:
        entry = tok_cfg["added_tokens_decoder"][str(tok.token_to_id(text))]
        assert entry["content"] == text
        assert entry["special"] is special


def test_tokenizer_round_trips_any_text(built: Path) -> None:
    tok = tokenizers.Tokenizer.from_file(str(built / "tokenizer.json"))
    text = "Hello, world! 12345 naïve café 中文 🙂 \x00\t\n  tabs\r\n"
    assert tok.decode(tok.encode(text).ids) == text
    # Common words of the corpus are single tokens, as in a real tokenizer.
    assert len(tok.encode(" the").ids) == 1


def test_think_tokens_are_added_but_not_special(built: Path) -> None:
    tok = tokenizers.Tokenizer.from_file(str(built / "tokenizer.json"))
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>"
    ids = tok.encode(text).ids
    assert tok.token_to_id("<think>") in ids
    assert tok.token_to_id("</think>") in ids
    assert tok.token_to_id("<|im_start|>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm\n</think>\n\nok"


# ------------------------------------------------------------ chat template


def _render(built: Path, messages: list[dict[str, str]], **kwargs: Any) -> str:
    # The environment transformers' apply_chat_template uses.
    env = jinja2_sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(_read_json(built / "tokenizer_config.json")["chat_template"])
    return template.render(messages=messages, **kwargs)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
PROMPT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_chat_template_generation_prompt(built: Path) -> None:
    assert _render(built, MESSAGES) == PROMPT
    assert _render(built, MESSAGES, add_generation_prompt=True) == (
        PROMPT + "<|im_start|>assistant\n"
    )
    assert _render(built, MESSAGES, add_generation_prompt=True, enable_thinking=True) == (
        PROMPT + "<|im_start|>assistant\n"
    )


def test_chat_template_thinking_off(built: Path) -> None:
    assert _render(built, MESSAGES, add_generation_prompt=True, enable_thinking=False) == (
        PROMPT + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_chat_template_strips_earlier_reasoning(built: Path) -> None:
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": "<think>\nplanning\n</think>\n\nHello!"},
        {"role": "user", "content": "Again"},
    ]
    assert _render(built, messages, add_generation_prompt=True) == (
        PROMPT + "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
    )
