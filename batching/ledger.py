"""Engine time per request: each engine step's wall time, split among the requests in it.

Why this module exists: a token of a 30,000-token prompt and a token of a chat turn
cost the engine very different time, so usage (server/operations/usage.py) and
budgets charge each caller its share of the engine's own steps, not its tokens.
vLLM reports, per step, its wall time and how many prompt and decode tokens it
scheduled (its iteration details), and an output for each request that produced a
token; not which request a prompt chunk belonged to. This module keeps, per request
in the engine, what it has been charged, and splits each step by these rules:

1. A request is admitted when it is released to the engine (its prompt length and
   data-parallel rank), and closed when its reader is done (`close` returns its
   charge and forgets it; an id admitted again closes its first life). Outputs of
   requests it does not know are ignored.
2. A step's seconds go to the requests in it in proportion to the tokens each put
   into the step: a decode output's new tokens, or the prompt tokens it computed.
3. A request whose first output is in the step finished its prefill there: it
   computed what was left of its prompt, after the prefix cache's hit (vLLM's
   `prefill_stats.num_computed_tokens`, else the prompt), less what earlier steps
   charged it for.
4. The step's prompt tokens that rule 3 does not account for are chunks of prompts
   still prefilling, on the step's rank: oldest admitted first, each up to its
   prompt less one token (a chunk that reached the end would have had an output).
5. The prompt-token weights are scaled to the step's prompt tokens, and the decode
   weights to its decode tokens, so each part weighs what the engine scheduled of
   it. A part the rules could not place at all is spread evenly over the rank's
   open requests; a step with none is charged to nobody and counted in
   `unattributed`.
6. The shares of one step add up to its seconds exactly: the last takes the rest.
7. KV residency: in each step, every request on the rank with tokens in the cache
   (its prompt once started, else its chunks so far, plus what it generated) holds
   ceil(tokens / block_size) blocks for the step's seconds (block-seconds).

Pure: no clock, no I/O; the engine adapter (server/engines/vllm_adapter.py) feeds it
what vLLM reports and the driver closes each generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Charge", "StepLedger", "StepOutput"]


class StepOutput(NamedTuple):
    """One request's output in a step, as the engine reported it (a tuple: one
    is made per output of every step, 0.3 us against a frozen dataclass's 1.5)."""

    request_id: str
    new_tokens: int
    computed: int | None = None  # prompt tokens the engine computed (first output only)
    finished: bool = False


@dataclass(frozen=True, slots=True)
class Charge:
    """What one request cost the engine."""

    engine_seconds: float = 0.0
    block_seconds: float = 0.0

    def __add__(self, other: Charge) -> Charge:
        return Charge(
            self.engine_seconds + other.engine_seconds, self.block_seconds + other.block_seconds
        )


NO_CHARGE = Charge()


