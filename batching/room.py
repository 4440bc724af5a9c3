"""Engine room: may one more generation go to the engine now?

Why this module exists: Sluice holds the backlog itself, so that ordering, dedupe,
cancel and expiry still act on it, and gives the engine only what its next steps
will take. vLLM's scheduler takes waiting requests, in its own order, while a step
has a running slot (`max_num_seqs`), token budget (`max_num_batched_tokens`) and KV
blocks; whatever waits beyond that waits in vLLM's queue, where Sluice can no longer
reorder it. Too little there and a step runs under-fed while Sluice holds work
(`underfed`, below: the number the room is judged by). This module is that test, on
what the engine reported of its last step and on what Sluice released since.

Rules (a generation's size here is its prompt tokens; 0 means "unknown" for each
engine number, and an unknown number never holds anything back):

1. Work-conserving: with nothing of ours in flight, anything fits.
2. Feed, from the engine's steps. The engine's queue is Sluice's unstarted work
   (released, no first output yet: waiting in vLLM, on its way there, or in its
   first prefill chunks). It may hold what the engine's next `feed_steps` steps
   can take, as its last step on each data-parallel rank showed: requests up to
   the running slots the steps left free (`max_seqs` - running after the step)
   plus the running generations that end by the step a release reaches
   (`EngineView.ending`, endings.py: vLLM decodes a token a step, so one whose
   first output came at step s ends by step s + max_new_tokens - 1), prompt
   tokens up to `feed_steps` x the budget their decodes left (`step_tokens` -
   decode tokens of the step); plus a spare of each that the
   steps set (`EngineView.spare_*`, coalescer.py): a step under-fed while this rule
   held work adds what it left unused, of the dimension the rule ran short of (at
   most one engine's slots and budget), and a step after which the engine still
   had waiting work of its own takes a 256th back. An unstarted prompt counts
   what the engine prefills of it in those steps: at most `feed_steps` chunks of
   vLLM's per-prompt cap (`prefill_chunk`, --long-prefill-token-threshold), and the
   unstarted prompts together no more than is left of them to prefill (their
   tokens less what the steps have prefilled, as rule 3 counts them): counted
   whole until its first output, a prompt in its last chunk held back a step's
   worth of others (modelled, the c=384 spread with the benchmark's 1,152
   requests, 5 seeds: under-fed steps 2.4-2.7% counted whole, 0.7-1.0% counted by
   what is left; vLLM's waiting queue 3 deep on average against 4.7). With
   nothing unstarted, a prompt of any size may go (a larger one then goes alone:
   chunked prefill takes it in pieces), if a slot is free for it. Two steps,
   because a release reaches the engine one step late: the driver hears of step N
   once the engine has scheduled step N+1, so what it releases then feeds step
   N+2; the spare covers what that misses (generations that end early, on a stop
   or EOS). Issue 27's first feed took `feed_steps` x the free slots, as if the
   next step freed as many as the last: equal requests started together end
   together, so one step frees a hundred slots and the next none, and the second
   hundred then waited in vLLM's queue for the next group to end (seconds: a
   quarter of the requests at data parallelism c=512, their TTFT p99 1.35x vLLM's
   server; modelled, bench/room_sim.py dp, 3 seeds: TTFT p99 17.0-17.8 s against
   11.9-12.1 s with the endings and rule 6's placement, vLLM's waiting queue 24 deep
   on average against 2; at the c=384 spread under-fed steps 2.9% -> 1.8%, TTFT
   p99 8.1 -> 8.2 s). Measured (bench/results/issue27-place-cpu.md, 3 repetitions,
   quiet): data parallelism c=512 TTFT p99 0.92x vLLM's server (was 1.35x), req/s
   1.00x; the c=384 spread 1.08x req/s, TTFT p99 0.87x (was 1.08x), under-fed
   steps 3.8% (was 5.1%). Measured at the
   c=384 spread (one caller, 16-700-token prompts; one run on a loaded 2-core
   machine): issue 21's prediction (released slots up to max_num_seqs + 1/16,
   unstarted prompt tokens up to one step's budget) left 89% of the engine's
   steps under-fed while the backlog held work (679 prefill tokens of 2,048 a
   step, 61 of 128 slots running); two steps, 45% (107 running); with the spare,
   12% (a spare decay of 1/16 then). Modelled (bench/room_sim.py): 10.8%
   under-fed at a decay of 1/16, 2.7% at 1/256, with vLLM's waiting queue 1.8 and
   2.7 requests deep on average (vLLM's server: 245). Before the engine has
   reported a step, running is Sluice's own count of started and unfinished work
   and a step's decodes are that many tokens.
3. KV room: estimated KV tokens in use plus this prompt <= `kv_tokens`. The estimate
   is `kv_usage` x `kv_tokens` from the engine's latest stats, plus what the engine
   has still to allocate for the prompts released to it: the unstarted prompts'
   tokens less the prompt tokens its steps have prefilled of them (`prefilled`,
   from each step's scheduled prompt tokens, which are in `kv_usage` once
   scheduled), and everything released in this round. The engine cannot tell
   this ahead: vLLM starts a prompt on its first chunk's blocks, and a prompt
   whose later chunks find none blocks the requests behind it in its
   first-come-first-served queue, so it has to be held before it is released.
   (Counted instead as the share of unstarted prompts the engine reported
   waiting, as issue 21's room did, a release on its way to the engine counted
   nothing until the engine's next report: at the flood, 2-4 flood prompts then
   waited for KV in vLLM's queue in 74% of the steps, where a chat turn waits
   behind them.) A short prompt (rule 4's) counts only the engine's use and this
   round's releases: vLLM allocates it whole in its first step, beside whatever is
   still to come of the long prompts in prefill, which then wait for blocks or are
   preempted; that is the room rule 4 keeps for it. Counting their pending tokens
   too held chat turns in Sluice's queue while a flood prompt was in prefill (chat
   queue wait p95 10 s beside the flood, one run on a loaded machine). Decode growth
   of running requests is in `kv_usage` as it happens; vLLM preempts when it runs
   out, as it would without Sluice.
4. Headroom for short requests (`reserve` > 0; a tenth by default, config.py): a
   prompt longer than `short_prompt` tokens may only use (1 - reserve) of the KV
   cache, so a short chat turn finds room at the next step instead of waiting for a
   long request to end. A policy, not a fact the engine has: measured (issue 21)
   beside two KV-bound bulk callers, chat TTFT p95 534 ms at 0 against 72 ms at 0.1.
5. Room for another caller's short turn (`long_prefills` > 0; one by default,
   config.py): while more than one caller has work in flight or queued, at most
   `long_prefills` unstarted prompts longer than one prefill chunk (vLLM's
   per-prompt cap, or `short_prompt` without one) per rank. vLLM schedules its
   running prefills before any waiting request, each a chunk per step, so with
   four 2,000-token prompts in prefill a step is all chunks (4 x 512 of 2,048) and a
   chat turn released beside them waits for their four steps. Modelled (the
   scheduler's rules, 2-core step times, Sluice's core; bench/room_sim.py): chat
   TTFT p95 beside the flood 293 ms with no bound, 110 ms at 2, 67 ms at 1 (issue
   21's room: 71 ms; measured 75 ms), flood throughput 4.17, 4.14, 4.06 req/s;
   beside two bulk callers 272 against 70 ms. With one caller
   there is no one else's turn to keep room for (its own short prompts go first
   in its order), and the bound only starves the engine: at the c=384 spread,
   35.3 req/s at 1 against 40.5 without.
6. Data-parallel ranks (`ranks` > 1; vLLM's --data-parallel-size): each rank has
   its own scheduler and KV cache, and the capacity numbers are one rank's. Rule 2
   adds up the ranks' own last steps and endings, and each release names its rank
   (`place`, below; vLLM's `data_parallel_rank`): the one with room for it, or,
   with prefix placement on (config.py), the one believed to hold the longest
   run of its prompt's leading blocks within a bound on load (prefix.py P1-P4); rule 5's
   bound is per rank. KV adds up for the total in use (rule 3 on `ranks` x `kv_tokens`,
   `kv_usage` being the ranks' mean), but a prompt's blocks live on one rank: it
   also needs `kv_tokens` x (1 - the least-used rank's usage) free on that rank.
7. LoRA slots (`max_loras` > 0; vLLM's --max-loras with --enable-lora): work on an
   adapter goes only while the distinct adapters in flight stay within `max_loras`
   (adapters.py rules 1-2 and 4: a slot, and the victim closed to new work).
   `admits()` is that test, apart from `fits()`: the backlog tells a generation that
   waits for a slot from one that waits for room (backlog.py rules 3 and 5). An
   adapter released in this round holds its slot at once (`take`). vLLM's scheduler
   counts the adapters of its running requests; Sluice's in flight (released, not
   finished) is a superset, so a released request never waits in vLLM's queue for a
   slot, at the price of counting a slot until the last of its work has ended.

8. Interactive first (`interactive_first`, where the engines run Sluice's scheduler:
   server/engines/vllm_scheduler.py). That scheduler keeps background work (classes.py)
   out of the steps interactive work waits for or prefills in, and preempts the newest
   background requests for an interactive request's seat (batching/step_share.py rules
   2-3). So for an interactive prompt rule 2 counts only the interactive work in the
   engine's queue, and the seats background work runs in as free: a chat turn is not
   held in Sluice's backlog because a batch fills the engine. Background work keeps
   rule 2 as it is, its own and the interactive work's together.

A caller's own limits (max_concurrency, backlog.py rule 4) are the backlog's, not
the room's: the engine cannot tell them either.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .adapters import AdapterSlots
from .types import EngineStep

__all__ = ["POLICY", "EngineCapacity", "EngineView", "Hold", "Room", "place", "underfed"]


class Hold(enum.Enum):
    """Which rule held the backlog (sluice_backlog_held_seconds_total{rule})."""

    FEED = "feed"  # rule 2: the engine's queue holds its next steps' work
    LONG = "long_prefill"  # rule 5: a long prompt in prefill beside another caller's work
    KV = "kv"  # rules 3 and 6
    RESERVE = "reserve"  # rule 4
    ADAPTER = "adapter_slot"  # rule 7
    CALLER = "caller_limit"  # a caller's max_concurrency (backlog.py rule 4)


# The rules that are Sluice's policy for a short turn's room rather than what the
# engine would take (4 and 5): a step under-fed beside work they held is their cost.
POLICY = frozenset((Hold.RESERVE, Hold.LONG))


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    """The engine's resolved scheduler and cache sizes (0 = unknown)."""

    max_seqs: int = 0  # vLLM max_num_seqs
    step_tokens: int = 0  # vLLM max_num_batched_tokens
    kv_tokens: int = 0  # KV cache size in tokens: num_gpu_blocks x block_size
    ranks: int = 1  # data-parallel ranks, each with the numbers above (rule 6)
    max_loras: int = 0  # vLLM lora_config.max_loras; 0 = LoRA off (rule 7)
    prefill_chunk: int = 0  # vLLM long_prefill_token_threshold; 0 = no cap (rule 2)
    # The block size of the engine's prefix cache (Request.prefix's blocks); 0 = its
    # prefix cache is off (or unknown): no prefix-warm order (warm.py W5).
    prefix_block: int = 0

    def __post_init__(self) -> None:
        if (
            min(
                self.max_seqs,
                self.step_tokens,
                self.kv_tokens,
                self.max_loras,
                self.prefill_chunk,
                self.prefix_block,
            )
            < 0
        ):
            raise ValueError("engine capacity numbers must be >= 0 (0 = unknown)")
        if self.ranks < 1:
            raise ValueError("data-parallel ranks must be >= 1")

    def multi_step(self, ptok: int, short_prompt: int) -> bool:
        """Rule 5: does a prompt of `ptok` take more than one step's chunk to prefill
        (more than vLLM's per-prompt cap, or than `short_prompt` without one)?"""
        return ptok > (self.prefill_chunk or short_prompt)

    def feed_size(self, ptok: int, steps: float) -> int:
        """Rule 2: the prompt tokens of `ptok` the engine prefills in `steps` steps."""
        chunk = self.prefill_chunk
        if not chunk:
            return ptok
        return min(ptok, math.ceil(steps * chunk))

    @property
    def known(self) -> bool:
        return bool(self.max_seqs or self.step_tokens or self.kv_tokens or self.max_loras)


