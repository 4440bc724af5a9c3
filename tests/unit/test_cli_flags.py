"""`sluice serve`'s own flags: a bad value is one usage line and exit 2, never a
traceback; the parser flags take vLLM's names; thinking's model-aware default."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli import build_serve_parser, parse_serve_args


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--gpu-shed-free-mib", "-5"], "gpu critical < gpu shed"),  # a watchdog threshold
        (["--kv-critical-usage", "2"], "kv storm <= kv critical <= 1"),
        (["--window-ms", "-1"], "window"),
        (["--port", "70000"], "--port must be <= 65535"),
        (["--queue-timeout", "0"], "--queue-timeout must be > 0"),
        (["--background-step-ratio", "0"], "--background-step-ratio must be > 0"),
        (["--max-n", "0"], "--max-n must be >= 1"),
        (["--watchdog-interval-ms", "nan"], "--watchdog-interval-ms must be > 0"),
        (["--max-batch-seqs", "0"], "--max-batch-seqs must be >= 1"),
        (["--tool-call-parser", "nope"], "invalid --tool-call-parser 'nope'"),
        (["--reasoning-parser", "nope"], "invalid --reasoning-parser 'nope'"),
        (["--api-key-file", "/nonexistent/key"], "--api-key-file"),
        (["--max-n", "two"], "invalid int value"),  # argparse's own type check
        (["--lora-modules", "a=/nonexistent"], "--lora-modules needs --enable-lora"),
        (
            ["--enable-lora", "--lora-modules", "a=/nonexistent"],
            "LoRA adapter 'a': /nonexistent is not a directory",
        ),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "Invalid fields for --lora-modules"),
    ],
)
def test_a_bad_value_is_one_usage_line_and_exit_2(
    demo_cache_root: Path, capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_serve_args(["--demo-cache-dir", str(demo_cache_root), *flags], {})
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("sluice serve: error: ") and says in lines[0]


def test_parser_flags_have_vllms_names_and_qwen3_defaults(demo_cache_root: Path) -> None:
    base = ["--demo-cache-dir", str(demo_cache_root)]
    d = parse_serve_args(base, {})
    assert (d.tool_call_parser, d.enable_auto_tool_choice) == ("hermes", True)
    assert d.engine_args.reasoning_parser == "qwen3"
    s = parse_serve_args(
        [
            *base,
            "--tool-call-parser",
            "qwen3_coder",
            "--no-enable-auto-tool-choice",
            "--reasoning-parser",
            "deepseek_r1",
        ],
        {},
    )
    assert (s.tool_call_parser, s.enable_auto_tool_choice) == ("qwen3_coder", False)
    assert s.engine_args.reasoning_parser == "deepseek_r1"


def test_thinking_is_off_by_default_for_the_demo_model_only(
    demo_cache_root: Path, demo_model_dir: Path
) -> None:
    demo = ["--demo-cache-dir", str(demo_cache_root)]
    real = ["--model", str(demo_model_dir)]  # a model path given: not the demo model
    assert parse_serve_args(demo, {}).default_thinking is False
    assert parse_serve_args(real, {}).default_thinking is True
    assert parse_serve_args([*demo, "--default-thinking"], {}).default_thinking is True
    assert parse_serve_args([*real, "--no-default-thinking"], {}).default_thinking is False


def test_the_pooling_runner_serves_the_demo_as_an_embedder_or_its_reranker_sibling(
    demo_cache_root: Path,
) -> None:
    demo = ["--demo-cache-dir", str(demo_cache_root)]
    chat = parse_serve_args(demo, {})
    embed = parse_serve_args([*demo, "--runner", "pooling"], {})
    rerank = parse_serve_args([*demo, "--convert", "classify"], {})
    assert (chat.model_name, embed.model_name, rerank.model_name) == (
        "sluice-demo",
        "sluice-demo-embed",
        "sluice-demo-reranker",
    )
    # The embedder is the demo model's own weights; the reranker its sibling.
    assert embed.engine_args.model == chat.engine_args.model
    assert rerank.engine_args.model != chat.engine_args.model
    assert "demo-reranker-" in rerank.engine_args.model
    named = parse_serve_args([*demo, "--runner", "pooling", "--served-model-name", "e"], {})
    assert named.model_name == "e"


def test_each_watchdog_threshold_is_a_flag_of_its_type() -> None:
    """PressureConfig's bools are switches and its numbers take their field's type."""
    parser = build_serve_parser()
    ns = parser.parse_args(["--abort-on-gpu", "--kv-storm-usage", "0.5", "--preempt-shed", "7"])
    assert ns.pressure_abort_on_gpu is True
    assert ns.pressure_kv_storm_usage == 0.5 and isinstance(ns.pressure_kv_storm_usage, float)
    assert ns.pressure_preempt_shed == 7 and isinstance(ns.pressure_preempt_shed, int)
    assert parser.parse_args(["--no-abort-on-gpu"]).pressure_abort_on_gpu is False
    assert parser.parse_args([]).pressure_min_dwell == 2.0


def test_lora_modules_as_vllm_takes_them(demo_cache_root: Path, tmp_path: Path) -> None:
    from server.engines.demo.lora_adapter import write_demo_adapter
    from server.engines.lora import Adapter

    a, b = write_demo_adapter(tmp_path / "a", seed=1), write_demo_adapter(tmp_path / "b", seed=2)
    s = parse_serve_args(
        [
            "--demo-cache-dir",
            str(demo_cache_root),
            "--enable-lora",
            "--max-loras",
            "2",
            "--lora-modules",
            f"alpha={a}",
            f'{{"name": "beta", "path": "{b}", "base_model_name": "sluice-demo"}}',
        ],
        {},
    )
    assert s.adapters == (
        Adapter("alpha", str(a), 1, "sluice-demo"),
        Adapter("beta", str(b), 2, "sluice-demo"),
    )
    assert s.engine_args.enable_lora and s.engine_args.max_loras == 2


@pytest.mark.parametrize(
    ("rank", "callers", "says"),
    [
        (16, "", "LoRA adapter 'alpha': rank 16 is above --max-lora-rank 8"),
        (8, 'adapters = ["gamma"]', "callers.x.adapters: 'gamma' is not a configured LoRA adapter"),
        (8, 'default_adapter = "sluice-demo"', "'sluice-demo' is not a configured LoRA adapter"),
    ],
)
def test_a_bad_adapter_or_callers_entry_is_one_line(
    demo_cache_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    rank: int,
    callers: str,
    says: str,
) -> None:
    from server.engines.demo.lora_adapter import write_demo_adapter

    path = write_demo_adapter(tmp_path / "alpha", rank=rank)
    file = tmp_path / "callers.toml"
    file.write_text(f'[callers.x]\nkey = "k"\n{callers}\n')
    file.chmod(0o600)
    flags = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"alpha={path}"]
    with pytest.raises(SystemExit) as exit_:
        parse_serve_args(
            ["--demo-cache-dir", str(demo_cache_root), "--callers", str(file), *flags], {}
        )
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and says in lines[0], lines


def test_the_state_dir_flag_wins_over_systemd_which_wins_over_xdg(
    demo_cache_root: Path, tmp_path: Path
) -> None:
    base = ["--demo-cache-dir", str(demo_cache_root)]
    env = {"XDG_STATE_HOME": str(tmp_path / "xdg")}
    assert parse_serve_args(base, env).state_dir == tmp_path / "xdg" / "sluice"
    env["STATE_DIRECTORY"] = str(tmp_path / "unit")
    assert parse_serve_args(base, env).state_dir == tmp_path / "unit"
    flag = parse_serve_args([*base, "--state-dir", str(tmp_path / "flag")], env)
    assert flag.state_dir == tmp_path / "flag" and (tmp_path / "flag").is_dir()
    assert parse_serve_args([*base, "--responses-retention", "2h"], env).responses_retention == 7200
    assert parse_serve_args([*base, "--responses-retention", "90"], env).responses_retention == 90


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--state-dir", "{file}"], "is not a directory"),
        (["--responses-retention", "0"], "--responses-retention must be > 0"),
        (["--responses-retention", "soon"], "invalid duration value"),
    ],
)
def test_a_bad_state_dir_or_retention_is_one_line_and_exit_2(
    demo_cache_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    says: str,
) -> None:
    (tmp_path / "file").write_text("")
    flags = [f.format(file=tmp_path / "file") for f in flags]
    with pytest.raises(SystemExit) as exit_:
        parse_serve_args(["--demo-cache-dir", str(demo_cache_root), *flags], {})
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("sluice serve: error: ") and says in err


def test_max_logprobs_is_vllms_flag_and_bounds_the_requests(demo_cache_root: Path) -> None:
    """vLLM's own --max-logprobs (an engine flag) is the bound request parsing
    puts on logprobs and prompt logprobs (issue 51): before, Sluice refused
    above 20 whatever the engine allowed."""
    from server.app import model_limits

    base = ["--demo-cache-dir", str(demo_cache_root)]
    d = parse_serve_args(base, {})
    assert d.max_logprobs == 20 == d.engine_args.max_logprobs
    s = parse_serve_args([*base, "--max-logprobs", "64"], {})
    assert s.engine_args.max_logprobs == 64
    (spec,) = s.specs()
    assert model_limits(s, spec).max_logprobs == 64
    unbounded = parse_serve_args([*base, "--max-logprobs", "-1"], {})
    assert unbounded.max_logprobs >= 2**31 - 1  # the engine checks the vocabulary
