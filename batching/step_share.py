"""Interactive first inside the engine's step: how much background work a step takes.

Why this module exists: the backlog keeps a chat turn out of the *queue* behind
background work (classes.py), but once released the turn shares the engine's *step*
with whatever runs there: on the 2-core demo a step of 128 batch lines lasts five
times a chat turn's own, and the turn waits for the step under way and then shares
the next (issue 49). vLLM's scheduler has no notion of the two classes; Sluice's
scheduler (server/engines/vllm_scheduler.py, behind the one adapter module for that
vLLM surface) asks this module, once per step of one engine rank, what to do with the
background work, and applies the answer. No constant here is tuned to a machine: the
budget is the measured step of the interactive work alone.

Rules (each step; `Sight` is what the scheduler sees of its own queues, plus the
board's word about the server's other engines):

1. Idle: with no interactive work present (none waiting, prefilling or running
   here, none pending or running on another engine, none ended here within
   `linger` seconds), background work takes the step as vLLM schedules it: no
   hold, no cap.
2. Hold: while interactive work waits here with a seat for it or is in prefill
   here, or has shown its client no token yet (the front's word: a streamed turn
   whose first tokens carried no text, as a thinking model's `<think>` or a part of
   a character, waits for the next step, not only its prefill), or is pending
   (any of these) on another engine of this server, background work sits the step
   out: its running requests skip the step and keep their KV, its waiting requests
   are not admitted. The step is the interactive work's own (or, for another
   engine's, the cores are).
3. Seats and KV: interactive work waiting here while every seat is taken, or while
   the KV cache has too few free blocks to admit its prompt, and background
   work runs: the newest background requests are preempted, one per waiting
   interactive request, at most `MAX_PREEMPT` a step (llm-d's flow control takes two
   victims a decision, newest first). vLLM's preemption frees their seats and
   blocks; the blocks stay in its prefix cache, so their recompute is a cache hit.
   (Without it a turn on a KV-bound engine waited, held steps and all, until rule 5's
   floor step let a background request end or vLLM preempt one.)
4. Budget: while interactive work runs here (decoding) or lingers and background
   work is here, the background tokens of a step are capped so that the step lasts
   no longer than the budget (with no background work, nothing is capped: the
   interactive work's own prompts are never cut to the background's cap):
   the measured time of the steps in which interactive prompts ran and no
   background tokens did (the interactive work alone: rule 2's held steps, and
   any step with no background work; an exponential average), so a budget is
   known before background work arrives wherever a chat turn ran before it. A
   chat turn that arrives then waits for at most one step as long as its own
   prefill: TTFT beside <= TTFT alone + the budget. `ratio` scales the budget
   (`--background-step-ratio`, 1 by default): 0.5 halves that wait, and on a
   machine whose step time grows with its tokens (a CPU) about halves the
   background's tokens beside a turn; the operator's trade, not a constant tuned
   here. After each capped step the cap is scaled by budget / measured: down
   in proportion at once (a step past the budget is a chat turn's wait), up at
   most 2x a step (a step short for want of tokens costs only throughput), so it
   follows the machine: on a GPU, where a step of 256 sequences costs a few
   times one of 16, the cap rises to the engine's seats. With no budget measured
   yet, no cap. Until a capped step has been measured, the cap is the token count
   of the step that measured the budget (that many tokens lasted it; times
   `ratio`), not the step's whole token budget: the first capped step is already
   about as long as the budget allows. While another engine of this server has
   interactive work present and this one has none, the budget is that engine's
   (the board publishes it): the cores or the card the two share are busy no
   longer than the other's own step.
5. Floor: background work is never starved. Rule 2 holds it at most `FLOOR - 1`
   steps in a row (the next runs it, under rule 4's cap), and rule 4's cap is never
   below 1/`FLOOR` of the engine's seats, in tokens (at least one).
6. Cores: while another engine of this server has interactive work pending or
   present and this one has none, this engine yields the CPU: its processes run
   at a lower CPU priority, under SCHED_IDLE above a floor
   (server/engines/start_priority.py rule 4), so on cores the engines share, the
   other's turn runs first and this one's steps take what is left. Rules 2 and 4
   only stop this engine's *next* step; a step already under way kept half of two
   cores (a chat turn beside another model's embedding flood: 4.4x its alone
   time).

Pure: no clock, no I/O, no vLLM; `plan` has no side effects, `done` records a step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["FLOOR", "LINGER_S", "MAX_PREEMPT", "Plan", "Sight", "StepCounters", "StepShare"]

# Rule 1's linger: a chat caller's next turn within this many seconds (an agent's
# tool loop, a closed-loop caller) still finds capped steps (the engine's scheduler
# passes it as `linger`).
LINGER_S = 1.0
# Rule 5: background runs in at least one step of FLOOR while held, and its cap is at
# least 1/FLOOR of the seats.
FLOOR = 8
# Rule 3: background requests preempted for interactive seats or KV blocks, at most,
# per step.
MAX_PREEMPT = 2
# Rule 4: the weight of the newest interactive-alone step in the budget's average, and
# the most a capped step's measurement raises the cap.
_BUDGET_WEIGHT = 0.2
_CAP_STEP = 2.0


@dataclass(frozen=True, slots=True)
class Sight:
    """What one engine rank's scheduler sees before a step."""

    interactive_waiting: int = 0  # interactive requests not yet admitted
    interactive_prefill: bool = False  # an admitted interactive prompt still prefilling
    interactive_running: int = 0  # admitted interactive requests (any phase)
    # A streamed interactive turn here has shown its client no token yet (rule 2;
    # the front's word, through the board).
    interactive_unshown: bool = False
    elsewhere: bool = False  # another engine has interactive work pending (the board)
    # The least budget of the other engines with interactive work present (rule 4),
    # None where none has.
    elsewhere_budget: float | None = None
    seats_free: int = 0  # running seats left (max_num_seqs - running)
    # The first waiting interactive request needs more KV blocks to be admitted than
    # are free (rule 3).
    kv_short: bool = False
    background_running: int = 0
    background_waiting: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """What the step does with background work."""

    hold: bool = False  # rule 2: background sits the step out
    cap: int | None = None  # rule 4: background tokens the step may take (None: no cap)
    budget: float | None = None  # rule 4: the seconds the capped step aims at
    preempt: int = 0  # rule 3: newest background requests to preempt first
    present: bool = False  # interactive work present (the step's telemetry class)


