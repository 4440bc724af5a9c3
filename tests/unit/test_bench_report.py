"""The pure parts of the benchmark (bench/report.py, bench/scenarios.py): no servers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import report as rp
from bench.scenarios import (
    CONCURRENCY,
    FULL,
    MIXED,
    QUICK,
    SCENARIOS,
    STRUCTURED,
    STRUCTURED_SCHEMA,
    build_plan,
    seed_for,
)

# A trimmed `vllm bench serve --save-result` document (keys as vllm 0.32 writes them).
CLIENT_JSON = {
    "date": "20250101-000000",
    "backend": "openai",
    "duration": 6.956,
    "completed": 256,
    "failed": 0,
    "total_input_tokens": 32809,
    "total_output_tokens": 16384,
    "request_throughput": 36.8,
    "request_goodput": None,
    "output_throughput": 2355.4,
    "p50_ttft_ms": 103.0,
    "p95_ttft_ms": 400.0,
    "p99_ttft_ms": 523.6,
    "p50_tpot_ms": 12.5,
    "p99_itl_ms": 40.0,
    "p99_e2el_ms": 1400.0,
    "mean_ttft_ms": 150.0,
}


def test_parse_client_result_maps_and_skips_non_numbers() -> None:
    m = rp.parse_client_result(CLIENT_JSON)
    assert m["req_s"] == pytest.approx(36.8)
    assert m["ttft_p99"] == pytest.approx(523.6)
    assert m["completed"] == 256.0
    assert m["failed"] == 0.0
    assert "request_goodput" not in m and "goodput" not in m
    assert all(isinstance(v, float) for v in m.values())


def test_parse_client_result_tolerates_missing_keys() -> None:
    assert rp.parse_client_result({"request_throughput": 3, "p99_ttft_ms": True}) == {"req_s": 3.0}


def test_spread_median_min_max() -> None:
    s = rp.spread([3.0, 1.0, 2.0, float("nan")])
    assert s == rp.Spread(2.0, 1.0, 3.0, 3)
    assert rp.spread([]) is None
    assert rp.spread([4.0, 2.0]) == rp.Spread(3.0, 2.0, 4.0, 2)


def test_ratio_of_medians() -> None:
    a, b = rp.spread([10.0, 12.0, 11.0]), rp.spread([5.0, 6.0, 4.0])
    assert rp.ratio(a, b) == pytest.approx(11.0 / 5.0)
    assert rp.ratio(a, None) is None
    assert rp.ratio(a, rp.Spread(0.0, 0.0, 0.0, 1)) is None


def test_fmt_spread() -> None:
    assert rp.fmt_spread(None) == "–"
    assert rp.fmt_spread(rp.Spread(36.8, 36.8, 36.8, 1)) == "36.8"
    assert rp.fmt_spread(rp.Spread(36.8, 30.0, 40.12, 3)) == "36.8 [30.0–40.1]"
    assert rp.fmt_num(1234.5) == "1,234" or rp.fmt_num(1234.5) == "1,235"
    assert rp.fmt_num(0.01234) == "0.012"


def _records() -> list[rp.Record]:
    recs = []
    for rep, (s, v, r) in enumerate([(50.0, 40.0, 70.0), (54.0, 38.0, 72.0), (52.0, 42.0, 74.0)]):
        recs.append(rp.Record(CONCURRENCY, "c=32", rp.SLUICE, rep, {"req_s": s, "ttft_p99": 100}))
        recs.append(rp.Record(CONCURRENCY, "c=32", rp.VLLM, rep, {"req_s": v, "ttft_p99": 200}))
        recs.append(rp.Record(CONCURRENCY, "c=32", rp.RAW, rep, {"req_s": r}))
    recs.append(rp.Record(CONCURRENCY, "c=1", rp.SLUICE, 0, {"req_s": 5.0}))
    recs.append(rp.Record(MIXED, "8 req/s", rp.SLUICE, 0, {"short_ttft_p95": 1.0}))
    return recs


def test_aggregate_and_comparison_table() -> None:
    table = rp.aggregate(_records(), CONCURRENCY)
    assert table.points == ["c=32", "c=1"]
    assert table.systems() == [rp.SLUICE, rp.VLLM, rp.RAW]
    assert table.get("c=32", rp.SLUICE, "req_s") == rp.Spread(52.0, 50.0, 54.0, 3)
    md = rp.render_comparison(table, ("req_s", "ttft_p99"))
    lines = md.splitlines()
    assert lines[0] == (
        "| point | metric | Sluice | vLLM server | raw engine | Sluice/vLLM | Sluice/raw |"
    )
    assert lines[1] == "|---|---|---|---|---|---|---|"
    assert (
        "| c=32 | req/s | 52.0 [50.0–54.0] | 40.0 [38.0–42.0] | 72.0 [70.0–74.0] | 1.30x | 0.72x |"
        in lines
    )
    # TTFT p99: raw has no value -> dash, ratio to raw missing
    assert "| c=32 | TTFT p99 (ms) | 100 | 200 | – | 0.50x | – |" in lines
    # c=1 has only Sluice: the ratio cells are dashes, the TTFT row is left out
    assert "| c=1 | req/s | 5.00 | – | – | – | – |" in lines
    assert not any(line.startswith("| c=1 | TTFT") for line in lines)


def test_comparison_without_raw_has_no_raw_columns() -> None:
    recs = [r for r in _records() if r.system != rp.RAW]
    md = rp.render_comparison(rp.aggregate(recs, CONCURRENCY), ("req_s",))
    assert "raw" not in md
    assert "Sluice/vLLM" in md


def test_render_single() -> None:
    recs = [rp.Record("window", "0 ms | low", rp.SLUICE, i, {"req_s": float(i)}) for i in (1, 2, 3)]
    md = rp.render_single(rp.aggregate(recs, "window"), rp.SLUICE, ("req_s",), "window | load")
    assert md.splitlines()[2] == "| 0 ms \\| low | 2.00 [1.00–3.00] |"  # pipe escaped


def test_records_round_trip_json() -> None:
    r = rp.Record(MIXED, "8 req/s", rp.VLLM, 2, {"req_s": 1.5})
    assert rp.Record.from_json(r.to_json()) == r


# ------------------------------------------------------------- mixed load


def test_mixed_classes_scale_with_context() -> None:
    short, medium, long_ = rp.mixed_classes(8192)
    assert (short.input_len, medium.input_len, long_.input_len) == (64, 512, 4096)
    assert [c.share for c in (short, medium, long_)] == [0.70, 0.20, 0.10]
    assert [c.input_len for c in rp.mixed_classes(32768)] == [256, 2048, 16384]


def test_split_mixed_rates_and_counts() -> None:
    jobs = rp.split_mixed(rp.mixed_classes(8192), total_rate=8.0, duration_s=20.0)
    assert [j.role for j in jobs] == ["short", "medium", "long"]
    assert [j.request_rate for j in jobs] == pytest.approx([5.6, 1.6, 0.8])
    assert [j.num_prompts for j in jobs] == [112, 32, 16]
    assert math.isclose(sum(j.request_rate for j in jobs), 8.0)


def test_split_mixed_at_least_one_prompt_and_validation() -> None:
    jobs = rp.split_mixed(rp.mixed_classes(8192), total_rate=1.0, duration_s=1.0)
    assert [j.num_prompts for j in jobs] == [1, 1, 1]
    with pytest.raises(ValueError):
        rp.split_mixed(rp.mixed_classes(8192), total_rate=0.0, duration_s=1.0)
    bad = (rp.MixedClass("a", 0.5, 1, 1),)
    with pytest.raises(ValueError):
        rp.split_mixed(bad, 1.0, 1.0)


def test_combine_mixed_reports_short_separately() -> None:
    per = {
        "short": {"completed": 70, "duration_s": 10.0, "ttft_p95": 20.0, "output_tokens": 700},
        "medium": {"completed": 20, "duration_s": 9.0, "ttft_p95": 80.0, "output_tokens": 200},
        "long": {"completed": 10, "duration_s": 10.0, "ttft_p95": 900.0, "failed": 1},
    }
    m = rp.combine_mixed(per)
    assert m["req_s"] == pytest.approx(10.0)
    assert m["out_tok_s"] == pytest.approx(90.0)
    assert m["short_ttft_p95"] == 20.0
    assert m["long_ttft_p95"] == 900.0
    assert m["failed"] == 1.0
    assert "ttft_p95" not in m


# --------------------------------------------------------------- /metrics


PROM_SLUICE = """\
# HELP sluice_engine_prefix_cache_queries_total Prompt tokens looked up
# TYPE sluice_engine_prefix_cache_queries_total counter
sluice_engine_prefix_cache_queries_total 32812.0
sluice_engine_prefix_cache_hits_total 512.0
"""
PROM_VLLM = """\
vllm:prefix_cache_queries_total{engine="0",model_name="sluice-demo"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="sluice-demo"} 24.0
vllm:prefix_cache_hits_total{engine="0",model_name="a b"} 100.0
vllm:num_requests_running{engine="0"} 3
"""


def test_parse_prometheus_sums_label_sets() -> None:
    assert rp.parse_prometheus(PROM_SLUICE)["sluice_engine_prefix_cache_hits_total"] == 512.0
    v = rp.parse_prometheus(PROM_VLLM)
    assert v["vllm:prefix_cache_queries_total"] == 1024.0
    assert v["vllm:prefix_cache_hits_total"] == 100.0
    assert v["vllm:num_requests_running"] == 3.0


def test_prefill_delta() -> None:
    before = rp.parse_prometheus(PROM_VLLM)
    after = dict(before)
    after["vllm:prefix_cache_queries_total"] += 5000
    after["vllm:prefix_cache_hits_total"] += 4000
    assert rp.prefill_delta(rp.VLLM, before, after) == {
        "prefix_queries": 5000.0,
        "prefix_hits": 4000.0,
        "prefill_tokens": 1000.0,
    }
    assert rp.prefill_delta(rp.SLUICE, {}, before) == {}


# ------------------------------------------------------------------- plan


def test_plan_all_scenarios() -> None:
    plan = build_plan(SCENARIOS, FULL, max_model_len=8192)
    names = [(p.scenario, p.name) for p in plan.points]
    assert names[:4] == [(CONCURRENCY, f"c={c}") for c in (1, 8, 32, 128)]
    assert [p.name for p in plan.raw_points] == ["c=32", "c=128"]
    mixed = next(p for p in plan.points if p.scenario == MIXED)
    assert [j.role for j in mixed.jobs] == ["short", "medium", "long"]
    assert len(plan.window_configs) == 6 and len(plan.window_points) == 2
    identical = next(p for p in plan.points if p.scenario == "identical_burst")
    args = identical.jobs[0].args
    assert "--temperature" in args and identical.prefix_metrics
    assert args[args.index("--prefix-repetition-num-prefixes") + 1] == "1"
    assert args[args.index("--prefix-repetition-suffix-len") + 1] == "0"


def test_plan_structured_pair() -> None:
    """Plain and JSON-schema points differ only in the constraint; EOS ends both."""
    plain, schema = build_plan([STRUCTURED], QUICK, max_model_len=8192).points
    assert (plain.name, schema.name) == ("plain c=32", "json schema c=32")
    (pj,), (sj,) = plain.jobs, schema.jobs
    assert not pj.ignore_eos and not sj.ignore_eos and pj.chat and sj.chat
    assert sj.args[:-1] == pj.args[:-1] and sj.args[-2] == "--extra-body"
    no_think = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": False}
    assert json.loads(pj.args[-1]) == no_think
    constrained = {**no_think, "structured_outputs": {"json": STRUCTURED_SCHEMA}}
    assert json.loads(sj.args[-1]) == constrained
    assert pj.args[pj.args.index("--max-concurrency") + 1] == "32"


def test_plan_subset_and_quick() -> None:
    plan = build_plan(["raw"], QUICK, max_model_len=8192)
    assert plan.points == () and [p.name for p in plan.raw_points] == ["c=32", "c=128"]
    assert not plan.window_configs


def test_seeds_are_deterministic_per_point_and_rep() -> None:
    assert seed_for("a", "b", 1) == seed_for("a", "b", 1)
    assert seed_for("a", "b", 1) != seed_for("a", "b", 2)


# ------------------------------------------------------------------- plot

_LINE = rp.LinePanel(CONCURRENCY, "req_s", "throughput", "concurrency")
_BARS = rp.BarPanel(MIXED, (("short", "short_ttft_p95"), ("long", "long_ttft_p95")), "t", "ms")


def test_point_number_reads_the_scenario_variable() -> None:
    assert rp.point_number("c=128") == 128.0
    assert rp.point_number("2.5 req/s") == 2.5
    assert rp.point_number("alone") is None


def test_line_series_on_the_scenarios_own_axis() -> None:
    recs = [*_records(), rp.Record(CONCURRENCY, "warm-up", rp.SLUICE, 0, {"req_s": 9.0})]
    series = rp.line_series(rp.aggregate(recs, CONCURRENCY), _LINE)
    # sorted by concurrency (c=32 was measured first); a point without a number is left out
    assert [(x, v.median) for x, v in series[rp.SLUICE]] == [(1.0, 5.0), (32.0, 52.0)]
    assert series[rp.RAW] == [(32.0, rp.Spread(72.0, 70.0, 74.0, 3))]
    ttft = rp.LinePanel(CONCURRENCY, "ttft_p99", "t", "c")
    assert rp.RAW not in rp.line_series(rp.aggregate(recs, CONCURRENCY), ttft)


def test_bar_groups_by_class_and_by_point() -> None:
    recs = [
        rp.Record(MIXED, "8 req/s", rp.SLUICE, 0, {"short_ttft_p95": 10.0, "long_ttft_p95": 90.0}),
        rp.Record(MIXED, "8 req/s", rp.VLLM, 0, {"short_ttft_p95": 30.0}),
    ]
    labels, per = rp.bar_groups(rp.aggregate(recs, MIXED), _BARS)
    assert labels == ["short", "long"]
    assert [v.median if v else None for v in per[rp.SLUICE]] == [10.0, 90.0]
    assert [v.median if v else None for v in per[rp.VLLM]] == [30.0, None]
    # several points (say alone / under a flood): the point is named under the label
    recs += [rp.Record(MIXED, "flood", rp.SLUICE, 0, {"short_ttft_p95": 50.0})]
    labels, per = rp.bar_groups(rp.aggregate(recs, MIXED), _BARS)
    assert labels == ["short\n8 req/s", "long\n8 req/s", "short\nflood"]
    assert per[rp.VLLM][2] is None


def test_panels_without_data_are_left_out(tmp_path: Path) -> None:
    tables = {CONCURRENCY: rp.aggregate(_records(), CONCURRENCY)}
    assert rp.panel_has_data(tables, _LINE)
    assert not rp.panel_has_data(tables, _BARS)  # no mixed table at all
    absent = rp.BarPanel("noisy_neighbour", (("chat", "chat_ttft_p95"),), "t", "ms")
    assert not rp.panel_has_data(tables, absent)
    pytest.importorskip("matplotlib")
    assert rp.write_panels(tables, (_BARS, absent), tmp_path / "p.png", "t").startswith(
        "plot skipped"
    )
    msg = rp.write_panels(tables, (_LINE, _BARS, absent), tmp_path / "p.png", "t")
    assert msg.startswith("plot written") and (tmp_path / "p.png").stat().st_size > 10_000


def test_parse_spread_reads_table_cells() -> None:
    assert rp.parse_spread("2,919 [2,830–3,064]", 3) == rp.Spread(2919.0, 2830.0, 3064.0, 3)
    assert rp.parse_spread("9.81", 3) == rp.Spread(9.81, 9.81, 9.81, 3)
    assert rp.parse_spread("–", 3) is None
    with pytest.raises(ValueError):
        rp.parse_spread("1.2x", 3)


def test_tables_from_markdown_round_trip() -> None:
    table = rp.aggregate(_records(), CONCURRENCY)
    md = "\n".join(
        [
            "# report",
            "## Concurrency",
            "",
            rp.render_comparison(table, ("req_s", "ttft_p99")),
            "",
            "## Something else",
            "| a | b |",
            "|---|---|",
            "| 1 | 2 |",
        ]
    )
    back = rp.tables_from_markdown(md, {CONCURRENCY: "Concurrency"}, n=3)
    assert set(back) == {CONCURRENCY}
    got = back[CONCURRENCY]
    assert got.points == ["c=32", "c=1"]
    assert got.get("c=32", rp.SLUICE, "req_s") == rp.Spread(52.0, 50.0, 54.0, 3)
    assert got.get("c=32", rp.VLLM, "ttft_p99") == rp.Spread(200.0, 200.0, 200.0, 3)
    assert got.get("c=32", rp.RAW, "ttft_p99") is None  # a dash

    def medians(t: rp.Table) -> dict[str, list[tuple[float, float, float, float]]]:
        return {
            s: [(x, v.median, v.low, v.high) for x, v in pts]
            for s, pts in rp.line_series(t, _LINE).items()
        }

    assert medians(got) == medians(table)
