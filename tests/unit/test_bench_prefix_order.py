"""Issue 62's benchmark point (bench/points/prefix_order_point.py), without servers:
the load's shape (system prompts, Zipf popularity, the 70/20/10 mix, the same
requests for every system) and the report's ratios."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from bench.points.prefix_order_point import (
    KINDS,
    Shape,
    command,
    from_log,
    parse_args,
    report,
    request,
    system_lengths,
    zipf_weights,
)

SHAPE = Shape(24, 1.0, False, (20, 240, 600), (16, 48, 64))


def test_system_prompts_span_600_to_1000_tokens() -> None:
    lengths = system_lengths(24)
    assert len(lengths) == 24
    assert abs(lengths[0] * 2.05 - 600) < 2 and abs(lengths[-1] * 2.05 - 1000) < 2
    assert zipf_weights(3, 1.0) == [1.0, 0.5, 1.0 / 3]


def test_every_system_gets_the_same_requests_and_the_mix_holds() -> None:
    def stream(seed: int) -> list[tuple[str, object]]:
        rng = random.Random(seed)
        return [request(SHAPE, rng, 0, 1, n) for n in range(400)]

    a, b = stream(5), stream(5)
    assert a == b
    kinds = Counter(k for k, _ in a)
    assert set(kinds) == set(KINDS)
    assert 0.6 < kinds["short"] / 400 < 0.8 and kinds["analysis"] / 400 < 0.2
    systems = Counter(body["messages"][0]["content"] for _, body in a)  # type: ignore[index]
    top = systems.most_common(1)[0][1]
    assert 24 >= len(systems) > 10 and top > 400 / 24 * 2  # Zipf: the first far ahead


def test_the_control_shares_no_system_prompt() -> None:
    rng = random.Random(1)
    shape = Shape(24, 1.0, True, (20, 240, 600), (16, 48, 64))
    bodies = [request(shape, rng, 0, 1, n)[1] for n in range(50)]
    assert len({b["messages"][0]["content"] for b in bodies}) == 50


def test_every_system_has_the_same_engine_flags() -> None:
    def engine(name: str) -> list[str]:
        cmd = command(name, 8000, 12)
        return cmd[cmd.index("--model") :]

    assert engine("sluice") == engine("vllm")
    assert "--enable-prefix-caching" in engine("vllm")
    assert str(12 * 2**20) in engine("vllm")
    assert "--no-prefix-order" in command("sluice-off", 8000, 12)


def test_a_report_from_a_runs_printed_repetitions(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    one = {"req_s": 2.0, "prefill": 900.0, "answered": 90.0, "hit_rate": 0.5}
    log.write_text(f"noise\nsluice repetition 0: {one}\nvllm repetition 0: {one}\n")
    runs = from_log(log)
    assert set(runs) == {"sluice", "vllm"} and runs["vllm"][0]["prefill_req"] == 10.0


def test_the_report_gives_the_issues_ratios(tmp_path: Path) -> None:
    args = parse_args(["--out", str(tmp_path / "r.md")])
    run = {"req_s": 2.0, "prefill": 1000.0, "hit_rate": 0.5, "short_p50": 100.0}
    runs = {
        "sluice": [{**run, "short_p95": 300.0, "answered": 90.0, "failed": 0.0}],
        "sluice-off": [{**run, "prefill": 2000.0, "short_p95": 300.0, "answered": 80.0}],
        "vllm": [{**run, "req_s": 1.0, "prefill": 4000.0, "short_p95": 600.0, "answered": 45.0}],
    }
    for rs in runs.values():
        rs[0].setdefault("failed", 0.0)
        rs[0].update(warm=0.0, record_cached=0.0, overbelief=0.0)
        rs[0]["prefill_req"] = rs[0]["prefill"] / rs[0]["answered"]
    text = "\n".join(report(runs, args, "22:00-22:10 UTC"))
    # Prefill a request: 1000 / 90 against 4000 / 45 and 2000 / 80.
    assert "req/s 2.00x (target >= 1.1x), prefill tokens a request 0.12x" in text
    assert "short TTFT p95 0.50x" in text
    assert "against --no-prefix-order: req/s 1.00x, prefill tokens a request 0.44x" in text
    assert "runs at 22:00-22:10 UTC" in text