@dataclass(slots=True)
class StepCounters:
    """What the rules did, summed since start (the scheduler publishes them)."""

    held: int = 0  # background requests left out of a step by rule 2 (request-steps)
    capped: int = 0  # background requests left out of a step by rule 4 (request-steps)
    preempted: int = 0  # background requests preempted by rule 3
    floor_steps: int = 0  # held steps that rule 5 ran background in instead
    steps_present: int = 0  # steps with interactive work present
    seconds_present: float = 0.0
    steps_alone: int = 0  # steps with none (rule 1)
    seconds_alone: float = 0.0

    @classmethod
    def total(cls, each: Iterable[StepCounters]) -> StepCounters:
        """Several ranks' or engines' counters added up."""
        out = cls()
        for c in each:
            out.held += c.held
            out.capped += c.capped
            out.preempted += c.preempted
            out.floor_steps += c.floor_steps
            out.steps_present += c.steps_present
            out.seconds_present += c.seconds_present
            out.steps_alone += c.steps_alone
            out.seconds_alone += c.seconds_alone
        return out


def _unshown(sight: Sight) -> bool:
    """Rule 2: is an admitted turn here still to show its client a token? (The front's
    word outlives the turn by a step when the turn ends on its first output.)"""
    return sight.interactive_unshown and sight.interactive_running > 0


def _elsewhere(sight: Sight) -> bool:
    """Has another engine interactive work pending or present (the board's word)?"""
    return sight.elsewhere or sight.elsewhere_budget is not None


