"""The engine step flags `sluice serve` sets when the user has not (issue 21)."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli import parse_serve_args
from server.engines.board import RATIO_KEY
from server.engines.step_flags import step_flags


def test_the_cap_is_a_quarter_of_the_step_within_the_context() -> None:
    assert step_flags(2048, 4096).long_prefill_token_threshold == 512
    assert step_flags(8192, 1024).long_prefill_token_threshold == 1024
    assert step_flags(32, 4096).long_prefill_token_threshold == 16
    assert step_flags(2048, 4096).argv() == (
        "--long-prefill-token-threshold",
        "512",
        "--long-prefill-token-threshold-adaptive",
    )


def test_sluice_sets_the_prefill_cap_when_no_flag_does(demo_cache_root: Path) -> None:
    # The demo model on CPU: vLLM batches 2,048 tokens per step.
    args = parse_serve_args(["--demo-cache-dir", str(demo_cache_root)], {}).engine_args
    assert args.long_prefill_token_threshold == 512
    assert args.long_prefill_token_threshold_adaptive is True


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (["--long-prefill-token-threshold", "0"], (0, False)),
        (["--long-prefill-token-threshold", "300"], (300, False)),
        (["--no-long-prefill-token-threshold-adaptive"], (0, False)),
        (["--max-num-batched-tokens", "1024"], (256, True)),
    ],
)
def test_a_users_flag_wins(demo_cache_root: Path, flags: list[str], want: tuple[int, bool]) -> None:
    """A flag given, even at vLLM's own default, is the user's choice: Sluice sets nothing."""
    argv = ["--demo-cache-dir", str(demo_cache_root), *flags]
    args = parse_serve_args(argv, {}).engine_args
    assert (args.long_prefill_token_threshold, args.long_prefill_token_threshold_adaptive) == want


def test_engine_priority_order_needs_the_priority_policy(
    demo_cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--demo-cache-dir", str(demo_cache_root), "--engine-priority", "order"]
    with pytest.raises(SystemExit) as exc:
        parse_serve_args(base, {})
    assert exc.value.code == 2
    assert "--scheduling-policy priority" in capsys.readouterr().err
    settings = parse_serve_args([*base, "--scheduling-policy", "priority"], {})
    assert settings.engine_priority == "order"


@pytest.mark.parametrize(("flags", "ratio"), [([], 1.0), (["--background-step-ratio", "0.5"], 0.5)])
def test_the_background_step_ratio_reaches_the_engines_scheduler(
    demo_cache_root: Path, flags: list[str], ratio: float
) -> None:
    """Through vLLM's additional_config, which the engine core's scheduler reads
    (server/engines/vllm_scheduler.py); a user's own keys stay."""
    argv = ["--demo-cache-dir", str(demo_cache_root), "--additional-config", '{"mine": 1}']
    args = parse_serve_args([*argv, *flags], {}).engine_args
    assert args.additional_config == {"mine": 1, RATIO_KEY: ratio}
