"""`sluice serve --models FILE`: a good file is one spec per table, its engine
flags read by vLLM's own definitions; a bad one is one usage line and exit 2
(server/engines/models_file.py, server/cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli import parse_serve_args
from server.engines.registry import Load

# Two demo models with small KV caches (the demo model's 1 KiB per token).
TWO = """
[models.chat]
kv-cache-memory-bytes = 67108864
max-model-len = 4096

[models.spare]
load = "on-demand"
unload-after = "90s"
kv_cache_memory_bytes = 67108864
max-num-seqs = 8
enforce-eager = true
"""


def _serve(root: Path, tmp_path: Path, text: str, *flags: str) -> object:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return parse_serve_args(["--demo-cache-dir", str(root), "--models", str(path), *flags], {})


def _refused(
    capsys: pytest.CaptureFixture[str], root: Path, tmp_path: Path, text: str, *flags: str
) -> str:
    """The one usage line `sluice serve` exits 2 with."""
    with pytest.raises(SystemExit) as exit_:
        _serve(root, tmp_path, text, *flags)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_each_table_is_a_model_with_its_own_engine_flags(
    demo_cache_root: Path, tmp_path: Path
) -> None:
    s = _serve(demo_cache_root, tmp_path, TWO, "--load-timeout", "7")
    chat, spare = s.models  # type: ignore[attr-defined]
    assert (chat.name, chat.load, chat.unload_after) == ("chat", Load.START, 0.0)
    assert (spare.name, spare.load, spare.unload_after) == ("spare", Load.ON_DEMAND, 90.0)
    assert chat.kind == "generate" and chat.demo and spare.demo
    # Each table's flags reached its own engine's arguments, and only its own.
    assert chat.engine_args.max_model_len == 4096 and chat.max_model_len == 4096
    assert spare.engine_args.max_num_seqs == 8 and spare.engine_args.enforce_eager
    assert not chat.engine_args.enforce_eager
    assert chat.engine_args.served_model_name == ["chat"]
    # Its share of the card: the KV cache it asked for plus its weights' files.
    assert 64 * 2**20 < chat.footprint < 64 * 2**20 + 64 * 2**20
    assert s.load_timeout == 7.0 and s.several  # type: ignore[attr-defined]


def test_each_models_logprobs_bound_is_its_own_max_logprobs(
    demo_cache_root: Path, tmp_path: Path
) -> None:
    """vLLM's --max-logprobs in a table bounds that model's requests (issue 51);
    a table without it has vLLM's default, 20."""
    from server.app import model_limits

    s = _serve(
        demo_cache_root, tmp_path, TWO.replace("max-num-seqs", "max-logprobs = 50\nmax-num-seqs")
    )
    chat, spare = s.models  # type: ignore[attr-defined]
    assert (chat.max_logprobs, spare.max_logprobs) == (20, 50)
    assert model_limits(s, spare).max_logprobs == 50  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (TWO + "colour = 'red'\n", "[models.spare]: unknown key 'colour'"),
        (TWO + "port = 9000\n", "'port': a server-wide flag"),
        (TWO + "served-model-name = 'x'\n", "the table's name is the served name"),
        (TWO.replace("max-num-seqs", "max_model_len = 1\nmax-model-len"), "given twice"),
        (TWO + "\n[models.chat]\n", "not valid TOML"),  # the same name twice
        (TWO.replace('"on-demand"', '"lazy"'), '.load must be "start" or "on-demand"'),
        (TWO.replace('"90s"', '"soon"'), "unload-after must be seconds or a duration"),
        ("[models.chat]\nunload-after = 5\n", "unload-after applies to on-demand models"),
        ("[models]\n", "no models"),
        ("memory = 1\n[models.a]\n", "unknown top-level key(s) memory"),
        ('[models."bad name"]\n', "a model name is 1-128"),
        (
            TWO + "max-num-batched-tokens = 'many'\n",
            "--max-num-batched-tokens: invalid",
        ),  # vLLM's own type check
        # Two models loaded at start whose own numbers do not fit the budget.
        (
            'memory-budget = "100MiB"\n'
            + TWO.replace('load = "on-demand"\nunload-after = "90s"', ""),
            "the models loaded at start need",
        ),
        # An on-demand model that can never fit beside the start models.
        ('memory-budget = "100MiB"\n' + TWO, "on-demand model 'spare' needs"),
    ],
)
def test_a_bad_models_file_is_one_usage_line_and_exit_2(
    demo_cache_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    text: str,
    says: str,
) -> None:
    line = _refused(capsys, demo_cache_root, tmp_path, text)
    assert line.startswith("sluice serve: error: models file ") and says in line, line


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--model", "x"], "--models and --model: give one"),
        (["--max-num-seqs", "4"], "go in the models file's tables"),
        (["--load-timeout", "-1"], "--load-timeout must be > 0"),
    ],
)
def test_models_and_the_command_line_do_not_mix(
    demo_cache_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    says: str,
) -> None:
    line = _refused(capsys, demo_cache_root, tmp_path, TWO, *flags)
    assert line.startswith("sluice serve: error: ") and says in line, line


def test_two_on_demand_models_that_fit_only_one_at_a_time_are_accepted(
    demo_cache_root: Path, tmp_path: Path
) -> None:
    """They swap (registry.py rule 6): only the start models must fit together."""
    text = 'memory-budget = "100MiB"\n' + TWO.replace(
        "[models.chat]", '[models.chat]\nload = "on-demand"'
    )
    s = _serve(demo_cache_root, tmp_path, text)
    assert [m.load for m in s.models] == [Load.ON_DEMAND, Load.ON_DEMAND]  # type: ignore[attr-defined]
    assert s.memory_budget == 100 * 2**20  # type: ignore[attr-defined]
