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

__all__ = ["Charge", "StepLedger", "StepOutput"]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One request's output in a step, as the engine reported it."""

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
    __slots__ = ("block_seconds", "generated", "prefilled", "prompt", "rank", "seconds", "started")

    def __init__(self, prompt: int, rank: int) -> None:
        self.prompt = prompt
        self.rank = rank
        self.prefilled = 0  # prompt tokens charged so far (rules 3-4)
        self.generated = 0
        self.started = False  # its first output came
        self.seconds = 0.0
        self.block_seconds = 0.0


class StepLedger:
    """Per-request engine seconds and block-seconds, from the engine's steps."""

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = max(1, block_size)
        self._open: dict[str, _Open] = {}
        # Not started yet, per rank, in admission order (rule 4).
        self._prefilling: dict[int, dict[str, _Open]] = {}
        self.seconds_total = 0.0  # every step's seconds
        self.unattributed = 0.0  # rule 5's steps with no request to charge
        self.closed_seconds = 0.0  # charged to requests since closed

    # -- queries -------------------------------------------------------------
    def charged(self, request_id: str) -> Charge:
        o = self._open.get(request_id)
        return NO_CHARGE if o is None else Charge(o.seconds, o.block_seconds)

    def open_seconds(self) -> float:
        return sum(o.seconds for o in self._open.values())

    def __len__(self) -> int:
        return len(self._open)

    # -- events --------------------------------------------------------------
    def admit(self, request_id: str, prompt_tokens: int, rank: int = 0) -> None:
        if request_id in self._open:
            self.close(request_id)  # an id used again: its first life ends here
        o = _Open(max(0, prompt_tokens), rank)
        self._open[request_id] = o
        self._prefilling.setdefault(rank, {})[request_id] = o

    def close(self, request_id: str) -> Charge:
        o = self._open.pop(request_id, None)
        if o is None:
            return NO_CHARGE
        self._prefilling.get(o.rank, {}).pop(request_id, None)
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
        prefilling = self._prefilling.get(rank, {})
        prefill: dict[str, tuple[_Open, float]] = {}
        decode: dict[str, tuple[_Open, float]] = {}
        left = prefill_tokens
        for out in outputs:
            o = self._open.get(out.request_id)
            if o is None:
                continue  # rule 1
            if o.started:
                decode[out.request_id] = (o, float(out.new_tokens))
            else:  # rule 3
                computed = o.prompt if out.computed is None else min(out.computed, o.prompt)
                w = max(computed - o.prefilled, 0)
                prefill[out.request_id] = (o, float(w))
                left -= w
                o.started = True
                o.prefilled = o.prompt
                prefilling.pop(out.request_id, None)
            o.generated += out.new_tokens
        if left > 0:  # rule 4
            for rid, o in prefilling.items():
                take = min(max(o.prompt - 1 - o.prefilled, 0), left)
                if take > 0:
                    o.prefilled += take
                    prefill[rid] = (o, float(take))
                    left -= take
                    if left <= 0:
                        break
        weights = _scaled(prefill, prefill_tokens) + _scaled(decode, decode_tokens)
        total = sum(w for _, w in weights)
        if total <= 0:  # rule 5: nothing placed
            on_rank = [o for o in self._open.values() if o.rank == rank]
            if not on_rank:
                self.unattributed += seconds
                return
            weights = [(o, 1.0) for o in on_rank]
            total = float(len(weights))
        given = 0.0
        last = len(weights) - 1
        for i, (o, weight) in enumerate(weights):  # rule 6
            share = seconds - given if i == last else seconds * weight / total
            o.seconds += share
            given += share
        size = self.block_size
        for o in self._open.values():  # rule 7
            if o.rank == rank:
                held = (o.prompt if o.started else o.prefilled) + o.generated
                if held > 0:
                    o.block_seconds += -(-held // size) * seconds


def _scaled(part: dict[str, tuple[_Open, float]], tokens: int) -> list[tuple[_Open, float]]:
    """Rule 5: one part's weights, scaled so they sum to the tokens the engine
    scheduled of that part (as they are where it reported none)."""
    total = sum(w for _, w in part.values())
    if total <= 0 or tokens <= 0:
        return [(o, w) for o, w in part.values() if w > 0]
    k = tokens / total
    return [(o, w * k) for o, w in part.values() if w > 0]
