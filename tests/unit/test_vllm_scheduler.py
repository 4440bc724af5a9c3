"""server/engines/vllm_scheduler.py: Sluice's subclass of vLLM's own scheduler, stepped
by hand (issue 49).

The scheduler is vLLM 0.32's, built from the demo model's configuration with a KV
cache of a given size; no model runs: each step's output gives every request that
finished its prompt one token, as a model runner would. So what is checked is what
vLLM's scheduler does with Sluice's levers, request by request.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from batching.step_share import FLOOR
from server.engines import board as board_mod
from server.engines import start_priority
from server.engines.board import ENV, PRIORITY_KEY, RATIO_KEY, SEAT_KEY, Board
from server.engines.vllm_adapter import engine_config
from server.engines.vllm_scheduler import InteractiveFirst, background, mark

BLOCK = 16
_ids = itertools.count()
init_none_hash(sha256)
_hasher = get_request_block_hasher(BLOCK, sha256)


@pytest.fixture
def board(monkeypatch: pytest.MonkeyPatch) -> Iterator[Board]:
    b = Board.create()
    monkeypatch.setenv(ENV, str(b.path))
    yield b
    b.close()


def make(
    model: Path,
    cls: type[Any] = InteractiveFirst,
    *,
    max_seqs: int = 8,
    step_tokens: int = 256,
    blocks: int = 400,
    slot: int | None = 0,
    ratio: float | None = None,
    nice: tuple[int, int] | None = None,
) -> Any:
    args = AsyncEngineArgs(
        model=str(model),
        max_num_seqs=max_seqs,
        max_num_batched_tokens=step_tokens,
        enable_prefix_caching=True,
        max_model_len=1024,
    )
    config = engine_config(args)
    if slot is not None:
        config.additional_config = {SEAT_KEY: slot}
    if ratio is not None:
        config.additional_config = {**(config.additional_config or {}), RATIO_KEY: ratio}
    if nice is not None:
        config.additional_config = {**(config.additional_config or {}), PRIORITY_KEY: list(nice)}
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )
    config.cache_config.num_gpu_blocks = blocks
    return cls(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )


def request(prompt: int, max_tokens: int, *, bg: bool = False, seed: int = 0) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if bg:
        sp = mark(sp)
    n = next(_ids)
    tokens = [(seed or n) * 97 % 5000 + i % 50 + 1 for i in range(prompt)]
    return Request(f"r{n}", tokens, sp, None, block_hasher=_hasher)


def step(s: Any) -> SchedulerOutput:
    """One step: schedule, then a token for each request past its prompt."""
    out: SchedulerOutput = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [
        [7] if s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens else []
        for r in ids
    ]
    mro = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )
    s.update_from_output(out, mro)
    return out


@pytest.fixture(scope="module")
def model(demo_model_dir: Path) -> Path:
    return demo_model_dir


def test_mark_and_background() -> None:
    plain = SamplingParams(max_tokens=3)
    marked = mark(plain)
    assert plain.extra_args is None and marked.max_tokens == 3
    assert background(Request("a", [1, 2], marked, None))
    assert not background(Request("b", [1, 2], plain, None))


def _busy(s: Any, n: int = 12) -> list[Request]:
    """n background requests (more than the 8 seats), running after a few steps."""
    bg = [request(20, 40, bg=True) for _ in range(n)]
    for r in bg:
        s.add_request(r)
    for _ in range(3):
        step(s)
    return bg


def test_a_chat_turn_gets_a_seat_and_a_step_of_its_own(model: Path) -> None:
    """Beside background work that fills every seat, a chat turn is scheduled in the
    next step, alone."""
    s = make(model)
    _busy(s)
    assert len(s.running) == 8
    chat = request(10, 4)
    s.add_request(chat)
    out = step(s)
    assert list(out.num_scheduled_tokens) == [chat.request_id]  # its prompt alone


def test_vllms_own_scheduler_makes_the_chat_turn_wait(model: Path) -> None:
    """The contrast (and a canary for a vLLM upgrade): vLLM's scheduler, marks or
    not, leaves the turn waiting for a seat behind the background's decodes."""
    s = make(model, Scheduler, slot=None)
    _busy(s)
    chat = request(10, 4)
    s.add_request(chat)
    out = step(s)
    assert chat.request_id not in out.num_scheduled_tokens
    assert len(out.num_scheduled_tokens) == 8