@dataclass(frozen=True, slots=True)
class EngineView:
    """Rule 2's numbers from the engine's last step on every rank: running slots and
    step tokens left free for waiting work, summed over ranks (0 where unknown), and
    the spare the steps set on top of them."""

    free_slots: int
    free_tokens: int
    spare_slots: float = 0.0
    spare_tokens: float = 0.0
    ending: int = 0  # running generations that end within the feed's steps (endings.py)

    @classmethod
    def of(
        cls,
        capacity: EngineCapacity,
        last: Iterable[EngineStep | None],
        running: int,
        spare_slots: float = 0.0,
        spare_tokens: float = 0.0,
        ending: int = 0,
    ) -> EngineView:
        """From each rank's latest step (None: none reported yet). A rank that has not
        reported gets its share of `running`, Sluice's own count of started and
        unfinished work, with one decode token each."""
        seqs, budget = capacity.max_seqs, capacity.step_tokens
        slots = tokens = 0
        steps = list(last)
        share = running // max(1, len(steps))
        for step in steps:
            run = step.running if step is not None else share
            dec = step.decode_tokens if step is not None else share
            slots += max(0, seqs - run)
            tokens += max(0, budget - dec)
        return cls(slots if seqs else 0, tokens if budget else 0, spare_slots, spare_tokens, ending)