class StepShare:
    """Rules 1-6 for one engine rank."""

    __slots__ = (
        "_held_run",
        "_judged",
        "_last_interactive",
        "budget",
        "cap",
        "ceiling",
        "counters",
        "floor",
        "linger",
        "ratio",
    )

    def __init__(
        self, max_seqs: int, step_tokens: int, linger: float, *, ratio: float = 1.0
    ) -> None:
        if max_seqs < 1 or step_tokens < 1 or linger < 0 or not ratio > 0:
            raise ValueError("max_seqs and step_tokens must be >= 1, linger >= 0, ratio > 0")
        self.floor = max(1, math.ceil(max_seqs / FLOOR))  # rule 5, in tokens
        self.ceiling = max(self.floor, step_tokens)  # a step's whole token budget
        self.linger = linger
        self.ratio = ratio  # rule 4: the budget's multiple
        self.budget: float | None = None  # rule 4: seconds, unknown until measured
        self.cap = self.ceiling  # rule 4: background tokens a capped step may take
        self.counters = StepCounters()
        self._held_run = 0  # steps held in a row (rule 5)
        self._judged = False  # a capped step has been measured (rule 4)
        self._last_interactive = -math.inf

    def present(self, now: float, sight: Sight) -> bool:
        """Rule 1's test: is interactive work present, here or on another engine?"""
        return self.here(now, sight) or _elsewhere(sight)

    def plan(self, now: float, sight: Sight) -> Plan:
        """What the next step does with background work (no side effects)."""
        if not self.present(now, sight):
            return Plan()  # rule 1
        background = sight.background_running + sight.background_waiting
        blocked = sight.interactive_waiting and (sight.seats_free <= 0 or sight.kv_short)
        preempt = 0
        if blocked and sight.background_running:
            preempt = min(sight.interactive_waiting, sight.background_running, MAX_PREEMPT)
        pending = (
            (sight.interactive_waiting and not blocked)
            or sight.interactive_prefill
            or _unshown(sight)
        )
        hold = bool(
            background and (pending or sight.elsewhere or preempt) and self._held_run < FLOOR - 1
        )
        preempt = preempt if hold else 0  # a floor step would take the seat back
        own = self.budget is not None and self.here(now, sight)
        budget = self.budget if own else sight.elsewhere_budget
        cap = None if hold or budget is None or not background else self.cap  # rule 4
        return Plan(
            hold=hold,
            cap=cap,
            budget=None if cap is None or budget is None else budget * self.ratio,
            preempt=preempt,
            present=True,
        )

    def pending(self, sight: Sight) -> bool:
        """Rule 2's word for the other engines: has this one interactive work waiting,
        in prefill, or still to show its client a token?"""
        return bool(sight.interactive_waiting or sight.interactive_prefill or _unshown(sight))

    def yields(self, now: float, sight: Sight) -> bool:
        """Rule 6: does this engine give the CPU to another's interactive work?"""
        return not self.here(now, sight) and _elsewhere(sight)

    def here(self, now: float, sight: Sight) -> bool:
        """Is interactive work present on this engine (rule 1, the board's word)?"""
        return bool(
            sight.interactive_waiting
            or sight.interactive_running
            or now - self._last_interactive < self.linger
        )

    def done(
        self,
        now: float,
        plan: Plan,
        seconds: float,
        *,
        tokens: int,
        interactive_prompt: bool,
        background_run: int,
        background_left: int,
        interactive: bool,
    ) -> None:
        """Record a step run under `plan`: its measured `seconds`, the `tokens` it ran
        (all classes), whether interactive prompt tokens were in it, the background
        tokens it ran and the background requests it left out, and whether
        interactive requests were in the engine after it (rule 1's linger starts
        when the last one leaves)."""
        c = self.counters
        if interactive:
            self._last_interactive = now
        if plan.present:
            c.steps_present += 1
            c.seconds_present += seconds
        else:
            c.steps_alone += 1
            c.seconds_alone += seconds
        c.preempted += plan.preempt
        if interactive_prompt and not background_run and seconds > 0:
            b = self.budget  # rule 4's budget: the interactive work alone
            self.budget = seconds if b is None else b + _BUDGET_WEIGHT * (seconds - b)
            if not self._judged:
                self.cap = self._clamp(round(tokens * self.ratio))
        if plan.hold:
            self._held_run += 1
            c.held += background_left
            return
        if plan.present and self._held_run >= FLOOR - 1 and background_run:
            c.floor_steps += 1
        self._held_run = 0
        if plan.cap is not None:
            c.capped += background_left
            if seconds > 0 and plan.budget is not None:
                scale = min(_CAP_STEP, plan.budget / seconds)
                # Only a cap the step used can be judged too large; one it did not
                # fill may still grow (the step was short for want of work).
                if scale < 1.0 or background_run >= plan.cap:
                    self.cap = self._clamp(round(plan.cap * scale))
                    self._judged = True

    def _clamp(self, tokens: int) -> int:
        """A cap within rule 5's floor and the step's whole token budget."""
        return min(self.ceiling, max(self.floor, tokens))