def test_a_preempted_background_request_resumes_on_a_prefix_cache_hit(model: Path) -> None:
    s = make(model)
    # No linger: once the turn has gone, rule 1. (With it, the steps after the turn
    # are capped to what its measured step allows, a matter of this machine's timing:
    # under CI's load the cap fell to the floor and the request waited out the linger.)
    s._share.linger = 0.0
    bg = _busy(s)
    newest = max((r for r in bg if r in s.running), key=lambda r: r.arrival_time)
    chat = request(10, 2)
    s.add_request(chat)
    step(s)
    assert newest.num_preemptions == 1 and newest not in s.running
    assert s._share.counters.preempted == 1
    while not chat.is_finished():
        step(s)
    for _ in range(FLOOR):
        out = step(s)
        if newest.request_id in out.num_scheduled_tokens:
            break
    # Its prompt and what it had generated (20 + 3 tokens) came back, less the
    # prefix cache's hit: its one full block of prompt.
    assert newest in s.running
    assert out.num_scheduled_tokens[newest.request_id] <= newest.num_tokens - BLOCK


def test_a_chat_turn_gets_kv_blocks_from_the_newest_background(model: Path) -> None:
    """A KV-bound engine: background requests hold every block but one, with seats
    free. The turn is scheduled in the next step: the newest background request is
    preempted for its blocks. (It waited 8 steps, held and all, for rule 5's floor
    step; vLLM's own scheduler left it waiting past 40.)"""
    s = make(model, max_seqs=16, step_tokens=256, blocks=40)
    bg = [request(100, 400, bg=True) for _ in range(8)]
    for r in bg:
        s.add_request(r)
    while s.kv_cache_manager.block_pool.get_num_free_blocks() > 1:
        step(s)
    assert len(s.running) < 16  # seats free: the blocks are what is short
    chat = request(40, 4)
    s.add_request(chat)
    out = step(s)
    assert chat.request_id in out.num_scheduled_tokens
    assert s._share.counters.preempted == 1


def test_under_kv_pressure_vllm_preempts_background_before_a_chat_turn(model: Path) -> None:
    """Background decodes fill the KV cache while a chat turn decodes, in steps no
    cap shapes (here: no budget yet): vLLM preempts from the end of its running list,
    and the turn is never the one it takes. (The running order was set interactive
    first only in capped steps; the turn, admitted last, was preempted first.)"""
    s = make(model, max_seqs=16, step_tokens=256, blocks=40)
    bg = [request(60, 400, bg=True) for _ in range(4)]
    for r in bg:
        s.add_request(r)
    step(s)
    chat = request(20, 300)
    s.add_request(chat)
    step(s)  # held: the turn's prompt alone
    assert chat in s.running
    preempted = 0
    for _ in range(200):
        s._share.budget = None  # no cap: the order is the only lever
        step(s)
        preempted = sum(r.num_preemptions for r in bg)
        if preempted >= 2 or chat.is_finished():
            break
    assert preempted >= 2  # vLLM preempted for KV
    assert chat.num_preemptions == 0


def test_background_is_capped_to_the_measured_budget(model: Path) -> None:
    """While a chat turn decodes, background tokens per step stay within the cap
    that the held steps' time set; with no interactive work, no cap."""
    s = make(model, max_seqs=64, step_tokens=512)
    _busy(s, 40)
    chat = request(10, 30)
    s.add_request(chat)
    step(s)  # held: the chat's prefill alone
    assert s._share.budget is not None
    s._share.budget = 1e-9  # a budget no step meets: the cap falls to its floor
    counts = []
    while not chat.is_finished():
        out = step(s)
        counts.append(sum(n for r, n in out.num_scheduled_tokens.items() if r != chat.request_id))
    floor = s._share.floor
    assert max(counts[-10:]) <= floor < 40
    assert s._share.counters.capped > 0


@pytest.mark.parametrize("ratio", [None, 0.5])
def test_the_first_capped_step_takes_the_held_steps_tokens(
    model: Path, ratio: float | None
) -> None:
    """The step after a chat turn's held prefill takes as many background tokens as
    that prefill had (that many lasted the budget), not the step's whole budget;
    with --background-step-ratio, that many times the ratio. (It took the whole:
    the noisy point's worst turn, 612 ms, waited for a 2,048-token step.)"""
    s = make(model, max_seqs=64, step_tokens=512, ratio=ratio)
    _busy(s, 40)
    chat = request(48, 30)
    s.add_request(chat)
    for _ in range(3):
        s.add_request(request(300, 8, bg=True))
    held = step(s)
    assert list(held.num_scheduled_tokens) == [chat.request_id]
    out = step(s)
    background = sum(n for r, n in out.num_scheduled_tokens.items() if r != chat.request_id)
    assert background == round(48 * (ratio or 1.0))
    assert out.num_scheduled_tokens[chat.request_id] == 1