class Room:
    """One release round's view of the engine; `take()` books each release."""

    __slots__ = (
        "bg_feed",
        "bg_flying",
        "bg_unstarted",
        "feed_size",
        "feed_slots",
        "feed_tokens",
        "first",
        "in_flight",
        "kv_long",
        "kv_pending",
        "kv_rank_free",
        "kv_round",
        "kv_tokens",
        "kv_used",
        "limited",
        "long_bound",
        "long_n",
        "loras",
        "multi_step",
        "now",
        "resident",
        "short_prompt",
        "slots",
        "steps",
        "unstarted_feed",
        "unstarted_n",
    )

    def __init__(
        self,
        capacity: EngineCapacity,
        in_flight: int,
        unstarted_n: int,
        unstarted_tokens: int,
        unstarted_feed: int,
        view: EngineView,
        kv_usage: float,
        prefilled: int,
        reserve: float,
        short_prompt: int,
        feed_steps: float,
        kv_usage_least: float | None = None,
        slots: AdapterSlots | None = None,
        now: float = 0.0,
        long_n: int = 0,
        long_bound: int = 0,
        background: tuple[int, int, int] | None = None,
    ) -> None:
        self.limited = capacity.known
        # Rule 8: with interactive first, background work's (in flight, unstarted,
        # unstarted feed tokens); None: off.
        self.first = background is not None
        self.bg_flying, self.bg_unstarted, self.bg_feed = background or (0, 0, 0)
        # Rule 5: unstarted multi-step prompts, and how many may be (0: no bound).
        self.long_n = long_n
        self.long_bound = long_bound * capacity.ranks
        self.multi_step = capacity.multi_step
        self.steps = feed_steps
        self.feed_size = capacity.feed_size
        # Rule 2: what the engine's next `feed_steps` steps take, and the spare.
        seqs, budget = capacity.max_seqs, capacity.step_tokens
        self.feed_slots = view.free_slots + view.ending + view.spare_slots if seqs else math.inf
        self.feed_tokens = feed_steps * view.free_tokens + view.spare_tokens if budget else math.inf
        self.kv_tokens = kv = capacity.kv_tokens * capacity.ranks
        self.kv_rank_free = _rank_free(capacity, kv_usage, kv_usage_least)
        self.kv_long = kv * (1.0 - reserve)
        self.kv_used = kv_usage * kv
        self.kv_pending = max(0, unstarted_tokens - prefilled)
        self.kv_round = 0  # prompt tokens released in this round (rule 3, short prompts)
        self.short_prompt = short_prompt
        self.in_flight = in_flight
        self.unstarted_n = unstarted_n
        self.unstarted_feed = min(unstarted_feed, self.kv_pending)
        # Rule 7: only with LoRA on; the set copies the adapters in flight, and grows
        # with this round's releases.
        self.loras = bool(slots is not None and slots.max_loras)
        self.slots = slots
        self.resident: set[str] = set(slots.flying) if slots is not None else set()
        self.now = now

    @property
    def full(self) -> bool:
        """The engine's queue holds all the requests its next steps take: nothing
        fits, whatever its size or class (rules 2 and 8)."""
        if not (self.limited and self.in_flight > 0 and self.unstarted_n >= self.feed_slots):
            return False
        return not self.first or self._interactive_slot_bound()

    def _interactive_slot_bound(self) -> bool:
        """Rule 8: interactive work's unstarted requests fill its feed's slots, the
        seats background work runs in counted free."""
        running_bg = self.bg_flying - self.bg_unstarted
        return self.unstarted_n - self.bg_unstarted >= self.feed_slots + running_bg

    @property
    def reserved(self) -> float:
        """Rule 4: the KV tokens kept for short prompts (0 without a reserve or KV size)."""
        return self.kv_tokens - self.kv_long

    @property
    def slot_bound(self) -> bool:
        """Rule 2 holds work for want of slots, not of budget."""
        return self.unstarted_n >= self.feed_slots

    def fits(self, ptok: int, interactive: bool = False) -> bool:
        return self.blocks(ptok, interactive) is None

    def blocks(self, ptok: int, interactive: bool = False) -> Hold | None:
        """The rule that holds a prompt of `ptok` tokens now, None if it fits."""
        if not self.limited or not self.in_flight:
            return None
        if interactive and self.first:  # rule 8
            ahead = self.unstarted_n - self.bg_unstarted
            feed = self.unstarted_feed - self.bg_feed
            slot_bound = self._interactive_slot_bound()
        else:
            ahead, feed, slot_bound = self.unstarted_n, self.unstarted_feed, self.slot_bound
        if slot_bound or (ahead and feed + self.feed_size(ptok, self.steps) > self.feed_tokens):
            return Hold.FEED
        if (
            self.long_bound
            and self.long_n >= self.long_bound
            and self.multi_step(ptok, self.short_prompt)
        ):
            return Hold.LONG
        kv = self.kv_tokens
        if kv:
            short = ptok <= self.short_prompt
            ahead = self.kv_round if short else self.kv_pending
            if self.kv_used + ahead + ptok > kv:
                return Hold.KV
            if not short and self.kv_used + self.kv_pending + ptok > self.kv_long:
                return Hold.RESERVE
            if ptok > self.kv_rank_free:
                return Hold.KV
        return None

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

    def take(self, ptok: int, adapter: str | None = None, interactive: bool = False) -> None:
        if adapter is not None and self.loras:
            self.resident.add(adapter)
        self.in_flight += 1
        self.unstarted_n += 1
        feed = self.feed_size(ptok, self.steps)
        self.unstarted_feed += feed
        if not interactive:  # rule 8's background counts
            self.bg_flying += 1
            self.bg_unstarted += 1
            self.bg_feed += feed
        self.kv_pending += ptok
        self.kv_round += ptok
        if self.multi_step(ptok, self.short_prompt):
            self.long_n += 1