class _Open:
    __slots__ = (
        "block_seconds",
        "blocks",
        "generated",
        "mark",
        "prefilled",
        "prompt",
        "rank",
        "seconds",
        "started",
    )

    def __init__(self, prompt: int, rank: int, mark: float) -> None:
        self.prompt = prompt
        self.rank = rank
        self.prefilled = 0  # prompt tokens charged so far (rules 3-4)
        self.generated = 0
        self.started = False  # its first output came
        self.seconds = 0.0
        # Rule 7, kept lazily: `blocks` held since its rank's step clock read
        # `mark`; settled (added to block_seconds) whenever its tokens change.
        self.block_seconds = 0.0
        self.blocks = 0
        self.mark = mark

    def settle(self, clock: float, size: int) -> None:
        """Rule 7 up to `clock`, then the blocks its tokens fill now."""
        self.block_seconds += self.blocks * (clock - self.mark)
        self.mark = clock
        held = (self.prompt if self.started else self.prefilled) + self.generated
        self.blocks = -(-held // size)


class StepLedger:
    """Per-request engine seconds and block-seconds, from the engine's steps.

    A step costs O(its outputs) (plus the prompts it finds still prefilling,
    rule 4): block-seconds are settled per request when its tokens change,
    against its rank's clock of step seconds, not by a pass over every request.
    """

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = max(1, block_size)
        self._open: dict[str, _Open] = {}
        # Not started yet, per rank, in admission order (rule 4).
        self._prefilling: dict[int, dict[str, _Open]] = {}
        # Each rank's step seconds so far (rule 7's clock).
        self._clock: dict[int, float] = {}
        self.seconds_total = 0.0  # every step's seconds
        self.unattributed = 0.0  # rule 5's steps with no request to charge
        self.closed_seconds = 0.0  # charged to requests since closed

    # -- queries -------------------------------------------------------------
    def charged(self, request_id: str) -> Charge:
        o = self._open.get(request_id)
        if o is None:
            return NO_CHARGE
        pending = o.blocks * (self._clock.get(o.rank, 0.0) - o.mark)
        return Charge(o.seconds, o.block_seconds + pending)

    def open_seconds(self) -> float:
        return sum(o.seconds for o in self._open.values())

    def __len__(self) -> int:
        return len(self._open)

    # -- events --------------------------------------------------------------
    def admit(self, request_id: str, prompt_tokens: int, rank: int = 0) -> None:
        if request_id in self._open:
            self.close(request_id)  # an id used again: its first life ends here
        o = _Open(max(0, prompt_tokens), rank, self._clock.get(rank, 0.0))
        self._open[request_id] = o
        self._prefilling.setdefault(rank, {})[request_id] = o

    def close(self, request_id: str) -> Charge:
        o = self._open.pop(request_id, None)
        if o is None:
            return NO_CHARGE
        self._prefilling.get(o.rank, {}).pop(request_id, None)
        o.settle(self._clock.get(o.rank, 0.0), self.block_size)
        self.closed_seconds += o.seconds
        return Charge(o.seconds, o.block_seconds)

    def step(
        self,
        seconds: float,
        prefill_tokens: int,
        decode_tokens: int,
        outputs: Sequence[StepOutput],
        rank: int = 0,
    ) -> None:
        """One step of `rank`: `seconds` split by rules 2-7."""
        seconds = max(0.0, seconds)
        self.seconds_total += seconds
        clock = self._clock.get(rank, 0.0)
        size = self.block_size
        get = self._open.get
        prefilling = self._prefilling.get(rank, {})
        prefill: list[tuple[_Open, int]] = []
        decode: list[tuple[_Open, int]] = []
        pre_total = dec_total = 0
        for out in outputs:
            o = get(out.request_id)
            if o is None:
                continue  # rule 1
            n = out.new_tokens
            if o.started:
                if n > 0:
                    decode.append((o, n))
                    dec_total += n
                    o.generated += n
                    if o.prompt + o.generated > o.blocks * size:  # rule 7: a new block
                        o.settle(clock if o.rank == rank else self._clock.get(o.rank, 0.0), size)
                continue
            # Rule 3: its first output.
            computed = o.prompt if out.computed is None else min(out.computed, o.prompt)
            w = computed - o.prefilled
            if w > 0:
                prefill.append((o, w))
                pre_total += w
            o.started = True
            o.prefilled = o.prompt
            prefilling.pop(out.request_id, None)
            o.generated += n
            o.settle(clock if o.rank == rank else self._clock.get(o.rank, 0.0), size)  # rule 7
        left = prefill_tokens - pre_total
        if left > 0:  # rule 4
            for o in prefilling.values():
                take = min(o.prompt - 1 - o.prefilled, left)
                if take > 0:
                    o.prefilled += take
                    o.settle(clock, size)
                    prefill.append((o, take))
                    pre_total += take
                    left -= take
                    if left <= 0:
                        break
        self._clock[rank] = clock + seconds
        # Rule 5: each part weighs what the engine scheduled of it (as counted
        # where it reported none).
        pre_w = prefill_tokens if pre_total and prefill_tokens > 0 else pre_total
        dec_w = decode_tokens if dec_total and decode_tokens > 0 else dec_total
        total = pre_w + dec_w
        if total <= 0:  # nothing placed: evenly over the rank's open requests
            on_rank = [o for o in self._open.values() if o.rank == rank]
            if not on_rank:
                self.unattributed += seconds
                return
            prefill, pre_total, pre_w = [(o, 1) for o in on_rank], len(on_rank), 1
            decode, dec_w, total = [], 0, 1
        given = 0.0
        last: _Open | None = None
        for part, w, n in ((prefill, pre_w, pre_total), (decode, dec_w, dec_total)):
            if not part:
                continue
            rate = seconds * w / (total * n)  # seconds per token of this part
            for o, tokens in part:
                share = tokens * rate
                o.seconds += share
                given += share
                last = o
        if last is not None:  # rule 6: the shares add up to the step's seconds
            last.seconds += seconds - given