def test_interactive_work_alone_is_not_capped(model: Path) -> None:
    """Once background work has gone (its budget measured, the cap at its floor),
    interactive requests alone are scheduled as vLLM's own scheduler schedules
    them: the waiting ones' prompts whole, not cut to the background's cap. (They
    were cut: a closed loop of 256 interactive lines ran at 0.81x.)"""
    s = make(model, max_seqs=64, step_tokens=512)
    _busy(s, 40)
    s.add_request(request(10, 4))
    step(s)  # held: the chat's prefill alone, the budget
    assert s._share.budget is not None
    s._share.budget, s._share.cap = 1e-9, s._share.floor
    while s.running or s.waiting:
        step(s)
    ours, theirs = s, make(model, Scheduler, max_seqs=64, step_tokens=512)
    taken = []
    for sched in (ours, theirs):
        for i in range(10):
            sched.add_request(request(40, 4, seed=i + 1))
        taken.append(sum(step(sched).num_scheduled_tokens.values()))
    assert taken[0] == taken[1] == 400


def test_a_model_holds_its_background_while_another_prefills(model: Path, board: Board) -> None:
    """Two engines on one board: while the first has a chat turn waiting or in
    prefill, the second's background sits its steps out; after, it runs again."""
    first = make(model, slot=0, step_tokens=64)
    second = make(model, slot=1)
    _busy(second, 6)
    chat = request(300, 2)  # 300 tokens at 64 a step: five steps of prefill
    first.add_request(chat)
    step(first)
    assert board.read(1).counters.held == 0
    assert step(second).num_scheduled_tokens == {}  # held: the first is prefilling
    while chat.num_computed_tokens < chat.num_prompt_tokens:
        step(first)
    assert len(step(second).num_scheduled_tokens) == 6
    assert board.read(1).counters.held == 6


