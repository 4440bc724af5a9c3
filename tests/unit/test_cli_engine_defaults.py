"""The engine defaults `sluice serve` adds for tool calls and structured output."""

from __future__ import annotations

from pathlib import Path

from server.cli import parse_serve_args


def test_demo_gets_the_reasoning_gate_and_compact_json(demo_cache_root: Path) -> None:
    args = parse_serve_args(["--demo-cache-dir", str(demo_cache_root)], {}).engine_args
    assert args.reasoning_parser == "qwen3"
    so = args.structured_outputs_config
    assert (so.backend, so.disable_any_whitespace) == ("xgrammar", True)


def test_flags_win(demo_cache_root: Path) -> None:
    argv = [
        "--demo-cache-dir",
        str(demo_cache_root),
        "--reasoning-parser",
        "deepseek_r1",
        "--structured-outputs-config",
        '{"backend": "guidance"}',
    ]
    args = parse_serve_args(argv, {}).engine_args
    assert args.reasoning_parser == "deepseek_r1"
    so = args.structured_outputs_config
    assert (so.backend, so.disable_any_whitespace) == ("guidance", False)
