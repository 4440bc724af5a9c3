"""The driver: the thin I/O shell around the sans-IO batching core.

The core (batching/) decides; the driver owns the clock (`loop.time()`), the
wake-ups and the engine. Its one task, started in the app's task group:

    loop:  batches = core.due(now, engine load)  ->  add each entry to the
           engine back to back, in the core's order  ->  hand the generation
           to every subscriber  ->  sleep until core.next_deadline() or a
           new request wakes it.

The core holds its backlog until the engine's next steps will take it
(batching/room.py), so the driver reports what the engine did: a generation's
first output (`core.started`, the engine has taken it out of its waiting
queue), its end (`core.finished`), and each engine step the engine adapter
read (`Engine.take_steps`: its scheduled tokens, running and waiting
requests, per data-parallel rank), each followed by a wake-up while the
backlog holds work, and it passes the engine's latest stats (running,
waiting, KV-cache use) and the steps since the last look to every `due()`.
An engine that reports no steps still gets a look every `BACKLOG_RECHECK`
seconds while the backlog holds work.

A caller's life: `submit()` admits it to the core (or raises the refusal as a
SluiceError with Retry-After), the caller awaits its `Ticket`, streams from
the `Generation` it receives, and leaves through `Ticket.leave()` whatever
happens. A caller that leaves while queued is removed from the core and never
costs the engine anything; one that leaves a running generation aborts it in
the engine unless other (deduplicated) callers still read it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

from batching import (
    AdmissionState,
    Admitted,
    Batch,
    Charge,
    Coalescer,
    Ended,
    EngineLoad,
    Entry,
    Event,
    Outcome,
    RefusalReason,
    Refused,
    Request,
    engine_priority,
    is_background,
)
from server.engines.interface import Engine, EngineOutput, EngineParams, OutputStream
from server.engines.lora import Adapter
from server.errors import SluiceError

log = logging.getLogger("sluice.driver")

# Refusal reason -> HTTP status. Per-caller or request-size problems are the
# caller's; capacity and memory are the server's (503: retry elsewhere/later).
_REFUSAL_STATUS = {
    RefusalReason.TOO_LARGE: 400,
    RefusalReason.DUPLICATE_ID: 400,
    RefusalReason.CALLER_LIMIT: 429,
}


def request_priority(entry: Entry) -> int:
    """The engine priority of a generation: its request's own `priority`, as vLLM
    takes it."""
    return entry.request.priority


def order_priority(entry: Entry) -> int:
    """Sluice's release key (batching/order.py) as one engine priority, for vLLM's
    `--scheduling-policy priority`, which orders its waiting queue by it and preempts
    running requests with a larger value for an arrival with a smaller one
    (--engine-priority order)."""
    return engine_priority(entry.order)


# While the backlog holds work: how often to look again without an event. The
# events that free room (a first output, a finish, an engine step, an abort,
# a new request, a deadline) wake the driver at once; vLLM reports every step
# (server/engines/vllm_adapter.py), so with it this timer finds nothing new. It stays for an
# engine that reports no steps (the tests' fake). Measured on the 2-core test
# machine (load average 17), the driver holding 132 generations behind a full
# fake engine: 45-48 wakes/s costing 0.5-0.7 % of one core, 0.00 % with the
# recheck off; core.due() itself takes 2-8 us per recheck (10 to 1000 held).
BACKLOG_RECHECK = 0.02


class Generation:
    """One engine request, read by one caller or (deduplicated) several.

    With one reader, the reader pulls from vLLM's output collector directly:
    no extra task, no extra wake-up per token. With several, no task either:
    the readers share a history, and whichever reader runs out of it first
    fetches the next output from the collector for all (the others wait for
    it). A fetch runs in a reader's own task, inside its request's scope: a
    reader that leaves mid-fetch is cancelled there (the collector's `get` is
    cancellation-safe, nothing is lost) and the next waiting reader takes
    over. Outputs nobody fetched yet are merged by the collector, as for one
    lagging reader.
    """

    def __init__(
        self,
        driver: Driver,
        engine_id: str,
        collector: OutputStream,
        subscribers: set[str],
        priority: int,
        started: float,
        rank: int = 0,
    ) -> None:
        self.driver = driver
        self.engine_id = engine_id
        self.priority = priority
        self.started = started
        self.rank = rank  # the data-parallel rank it runs on
        self._collector = collector
        self._subscribers = subscribers
        self._shared = len(subscribers) > 1
        self._done = False
        self._history: list[EngineOutput] = []
        self._error: BaseException | None = None
        self._changed = asyncio.Event()  # the history grew, or the fetcher left
        self._fetching = False
        self._first = True  # no output seen yet
        self.completion_tokens = 0
        # Its share of the engine's steps, set when it is done (batching/ledger.py).
        self.charge = Charge()

    async def _fetch(self) -> None:
        """One output from the collector into the shared history, in the
        calling reader's task."""
        self._fetching = True
        try:
            out = await self._collector.get()
            self._count(out)
            self._history.append(out)
            if out.finished:
                self._finish()
        except Exception as exc:
            self._error = exc
            self._finish()
        finally:
            self._fetching = False
            self._changed.set()

    async def outputs(self, subscriber: str) -> AsyncGenerator[EngineOutput, None]:
        """The engine's outputs (vLLM RequestOutput deltas) for one reader."""
        if not self._shared:
            while True:
                try:
                    out = await self._collector.get()
                except SluiceError:
                    self._finish()
                    raise
                except Exception as exc:
                    self._finish()
                    raise self.driver.engine_error(exc) from exc
                self._count(out)
                if out.finished:
                    self._finish()
                yield out
                if out.finished:
                    return
        i = 0
        while True:
            while i < len(self._history):
                out = self._history[i]
                i += 1
                yield out
                if out.finished:
                    return
            if self._error is not None:
                if isinstance(self._error, SluiceError):
                    raise self._error
                raise self.driver.engine_error(self._error)
            if self._done:
                return
            if self._fetching:
                self._changed.clear()
                await self._changed.wait()
            else:
                await self._fetch()

    def _count(self, out: EngineOutput) -> None:
        if self._first:
            self._first = False
            self.driver.generation_started(self, out.num_cached_tokens or 0)
        for c in out.outputs:
            self.completion_tokens += len(c.token_ids)

    def fail(self, exc: BaseException) -> None:
        """Make every reader raise `exc` (watchdog abort, drain deadline)."""
        if self._done:
            return
        # A reader waiting on the collector (the only one, or the fetcher of
        # several) raises it from there; the others find it in `_error`.
        self._collector.put(exc)
        if self._shared:
            self._error = exc
            self._changed.set()
        self.driver.abort_engine(self.engine_id)
        self._finish()

    def leave(self, subscriber: str) -> None:
        self._subscribers.discard(subscriber)
        if not self._subscribers and not self._done:
            # Nobody reads it any more: stop paying for it at once.
            self.driver.abort_engine(self.engine_id)
            self._finish()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self.driver.generation_done(self)


