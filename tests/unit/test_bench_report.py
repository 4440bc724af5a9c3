"""The pure parts of the benchmark (bench/report/, bench/scenarios.py): no servers."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from bench import report as rp
from bench.report import targets as tg
from bench.scenarios import (
    ALONE_POINT,
    CONCURRENCY,
    FLOOD_POINT,
    FULL,
    MIXED,
    NOISY,
    PAST_CAPACITY,
    QUICK,
    SCENARIOS,
    SPREAD_POINT,
    STRUCTURED,
    STRUCTURED_SCHEMA,
    WIDE_POINT,
    EngineProfile,
    build_plan,
    by_engine,
    callers_of,
    check_callers,
    kv_bytes_per_token,
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
    plan = build_plan(SCENARIOS, FULL, max_model_len=8192, kv_bytes_per_token=1024)
    names = [(p.scenario, p.name) for p in plan.points]
    assert names[:5] == [(CONCURRENCY, f"c={c}") for c in (1, 8, 32, 128)] + [
        (CONCURRENCY, WIDE_POINT)
    ]
    assert [p.name for p in plan.raw_points] == ["c=32", "c=128"]
    mixed = next(p for p in plan.points if p.scenario == MIXED)
    assert [j.role for j in mixed.jobs] == ["short", "medium", "long"]
    assert len(plan.window_configs) == 6 and len(plan.window_points) == 2
    identical = next(p for p in plan.points if p.scenario == "identical_burst")
    args = identical.jobs[0].args
    assert "--temperature" in args and identical.prefix_metrics
    assert args[args.index("--prefix-repetition-num-prefixes") + 1] == "1"
    assert args[args.index("--prefix-repetition-suffix-len") + 1] == "0"


def test_plan_data_parallel() -> None:
    """Issue 19's DP points: both servers on --data-parallel-size 2, c=256 and c=512,
    asked for by name (the default run leaves them out)."""
    from bench.scenarios import DATA_PARALLEL, DEFAULT_SCENARIOS

    plan = build_plan([DATA_PARALLEL], FULL, max_model_len=8192)
    assert [(p.name, p.concurrency) for p in plan.points] == [
        ("c=256 (64 in, 64 out)", 256),
        ("c=512 (64 in, 64 out)", 512),
    ]
    for p in plan.points:
        assert p.engine is not None and p.engine.flags == ("--data-parallel-size", "2")
        args = p.jobs[0].args
        assert args[args.index("--random-input-len") + 1] == "64"
        assert args[args.index("--random-output-len") + 1] == "64"
        assert p.running_metrics  # the engine's running count is sampled (issue 19)
    assert DATA_PARALLEL in SCENARIOS and DATA_PARALLEL not in DEFAULT_SCENARIOS
    others = build_plan(DEFAULT_SCENARIOS, FULL, max_model_len=8192, kv_bytes_per_token=1024)
    # Elsewhere only the saturated one-caller points (issue 27: requests in the engine).
    assert {p.name for p in others.points if p.running_metrics} == {SPREAD_POINT, WIDE_POINT}


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
    # the jobs of one point get their own seeds (else a chat prompt is a flood
    # prompt's prefix); a point's only job keeps the seed it always had
    assert seed_for("a", "b", 1, "chat") != seed_for("a", "b", 1, "flood")
    assert seed_for("a", "b", 1, "all") == seed_for("a", "b", 1)


def _arg(args: tuple[str, ...], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_plan_wide_point_is_short_requests_beyond_max_num_seqs() -> None:
    plan = build_plan([CONCURRENCY], FULL, max_model_len=8192)
    wide = plan.points[-1]
    assert wide.name == WIDE_POINT == "c=512 (64 in, 32 out)"
    args = wide.jobs[0].args
    assert _arg(args, "--max-concurrency") == "512"
    assert (_arg(args, "--random-input-len"), _arg(args, "--random-output-len")) == ("64", "32")
    assert int(_arg(args, "--num-prompts")) >= 2 * 512
    assert not wide.raw and wide.engine is None


def test_plan_noisy_neighbour_on_a_kv_bound_engine() -> None:
    plan = build_plan([NOISY], FULL, max_model_len=8192, kv_bytes_per_token=1024)
    alone, flood = plan.points
    assert (alone.name, flood.name) == (ALONE_POINT, FLOOD_POINT)
    assert alone.engine is flood.engine or alone.engine == flood.engine
    assert alone.engine is not None
    # ~16k tokens of KV at 1 KiB a token, a 4,096 context: both flags follow
    # the run's, so they override the demo model's 512 MiB and 8,192
    assert alone.engine.flags == (
        "--kv-cache-memory-bytes",
        str(16 * 2**20),
        "--max-model-len",
        "4096",
    )
    assert [j.role for j in alone.jobs] == ["chat"]
    assert [(j.role, j.caller) for j in flood.jobs] == [("chat", "chat"), ("flood", "batch")]
    chat, fl = flood.jobs
    assert chat == alone.jobs[0]  # the same chat job alone and beside the flood
    assert _arg(chat.args, "--request-rate") == "3"
    assert (_arg(chat.args, "--random-input-len"), _arg(chat.args, "--random-output-len")) == (
        "64",
        "32",
    )
    assert _arg(fl.args, "--max-concurrency") == "32"
    assert _arg(fl.args, "--random-input-len") == "2000"
    assert "--request-rate" not in fl.args  # closed loop
    assert "--save-detailed" in chat.args and "--save-detailed" in fl.args
    # 30-60 s of chat, and a flood that outlasts it by half at the 6.9 req/s
    # vLLM's server gave it in the pilot
    n_chat = int(_arg(chat.args, "--num-prompts"))
    assert 30 <= n_chat / 3 <= 60
    assert int(_arg(fl.args, "--num-prompts")) / 6.9 >= 1.5 * n_chat / 3
    assert callers_of(plan.points) == ("chat", "batch")


def test_plan_past_capacity_reuses_the_mixed_classes_on_the_kv_bound_engine() -> None:
    plan = build_plan(
        [MIXED, PAST_CAPACITY, CONCURRENCY], FULL, max_model_len=8192, kv_bytes_per_token=2048
    )
    past = next(p for p in plan.points if p.scenario == PAST_CAPACITY)
    assert past.engine is not None
    assert past.engine.flags[1] == str(16_384 * 2048)
    assert [j.role for j in past.jobs] == ["short", "medium", "long"]
    assert [_arg(j.args, "--random-input-len") for j in past.jobs] == ["32", "256", "2048"]
    assert all("--save-detailed" in j.args for j in past.jobs)  # refusal reasons
    rates = [float(_arg(j.args, "--request-rate")) for j in past.jobs]
    assert sum(rates) == pytest.approx(FULL.past_capacity_rate)
    assert past.callers == ("mixed",)  # its server has the noisy neighbour's callers file
    # one server group for the run's engine, one for the KV-bound one, in plan order
    groups = by_engine(plan.points)
    assert [g.name if g else None for g, _ in groups] == [None, "KV-bound"]
    assert [p.scenario for p in groups[1][1]] == [PAST_CAPACITY]
    assert groups[0][1][0].name == "c=1"


def test_plan_every_job_of_a_server_with_callers_names_one() -> None:
    from bench.scenarios import Job, Point

    keyed = Point(NOISY, "a", (Job("chat", (), caller="chat"),))
    plain = Point(NOISY, "b", (Job("all", ()),))
    with pytest.raises(ValueError, match="some jobs name a caller"):
        check_callers([keyed, plain])
    other = EngineProfile("other", ("--x",))
    check_callers([keyed, Point(NOISY, "b", (Job("all", ()),), engine=other)])  # two servers
    plan = build_plan([NOISY, PAST_CAPACITY], QUICK, max_model_len=8192, kv_bytes_per_token=1024)
    assert callers_of(plan.points) == ("chat", "batch", "mixed")
    assert all(j.caller for p in plan.points for j in p.jobs)


def test_plan_kv_bound_needs_bytes_per_token() -> None:
    with pytest.raises(ValueError, match="KV bytes per token"):
        build_plan([NOISY], QUICK, max_model_len=8192)
    assert build_plan([CONCURRENCY], QUICK, max_model_len=8192).points  # others do not


def test_kv_bytes_per_token_from_config() -> None:
    demo = {
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_size": 256,
        "num_attention_heads": 4,
    }
    assert kv_bytes_per_token(demo) == 1024
    no_head_dim = {k: v for k, v in demo.items() if k != "head_dim"}
    assert kv_bytes_per_token(no_head_dim) == 1024  # 256 / 4 heads
    assert kv_bytes_per_token({"num_hidden_layers": 2}) is None


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


# ------------------------------------------------------- noisy neighbour


def _detail(
    starts: list[float],
    lats: list[float],
    errors: list[str],
    out: int = 32,
    ttfts: list[float] | None = None,
) -> dict:
    return {
        "start_times": starts,
        "latencies": lats,
        "output_lens": [0 if e else out for e in errors],
        "errors": errors,
        "ttfts": ttfts if ttfts is not None else [0.01] * len(starts),
    }


def test_percentile_is_numpys_linear_one() -> None:
    np = pytest.importorskip("numpy")
    vals = [5.0, 1.0, 9.0, 3.0, 7.5, 2.25, 8.0]
    for p in (0, 50, 95, 99, 100):
        assert rp.percentile(vals, p) == pytest.approx(float(np.percentile(vals, p)))
    assert math.isnan(rp.percentile([], 50))


def test_request_log_from_a_detailed_result() -> None:
    assert rp.RequestLog.from_result(CLIENT_JSON) is None  # saved without --save-detailed
    d = _detail([10.0, 11.0, 12.0], [0.5, 0.0, 2.0], ["", "Service Unavailable", ""])
    log = rp.RequestLog.from_result(d)
    assert log is not None
    assert log.ok() == [0, 2]
    assert log.span() == (10.0, 14.0)
    assert log.error_counts() == {"Service Unavailable": 1}
    tb = "Traceback (most recent call last):\n  File x\naiohttp.ClientOSError: reset"
    log = rp.RequestLog.from_result(_detail([1.0, 2.0], [0.0, 0.0], [tb, tb]))
    assert log is not None and log.error_counts() == {"aiohttp.ClientOSError: reset": 2}
    with pytest.raises(ValueError, match="different lengths"):
        rp.RequestLog.from_result({**d, "errors": ["", ""]})


def test_noisy_metrics_alone_has_only_the_chat_callers_numbers() -> None:
    chat = {"ttft_p50": 20.0, "ttft_p95": 30.0, "completed": 120.0, "failed": 0.0, "req_s": 3.0}
    m = rp.noisy_metrics({"chat": chat}, {})
    assert m == {
        "chat_ttft_p50": 20.0,
        "chat_ttft_p95": 30.0,
        "chat_completed": 120.0,
        "chat_failed": 0.0,
    }


def test_noisy_metrics_count_the_flood_inside_the_chat_span() -> None:
    # chat: sent at 10..19 s, last answer at 20 s (span 10 s); the first refused;
    # TTFTs 10, 20, ..., 100 ms
    chat_log = _detail(
        [10.0 + i for i in range(10)],
        [0.0] + [1.0] * 9,
        ["Busy"] + [""] * 9,
        ttfts=[0.01 * (i + 1) for i in range(10)],
    )
    # flood: ends at 5 (before), 12, 15, 19.5 (inside), 25 (after); one refused inside
    flood_log = _detail(
        [0.0, 2.0, 5.0, 9.5, 14.0, 15.0],
        [5.0, 10.0, 10.0, 10.0, 11.0, 0.0],
        ["", "", "", "", "", "Too Many Requests"],
        out=128,
    )
    results = {
        "chat": {"ttft_p95": 40.0, "completed": 9.0, "failed": 1.0},
        "flood": {"completed": 5.0, "failed": 1.0, "req_s": 0.2},
    }
    chat = rp.RequestLog.from_result(chat_log)
    flood = rp.RequestLog.from_result(flood_log)
    assert chat is not None and flood is not None
    m = rp.noisy_metrics(results, {"chat": chat, "flood": flood})
    # the chat percentiles count the answered requests sent beside the flood:
    # 20..100 ms (the client's own p95, 40, covered requests without it)
    assert m["chat_ttft_p50"] == pytest.approx(60.0)
    assert m["chat_ttft_p95"] == pytest.approx(96.0)
    assert m["chat_failed"] == 1.0
    assert m["flood_completed"] == 5.0 and m["flood_failed"] == 1.0
    assert m["flood_span_completed"] == 3.0  # ends at 12, 15 and 19.5
    assert m["flood_span_req_s"] == pytest.approx(0.3)
    assert m["flood_span_tok_s"] == pytest.approx(3 * 128 / 10)
    # the flood ran 0..25 s: every chat request was sent beside it
    assert m["chat_beside_flood"] == 1.0
    early = rp.RequestLog.from_result(_detail([0.0], [14.5], [""]))
    assert early is not None
    m = rp.noisy_metrics(results, {"chat": chat, "flood": early})
    assert m["chat_beside_flood"] == pytest.approx(0.5)  # the flood ended at 14.5
    assert m["chat_ttft_p50"] == pytest.approx(35.0)  # 20..50 ms: sent at 11..14 s


# ------------------------------------------------------------- targets


def _noisy_records(
    s_alone: float, s_flood: float, v_flood: float, *, refused: float = 0.0, s_fl: float = 5.0
) -> list[rp.Record]:
    recs = []
    for rep in (1, 2, 3):
        recs += [
            rp.Record(NOISY, ALONE_POINT, rp.SLUICE, rep, {"chat_ttft_p95": s_alone}),
            rp.Record(NOISY, ALONE_POINT, rp.VLLM, rep, {"chat_ttft_p95": 25.0}),
            rp.Record(
                NOISY,
                FLOOD_POINT,
                rp.SLUICE,
                rep,
                {
                    "chat_ttft_p95": s_flood,
                    "chat_failed": refused if rep == 2 else 0.0,
                    "chat_completed": 120.0,
                    "flood_span_req_s": s_fl,
                    "flood_span_completed": s_fl * 40,
                    "chat_beside_flood": 1.0,
                },
            ),
            rp.Record(
                NOISY,
                FLOOD_POINT,
                rp.VLLM,
                rep,
                {
                    "chat_ttft_p95": v_flood,
                    "chat_failed": 0.0,
                    "flood_span_req_s": 5.0,
                    "flood_span_completed": 200.0,
                    "chat_beside_flood": 0.95 if rep == 3 else 1.0,
                },
            ),
        ]
    return recs


def test_issue11_noisy_neighbour_targets_met() -> None:
    rows = tg.issue11(_noisy_records(30.0, 150.0, 7000.0))
    by = {t: (m, v) for t, m, v in rows}
    within = by["noisy neighbour: chat TTFT p95 beside the flood <= 3x alone (or alone + 150 ms)"]
    assert within == ("150 ms vs 30 ms alone (5.0x; bound 180 ms)", "met")
    better = by["noisy neighbour: chat TTFT p95 beside the flood >= 5x better than vLLM"]
    assert better[1] == "met" and "46.7x better" in better[0] and "vLLM 25 ms alone" in better[0]
    assert by["noisy neighbour: the chat caller is never refused"][1] == "met"
    assert by["noisy neighbour: flood throughput >= 0.9x vLLM's"] == (
        "5.00 vs 5.00 req/s (1.00x; 200 vs 200 completed)",
        "met",
    )
    check = by[
        "noisy neighbour (set-up check): chat requests sent while the flood ran "
        "(the TTFT rows count only these)"
    ]
    assert check == ("95% (lowest over systems and repetitions)", "ok")


def test_issue11_noisy_neighbour_targets_missed() -> None:
    by = {
        t: (m, v)
        for t, m, v in tg.issue11(_noisy_records(30.0, 400.0, 1000.0, refused=84.0, s_fl=4.0))
    }
    assert (
        by["noisy neighbour: chat TTFT p95 beside the flood <= 3x alone (or alone + 150 ms)"][1]
        == "MISSED"
    )
    assert (
        by["noisy neighbour: chat TTFT p95 beside the flood >= 5x better than vLLM"][1] == "MISSED"
    )
    # one repetition refused 84: the worst repetition decides
    assert by["noisy neighbour: the chat caller is never refused"] == (
        "84 of 204 refused (worst repetition)",
        "MISSED",
    )
    assert by["noisy neighbour: flood throughput >= 0.9x vLLM's"][1] == "MISSED"


def test_issue11_sweep_and_past_capacity_targets() -> None:
    recs = []
    for system, rates in (
        (rp.SLUICE, (10.0, 40.0, 45.0, 44.4)),
        (rp.VLLM, (10.5, 41.0, 52.0, 51.1)),
    ):
        for point, r in zip(("c=1", "c=32", "c=128", WIDE_POINT), rates, strict=True):
            recs.append(rp.Record(CONCURRENCY, point, system, 1, {"req_s": r, "ttft_p99": r * 100}))
    recs.append(
        rp.Record(PAST_CAPACITY, "24 req/s", rp.SLUICE, 1, {"short_ttft_p95": 50.0, "failed": 3.0})
    )
    recs.append(rp.Record(PAST_CAPACITY, "24 req/s", rp.VLLM, 1, {"short_ttft_p95": 90.0}))
    by = {t: (m, v) for t, m, v in tg.issue11(recs)}
    assert by["mixed past capacity (24 req/s): short TTFT p95 >= 2x better than vLLM"] == (
        "50 ms vs 90 ms (1.80x better)",
        "MISSED",
    )
    assert by["mixed past capacity (24 req/s): nothing refused (TTFT counts answers only)"] == (
        "3 refused (worst repetition)",
        "MISSED",
    )
    sweep = "no throughput regression (Sluice req/s >= 0.9x vLLM, noise band)"
    assert by[f"c=1: {sweep}"] == ("0.95x", "met")
    assert by[f"c=32: {sweep}"] == ("0.98x", "met")
    assert by[f"c=128: {sweep}"] == ("0.87x", "MISSED")
    assert by[f"{WIDE_POINT}: req/s at least parity with vLLM"] == (
        "44.4 vs 51.1 req/s (0.87x)",
        "MISSED",
    )
    assert by[f"{WIDE_POINT}: TTFT p99 at least parity with vLLM"] == (
        "4,440 ms vs 5,110 ms (0.87x)",
        "met",
    )
    assert not any(t.startswith("noisy") for t in by)  # not run: no rows
    assert tg.issue11([]) == [] and tg.issue7([]) == []


# ------------------------------------------------------- callers, flags


def test_callers_file_is_valid_toml() -> None:
    import tomllib

    from bench.run.servers import callers_toml

    text = callers_toml({"chat": "sk-bench-1", "batch": 'k"ey'})
    assert tomllib.loads(text) == {
        "callers": {
            "chat": {"key": "sk-bench-1", "weight": 1},
            "batch": {"key": 'k"ey', "weight": 1},
        }
    }
    with pytest.raises(ValueError):
        callers_toml({"a b": "k"})
    marked = tomllib.loads(callers_toml({"chat": "k1", "batch": "k2"}, background=("batch",)))
    assert marked["callers"]["batch"]["background"] is True  # issue 49's flood
    assert "background" not in marked["callers"]["chat"]


def test_has_flag_reads_whole_options() -> None:
    from bench.run.servers import has_flag

    help_text = "usage: sluice serve [-h] [--callers CALLERS]\n  --callers-reload  x\n"
    assert has_flag(help_text, "--callers")
    assert not has_flag("usage: [--callers-reload]", "--callers")
    assert not has_flag("usage: [--no-callers]", "--callers")


def test_client_argv_sends_the_callers_key_as_a_header(tmp_path: Path) -> None:
    from bench.run import runner as rn
    from bench.scenarios import Job

    cfg = rn.RunConfig(
        name="t",
        results_dir=tmp_path,
        engine_flags=[],
        served_name="m",
        tokenizer="m",
        max_model_len=4096,
        plan=build_plan([], QUICK, max_model_len=4096),
        repeat=1,
        quick=True,
    )
    job = Job("chat", ("--num-prompts", "3"), caller="chat")
    argv = rn.client_argv(cfg, "http://h:1", job, 7, tmp_path / "r.json", "sk-1")
    assert argv[-2:] == ["--header", "Authorization=Bearer sk-1"]
    assert "--header" not in rn.client_argv(cfg, "http://h:1", job, 7, tmp_path / "r.json")


# ---------------------------------------------------- panels and report


def test_panel_point_filters() -> None:
    recs = [
        rp.Record(CONCURRENCY, "c=32", rp.SLUICE, 1, {"req_s": 40.0}),
        rp.Record(CONCURRENCY, WIDE_POINT, rp.SLUICE, 1, {"req_s": 44.0}),
        rp.Record(CONCURRENCY, WIDE_POINT, rp.VLLM, 1, {"req_s": 51.0}),
    ]
    table = rp.aggregate(recs, CONCURRENCY)
    line = rp.LinePanel(CONCURRENCY, "req_s", "t", "c", skip=(WIDE_POINT,))
    assert [x for x, _ in rp.line_series(table, line)[rp.SLUICE]] == [32.0]
    assert rp.VLLM not in rp.line_series(table, line)
    bars = rp.BarPanel(CONCURRENCY, (("req/s", "req_s"),), "t", "r", only=(WIDE_POINT,))
    labels, per = rp.bar_groups(table, bars)
    assert labels == ["req/s"]  # one point selected: no point name under the label
    assert [v.median if v else None for v in per[rp.VLLM]] == [51.0]


def test_report_renders_the_backlog_targets_notes_and_sections(tmp_path: Path) -> None:
    from bench.report import markdown as rn

    recs = _noisy_records(30.0, 150.0, 7000.0)
    md = rn.render_markdown(
        "t",
        recs,
        quick=False,
        repeat=3,
        info={},
        commands={},
        start_times=[],
        plot_msg="plot skipped",
        wall_seconds=None,
        notes=["Sluice, noisy_neighbour / chat + flood, rep 1, chat: 2 of 120 requests failed"],
    )
    assert "## Targets (issue 11: the held backlog)" in md
    assert "## Targets (issue 7)" not in md  # no issue-7 scenario in these records
    assert "## Notes\n\n- Sluice, noisy_neighbour" in md
    assert "## Noisy neighbour on a KV-bound engine" in md
    assert "| chat + flood | chat TTFT p95 (ms) | 150 | 7,000 | 0.02x |" in md
    # the noisy tables read back for --plot-from-md
    back = rp.tables_from_markdown(md, rn.SCENARIO_TITLES, 3)
    assert back[NOISY].get(FLOOD_POINT, rp.VLLM, "chat_ttft_p95") == rp.Spread(
        7000.0, 7000.0, 7000.0, 3
    )
    pytest.importorskip("matplotlib")
    tables = {NOISY: rp.aggregate(recs, NOISY)}
    assert rp.write_panels(tables, rn.PANELS, tmp_path / "p.png", "t").startswith("plot written")


# ------------------------------------------------------- issue 21's scenarios


def test_plan_issue21_scenarios() -> None:
    from bench.scenarios import (
        BULK_CALLERS,
        CHAT_MIX,
        SPREAD,
        SPREAD_CONCURRENCY,
        THREE,
        kv_bound,
    )

    plan = build_plan([SPREAD, THREE, CHAT_MIX], FULL, max_model_len=8192, kv_bytes_per_token=1024)
    spread = next(p for p in plan.points if p.scenario == SPREAD)
    args = spread.jobs[0].args
    assert _arg(args, "--max-concurrency") == str(SPREAD_CONCURRENCY) == "384"
    assert int(_arg(args, "--num-prompts")) >= SPREAD_CONCURRENCY
    ratio = json.loads(_arg(args, "--random-range-ratio"))
    lo = int(_arg(args, "--random-input-len")) * (1 - ratio["input"])
    hi = int(_arg(args, "--random-input-len")) * (1 + ratio["input"])
    assert (round(lo), round(hi), ratio["output"]) == (16, 700, 0)  # outputs stay at 32
    assert _arg(args, "--random-output-len") == "32" and "--save-detailed" in args
    assert spread.engine is None  # the run's engine, as the issue measured it
    # three callers: the noisy neighbour's chat job (and its alone point) on the KV-bound engine
    three = next(p for p in plan.points if p.scenario == THREE)
    assert three.callers == ("chat", *BULK_CALLERS)
    assert three.engine == kv_bound(1024)
    assert [(p.scenario, p.name) for p in plan.points if p.scenario == NOISY] == [
        (NOISY, ALONE_POINT)
    ]
    for job in three.jobs[1:]:
        assert _arg(job.args, "--max-concurrency") == "16"
        assert _arg(job.args, "--random-input-len") == "1500"
        assert "--save-detailed" in job.args
    # the chat mix: 24 streams, 70/20/10, chat API, each class about as long
    mix = next(p for p in plan.points if p.scenario == CHAT_MIX)
    assert [j.role for j in mix.jobs] == ["short", "medium", "long"]
    assert all(j.chat for j in mix.jobs)
    streams = [int(_arg(j.args, "--max-concurrency")) for j in mix.jobs]
    assert streams == [17, 5, 2] and sum(streams) == 24
    lens = [
        (_arg(j.args, "--random-input-len"), _arg(j.args, "--random-output-len")) for j in mix.jobs
    ]
    assert lens == [("30", "24"), ("220", "64"), ("720", "128")]
    tokens_per_stream = [
        int(_arg(j.args, "--num-prompts")) / s * int(o)
        for j, s, (_, o) in zip(mix.jobs, streams, lens, strict=True)
    ]
    assert max(tokens_per_stream) / min(tokens_per_stream) < 1.1
    # with the noisy neighbour selected too, its alone point appears once
    both = build_plan([NOISY, THREE], QUICK, max_model_len=8192, kv_bytes_per_token=1024)
    assert [p.name for p in both.points].count(ALONE_POINT) == 1


def test_spread_metrics_split_the_answered_requests_by_prompt_length() -> None:
    # 7 requests: lengths 700..100 (sent longest first), TTFT = length / 10 ms;
    # the shortest refused (no TTFT)
    lens = [700, 600, 500, 400, 300, 200, 100]
    d = _detail(
        [0.0] * 7,
        [1.0] * 7,
        ["", "", "", "", "", "", "Busy"],
        ttfts=[n / 10_000 for n in lens[:-1]] + [0.0],
    )
    log = rp.RequestLog.from_result({**d, "input_lens": lens})
    assert log is not None and log.input_lens == tuple(lens)
    m = rp.spread_metrics({"ttft_p99": 1.0, "completed": 6.0}, log)
    assert m["ttft_p99"] == 1.0 and m["completed"] == 6.0  # the client's own, kept
    assert m["ttft_max"] == pytest.approx(70.0)
    # 6 answered: thirds of 2: (200, 300) and (600, 700)
    assert m["short_third_ttft_p95"] == pytest.approx(20 + 10 * 0.95)
    assert m["long_third_ttft_p99"] == pytest.approx(60 + 10 * 0.99)
    assert rp.spread_metrics({"req_s": 2.0}, None) == {"req_s": 2.0}
    with pytest.raises(ValueError, match="different lengths"):
        rp.RequestLog.from_result({**d, "input_lens": [1, 2]})


def test_three_caller_metrics_count_each_bulk_caller_inside_the_chat_span() -> None:
    chat = rp.RequestLog.from_result(_detail([10.0, 15.0], [1.0, 5.0], ["", ""]))  # span 10..20
    # bulk_a: one end inside (12); bulk_b: three inside (11, 14, 19), one after (25)
    a = rp.RequestLog.from_result(_detail([0.0, 2.0], [12.0, 30.0], ["", ""]))
    b = rp.RequestLog.from_result(_detail([5.0, 6.0, 7.0, 8.0], [6.0, 8.0, 12.0, 17.0], [""] * 4))
    assert chat is not None and a is not None and b is not None
    results = {
        "chat": {"ttft_p95": 20.0},
        "bulk_a": {"completed": 2.0},
        "bulk_b": {"completed": 4.0},
    }
    m = rp.three_caller_metrics(
        results, {"chat": chat, "bulk_a": a, "bulk_b": b}, ("bulk_a", "bulk_b")
    )
    assert (m["bulk_a_span_completed"], m["bulk_b_span_completed"]) == (1.0, 3.0)
    assert m["bulk_span_completed"] == 4.0
    assert m["bulk_span_req_s"] == pytest.approx(0.4)
    assert m["bulk_b_per_a"] == 3.0
    assert m["chat_beside_bulk"] == 1.0 and "chat_beside_bulk_a_bulk_b" not in m
    assert m["bulk_a_completed"] == 2.0


def _issue21_records(
    *, s_p99: float, s_short: float, s_three: float, s_bulk: float, per_a: float
) -> list[rp.Record]:
    from bench.scenarios import CHAT_MIX, SPREAD, SPREAD_POINT, THREE, THREE_POINT

    recs = []
    for rep in (1, 2, 3):
        recs += [
            rp.Record(
                SPREAD,
                SPREAD_POINT,
                rp.SLUICE,
                rep,
                {
                    "ttft_p99": s_p99,
                    "ttft_max": 9000.0,
                    "short_third_ttft_p95": s_short,
                    "long_third_ttft_p99": 8000.0,
                    "req_s": 20.0,
                },
            ),
            rp.Record(
                SPREAD,
                SPREAD_POINT,
                rp.VLLM,
                rep,
                {
                    "ttft_p99": 6000.0,
                    "ttft_max": 7000.0,
                    "short_third_ttft_p95": 5000.0,
                    "long_third_ttft_p99": 6000.0,
                    "req_s": 20.0,
                },
            ),
            rp.Record(NOISY, ALONE_POINT, rp.SLUICE, rep, {"chat_ttft_p95": 17.0}),
            rp.Record(
                THREE,
                THREE_POINT,
                rp.SLUICE,
                rep,
                {"chat_ttft_p95": s_three, "bulk_span_req_s": s_bulk, "bulk_b_per_a": per_a},
            ),
            rp.Record(
                THREE, THREE_POINT, rp.VLLM, rep, {"chat_ttft_p95": 1400.0, "bulk_span_req_s": 10.0}
            ),
            rp.Record(CHAT_MIX, "24 streams", rp.SLUICE, rep, {"short_ttft_p95": 40.0}),
            rp.Record(CHAT_MIX, "24 streams", rp.VLLM, rep, {"short_ttft_p95": 60.0}),
            # past capacity: 3x, 3x, then 1.5x better in the third repetition
            rp.Record(
                PAST_CAPACITY,
                "32 req/s",
                rp.SLUICE,
                rep,
                {"short_ttft_p95": 1000.0 if rep < 3 else 2000.0},
            ),
            rp.Record(PAST_CAPACITY, "32 req/s", rp.VLLM, rep, {"short_ttft_p95": 3000.0}),
        ]
    return recs


@pytest.mark.parametrize(
    ("per_a", "verdict"), [(2.45, "met"), (3.55, "met"), (2.35, "MISSED"), (3.65, "MISSED")]
)
def test_the_bulk_split_bound_is_20_percent_either_side_of_3(per_a: float, verdict: str) -> None:
    recs = _issue21_records(s_p99=6300.0, s_short=3000.0, s_three=45.0, s_bulk=9.6, per_a=per_a)
    by = {t: (m, v) for t, m, v in tg.issue21(recs)}
    got = by["three callers: bulk callers' completed work within 20% of 1:3 (Sluice)"]
    assert got == (f"bulk_b / bulk_a = {per_a:.2f} (bound 2.40-3.60)", verdict)


def test_issue21_targets() -> None:
    from bench.scenarios import SPREAD_POINT

    recs = _issue21_records(s_p99=6300.0, s_short=3000.0, s_three=45.0, s_bulk=9.6, per_a=3.3)
    by = {t: (m, v) for t, m, v in tg.issue21(recs)}
    assert by[f"{SPREAD_POINT}: TTFT p99 <= 1.1x vLLM's"] == (
        "6,300 ms vs 6,000 ms (1.05x)",
        "met",
    )
    assert by[f"{SPREAD_POINT}: max TTFT <= 1.5x vLLM's"][1] == "met"  # 1.29x
    assert by[f"{SPREAD_POINT}: shortest third's TTFT p95 <= 0.7x vLLM's"][1] == "met"  # 0.6x
    assert by[f"{SPREAD_POINT}: longest third's TTFT p99 (reported, no target)"][1] == "–"
    assert by[f"{SPREAD_POINT}: completed per second >= 0.95x vLLM's"][1] == "met"
    # 45 ms against 17 ms alone: within alone + 30 ms (47), though above 2x (34)
    assert by["three callers: chat TTFT p95 <= 2x alone (or alone + 30 ms)"] == (
        "45 ms vs 17 ms alone (2.6x; bound 47 ms)",
        "met",
    )
    assert by["three callers: bulk throughput >= 0.95x vLLM's"] == (
        "9.60 req/s vs 10.00 req/s (0.96x)",
        "met",
    )
    share = by["three callers: bulk callers' completed work within 20% of 1:3 (Sluice)"]
    assert share == ("bulk_b / bulk_a = 3.30 (bound 2.40-3.60)", "met")
    every = by[
        "mixed past capacity (32 req/s): short TTFT p95 >= 2x better than "
        "vLLM's in every repetition"
    ]
    assert every == ("3.00x, 3.00x, 1.50x better", "MISSED")  # the median alone would pass
    assert by["chat mix below capacity (24 streams): short TTFT p95 <= 0.8x vLLM's"][1] == "met"
    assert not any("noisy neighbour" in t for t in by)  # no flood point: no rows

    recs = _issue21_records(s_p99=7000.0, s_short=4000.0, s_three=48.0, s_bulk=9.0, per_a=2.0)
    by = {t: (m, v) for t, m, v in tg.issue21(recs)}
    assert by[f"{SPREAD_POINT}: TTFT p99 <= 1.1x vLLM's"][1] == "MISSED"  # 1.17x
    assert by[f"{SPREAD_POINT}: shortest third's TTFT p95 <= 0.7x vLLM's"][1] == "MISSED"
    assert by["three callers: chat TTFT p95 <= 2x alone (or alone + 30 ms)"][1] == "MISSED"
    assert by["three callers: bulk throughput >= 0.95x vLLM's"][1] == "MISSED"
    assert by["three callers: bulk callers' completed work within 20% of 1:3 (Sluice)"][1] == (
        "MISSED"
    )
    assert tg.issue21([]) == []


def test_callers_file_carries_the_weights() -> None:
    import tomllib

    from bench.run.servers import callers_toml
    from bench.scenarios import CALLER_WEIGHTS

    text = callers_toml({"chat": "k1", "bulk_a": "k2", "bulk_b": "k3"}, CALLER_WEIGHTS)
    weights = {n: c["weight"] for n, c in tomllib.loads(text)["callers"].items()}
    assert weights == {"chat": 1, "bulk_a": 1, "bulk_b": 3}


def test_report_renders_issue21_sections(tmp_path: Path) -> None:
    from bench.report import markdown as rn
    from bench.scenarios import CHAT_MIX, SPREAD, THREE

    recs = _issue21_records(s_p99=6300.0, s_short=3000.0, s_three=45.0, s_bulk=9.6, per_a=3.3)
    md = rn.render_markdown(
        "t",
        recs,
        quick=False,
        repeat=3,
        info={},
        commands={},
        start_times=[],
        plot_msg="plot skipped",
        wall_seconds=None,
    )
    assert "## Targets (issue 21: the release key and the engine step)" in md
    for sc in (SPREAD, THREE, CHAT_MIX):
        assert f"## {rn.SCENARIO_TITLES[sc]}" in md
    assert "| shortest third's TTFT p95 (ms) | 3,000 | 5,000 | 0.60x |" in md
    back = rp.tables_from_markdown(md, rn.SCENARIO_TITLES, 3)
    assert back[THREE].get("chat + 2 bulk (1:1:3)", rp.VLLM, "chat_ttft_p95") is not None
    pytest.importorskip("matplotlib")
    tables = {sc: rp.aggregate(recs, sc) for sc in (SPREAD, THREE, CHAT_MIX)}
    assert rp.write_panels(tables, rn.PANELS, tmp_path / "p.png", "t").startswith("plot written")


def test_bench_gives_every_system_the_step_flags_sluice_would_set(demo_model_dir: Path) -> None:
    from bench.run.engine_flags import step_flags as _step_flags

    flags = ["--model", str(demo_model_dir), "--max-model-len", "4096"]
    assert _step_flags(flags) == [
        "--long-prefill-token-threshold",
        "512",
        "--long-prefill-token-threshold-adaptive",
    ]
    # a user's choice goes to every system as given: nothing added
    assert _step_flags([*flags, "--long-prefill-token-threshold", "0"]) == []
    assert _step_flags([*flags, "--no-long-prefill-token-threshold-adaptive"]) == []


def test_api_point_reports_the_apis_and_their_translation_cost() -> None:
    from bench.points import api_point as ap

    def run(req_s: float, cpu_ms: float, out_tok: float = 64.0) -> dict[str, float]:
        return {"req_s": req_s, "ttft_p50": 30, "ttft_p99": 90, "cpu_ms": cpu_ms,
                "out_tok": out_tok, "failed": 0}  # fmt: skip

    results = {
        (rp.SLUICE, "chat"): [run(20.0, 4.0), run(22.0, 4.4), run(21.0, 4.2)],
        (rp.SLUICE, "responses"): [run(21.0, 4.4)],
        (rp.SLUICE, "messages"): [run(19.0, 4.62)],
        (rp.SLUICE, "ollama"): [run(20.5, 4.83)],
        (rp.VLLM, "chat"): [run(18.0, 8.0)],
        (rp.VLLM, "messages"): [run(18.0, 8.0, out_tok=40.0)],
    }
    md = "\n".join(ap.report(results, 3, 256))
    assert "| sluice chat | 21.0 [20.0-22.0] | 30 [30-30] | 90 [90-90] | 64.0 [64.0-64.0] |" in md
    assert "| vllm messages | 18.0 [18.0-18.0] | 30 [30-30] | 90 [90-90] | 40.0 [40.0-40.0] |" in md
    assert ap.translation_cost(results) == [
        "* sluice responses / chat: req/s 1.000x (within the 5% budget); "
        "front CPU 4.40 against 4.20 ms/req (+4.8%).",
        "* sluice messages / chat: req/s 0.905x (over the 5% budget); "
        "front CPU 4.62 against 4.20 ms/req (+10.0%).",
        # Ollama's is priced in front CPU too (issue 31: within 10%).
        "* sluice ollama / chat: req/s 0.976x (within the 5% budget); "
        "front CPU 4.83 against 4.20 ms/req (+15.0%, over the 10% budget).",
        "* vllm messages / chat: req/s 1.000x (within the 5% budget); "
        "front CPU 8.00 against 8.00 ms/req (+0.0%).",
    ]
    assert all(line in md for line in ap.translation_cost(results))
    assert set(ap.APIS) == {"chat", "responses", "messages", "ollama"}
    assert ap.APIS["messages"][:2] == ("anthropic-messages", "/v1/messages")
    assert ap.APIS["ollama"][:2] == ("ollama-chat", "/api/chat")
    assert ap.UNSPOKEN[rp.VLLM] == {"ollama"}  # vLLM's own server has no Ollama API


def test_running_summary_and_the_sampler_read_each_servers_gauge() -> None:
    """The runner's /metrics sampler sums vLLM's per-engine series (one per DP
    rank) and reads Sluice's gauge; peak and median of what it saw."""
    from bench.run.runner import _running_sampler

    class Scraped:
        def __init__(self, texts: list[str]) -> None:
            self.texts = texts
            self.calls = 0

        def metrics(self) -> str:
            self.calls += 1
            return self.texts[min(self.calls, len(self.texts)) - 1]

    def text(*per_engine: float) -> str:
        return "\n".join(
            f'vllm:num_requests_running{{engine="{i}"}} {v}' for i, v in enumerate(per_engine)
        )

    vllm = Scraped([text(60.0, 60.0), text(128.0, 120.0)])
    with _running_sampler(vllm, rp.VLLM, on=True) as samples:  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while len(samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the sampler thread's third scrape
    assert samples[:2] == [120.0, 248.0]
    assert rp.running_summary(samples[:2]) == {
        "running_peak": 248.0,
        "running_p50": 184.0,
        "running_mean": 184.0,
    }
    sluice = Scraped(["sluice_engine_requests_running 17.0"])
    with _running_sampler(sluice, rp.SLUICE, on=False) as none:  # type: ignore[arg-type]
        pass
    assert none == [] and sluice.calls == 0 and rp.running_summary(none) == {}


def _dp_records(peak: float, s_req: float, s_p99: float) -> list[rp.Record]:
    from bench.scenarios import DATA_PARALLEL

    point = "c=256 (64 in, 64 out)"
    return [
        r
        for rep in (1, 2, 3)
        for r in (
            rp.Record(
                DATA_PARALLEL,
                point,
                rp.SLUICE,
                rep,
                {"running_peak": peak, "req_s": s_req, "ttft_p99": s_p99},
            ),
            rp.Record(
                DATA_PARALLEL,
                point,
                rp.VLLM,
                rep,
                {"running_peak": 256.0, "req_s": 40.0, "ttft_p99": 3000.0},
            ),
        )
    ]


def test_issue19_data_parallel_targets() -> None:
    rows = {t: (m, v) for t, m, v in tg.issue19(_dp_records(250.0, 39.0, 3200.0))}
    p = "data parallel (c=256 (64 in, 64 out))"
    assert rows[f"{p}: the engine's running count reaches the summed slots (2 x 128 = 256)"] == (
        "peak 250 (vLLM's server: 256)",
        "met",
    )
    assert rows[f"{p}: req/s >= 0.95x vLLM"] == ("39.00 req/s vs 40.00 req/s (0.97x)", "met")
    assert rows[f"{p}: TTFT p99 <= 1.1x vLLM"] == ("3,200 ms vs 3,000 ms (1.07x)", "met")
    # One rank's worth running (issue 19's 43-93), slower and with a long tail.
    missed = {t: v for t, _, v in tg.issue19(_dp_records(93.0, 30.0, 9000.0))}
    assert set(missed.values()) == {"MISSED"} and len(missed) == 3
    assert tg.issue19([]) == []


def _issue27_records(underfed: float, s_req: float, n_req: float, chat: float) -> list[rp.Record]:
    """One repetition: the spread point on the three systems, c=512, DP, LoRA and the
    two chat points, Sluice's under-fed counts on each saturated point."""
    from bench.scenarios import DATA_PARALLEL, LORA, LORA_POINT, SPREAD, SPREAD_POINT, THREE
    from bench.scenarios import THREE_POINT as TP

    fed = {"held_steps": 1000.0, "underfed_steps": underfed, "underfed_share": underfed / 1000}
    dp = tg.DP_WIDE_POINT
    return [
        rp.Record(
            SPREAD,
            SPREAD_POINT,
            rp.SLUICE,
            1,
            {"req_s": s_req, "ttft_p99": 8000.0, "running_mean": 120.0, **fed},
        ),
        rp.Record(
            SPREAD,
            SPREAD_POINT,
            rp.VLLM,
            1,
            {"req_s": 43.0, "ttft_p99": 8200.0, "running_mean": 122.0},
        ),
        rp.Record(SPREAD, SPREAD_POINT, rp.NOHOLD, 1, {"req_s": n_req}),
        rp.Record(CONCURRENCY, WIDE_POINT, rp.SLUICE, 1, {"ttft_p99": 5300.0, **fed}),
        rp.Record(CONCURRENCY, WIDE_POINT, rp.VLLM, 1, {"ttft_p99": 5000.0}),
        rp.Record(DATA_PARALLEL, dp, rp.SLUICE, 1, {"req_s": 40.0, "ttft_p99": 8000.0, **fed}),
        rp.Record(DATA_PARALLEL, dp, rp.VLLM, 1, {"req_s": 40.5, "ttft_p99": 7500.0}),
        rp.Record(LORA, LORA_POINT, rp.SLUICE, 1, {"worst_ttft_p95": 2800.0, "share_dev": 0.06}),
        rp.Record(LORA, LORA_POINT, rp.VLLM, 1, {"worst_ttft_p95": 2817.0}),
        rp.Record(NOISY, FLOOD_POINT, rp.SLUICE, 1, {"chat_ttft_p95": chat, **fed}),
        rp.Record(THREE, TP, rp.SLUICE, 1, {"chat_ttft_p95": chat, "bulk_b_per_a": 3.1}),
    ]


def test_issue27_targets() -> None:
    from bench.scenarios import SPREAD_POINT

    by = {t: (m, v) for t, m, v in tg.issue27(_issue27_records(15.0, 43.5, 44.0, 60.0))}
    assert by[
        f"{SPREAD_POINT}: under-fed steps <= 2% of the steps beside a held backlog (Sluice)"
    ] == (
        "1.5% (15 of 1,000)",
        "met",
    )
    assert (
        by[f"{WIDE_POINT}: under-fed steps <= 2% of the steps beside a held backlog (Sluice)"][1]
        == "met"
    )
    assert by[f"{SPREAD_POINT}: req/s >= 1.0x vLLM's"] == (
        "43.50 req/s vs 43.00 req/s (1.01x)",
        "met",
    )
    assert by[f"{SPREAD_POINT}: req/s >= 0.98x Sluice's own --no-hold-backlog"][1] == "met"
    assert by[f"{SPREAD_POINT}: TTFT p99 <= 1.0x vLLM's"][1] == "met"
    assert (
        by[f"{SPREAD_POINT}: requests in the engine (its running count, mean) >= 0.95x vLLM's"][1]
        == "met"
    )
    assert by[f"{WIDE_POINT}: TTFT p99 <= 1.07x vLLM's"] == ("5,300 ms vs 5,000 ms (1.06x)", "met")
    assert by[f"data parallel ({tg.DP_WIDE_POINT}): req/s >= 0.98x vLLM's"][1] == "met"
    assert by[f"data parallel ({tg.DP_WIDE_POINT}): TTFT p99 <= 1.1x vLLM's"][1] == "met"
    assert by["LoRA: worst caller's TTFT p95 <= vLLM's worst"][1] == "met"
    assert by["LoRA: every caller's share of service within 10% of a quarter (Sluice)"][1] == "met"
    assert by["noisy neighbour: chat TTFT p95 <= 75 ms (Sluice)"] == ("60 ms", "met")
    assert by["three callers: chat TTFT p95 <= 68 ms (Sluice)"][1] == "met"
    # Four under-fed rows: the spread, c=512, DP and the flood; not the three callers
    # (no counts there) nor LoRA.
    assert sum("under-fed" in t for t in by) == 4

    by = {t: (m, v) for t, m, v in tg.issue27(_issue27_records(25.0, 42.0, 44.0, 80.0))}
    assert (
        by[f"{SPREAD_POINT}: under-fed steps <= 2% of the steps beside a held backlog (Sluice)"][1]
        == "MISSED"
    )
    assert by[f"{SPREAD_POINT}: req/s >= 1.0x vLLM's"][1] == "MISSED"
    assert by[f"{SPREAD_POINT}: req/s >= 0.98x Sluice's own --no-hold-backlog"] == (
        "42.00 req/s vs 44.00 req/s (0.95x)",
        "MISSED",
    )
    assert by["noisy neighbour: chat TTFT p95 <= 75 ms (Sluice)"][1] == "MISSED"
    assert by["three callers: chat TTFT p95 <= 68 ms (Sluice)"][1] == "MISSED"
    assert tg.issue27([]) == []


def test_nohold_is_sluice_without_its_held_backlog() -> None:
    from bench.run.servers import ready_path, server_command

    cmd = server_command(rp.NOHOLD, 8000, ["--model", "m"], ["--window-ms", "5"])
    assert cmd == [
        *server_command(
            rp.SLUICE, 8000, ["--model", "m"], ["--no-hold-backlog", "--window-ms", "5"]
        )
    ]
    assert ready_path(rp.NOHOLD) == "/ready"
    assert rp.RUNNING_METRICS[rp.NOHOLD] == rp.RUNNING_METRICS[rp.SLUICE]


def test_step_time_is_the_mean_step_and_the_points_share_in_steps() -> None:
    """Issue 27: 300 steps that ran 27 s in all, over a 30 s point: 90 ms a step,
    0.9 of the point in steps (what tells longer steps from gaps between them)."""
    counted = {"engine_steps": 300.0, "step_s": 27.0}
    assert rp.step_time(counted, 30.0) == pytest.approx({"step_ms": 90.0, "in_steps": 0.9})
    assert rp.step_time({"engine_steps": 0.0, "step_s": 0.0}, 30.0) == {}  # no step ran
    assert rp.step_time({"engine_steps": 300.0}, 30.0) == {}  # an older Sluice: no time


def test_front_cpu_is_the_server_process_cpu_per_completed_request() -> None:
    jobs = [{"completed": 300.0, "failed": 1.0}, {"completed": 100.0}]
    assert rp.front_cpu(2.0, jobs) == {"front_cpu_ms": 5.0}
    assert rp.front_cpu(2.0, [{"completed": 0.0}]) == {}  # nothing done: no figure


def test_process_cpu_seconds_reads_one_process_user_and_system_time() -> None:
    import os

    from bench.run.servers import process_cpu_seconds

    t0 = time.process_time()
    end = t0 + 0.3
    while time.process_time() < end:  # burn 0.3 s of CPU in this process
        pass
    # /proc counts in clock ticks (10 ms): allow two of them either way.
    assert process_cpu_seconds(os.getpid()) == pytest.approx(time.process_time(), abs=0.02)


def test_issue27_front_cpu_targets() -> None:
    from bench.scenarios import DATA_PARALLEL, dp_point

    def recs(sluice_ms: float) -> list[rp.Record]:
        out = []
        for sc, point in ((CONCURRENCY, "c=128"), (DATA_PARALLEL, dp_point(512))):
            for system, ms in ((rp.SLUICE, sluice_ms), (rp.VLLM, 8.0)):
                out.append(rp.Record(sc, point, system, 1, {"front_cpu_ms": ms}))
        return out

    by = {t: (m, v) for t, m, v in tg.issue27_cpu(recs(4.0))}
    assert by["c=128: front CPU per request <= 0.5x vLLM's server's"] == (
        "4.00 ms/req vs 8.00 ms/req (0.50x)",
        "met",
    )
    assert by[f"{dp_point(512)} (DP=2): front CPU per request <= 0.5x vLLM's server's"][1] == (
        "met"
    )
    assert not any(WIDE_POINT in t for t in by)  # not run: no row
    by = {t: (m, v) for t, m, v in tg.issue27_cpu(recs(4.8))}
    assert by["c=128: front CPU per request <= 0.5x vLLM's server's"][1] == "MISSED"
    assert tg.issue27_cpu([]) == []


def test_plan_prefix_callers() -> None:
    """Issue 28's point: the prefix burst's prompts from four callers, each with
    its key and the same prompts (one seed), on a server of its own (its jobs
    name callers, the other points' do not); asked for by name."""
    from bench.scenarios import (
        DEFAULT_SCENARIOS,
        PREFIX,
        PREFIX_CALLERS,
        callers_of,
        check_callers,
    )

    plan = build_plan([*DEFAULT_SCENARIOS, PREFIX_CALLERS], FULL, max_model_len=8192,
                      kv_bytes_per_token=1024)  # fmt: skip
    check_callers(plan.points)  # a server of its own: no mix of keyed and unkeyed jobs
    (burst,) = [p for p in plan.points if p.scenario == PREFIX]
    (point,) = [p for p in plan.points if p.scenario == PREFIX_CALLERS]
    assert point.engine is not None and point.engine != burst.engine and point.prefix_metrics
    assert len(callers_of([point])) == 4 and len({j.role for j in point.jobs}) == 4
    assert {j.seed_role for j in point.jobs} == {point.jobs[0].role}
    quarter = list(burst.jobs[0].args)
    quarter[quarter.index("--num-prompts") + 1] = "32"
    for j in point.jobs:
        assert list(j.args[: len(quarter)]) == quarter
    assert PREFIX_CALLERS in SCENARIOS and PREFIX_CALLERS not in DEFAULT_SCENARIOS


def test_pooled_metrics_take_every_callers_requests() -> None:
    from bench.report import RequestLog, pooled_metrics

    def log(ttfts: list[float], errors: list[str]) -> RequestLog:
        n = len(ttfts)
        return RequestLog((0.0,) * n, (1.0,) * n, tuple(ttfts), (1,) * n, tuple(errors), ())

    results = {"a": {"completed": 2, "duration_s": 2.0}, "b": {"completed": 2, "duration_s": 4.0}}
    logs = {"a": log([0.1, 0.3], ["", ""]), "b": log([0.2, 9.0], ["", "refused"])}
    out = pooled_metrics(results, logs)
    assert out["req_s"] == 1.0  # 4 completions over the longest job
    assert out["ttft_p50"] == pytest.approx(200.0)  # 100, 200, 300 ms: the refused one left out


def test_issue27_underfed_rows_say_how_much_the_policy_rules_held() -> None:
    """Rules 4-5 (the reserve, one long prefill) hold work the engine would take for
    a short turn's room: the row keeps the whole share as its verdict and says what
    is left without them."""
    from bench.scenarios import NOISY

    rows = _issue27_records(300.0, 43.5, 44.0, 60.0)
    flood = next(r for r in rows if r.scenario == NOISY)
    flood.metrics.update(
        underfed_policy_steps=290.0,
        **rp.underfed_share({**flood.metrics, "underfed_policy_steps": 290.0}),
    )
    by = {t: (m, v) for t, m, v in tg.issue27(rows)}
    row = f"{FLOOD_POINT}: under-fed steps <= 2% of the steps beside a held backlog (Sluice)"
    assert by[row] == (
        "30.0% (300 of 1,000); 1.0% beside work the reserve and long-prefill bound did not hold",
        "MISSED",
    )


def test_underfed_share_less_the_policy_rules() -> None:
    got = rp.underfed_share(
        {"held_steps": 200.0, "underfed_steps": 20.0, "underfed_policy_steps": 15.0}
    )
    assert got == {"underfed_share": 0.1, "underfed_rest_share": 0.025}
    assert rp.underfed_share({"underfed_steps": 3.0}) == {}
