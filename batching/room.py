"""Engine room: may one more generation go to the engine now?

Why this module exists: Sluice holds the backlog itself, so that ordering, dedupe,
cancel and expiry still act on it, and gives the engine only what it can schedule
soon. vLLM's scheduler takes waiting requests, in its own order, while it has a
running slot (`max_num_seqs`), token budget in the step (`max_num_batched_tokens`)
and KV blocks; whatever waits beyond that waits in vLLM's queue, where Sluice can no
longer reorder it. This module is that test, on numbers the driver reports.

Rules (a generation's size here is its prompt tokens; 0 means "unknown" for each
engine number, and an unknown number never holds anything back):

1. Work-conserving: with nothing of ours in flight, anything fits.
2. Slots: in flight (released, not finished) < `max_seqs` plus `slot_spare` of it
   (rounded down). The driver learns that a slot freed one engine step late (the
   engine has scheduled its next step by then); a few spare requests in the
   engine's own queue fill a freed slot at once instead of a step later.
3. Step budget: prompt tokens released but not yet started (no first output yet)
   plus this one <= `step_lookahead` x `step_tokens`, unless nothing is unstarted
   (a prompt larger than that then goes alone: chunked prefill takes it in
   pieces). One step by default (config.py says why: two let released long
   prompts fill the step a chat turn needs). Together with rule 2 this keeps
   the engine's own waiting queue at about one step of prefill; the number of
   unstarted requests needs no bound of its own, since the engine admits them
   in its next steps when both hold.
   A short prompt (`short_prompt` tokens or fewer, as in rule 5) counts the
   unstarted prompts' next chunks instead of their whole prompts: with vLLM's
   per-prompt cap (`prefill_chunk`, its --long-prefill-token-threshold) an
   unstarted 2,000-token prompt takes 512 tokens of the next step, so a chat
   turn fits in that step beside it. Booking it whole held the chat turn in
   Sluice's queue for the 4 steps of that prefill (issue 21: chat TTFT p95
   189 ms beside the flood against 18 ms alone). Long prompts still count
   whole prompts: counting chunks for them too let four flood prompts be
   unstarted at once, which filled the step and the KV cache (chat p95
   1,223 ms; bench/results/issue21-rule3-cpu.md).
4. KV room: estimated KV tokens in use plus this prompt <= `kv_tokens`. The estimate
   is `kv_usage` x `kv_tokens` from the engine's latest stats, plus the prompts the
   engine has not allocated yet: of the unstarted prompts, the share the engine
   reports waiting (`engine_waiting` of them; the others are in prefill, and their
   blocks are in `kv_usage` already), and everything released in this round.
   Decode growth of running requests is in `kv_usage` as it happens; vLLM
   preempts when it runs out, as it would without Sluice.
5. Headroom for short requests (`reserve` > 0; a tenth by default, config.py): a
   prompt longer than `short_prompt` tokens may only use (1 - reserve) of the KV
   cache, so a short chat turn finds room at the next step instead of waiting for a
   long request to end.
6. Data-parallel ranks (`ranks` > 1; vLLM's --data-parallel-size): each rank has
   its own scheduler and KV cache, and the capacity numbers are one rank's. Slots
   and step budgets add up (each rank runs its own steps), so rules 2 and 3 use
   `ranks` x each. KV adds up for the total in use (rule 4 on `ranks` x
   `kv_tokens`, `kv_usage` being the ranks' mean), but a prompt's blocks live
   on one rank: it also needs `kv_tokens` x (1 - the least-used rank's usage)
   free on that rank. vLLM's coordinator places each request (server/engines/vllm_adapter.py
   says why Sluice leaves it to it), so pending prompts are not booked per rank.
7. LoRA slots (`max_loras` > 0; vLLM's --max-loras with --enable-lora): work on an
   adapter goes only while the distinct adapters in flight stay within `max_loras`
   (adapters.py rules 1-2 and 4: a slot, and the victim closed to new work).
   `admits()` is that test, apart from `fits()`: the backlog tells a generation that
   waits for a slot from one that waits for room (backlog.py rules 3 and 5). An
   adapter released in this round holds its slot at once (`take`). vLLM's scheduler
   counts the adapters of its running requests; Sluice's in flight (released, not
   finished) is a superset, so a released request never waits in vLLM's queue for a
   slot, at the price of counting a slot until the last of its work has ended.
"""

from __future__ import annotations

from dataclasses import dataclass

from .adapters import AdapterSlots