def test_a_model_with_only_background_yields_the_cores_to_anothers_turn(
    model: Path, board: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule 6: while the first engine has a chat turn, the second (background only)
    lowers its own process tree's CPU priority once, and raises it back once the
    turn has gone; with its own interactive work it does not yield."""
    calls: list[tuple[str, int, list[int]]] = []
    monkeypatch.setattr(
        start_priority, "lower", lambda p, pids: calls.append(("lower", p.start, pids)) or 0
    )
    monkeypatch.setattr(
        start_priority, "restore", lambda p, pids: calls.append(("restore", p.serve, pids)) or 0
    )
    idled: list[bool] = []  # SCHED_IDLE asked for, not set on this test's own process
    monkeypatch.setattr(start_priority, "_idle", lambda idle, p, tids: idled.append(idle))
    first = make(model, slot=0, step_tokens=64)
    second = make(model, slot=1, nice=(10, 0))
    _busy(second, 6)
    assert calls == []
    first.add_request(request(300, 2))
    step(first)
    step(second)
    step(second)
    assert [(c[0], c[1]) for c in calls] == [("lower", 10)]
    assert calls[0][2][0] == os.getpid()  # the engine core, then its workers
    assert idled == [True]  # and under SCHED_IDLE above its floor
    board.set_pending(0, False)  # the first's turn has gone
    step(second)
    assert [(c[0], c[1]) for c in calls] == [("lower", 10), ("restore", 0)]
    # Its own chat turn: it never yields, whatever the first has.
    board.set_pending(0, True)
    second.add_request(request(10, 20))
    step(second)
    assert len(calls) == 2


def test_a_turn_that_has_shown_no_token_keeps_its_steps(model: Path, board: Board) -> None:
    """Rule 2, the front's word: after a chat turn's prefill the background shares
    its decode steps, unless the front says the turn has shown its client no token
    yet (a first token without text): then the next step is the turn's alone too."""
    s = make(model)
    _busy(s)
    chat = request(10, 6)
    s.add_request(chat)
    assert list(step(s).num_scheduled_tokens) == [chat.request_id]  # its prefill, held
    board.set_unshown(0, 1)  # its first token carried no text
    assert list(step(s).num_scheduled_tokens) == [chat.request_id]
    board.set_unshown(0, 0)  # shown
    assert len(step(s).num_scheduled_tokens) > 1  # background beside its decode


def test_board_slots(board: Board, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(board_mod, "_taken", 0)
    assert board_mod.allocate(2) == 0
    assert board_mod.allocate(1) == 2
    assert board_mod.allocate(board_mod.SLOTS) is None
    board.set_pending(3, True)
    import time

    assert board.elsewhere(0, time.monotonic_ns()) == (True, None)
    assert board.elsewhere(3, time.monotonic_ns()) == (False, None)  # its own slot
    assert board.elsewhere(0, time.monotonic_ns() + int(20e9)) == (False, None)  # stale
    # A starting engine's word (start_priority.py rule 5): pending elsewhere.
    assert board.interactive_elsewhere(0) and not board.interactive_elsewhere(3)
    # Present with a budget: the least of those present, for a second.
    from batching.step_share import StepCounters

    board.publish(4, StepCounters(), 0.02, 16)
    board.publish(5, StepCounters(), 0.01, 16)
    board.set_pending(4, False, True)
    board.set_pending(5, False, True)
    assert board.elsewhere(0, time.monotonic_ns()) == (True, 0.01)
    assert board.elsewhere(5, time.monotonic_ns()) == (True, 0.02)
    assert board.elsewhere(0, time.monotonic_ns() + int(2e9)) == (True, None)
    board.set_pending(3, False)
    assert board.interactive_elsewhere(3)  # present elsewhere, nothing pending
    board.set_pending(4, False)
    board.set_pending(5, False)
    assert not board.interactive_elsewhere(3)
    # The front's word on a slot: kept apart from what its scheduler publishes,
    # not believed once stale, zeroed with the slot.
    board.set_unshown(6, 2)
    board.publish(6, StepCounters(held=3), 0.01, 16)
    board.set_pending(6, False)
    assert board.unshown(6, time.monotonic_ns()) and not board.unshown(7, time.monotonic_ns())
    assert board.read(6).counters.held == 3
    assert not board.unshown(6, time.monotonic_ns() + int(20e9))
    board.clear(6)
    assert not board.unshown(6, time.monotonic_ns())


def test_a_capped_step_cuts_background_prompts_to_the_cap(model: Path) -> None:
    """Background prompts longer than the cap still advance (vLLM chunks them to
    the cap's remainder), the interactive turn is in every step, and no step takes
    more background tokens than the cap. (The first cap skipped a prompt that did
    not fit whole: under a closed-loop chat caller a batch stalled for good.)"""
    s = make(model, max_seqs=64, step_tokens=512)
    chat = request(10, 80)
    s.add_request(chat)
    step(s)
    s._share.budget = 1e-9  # a budget no step meets
    s._share.cap = s._share.floor  # where such steps bring the cap: 8 tokens
    bg = [request(30, 4, bg=True) for _ in range(6)]
    for r in bg:
        s.add_request(r)
    for _ in range(60):
        out = step(s)
        assert chat.request_id in out.num_scheduled_tokens
        taken = sum(n for r, n in out.num_scheduled_tokens.items() if r != chat.request_id)
        assert taken <= 8
    assert s._share.floor == 8
    assert all(r.is_finished() for r in bg)


def test_a_model_caps_its_background_while_another_serves_a_turn(model: Path, board: Board) -> None:
    """While the first engine's chat turn decodes, the second's background work is
    capped to the first's budget (the board carries it), and runs uncapped once
    the first has been idle for the linger."""
    first = make(model, slot=0)
    second = make(model, slot=1, max_seqs=64, step_tokens=512)
    chat = request(10, 200)
    first.add_request(chat)
    step(first)  # its prefill alone: the budget
    first._share.budget = 1e-9  # a budget no step meets
    step(first)
    bg = [request(20, 100, bg=True) for _ in range(40)]
    for r in bg:
        second.add_request(r)
    taken = []
    for _ in range(12):
        step(first)
        out = step(second)
        taken.append(sum(out.num_scheduled_tokens.values()))
    assert max(taken[-4:]) <= second._share.floor == 8
    assert second._share.counters.capped > 0 and second._share.counters.held == 0
