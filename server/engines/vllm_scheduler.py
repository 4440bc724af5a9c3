"""Sluice's scheduler inside vLLM's engine core: interactive work first in each step.

Why this module exists: vLLM's scheduler schedules its running requests before any
waiting one and knows no request classes, so a chat turn shares its step with a
batch's 128 running lines (issue 49). This is the one module that touches vLLM's
scheduler surface (`--scheduler-cls`, vLLM 0.32's `Scheduler` and `AsyncScheduler`):
it subclasses them, asks batching/step_share.py what the next step does with background
work, and applies the answer with the scheduler's own levers:

* a background request left out of a step gets `next_decode_eligible_step` past
  the step (the lever vLLM's async and diffusion schedulers use): it stays running,
  its KV kept;
* background requests not admitted this step are taken out of the waiting queue
  for the call and put back after it, in their order;
* a step under rule 4's cap gets a token budget of what its admitted work needs
  plus the cap's remainder, so new background prompts fill at most that;
* rule 3's preemption (no seat, or too few free KV blocks, for a waiting turn) is
  vLLM's own (`_preempt_request`, as its prefix-cache reset calls it between
  steps): the blocks go back to the free list with their hashes, so the
  request's recompute is a prefix-cache hit;
* rule 6's lower CPU priority is the OS's (server/engines/start_priority.py
  `Yielding`: nice, and SCHED_IDLE above its floor, over this engine core and its
  workers), set when the answer changes, its floor looked at once a second; only
  where the front's priority plan came in `additional_config` (the OS lets it be
  raised back).

A request is background when its parameters say so (`mark`, set by the adapter:
SamplingParams.extra_args, PoolingParams.extra_kwargs). Step time is measured here,
from the end of a step's scheduling (or the end of the previous step's output, with
async scheduling) to its output. The board (server/engines/board.py) carries the
pending flag to the other engines and the counters to the front, and the front's
word on turns that have shown their client no token yet (rule 2) to the scheduler.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Final

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from batching.step_share import LINGER_S, Plan, Sight, StepShare
from server.engines import start_priority
from server.engines.board import PRIORITY_KEY, RATIO_KEY, SEAT_KEY, Board
from server.engines.start_priority import StartPriority

__all__ = ["BACKGROUND_KEY", "InteractiveFirst", "InteractiveFirstAsync", "background", "mark"]

# The parameter key that marks a background request (its class: batching/classes.py).
BACKGROUND_KEY: Final = "sluice_background"


_NOTHING = Sight()  # rule 1's linger alone
# Steps scheduled and not yet reported (async scheduling has one or two in flight).
_KEPT_STEPS = 16


def mark(params: Any) -> Any:
    """A copy of sampling or pooling parameters that marks their request background."""
    field = "extra_args" if hasattr(params, "extra_args") else "extra_kwargs"
    out = copy.copy(params)
    setattr(out, field, {**(getattr(params, field, None) or {}), BACKGROUND_KEY: True})
    return out


def background(request: Request) -> bool:
    """Is this engine request background work (`mark`)?"""
    sp = request.sampling_params
    if sp is not None:
        return bool(sp.extra_args and sp.extra_args.get(BACKGROUND_KEY))
    pp = request.pooling_params
    return bool(pp is not None and pp.extra_kwargs and pp.extra_kwargs.get(BACKGROUND_KEY))


def _need(r: Request) -> int:
    """The most tokens a running request schedules next step."""
    return max(1, int(r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens))


class _StepRecord:
    __slots__ = ("at", "background", "interactive", "left", "plan", "prompt", "tokens")

    def __init__(
        self,
        plan: Plan,
        at: float,
        tokens: int,
        background: int,
        left: int,
        prompt: bool,
        interactive: bool,
    ) -> None:
        self.plan = plan
        self.at = at  # when its scheduling ended
        self.tokens = tokens  # all tokens scheduled
        self.background = background  # background tokens scheduled
        self.left = left  # running background requests left out
        self.prompt = prompt  # interactive prompt tokens scheduled
        self.interactive = interactive  # interactive requests in the engine at the step


class _InteractiveFirstMixin:
    """Rules of batching/step_share.py around vLLM's `schedule` and `update_from_output`."""

    # Set by vLLM's Scheduler.__init__ (declared for the type checker).
    running: list[Request]
    waiting: Any
    requests: dict[str, Request]
    current_step: int
    max_num_active_reqs: int
    max_num_scheduled_tokens: int
    block_size: int
    kv_cache_manager: Any
    scheduler_reserve_full_isl: bool
    vllm_config: Any
    parallel_config: Any

    # vLLM's scheduler methods, wrapped (the class after this mixin is vLLM's).

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sched = self.vllm_config.scheduler_config
        extra = self.vllm_config.additional_config
        if not isinstance(extra, dict):
            extra = {}
        self._share = StepShare(
            int(sched.max_num_seqs),
            int(sched.max_num_batched_tokens),
            LINGER_S,
            ratio=float(extra.get(RATIO_KEY, 1.0)),
        )
        first = extra.get(SEAT_KEY)
        self._board = Board.from_env() if first is not None else None
        nice = extra.get(PRIORITY_KEY)  # rule 6's means, where the OS gives it
        self._yield = (
            None
            if nice is None
            else start_priority.Yielding(StartPriority(int(nice[0]), int(nice[1])), os.getpid())
        )
        self._slot = int(first or 0) + int(self.parallel_config.data_parallel_rank or 0)
        if self._board is not None:
            self._board.clear(self._slot)
        self._steps: dict[int, _StepRecord] = {}
        self._last_end = 0.0
        self._prefilling: list[Request] = []

    def _sight(self, now_ns: int) -> tuple[Sight, list[Request], list[Request], list[Request]]:
        """What the step's plan is made from, and the running interactive, running
        background and waiting background requests (in their queues' order)."""
        bg_run: list[Request] = []
        ia_run: list[Request] = []
        prefilling = False
        for r in self.running:
            if background(r):
                bg_run.append(r)
            else:
                ia_run.append(r)
                prefilling = prefilling or r.num_computed_tokens < r.num_prompt_tokens
        bg_wait: list[Request] = []
        first: Request | None = None  # the first waiting interactive request
        for r in self.waiting:
            if background(r):
                bg_wait.append(r)
            elif first is None:
                first = r
        ia_wait = len(self.waiting) - len(bg_wait)
        board = self._board
        pending, budget = board.elsewhere(self._slot, now_ns) if board else (False, None)
        sight = Sight(
            interactive_waiting=ia_wait,
            interactive_prefill=prefilling,
            interactive_running=len(ia_run),
            interactive_unshown=board is not None and board.unshown(self._slot, now_ns),
            elsewhere=pending,
            elsewhere_budget=budget,
            seats_free=self.max_num_active_reqs - len(self.running),
            kv_short=first is not None and self._kv_short(first),
            background_running=len(bg_run),
            background_waiting=len(bg_wait),
        )
        return sight, ia_run, bg_run, bg_wait

    def _kv_short(self, r: Request) -> bool:
        """Too few free KV blocks to admit a waiting request (rule 3): its tokens to
        compute in blocks (with vLLM's `scheduler_reserve_full_isl`, on by default,
        the whole prompt must fit; without it, the step's chunk), plus vLLM's admission
        watermark. An estimate: a prefix-cache hit needs fewer."""
        kv = self.kv_cache_manager
        tokens = max(1, r.num_tokens - r.num_computed_tokens)
        if not self.scheduler_reserve_full_isl:
            tokens = min(tokens, self.max_num_scheduled_tokens)
        need = -(-tokens // self.block_size) + int(kv.watermark_blocks)
        return bool(kv.block_pool.get_num_free_blocks() < need)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        now_ns = time.monotonic_ns()
        now = now_ns / 1e9
        sight, ia_run, bg_run, bg_wait = self._sight(now_ns)
        plan = self._share.plan(now, sight)
        if self._yield is not None:  # rule 6
            yielding = self._share.yields(now, sight)
            if yielding != self._yield.on:
                self._yield.set(yielding, now)
            else:
                self._yield.tick(now)
        if self._board is not None:
            self._board.set_pending(
                self._slot,
                self._share.pending(sight),
                self._share.budget is not None and self._share.here(now, sight),
            )
        if plan.preempt:  # rule 3: the newest background requests
            for r in sorted(bg_run, key=lambda q: q.arrival_time)[-plan.preempt :]:
                self.running.remove(r)
                self._preempt_request(r, now)  # type: ignore[attr-defined]
                bg_run.remove(r)
                bg_wait.append(r)
        if plan.present and bg_run:
            # Interactive requests first in the running order, which vLLM schedules
            # in and preempts from the end of under KV pressure: a background request
            # goes before a chat turn (held, capped or floor step alike), and under
            # rule 4's cap a background prompt cut to the cap's remainder (vLLM chunks
            # the last one to the step's budget) cannot take a turn's tokens.
            self.running[:] = [*ia_run, *bg_run]
        skip = self.current_step + 2  # schedule() counts this step as current + 1
        budget = self.max_num_scheduled_tokens
        kept_out = False
        if plan.hold:
            for r in bg_run:
                r.next_decode_eligible_step = max(r.next_decode_eligible_step, skip)
            kept_out = True
        elif plan.cap is not None:
            room = plan.cap
            for r in bg_run:
                if room > 0:
                    room -= min(_need(r), room)
                else:
                    r.next_decode_eligible_step = max(r.next_decode_eligible_step, skip)
            need = sum(_need(r) for r in ia_run)
            self.max_num_scheduled_tokens = min(budget, need + plan.cap)
            kept_out = room <= 0
        if kept_out and bg_wait:
            self.waiting.remove_requests(bg_wait)
        try:
            out: SchedulerOutput = super().schedule(throttle_prefills)  # type: ignore[misc]
        finally:
            self.max_num_scheduled_tokens = budget
            if kept_out and bg_wait:
                if isinstance(self.waiting, FCFSRequestQueue):
                    self.waiting.prepend_requests(bg_wait)
                else:
                    for r in bg_wait:
                        self.waiting.add_request(r)
        self._record(
            out, plan, bg_run, bg_wait, bool(sight.interactive_running or sight.interactive_waiting)
        )
        return out

    def _record(
        self,
        out: SchedulerOutput,
        plan: Plan,
        bg_run: list[Request],
        bg_wait: list[Request],
        interactive: bool,
    ) -> None:
        """Keep what the step will be judged by: the background tokens it took, the
        running background requests it left out, and whether interactive prompt
        tokens were in it."""
        bg_tokens = 0
        prompt = False
        requests = self.requests
        scheduled = out.num_scheduled_tokens
        prefilling = self._prefilling = []
        bg = {r.request_id for r in bg_run}
        bg.update(r.request_id for r in bg_wait)
        for rid, n in scheduled.items():
            if rid in bg:
                bg_tokens += n
                continue
            r = requests.get(rid)
            if r is not None and r.num_computed_tokens - n < r.num_prompt_tokens:
                prompt = True
                prefilling.append(r)
        left = sum(1 for r in bg_run if r.request_id not in scheduled)
        if len(self._steps) > _KEPT_STEPS:  # outputs vLLM never reported back
            self._steps.clear()
        self._steps[id(out)] = _StepRecord(
            plan,
            time.monotonic(),
            out.total_num_scheduled_tokens,
            bg_tokens,
            left,
            prompt,
            interactive,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        now = time.monotonic()
        rec = self._steps.pop(id(scheduler_output), None)
        result: dict[int, EngineCoreOutputs] = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
        if rec is not None:
            seconds = now - max(rec.at, self._last_end)
            share = self._share
            share.done(
                now,
                rec.plan,
                seconds,
                tokens=rec.tokens,
                interactive_prompt=rec.prompt,
                background_run=rec.background,
                background_left=rec.left,
                interactive=rec.interactive,
            )
            board = self._board
            if board is not None:
                present = share.budget is not None and share.here(now, _NOTHING)
                board.set_pending(self._slot, self._pending(), present)
                board.publish(self._slot, share.counters, share.budget, share.cap)
        self._last_end = time.monotonic()
        return result

    def _pending(self) -> bool:
        """Interactive work still waiting or in prefill after a step (of those that
        the step prefilled, and the waiting queue)."""
        return any(
            r.num_computed_tokens < r.num_prompt_tokens and not r.is_finished()
            for r in self._prefilling
        ) or any(not background(r) for r in self.waiting)


class InteractiveFirst(_InteractiveFirstMixin, Scheduler):  # type: ignore[misc]
    """vLLM's synchronous scheduler with Sluice's rules (the CPU backend's)."""


class InteractiveFirstAsync(_InteractiveFirstMixin, AsyncScheduler):  # type: ignore[misc]
    """vLLM's async scheduler with Sluice's rules (a GPU's default)."""
