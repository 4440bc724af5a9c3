"""Engine time per request reaches the ledger (issue 52, item 1): the adapter reads
each step as the engine client receives it, vLLM's own EngineCoreOutputs, and
names each output by Sluice's request id (server/engines/vllm_adapter.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.metrics.stats import PrefillStats, SchedulerIterationDetails, SchedulerStats

from server.engines.vllm_adapter import EngineAdapter, step_outputs, watch_outputs


def _state(external: str, parent: str | None = None) -> Any:
    return SimpleNamespace(
        external_req_id=external,
        parent_req=None if parent is None else SimpleNamespace(external_req_id=parent),
    )


def _step(ms: float, ctx: int, gen: int, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
    details = SchedulerIterationDetails(
        iteration_index=0,
        num_ctx_requests=1,
        num_ctx_tokens=ctx,
        num_generation_requests=1,
        num_generation_tokens=gen,
        elapsed_ms=ms,
    )
    return EngineCoreOutputs(
        outputs=outputs, scheduler_stats=SchedulerStats(iteration_details=details)
    )


def _first(rid: str, computed: int) -> EngineCoreOutput:
    ps = PrefillStats()
    ps.num_prompt_tokens = ps.num_computed_tokens = computed
    return EngineCoreOutput(request_id=rid, new_token_ids=[5], prefill_stats=ps)


STATES = {
    "a-12345678": _state("a"),
    "0_b-12345678": _state("0_b-12345678", parent="b"),
}


def test_outputs_are_named_by_sluices_request_ids() -> None:
    outs = step_outputs(
        _step(
            10,
            30,
            1,
            [
                _first("a-12345678", 30),
                EngineCoreOutput(request_id="0_b-12345678", new_token_ids=[1], finish_reason=0),
                EngineCoreOutput(request_id="gone", new_token_ids=[1]),
            ],
        ),
        STATES,
    )
    assert [(o.request_id, o.new_tokens, o.computed, o.finished) for o in outs] == [
        ("a", 1, 30, False),
        ("b", 1, None, True),
    ]


def test_each_step_is_charged_to_its_requests() -> None:
    adapter = EngineAdapter(None, "m")
    adapter._llm = SimpleNamespace(output_processor=SimpleNamespace(request_states=STATES))  # type: ignore[assignment]
    adapter._ledger.admit("b", 10)
    adapter._observe(_step(5, 10, 0, [_first("0_b-12345678", 10)]))
    adapter._ledger.admit("a", 30)
    adapter._observe(
        _step(
            40,
            30,
            1,
            [
                _first("a-12345678", 30),
                EngineCoreOutput(request_id="0_b-12345678", new_token_ids=[1]),
            ],
        )
    )
    assert adapter.charge("a").engine_seconds == pytest.approx(0.040 * 30 / 31)
    assert adapter.charge("b").engine_seconds == pytest.approx(0.005 + 0.040 * 1 / 31)
    assert adapter.charge("a").engine_seconds == 0.0  # taken once


def test_the_step_is_seen_before_the_readers_get_it() -> None:
    seen: list[Any] = []
    step = _step(1, 0, 0, [])

    class Core:
        async def get_output_async(self) -> Any:
            assert not seen
            return step

    llm = SimpleNamespace(engine_core=Core())
    watch_outputs(llm, seen.append)
    got = asyncio.run(llm.engine_core.get_output_async())
    assert got is step and seen == [step]