def _rank_free(capacity: EngineCapacity, kv_usage: float, least: float | None) -> float:
    """Rule 6: KV tokens free on the least-used rank (no bound with one rank)."""
    if capacity.ranks == 1 or not capacity.kv_tokens:
        return float("inf")
    usage = kv_usage if least is None else least
    return capacity.kv_tokens * (1.0 - usage)


def underfed(step: EngineStep, capacity: EngineCapacity, held: int, pending: int = 0) -> bool:
    """Was `step` under-fed: did it leave token budget and a running slot unused
    while Sluice held work that would have fit?

    `held` is the prompt size of the smallest generation Sluice held for engine
    room, 0 if it held none: work that waits for its caller's limit or for a LoRA
    slot is held on purpose, and a step beside it is not under-fed. "Would have
    fit" is the engine's own test for a waiting request, on the step's rank, with
    the whole prompt's KV: a running slot free (requests scheduled < max_seqs), its
    first prefill chunk (the prompt, or vLLM's per-prompt cap if smaller) within
    the token budget the step left, and KV for the whole prompt free after the step
    beside `pending`, what the step's rank has still to allocate for the prompts
    released to it (rule 3's pending tokens: their later chunks): vLLM would start a
    prompt on its first chunk's blocks alone, and preempt when a later chunk, its
    own or an earlier prompt's, finds none, so holding that prompt is not
    under-feeding. Work the
    short-prompt reserve or the long-prefill bound holds (rules 4-5) counts: they
    are Sluice's policy for a short turn's room, and their cost shows here and in
    the held time by rule. A step after which the engine
    itself still had waiting work is never under-fed: the engine held something it
    could not schedule (KV, an adapter, its own order), so it was not short of work
    from Sluice. Capacity numbers that are unknown (0) never make a step look full.
    """
    if held <= 0 or step.waiting:
        return False
    if capacity.max_seqs and step.requests >= capacity.max_seqs:
        return False
    chunk = capacity.feed_size(held, 1.0)
    if capacity.step_tokens and step.tokens + chunk > capacity.step_tokens:
        return False
    kv = capacity.kv_tokens
    return not (kv and held + pending > kv * (1.0 - step.kv_usage))


