"""When a dead engine is started again, and when its model gives up: the decisions alone.

Why this module exists: issue 41 (faults stay where they happen). One model's
engine core that dies must cost that model's requests and nothing else, and
come back; one that keeps dying must stop costing engine starts. These are
the rules, as plain functions of a model's restart history and the time
(no I/O, time is an argument); server/engines/supervisor.py does what they say.

Rules:

1. A death is an engine core process that exited (its exit code, or the
   signal that ended it) or an engine that failed its health check: a hung
   core is a dead one. A core answers between its steps, so the check waits
   --engine-health-timeout beyond a few of the engine's own longest recent step
   (`answer_within`): a long prompt's chunks on a CPU beside another engine take
   seconds each and grow with the context, a GPU's take milliseconds. `Death`
   names it for the log line and the `cause` label of the metrics.
2. A dead engine is started again after a back-off: `base` seconds after the
   first death in the window, doubled for each restart already in it, never
   more than `cap` (`backoff`: 1 s, 2 s, 4 s, ... 30 s by default).
3. The budget: at most `restarts` restarts per `window` seconds per model. A
   death when the window's budget is spent is final: the model is `failed`
   (`decide`).
4. A restart that fails (its load raises: the weights are gone, the card is
   full) is final too: the model is `failed`, its requests get a 503 naming the
   cause; a request after the loader's retry time tries a load again, as after
   any failed load (server/engines/loader.py).
5. The process exits (code 1: systemd restarts it) only when a model marked
   `essential` is failed; with one --model that is the model, with a models
   file the models whose table says `essential = true` (`exits`).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Death",
    "RestartPolicy",
    "Verdict",
    "answer_within",
    "backoff",
    "decide",
    "exits",
    "recent",
]

# Rule 1: the steps a health check may wait for, counted in the engine's longest
# recent step: the one in progress can be longer than any before it (a prompt's
# later chunks attend over more context; another process took the cores).
STEPS_WAITED = 3


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """--engine-restarts per --engine-restart-window, and the back-off's bounds."""

    restarts: int = 5
    window: float = 600.0
    base: float = 1.0
    cap: float = 30.0

    def __post_init__(self) -> None:
        if self.restarts < 0 or self.window <= 0 or self.base <= 0 or self.cap < self.base:
            raise ValueError(f"bad restart policy {self}")


def answer_within(timeout: float, longest_step: float) -> float:
    """Rule 1: the seconds a health check waits for its answer before the engine is
    hung: `timeout` beyond STEPS_WAITED of its longest recent step (seconds)."""
    return timeout + STEPS_WAITED * max(0.0, longest_step)


@dataclass(frozen=True, slots=True)
class Death:
    """Rule 1: how an engine died. `code`: the process's exit code (negative:
    the signal that ended it, as multiprocessing reports it); None with `hung`
    or when no process handle said."""

    code: int | None = None
    hung: bool = False

    @property
    def label(self) -> str:
        """The metrics' `cause` label: SIGKILL, exit_1, health_check, unknown."""
        if self.hung:
            return "health_check"
        if self.code is None:
            return "unknown"
        if self.code < 0:
            return _signal_name(-self.code)
        return f"exit_{self.code}"

    @property
    def describe(self) -> str:
        """The log's and the error's words for it."""
        if self.hung:
            return "its health check got no answer"
        if self.code is None:
            return "its engine core process died"
        if self.code < 0:
            return f"its engine core process was ended by {_signal_name(-self.code)}"
        return f"its engine core process exited with code {self.code}"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal_{num}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do about a death: restart after `delay` seconds, or give up."""

    restart: bool
    delay: float = 0.0
    used: int = 0  # restarts in the window before this one


def recent(history: Sequence[float], now: float, window: float) -> tuple[float, ...]:
    """The restarts (their times) that count against the budget at `now`."""
    return tuple(t for t in history if now - window < t <= now)


def backoff(policy: RestartPolicy, used: int) -> float:
    """Rule 2: the wait before a restart when `used` restarts are in the window."""
    if used <= 0:
        return policy.base
    # 2**used overflows a float past ~1024; the cap is reached long before.
    return min(policy.cap, policy.base * 2.0 ** min(used, 64))


def decide(policy: RestartPolicy, history: Sequence[float], now: float) -> Verdict:
    """Rules 2-3: a death at `now`, with `history` the times of this model's
    earlier restarts."""
    used = len(recent(history, now, policy.window))
    if used >= policy.restarts:
        return Verdict(restart=False, used=used)
    return Verdict(restart=True, delay=backoff(policy, used), used=used)


def exits(essential: bool, failed: bool) -> bool:
    """Rule 5: whether a model's state stops the process."""
    return essential and failed