__all__ = ["EngineCapacity", "Room"]


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    """The engine's resolved scheduler and cache sizes (0 = unknown)."""

    max_seqs: int = 0  # vLLM max_num_seqs
    step_tokens: int = 0  # vLLM max_num_batched_tokens
    kv_tokens: int = 0  # KV cache size in tokens: num_gpu_blocks x block_size
    ranks: int = 1  # data-parallel ranks, each with the numbers above (rule 6)
    max_loras: int = 0  # vLLM lora_config.max_loras; 0 = LoRA off (rule 7)
    prefill_chunk: int = 0  # vLLM long_prefill_token_threshold; 0 = no cap (rule 3)

    def __post_init__(self) -> None:
        if (
            min(self.max_seqs, self.step_tokens, self.kv_tokens, self.max_loras, self.prefill_chunk)
            < 0
        ):
            raise ValueError("engine capacity numbers must be >= 0 (0 = unknown)")
        if self.ranks < 1:
            raise ValueError("data-parallel ranks must be >= 1")

    def next_chunk(self, ptok: int) -> int:
        """Rule 3: the tokens an unstarted prompt of `ptok` takes in one engine step."""
        chunk = self.prefill_chunk
        return ptok if not chunk or ptok <= chunk else chunk

    @property
    def known(self) -> bool:
        return bool(self.max_seqs or self.step_tokens or self.kv_tokens or self.max_loras)


class Room:
    """One release round's view of the engine; `take()` books each release."""

    __slots__ = (
        "in_flight",
        "kv_long",
        "kv_pending",
        "kv_rank_free",
        "kv_tokens",
        "kv_used",
        "limited",
        "loras",
        "next_chunk",
        "now",
        "resident",
        "seq_limit",
        "short_prompt",
        "slots",
        "step_tokens",
        "unstarted_chunks",
        "unstarted_n",
        "unstarted_tokens",
    )

    def __init__(
        self,
        capacity: EngineCapacity,
        in_flight: int,
        unstarted_n: int,
        unstarted_tokens: int,
        unstarted_chunks: int,
        kv_usage: float,
        engine_waiting: int,
        reserve: float,
        short_prompt: int,
        step_lookahead: float,
        slot_spare: float,
        kv_usage_least: float | None = None,
        slots: AdapterSlots | None = None,
        now: float = 0.0,
    ) -> None:
        self.limited = capacity.known
        ranks = capacity.ranks
        seqs = capacity.max_seqs * ranks
        self.seq_limit = seqs + int(seqs * slot_spare) if seqs else 0
        self.step_tokens = capacity.step_tokens * ranks * step_lookahead
        self.kv_tokens = kv = capacity.kv_tokens * ranks
        self.kv_rank_free = _rank_free(capacity, kv_usage, kv_usage_least)
        self.kv_long = kv * (1.0 - reserve)
        self.kv_used = kv_usage * kv
        waiting = min(1.0, engine_waiting / unstarted_n) if unstarted_n else 0.0
        self.kv_pending = unstarted_tokens * waiting
        self.short_prompt = short_prompt
        self.in_flight = in_flight
        self.unstarted_n = unstarted_n
        self.unstarted_tokens = unstarted_tokens
        self.unstarted_chunks = unstarted_chunks
        self.next_chunk = capacity.next_chunk
        # Rule 7: only with LoRA on; the set copies the adapters in flight, and grows
        # with this round's releases.
        self.loras = bool(slots is not None and slots.max_loras)
        self.slots = slots
        self.resident: set[str] = set(slots.flying) if slots is not None else set()
        self.now = now

    @property
    def full(self) -> bool:
        """No slot left: nothing fits, whatever its size."""
        return 0 < self.seq_limit <= self.in_flight

    def fits(self, ptok: int) -> bool:
        if not self.limited or not self.in_flight:
            return True
        if self.seq_limit and self.in_flight >= self.seq_limit:
            return False
        step = self.step_tokens
        if step and self.unstarted_n:
            short = ptok <= self.short_prompt
            ahead = self.unstarted_chunks if short else self.unstarted_tokens
            if ahead + ptok > step:
                return False
        kv = self.kv_tokens
        if kv:
            limit = kv if ptok <= self.short_prompt else self.kv_long
            if self.kv_used + self.kv_pending + ptok > limit:
                return False
            if ptok > self.kv_rank_free:
                return False
        return True

    def admits(self, adapter: str | None) -> bool:
        """Rule 7: may work on `adapter` go now (a LoRA slot)?"""
        slots = self.slots
        if not self.loras or adapter is None or slots is None:
            return True
        return slots.admits(adapter, self.resident, self.now)

    def new_slot(self, adapter: str | None) -> int:
        """1 if work on `adapter` would take a slot no work in flight holds, else 0
        (the tie-break between callers of equal standing, backlog.py rule 5)."""
        if not self.loras or adapter is None or adapter in self.resident:
            return 0
        return 1

    def take(self, ptok: int, adapter: str | None = None) -> None:
        if adapter is not None and self.loras:
            self.resident.add(adapter)
        self.in_flight += 1
        self.unstarted_n += 1
        self.unstarted_tokens += ptok
        self.unstarted_chunks += self.next_chunk(ptok)
        self.kv_pending += ptok


def _rank_free(capacity: EngineCapacity, kv_usage: float, least: float | None) -> float:
    """Rule 6: KV tokens free on the least-used rank (no bound with one rank)."""
    if capacity.ranks == 1 or not capacity.kv_tokens:
        return float("inf")
    usage = kv_usage if least is None else least
    return capacity.kv_tokens * (1.0 - usage)
