"""The board: what each engine's scheduler tells the others and the front, per step.

Why this module exists: several models share one card and one CPU (issue 49 item
3). While one model's interactive work waits or prefills, the others' background
work must sit out their steps, and each engine's scheduler runs in a process of its
own (vLLM's engine core), stepping many times a second. A shared memory page is the
cheapest way they can tell each other: one slot per engine rank, written only by
that rank's scheduler (server/engines/vllm_scheduler.py), read by every other
scheduler before its step and by the front for metrics. No locks: one writer per
slot, each field 8 bytes and aligned, a torn read of a counter is off by one step.
The one exception is the front's word on each slot: how many streamed interactive
turns on that rank have shown their client no token yet (rule 2), written only by
the front, read only by that rank's scheduler.

The front creates the page at start (`Board.create`) and names it to the engine
processes it starts through the environment (`SLUICE_BOARD`); each engine learns its
slot from its configuration (`SEAT_KEY` in vLLM's `additional_config`, plus its
data-parallel rank). A pending flag older than `STALE_S` is not believed: an engine
that died mid-step does not hold the others' work; nor a present flag older than
`PRESENT_S` (rule 4's linger: an engine that went idle writes nothing more).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from batching.step_share import StepCounters

__all__ = ["ENV", "PRIORITY_KEY", "RATIO_KEY", "SEAT_KEY", "SLOTS", "Board", "SlotView", "allocate"]

ENV: Final = "SLUICE_BOARD"  # the page's path, for the engine processes
SEAT_KEY: Final = "sluice_board_slot"  # additional_config key: an engine's first slot
# additional_config key: rule 4's budget as a multiple of the measured interactive
# step (--background-step-ratio; batching/step_share.py).
RATIO_KEY: Final = "sluice_background_step_ratio"
# additional_config key: the front's start priority, [start nice, serving nice], where
# an engine may lower and raise its own (server/engines/start_priority.py rule 4).
PRIORITY_KEY: Final = "sluice_start_priority"
SLOTS: Final = 64  # engine ranks one server may run (models x data-parallel ranks)
STALE_S: Final = 10.0  # a pending flag older than this is ignored
PRESENT_S: Final = 1.0  # a present flag older than this too (an idle engine writes none)
# A slot: the flags and their stamp (ns), then what `publish` writes: held, capped,
# preempted, floor steps, steps present, seconds present, steps alone, seconds
# alone (StepCounters, in order), then the budget (s; NaN unknown) and the cap.
_PENDING: Final = struct.Struct("<QQ")
_COUNTERS = "QQQQQdQd"
_PUBLISHED: Final = struct.Struct("<" + _COUNTERS + "dQ")
_SLOT: Final = struct.Struct("<QQ" + _COUNTERS + "dQ")
_BUDGET: Final = struct.Struct("<d")
_BUDGET_AT: Final = _PENDING.size + struct.calcsize("<" + _COUNTERS)
# The front's word after the slot's own: turns not yet shown a token, and its stamp (ns).
_UNSHOWN: Final = struct.Struct("<QQ")
_UNSHOWN_AT: Final = _SLOT.size
_SIZE: Final = 128  # bytes per slot (>= _UNSHOWN_AT + _UNSHOWN.size; aligned)


@dataclass(frozen=True, slots=True)
class SlotView:
    """One slot as the front reads it."""

    counters: StepCounters
    budget: float | None  # rule 4's budget, seconds (None until measured)
    cap: int


class Board:
    """The page, mapped; `path` names it to other processes."""

    __slots__ = ("_fd", "_map", "owner", "path")

    def __init__(self, path: Path, *, owner: bool = False) -> None:
        self.path = path
        self.owner = owner
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, SLOTS * _SIZE)

    @classmethod
    def create(cls) -> Board:
        """A new zeroed page, in /dev/shm where there is one (memory, not disk)."""
        shm = Path("/dev/shm")
        where = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
        fd, name = tempfile.mkstemp(prefix="sluice-board-", dir=where)
        try:
            os.ftruncate(fd, SLOTS * _SIZE)
        finally:
            os.close(fd)
        return cls(Path(name), owner=True)

    @classmethod
    def from_env(cls) -> Board | None:
        """The page the front named, in an engine process (None outside a server)."""
        path = os.environ.get(ENV)
        return cls(Path(path)) if path else None

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
        if self.owner:
            self.path.unlink(missing_ok=True)

    # -- the scheduler's side ---------------------------------------------------

    def set_pending(self, slot: int, pending: bool, present: bool = False) -> None:
        """Does this rank have interactive work waiting or in prefill (rule 2), and
        present at all with a budget measured (rule 4)?"""
        flags = int(pending) | (int(present) << 1)
        _PENDING.pack_into(self._map, slot * _SIZE, flags, time.monotonic_ns())

    def elsewhere(self, slot: int, now_ns: int) -> tuple[bool, float | None]:
        """Has any other rank interactive work pending, and the least budget of those
        with interactive work present (recent flags only)?"""
        m = self._map
        stale = int(STALE_S * 1e9)
        pending = False
        budget: float | None = None
        for s in range(SLOTS):
            if s == slot:
                continue
            flags, stamp = _PENDING.unpack_from(m, s * _SIZE)
            if not flags or now_ns - stamp >= stale:
                continue
            pending = pending or bool(flags & 1)
            if flags & 2 and now_ns - stamp < PRESENT_S * 1e9:
                (b,) = _BUDGET.unpack_from(m, s * _SIZE + _BUDGET_AT)
                if not math.isnan(b) and (budget is None or b < budget):
                    budget = b
        return pending, budget

    def interactive_elsewhere(self, slot: int) -> bool:
        """Has any other rank interactive work, pending or present, now (a starting
        engine's word: server/engines/start_priority.py rule 5; a scheduler reads
        `elsewhere` with its step's own clock)?"""
        pending, budget = self.elsewhere(slot, time.monotonic_ns())
        return pending or budget is not None

    def unshown(self, slot: int, now_ns: int) -> bool:
        """Has a streamed interactive turn on this rank shown its client no token yet
        (the front's word; not believed once older than `STALE_S`: a front that died)?"""
        count, stamp = _UNSHOWN.unpack_from(self._map, slot * _SIZE + _UNSHOWN_AT)
        return bool(count) and now_ns - stamp < STALE_S * 1e9

    def publish(self, slot: int, counters: StepCounters, budget: float | None, cap: int) -> None:
        """This rank's counters after a step (its pending flag is kept)."""
        c = counters
        _PUBLISHED.pack_into(
            self._map,
            slot * _SIZE + _PENDING.size,
            c.held,
            c.capped,
            c.preempted,
            c.floor_steps,
            c.steps_present,
            c.seconds_present,
            c.steps_alone,
            c.seconds_alone,
            float("nan") if budget is None else budget,
            cap,
        )

    # -- the front's side ------------------------------------------------------

    def set_unshown(self, slot: int, count: int) -> None:
        """How many streamed interactive turns on this rank have shown their client no
        token yet (rule 2)."""
        _UNSHOWN.pack_into(self._map, slot * _SIZE + _UNSHOWN_AT, count, time.monotonic_ns())

    def read(self, slot: int) -> SlotView:
        (_, _, held, capped, pre, floor, sp, secp, sa, seca, budget, cap) = _SLOT.unpack_from(
            self._map, slot * _SIZE
        )
        counters = StepCounters(held, capped, pre, floor, sp, secp, sa, seca)
        return SlotView(counters, None if math.isnan(budget) else budget, cap)

    def clear(self, slot: int) -> None:
        """Zero a slot (an engine starting on it afresh)."""
        self._map[slot * _SIZE : (slot + 1) * _SIZE] = bytes(_SIZE)


_taken = 0  # slots handed out in this process (an engine keeps its own across restarts)


def allocate(ranks: int) -> int | None:
    """The first of `ranks` slots for a new engine; None when the page is full (that
    engine then runs vLLM's own scheduler)."""
    global _taken
    if _taken + ranks > SLOTS:
        return None
    first, _taken = _taken, _taken + ranks
    return first