class FirstTokens:
    """One streamed response's interactive generations that have shown their client
    no token yet, counted on their engine's rank from here until `shown` or `close`
    (batching/step_share.py rule 2: a turn whose first tokens carry no text, as a
    thinking model's `<think>`, still holds the background's next step). Background
    generations are not counted: nobody waits on their first token."""

    __slots__ = ("_due",)

    def __init__(self, gens: Sequence[Generation]) -> None:
        self._due = {i: g for i, g in enumerate(gens) if not is_background(g.priority)}
        for g in self._due.values():
            g.driver.unshown(g.rank, 1)

    def shown(self, index: int) -> None:
        """Generation `index` has shown its client a token."""
        g = self._due.pop(index, None)
        if g is not None:
            g.driver.unshown(g.rank, -1)

    def close(self) -> None:
        """The response ended (or failed): none of it is due any more."""
        for g in self._due.values():
            g.driver.unshown(g.rank, -1)
        self._due.clear()


@dataclass(slots=True)
class Ticket:
    """A caller's claim on a future generation."""

    id: str
    driver: Driver
    future: asyncio.Future[Generation]
    arrival: float
    generation: Generation | None = None
    queue_wait: float = 0.0
    batch_id: int = -1
    batch_size: int = 0
    joined: bool = False
    release: str | None = None  # why its batch left the core (ReleaseReason's value)

    async def wait(self) -> Generation:
        self.generation = await self.future
        return self.generation

    def leave(self) -> None:
        """Always called when the caller is done, normally or not."""
        self.driver.leave(self)