def place(
    capacity: EngineCapacity,
    last: Sequence[EngineStep | None],
    ending: Sequence[int],
    unstarted: Sequence[int],
    ptok: int,
) -> int:
    """Rule 6's placement: the data-parallel rank a released generation of `ptok`
    prompt tokens goes to.

    The rank with the most room: the running slots its last step left free, plus its
    generations that end within the feed's steps (`ending`, endings.py), less the
    unstarted work already placed on it; a rank whose KV cache has room for the whole
    prompt first; ties to the lower rank. vLLM's own client balances this process's
    unfinished requests per rank instead, which sends a release beside a rank whose
    slots free next step to one whose requests all run for seconds more, where it
    waits in that rank's queue: modelled (bench/room_sim.py dp, c=512, 64 in / 64 out,
    3 seeds) TTFT p99 17.0-17.4 s against 11.9-12.4 s placed here, with everything sent
    at once 11.8-11.9 s. A rank that has not reported a step counts as empty.
    """
    seqs, kv = capacity.max_seqs, capacity.kv_tokens
    best = 0
    best_key: tuple[bool, int, float] | None = None
    for r, waiting in enumerate(unstarted):
        step = last[r] if r < len(last) else None
        running = step.running if step is not None else 0
        room = (seqs - running if seqs else 0) + (ending[r] if r < len(ending) else 0) - waiting
        kv_free = kv * (1.0 - step.kv_usage) if kv and step is not None else math.inf
        key = (kv_free >= ptok, room, kv_free)
        if best_key is None or key > best_key:
            best, best_key = r, key
    return best


def rooms(
    capacity: EngineCapacity,
    last: Sequence[EngineStep | None],
    ending: Sequence[int],
    unstarted: Sequence[int],
    ptok: int,
) -> list[bool]:
    """Rule 6's room per rank, as `place` counts it: a free slot (or one ending) beyond
    the unstarted work placed there, and KV room for the whole prompt; for prefix
    placement (prefix.py rule P4). A rank that has not reported a step has room."""
    seqs, kv = capacity.max_seqs, capacity.kv_tokens
    out = []
    for r, waiting in enumerate(unstarted):
        step = last[r] if r < len(last) else None
        if step is None:
            out.append(True)
            continue
        room = (seqs - step.running if seqs else 1) + (ending[r] if r < len(ending) else 0)
        kv_free = kv * (1.0 - step.kv_usage) if kv else math.inf
        out.append(room - waiting > 0 and kv_free >= ptok)
    return out