@dataclass(slots=True)
class _Pending:
    ticket: Ticket
    params: EngineParams | None = None  # None for a joined duplicate
    # The LoRA adapter it runs on (None: the base weights). Equal for every
    # subscriber of one generation: the adapter's name is part of the group
    # key (batching/keys.py), which the dedupe key includes.
    adapter: Adapter | None = None
    # The prefix-cache salt (server/callers.py); equal for every subscriber of
    # one generation too: the dedupe fingerprint includes it.
    cache_salt: str | None = None


class Driver:
    """Feeds the core's batches to the engine; see the module docstring."""

    def __init__(
        self,
        core: Coalescer,
        engine: Engine,
        on_events: Callable[[Sequence[Event]], None] | None = None,
        clock: Callable[[], float] | None = None,
        engine_priority: Callable[[Entry], int] = request_priority,
        on_dead: Callable[[], None] = lambda: None,
    ) -> None:
        self.core = core
        self.engine = engine
        # Told when this driver meets its engine's death (a failed output or
        # add): the supervisor's wake (server/engines/supervisor.py), which
        # otherwise sees it at its next look.
        self._on_dead = on_dead
        self._engine_priority = engine_priority
        self._on_events = on_events or (lambda _evs: None)
        self._loop = asyncio.get_running_loop()
        self._clock = clock or self._loop.time
        self._pending: dict[str, _Pending] = {}
        self._running: dict[str, Generation] = {}
        self._unshown: dict[int, int] = {}  # per rank (FirstTokens)
        self._wakeup = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._fired = float("-inf")  # the latest deadline a timer fired for
        self._dead: BaseException | None = None
        self._aborts: set[str] = set()
        self.idle = asyncio.Event()
        self.idle.set()

    # -- the caller's side --------------------------------------------------

    def now(self) -> float:
        return self._clock()

    def prefix(
        self, prompt_tokens: Sequence[int], cache_salt: str | None, adapter: Adapter | None = None
    ) -> tuple[int, ...]:
        """A prompt's prefix block hashes for the core's placement (batching/prefix.py)
        and warm order (batching/warm.py), from the engine (a LoRA adapter's blocks are
        its own): the whole prompt's for placement, the leading blocks' for the order
        alone; () with neither to do (one data-parallel rank or --no-prefix-placement,
        and --no-prefix-order or the engine's prefix cache off): no hashing then."""
        n = self.core.prefix_tokens
        if n == 0:
            return ()
        if n is not None and len(prompt_tokens) > n:
            prompt_tokens = prompt_tokens[:n]
        return self.engine.prefix_hashes(prompt_tokens, cache_salt, adapter)

    def submit(
        self,
        request: Request,
        params: EngineParams,
        adapter: Adapter | None = None,
        cache_salt: str | None = None,
    ) -> Ticket:
        """Admit `request` to the core; raise a SluiceError if refused.

        `adapter` is the LoRA adapter named by `request.key.adapter`, and
        `cache_salt` its caller's prefix-cache salt; the engine gets both with
        the request."""
        if self._dead is not None:
            raise SluiceError("the engine is not running", status=503, retry_after=5)
        result = self.core.add(request, self.now())
        self._flush_events()
        if isinstance(result, Refused):
            status = _REFUSAL_STATUS.get(result.reason, 503)
            raise SluiceError(
                result.message,
                status=status,
                code=result.reason.value,
                retry_after=None if status == 400 else result.retry_after,
            )
        assert isinstance(result, Admitted)
        ticket = Ticket(
            request.id,
            self,
            self._loop.create_future(),
            request.arrival,
            joined=bool(result.joined),
        )
        self._pending[request.id] = _Pending(
            ticket, None if result.joined else params, adapter, cache_salt
        )
        self.idle.clear()
        self._wake()
        return ticket

    def leave(self, ticket: Ticket) -> None:
        if ticket.id in self._pending:
            # Still queued (or dispatch in progress): the core removes it
            # without it ever reaching the engine.
            self.core.cancel(ticket.id, self.now())
            pending = self._pending.pop(ticket.id)
            if pending.ticket.future.done() and not pending.ticket.future.cancelled():
                ticket.generation = pending.ticket.future.result()
            else:
                pending.ticket.future.cancel()
            self._flush_events()
            self._wake()
        if ticket.generation is not None:
            ticket.generation.leave(ticket.id)
        self._check_idle()

    # -- the engine's side --------------------------------------------------

    def abort_engine(self, engine_id: str) -> None:
        if self._dead is None and engine_id not in self._aborts:
            self._aborts.add(engine_id)
            self._wake()

    def generation_done(self, gen: Generation) -> None:
        self._running.pop(gen.engine_id, None)
        gen.charge = self.engine.charge(gen.engine_id)
        self.core.finished(gen.engine_id, self.now(), gen.completion_tokens)
        self._flush_events()
        self._check_idle()
        self._wake()

    def unshown(self, rank: int, change: int) -> None:
        """`change` the count of streamed interactive turns on `rank` that have shown
        their client no token yet, and tell the engine's scheduler (FirstTokens)."""
        count = self._unshown[rank] = self._unshown.get(rank, 0) + change
        self.engine.set_unshown(rank, count)

    def generation_started(self, gen: Generation, cached: int = 0) -> None:
        """Its first output: it left the engine's waiting queue (room for more);
        `cached` of its prompt tokens were in the prefix cache."""
        if self.core.started(gen.engine_id, self.now(), cached) and self.core.backlog_generations:
            self._wake()

    def load(self) -> EngineLoad:
        s = self.engine.stats()
        return EngineLoad(
            running=s.running,
            waiting=s.waiting,
            kv_usage=s.kv_cache_usage,
            kv_usage_least=s.kv_usage_least,
        )

    def set_state(self, state: AdmissionState) -> None:
        if self.core.state is AdmissionState.DRAINING and state is not AdmissionState.DRAINING:
            return  # draining is final
        self.core.state = state
        self._wake()

    def running_generations(self) -> list[Generation]:
        return list(self._running.values())

    def fail_queued(self, error: SluiceError) -> int:
        ids = self.core.reject_queued(self.now())
        for rid in ids:
            pending = self._pending.pop(rid, None)
            if pending is not None and not pending.ticket.future.done():
                pending.ticket.future.set_exception(error)
        self._flush_events()
        self._check_idle()
        return len(ids)

    def fail_running(self, error: SluiceError) -> int:
        gens = list(self._running.values())
        for gen in gens:
            gen.fail(error)
        return len(gens)

    def engine_error(self, exc: BaseException) -> SluiceError:
        """The caller-facing error for an engine failure."""
        if self._dead is not None or self.engine.errored:
            self._on_dead()
            return SluiceError("the engine died; retry shortly", status=503, retry_after=5)
        log.error("generation failed: %r", exc)
        return SluiceError("generation failed", status=500)

    def engine_died(self, exc: BaseException, error: SluiceError | None = None) -> None:
        """The engine is gone: fail what is queued and running (with `error`,
        else a plain 503) and refuse new work until `revive`."""
        self._dead = exc
        err = error or SluiceError("the engine died; retry shortly", status=503, retry_after=5)
        self.fail_queued(err)
        self.fail_running(err)

    def revive(self) -> None:
        """A fresh engine runs again (a restart: server/engines/supervisor.py)."""
        self._dead = None
        self._aborts.clear()
        self._wake()

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        """Generations in the engine now."""
        return len(self._running)

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._running)

    def _check_idle(self) -> None:
        if not self._pending and not self._running:
            self.idle.set()

    def _wake(self) -> None:
        self._wakeup.set()

    def _flush_events(self) -> None:
        events = self.core.pop_events()
        if not events:
            return
        self._on_events(events)
        for e in events:
            if type(e) is Ended and e.outcome is Outcome.EXPIRED:
                pending = self._pending.pop(e.request_id, None)
                if pending is not None and not pending.ticket.future.done():
                    pending.ticket.future.set_exception(
                        SluiceError(
                            f"request waited {e.queue_wait:.1f}s in the queue, past "
                            "--queue-timeout (--background-queue-timeout for background "
                            "work)",
                            status=503,
                            code="queue_timeout",
                            retry_after=1.0,
                        )
                    )
                self._check_idle()

    def _arm_timer(self) -> None:
        deadline = self.core.next_deadline()
        if self.core.backlog_generations:
            recheck = self.now() + BACKLOG_RECHECK
            if deadline is None or recheck < deadline:
                deadline = recheck
        if deadline == self._timer_at and self._timer is not None:
            return  # already armed for that moment
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = deadline
        if deadline is not None:
            self._timer = self._loop.call_at(deadline, self._on_timer, deadline)

    def _on_timer(self, deadline: float) -> None:
        # Event loops may run a timer a little before its time (asyncio by
        # its clock resolution, uvloop by up to a millisecond: libuv counts
        # in whole ms). The core must see the deadline as reached, or nothing
        # is due, the timer is not re-armed and the batch waits for the next
        # unrelated wake-up.
        self._timer = None
        self._timer_at = None
        self._fired = max(self._fired, deadline)
        self._wakeup.set()

    def _on_step(self) -> None:
        """The engine ran a step: while work is held, the room it left is released now."""
        if self.core.backlog_generations:
            self._wake()

    async def run(self) -> None:
        """The driver task: runs until cancelled at shutdown."""
        self.engine.watch_steps(self._on_step)
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                if self._aborts:
                    ids, self._aborts = list(self._aborts), set()
                    try:
                        await self.engine.abort(ids)
                    except Exception:
                        log.exception("engine abort failed")
                batches = self.core.due(
                    max(self.now(), self._fired), self.load(), self.engine.take_steps()
                )
                self._flush_events()
                for batch in batches:
                    await self._dispatch(batch)
                self._arm_timer()
        finally:
            self.engine.watch_steps(None)
            if self._timer is not None:
                self._timer.cancel()

    async def _dispatch(self, batch: Batch) -> None:
        for entry in batch.entries:
            req = entry.request
            lead = self._pending.get(req.id)
            if lead is None or lead.params is None:
                # The first caller left while dispatch was under way; its
                # parameters travel with the first remaining subscriber.
                lead = next(
                    (
                        p
                        for s in entry.subscribers
                        if (p := self._pending.get(s)) is not None and p.params is not None
                    ),
                    None,
                )
            subscribers = {s for s in entry.subscribers if s in self._pending}
            if not subscribers or lead is None or lead.params is None:
                self.core.finished(req.id, self.now(), 0)
                continue
            now = self.now()
            try:
                collector = await self.engine.add(
                    req.id,
                    req.prompt_tokens,
                    lead.params,
                    self._engine_priority(entry),
                    lead.adapter,
                    lead.cache_salt,
                    entry.rank,
                    background=is_background(req.priority),
                )
            except SluiceError as exc:
                self._fail_entry(req.id, subscribers, exc)
                continue
            except Exception as exc:
                dead = self.engine.errored
                if dead:
                    self._on_dead()
                log.warning("engine refused %s: %s", req.id, exc)
                self._fail_entry(
                    req.id,
                    subscribers,
                    SluiceError(
                        "the engine died; retry shortly" if dead else f"engine error: {exc}",
                        status=503 if dead else 500,
                        retry_after=5 if dead else None,
                    ),
                )
                continue
            gen = Generation(
                self, req.id, collector, set(subscribers), req.priority, now, entry.rank or 0
            )
            self._running[req.id] = gen
            for sub in subscribers:
                pending = self._pending.pop(sub)
                t = pending.ticket
                t.queue_wait = now - t.arrival
                t.batch_id, t.batch_size = batch.id, len(batch.entries)
                t.release = batch.reason.value
                if t.future.cancelled():
                    gen.leave(sub)
                else:
                    t.generation = gen  # so leave() works even if wait() never resumes
                    t.future.set_result(gen)
            # Subscribers that left between due() and here.
            for sub in set(entry.subscribers) - subscribers:
                gen.leave(sub)

    def _fail_entry(self, engine_id: str, subscribers: set[str], exc: SluiceError) -> None:
        for sub in subscribers:
            pending = self._pending.pop(sub, None)
            if pending is not None and not pending.ticket.future.done():
                pending.ticket.future.set_exception(exc)
        self.core.finished(engine_id, self.now(), 0)
        self._flush_events()
        self._check_idle()


__all__ = ["Driver", "Generation", "Outcome", "Ticket", "order_priority", "request_priority"]
