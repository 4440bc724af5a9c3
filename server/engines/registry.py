"""The models this process serves: one table, and per model its engine, core and state.

Why this module exists: Sluice serves one model per engine (vLLM serves one
model per engine core) and several engines behind one front (issue 30: a chat
model, an embedding model, a reranker on one workstation). Issue 29 asked that
the one-engine assumption be made explicit in one place; this is it. Every
handler turns a request's `model` into a `ModelEntry` here (`resolve`), and
takes that entry's engine, driver (its own batching core) and limits; nothing
else in the app holds an engine. `sluice serve --model X` is a registry of one
and behaves as before; `--models FILE` (server/engines/models_file.py) fills it
with one entry per table. The I/O that changes an entry's state (engine start,
stop, sleep) is server/engines/loader.py; this module holds the table, the
states and the policy decisions, as plain functions of the entries and a time.

Rules:

1. The table is fixed when the process starts: names neither come nor go
   while it lives (a name is a metric label, and the callers file's `models`
   lists are checked against them). A `ModelSpec` is what the command line or
   the models file said about a model, frozen; a `ModelEntry` is its life.
2. A request's `model` is a served model's name (with `--model`, its path
   too, as before), or a LoRA adapter of one (server/engines/lora.py); any other
   name, and a model outside its caller's `models` list, is the 404
   `model_not_found`, the body vLLM sends for an unknown model, so a caller
   cannot probe another team's model names.
3. A model serves one kind: generation, embeddings or reranking (`Kind`,
   from vLLM's `--runner` and `--convert` as vLLM resolves them for the
   model). A request of another kind is a 400 naming the model and what it
   serves (`require_kind`).
4. States: unloaded -> waiting (a load is queued: for the card, or for room
   on it) -> loading (the engine starts) -> loaded -> unloading -> unloaded,
   or sleeping (vLLM's sleep mode: weights in host memory, the card free) ->
   loading (wake up) -> loaded; a load that fails is `failed` until its
   retry time, and the next request after it tries again. A loaded model
   whose engine dies is `restarting` (its processes ended, the back-off, the
   new start: server/engines/restarts.py) -> loaded, or `failed` when the
   restart fails or its budget is spent.
5. Room: each model has a footprint on the card (bytes, from its own flags:
   server/cli.py `footprint`), and the models that occupy it (loading,
   loaded, unloading) must fit the budget together. The models file is
   refused at start when the `load = "start"` models do not fit together, or
   an on-demand model does not fit beside them (it could never load).
6. When an on-demand model must load and does not fit, the least recently
   used idle on-demand models are unloaded first, as few as needed
   (`plan_room`). Idle: no request holds it (a `lease`: from the handler's
   model check, while it waits for the load, to its end) and its core holds
   no work. A `load = "start"` model is never unloaded, nor one with work in
   flight; when no idle set frees enough, the load waits for one.
7. An on-demand model idle for its `unload_after` seconds is unloaded
   (`idle_deadline`; Ollama's keep_alive, except that 0 means never). A
   request through Ollama's API that sends `keep_alive` sets that model's
   idle time from then on, as Ollama does (`ModelEntry.keep_alive`: 0 unloads
   it as soon as it is idle, a negative one never); a model loaded at start
   is never unloaded, whatever a request says.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from server.engines.driver import Driver
from server.engines.interface import Engine, Kind, Service, refuse_kind
from server.engines.lora import Adapter, AdapterAccess, AdapterRegistry, choose, model_not_found

__all__ = [
    "Load",
    "ModelEntry",
    "ModelRegistry",
    "ModelSpec",
    "State",
    "check_fit",
    "configured_kind",
    "idle_deadline",
    "plan_room",
]


def configured_kind(runner_type: str, convert_type: str, architectures: Iterable[str]) -> Kind:
    """The kind a models-file model is served as, from vLLM's resolved runner
    and convert types (its ModelConfig `runner_type`, `convert_type`,
    `architectures`), before its engine starts. Once it runs, the engine's own
    answer is server/engines/vllm_pooling.py `model_kind` (its pooling task).

    vLLM's generate runner generates. Its pooling runner embeds, or, with
    `--convert classify` or a sequence-classification architecture (a
    cross-encoder such as BAAI/bge-reranker), scores pairs: that is a reranker.
    """
    if runner_type == "generate":
        return "generate"
    if runner_type != "pooling":
        raise ValueError(f"runner {runner_type!r} serves no API (generate or pooling)")
    if convert_type == "classify":
        return "rerank"
    if convert_type == "none" and any(
        a.endswith("ForSequenceClassification") for a in architectures
    ):
        return "rerank"
    return "embed"


class Load(enum.Enum):
    """When a model's engine starts: with the process, or on its first request."""

    START = "start"
    ON_DEMAND = "on-demand"


class State(enum.Enum):
    """Where a model's engine is (rule 4)."""

    UNLOADED = "unloaded"
    WAITING = "waiting"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    SLEEPING = "sleeping"
    FAILED = "failed"
    RESTARTING = "restarting"  # its engine died; started again (restarts.py)


# States in which a model takes its footprint on the card (rule 5).
OCCUPYING = frozenset({State.LOADING, State.LOADED, State.UNLOADING, State.RESTARTING})


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One served model as the command line or the models file gave it (rule 1)."""

    name: str  # what clients put in `model`
    path: str = ""  # what the engine loads (a directory or a hub id)
    kind: Kind = "generate"
    load: Load = Load.START
    unload_after: float = 0.0  # seconds idle before an on-demand model unloads; 0: never
    footprint: int = 0  # bytes of the card it takes while loaded (0: not counted)
    # --enable-sleep-mode among its engine flags: swapped out by sleeping
    # (weights to host memory) rather than stopped (server/engines/loader.py).
    sleep: bool = False
    demo: bool = False  # the offline demo model
    # Its engine's final failure stops the process (server/engines/restarts.py
    # rule 5): the one --model, or a models-file table's `essential = true`.
    essential: bool = False
    # vLLM's engine flags, as parsed by vLLM's argument definitions (an
    # AsyncEngineArgs); opaque here, read by server/engines/vllm_adapter.py.
    engine_args: Any = field(default=None, repr=False, compare=False)
    adapters: tuple[Adapter, ...] = ()  # its static LoRA adapters (--lora-modules)
    max_lora_rank: int = 16
    tool_call_parser: str = "hermes"
    enable_auto_tool_choice: bool = True
    default_thinking: bool = True
    # From the model's config, resolved at start (0 / () / None: not known
    # until its engine starts): the context, and the generation config's
    # sampling defaults and max_tokens, which request parsing applies.
    max_model_len: int = 0
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    default_max_tokens: int | None = None
    # vLLM's --max-logprobs among its engine flags (server/engines/vllm_adapter.py
    # max_logprobs): the bound request parsing puts on logprobs and prompt logprobs.
    max_logprobs: int = 20


@dataclass(eq=False, slots=True)
class ModelEntry:
    """One model's life: its engine, its core's driver, its state (rule 4).

    `engine` is always an engine object; whether it runs is `state`. After an
    unload it is a fresh, unstarted one (an engine adapter is not restarted),
    and the driver is pointed at it. The driver is attached by the app's
    lifespan (it needs the running loop) and lives as long as the process: the
    core's callers, fair-share counters and totals outlive each load.
    """

    spec: ModelSpec
    engine: Engine
    adapters: AdapterRegistry
    state: State = State.UNLOADED
    leases: int = 0  # requests holding it (rule 6), waiting for its load included
    last_used: float = 0.0  # monotonic: the last lease taken or given back
    loads: int = 0  # loads that succeeded
    failures: int = 0  # loads that failed
    unloads: int = 0  # unloads (idle, or to make room), sleeps included
    asleep: bool = False  # its engine sleeps (vLLM's sleep mode): the next load wakes it
    load_seconds: float | None = None  # the last one's duration
    loaded_at: float | None = None  # wall clock, for the status page
    error: str | None = None  # the last load's failure, until the next success
    retry_at: float = 0.0  # monotonic: a failed load is not retried before it
    # The idle time the last Ollama request asked for (rule 7; seconds, negative:
    # never unload); None: the spec's `unload_after`.
    keep_alive: float | None = None
    # Its engine's deaths (server/engines/supervisor.py): how many, the times of
    # the restarts they caused (restarts.py's budget), the last one's wall
    # clock and cause, and the time from the last death to serving again.
    deaths: int = 0
    restart_times: tuple[float, ...] = ()
    last_death: tuple[float, str] | None = None
    back_in_s: float | None = None
    gave_up: bool = False  # failed because its restart budget is spent (not a load)
    _driver: Driver | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def driver(self) -> Driver:
        if self._driver is None:
            raise RuntimeError(f"model {self.name!r}: no driver attached yet")
        return self._driver

    def attach(self, driver: Driver) -> None:
        self._driver = driver

    @property
    def attached(self) -> bool:
        return self._driver is not None

    @property
    def busy(self) -> bool:
        """A request holds it, or its core holds work (rule 6: never unloaded)."""
        return self.leases > 0 or (self._driver is not None and self._driver.busy)

    def set_state(self, state: State) -> None:
        """Change state and wake everyone waiting for a change."""
        self.state = state
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self) -> None:
        """Until the next state change."""
        await self._changed.wait()

    def use(self, engine: Engine) -> None:
        """A fresh engine object for the next load (after an unload or a failure)."""
        self.engine = engine
        if self._driver is not None:
            self._driver.engine = engine


class ModelRegistry:
    """The served models, by name, in the order given (rule 1)."""

    def __init__(self, entries: Iterable[ModelEntry]) -> None:
        by_name: dict[str, ModelEntry] = {}
        for e in entries:
            if e.name in by_name:
                raise ValueError(f"model {e.name!r} is given twice")
            by_name[e.name] = e
        if not by_name:
            raise ValueError("no models to serve")
        self._by_name: Mapping[str, ModelEntry] = MappingProxyType(by_name)
        self.default = next(iter(by_name.values()))

    @classmethod
    def build(
        cls,
        specs: Iterable[ModelSpec],
        make_engine: Callable[[ModelSpec], Engine],
        *,
        path_names: bool = False,
    ) -> ModelRegistry:
        """One entry per spec, each with an engine object (not started).
        `path_names`: a request may also name a model by its path (`--model`)."""
        return cls(
            ModelEntry(
                spec=s,
                engine=make_engine(s),
                adapters=AdapterRegistry(
                    s.name, s.adapters, base_path=s.path if path_names else ""
                ),
            )
            for s in specs
        )

    def __iter__(self) -> Iterator[ModelEntry]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def get(self, name: str) -> ModelEntry | None:
        return self._by_name.get(name)

    def find(self, model: str) -> ModelEntry | None:
        """The entry a request's `model` names: the model itself or one of its
        adapters (rule 2), regardless of who asks."""
        entry = self._by_name.get(model)
        if entry is not None:
            return entry
        return next(
            (e for e in self if e.adapters.is_base(model) or e.adapters.get(model) is not None),
            None,
        )

    def resolve(
        self, model: str, access: AdapterAccess, serves: Service | None = None
    ) -> tuple[ModelEntry, Adapter | None]:
        """The entry and adapter a caller's request for `model` runs on (rules 2-3),
        or its refusal: 404 for a name it may not see, 403 for the base model a
        caller's `adapters` list leaves out (server/engines/lora.py rule 4), 400 for
        a model of another kind."""
        entry = self.find(model)
        if entry is None or not access.sees_model(entry.name):
            raise model_not_found(model)
        adapter = choose(entry.adapters, access, model)
        if serves is not None:
            require_kind(entry, serves)
        return entry, adapter

    def visible(self, access: AdapterAccess) -> tuple[ModelEntry, ...]:
        """The models a caller may see (its `/v1/models`)."""
        return tuple(e for e in self if access.sees_model(e.name))


def require_kind(entry: ModelEntry, serves: Service) -> None:
    """Rule 3: the 400 naming the model and what it serves, unless it serves
    `serves` (an embedding model also reranks, by cosine similarity:
    server/engines/interface.py `KIND_SERVES`)."""
    # Once loaded, the kind its engine resolved; before, the one its config gave.
    loaded = entry.state is State.LOADED
    kind = entry.engine.info.kind if loaded else entry.spec.kind
    refusal = refuse_kind(entry.name, kind, serves)
    if refusal is not None:
        raise refusal


def check_fit(specs: Iterable[ModelSpec], budget: int) -> str | None:
    """Rule 5, at start: why these models cannot share the card, or None.

    The start models must fit together; every on-demand model must fit beside
    them (alone among the on-demand ones: the others unload for it)."""
    specs = tuple(specs)
    if budget <= 0:
        return None
    mib = 1024 * 1024
    start = [s for s in specs if s.load is Load.START]
    used = sum(s.footprint for s in start)
    if used > budget:
        parts = ", ".join(f"{s.name} {s.footprint / mib:,.0f} MiB" for s in start)
        return (
            f"the models loaded at start need {used / mib:,.0f} MiB together ({parts}), "
            f"more than the {budget / mib:,.0f} MiB they may use"
        )
    for s in specs:
        if s.load is Load.ON_DEMAND and used + s.footprint > budget:
            return (
                f"on-demand model {s.name!r} needs {s.footprint / mib:,.0f} MiB beside the "
                f"{used / mib:,.0f} MiB of the models loaded at start: more than the "
                f"{budget / mib:,.0f} MiB they may use, so it could never load"
            )
    return None


def _evictable(e: ModelEntry) -> bool:
    return e.spec.load is Load.ON_DEMAND and e.state is State.LOADED and not e.busy


def plan_room(
    entries: Iterable[ModelEntry], want: ModelEntry, budget: int
) -> list[ModelEntry] | None:
    """Rule 6: the models to unload so that `want` fits, least recently used
    first and as few as needed ([]: it fits as it is), or None when the idle
    on-demand models cannot free enough (busy ones must finish first)."""
    entries = tuple(entries)
    if budget <= 0:
        return []
    used = sum(e.spec.footprint for e in entries if e is not want and e.state in OCCUPYING)
    over = used + want.spec.footprint - budget
    if over <= 0:
        return []
    out: list[ModelEntry] = []
    for e in sorted((e for e in entries if e is not want and _evictable(e)), key=_last_used):
        out.append(e)
        over -= e.spec.footprint
        if over <= 0:
            return out
    return None


def _last_used(e: ModelEntry) -> float:
    return e.last_used


def idle_deadline(e: ModelEntry) -> float | None:
    """Rule 7: when an idle on-demand model unloads (monotonic), or None when it
    does not (a start model, `unload_after` 0 or a negative `keep_alive`, busy,
    or not loaded)."""
    if e.spec.load is not Load.ON_DEMAND or e.state is not State.LOADED or e.busy:
        return None
    if e.keep_alive is None:  # the models file's: 0 is never
        idle = e.spec.unload_after if e.spec.unload_after > 0 else -1.0
    else:  # Ollama's: 0 is at once, negative never
        idle = e.keep_alive
    return None if idle < 0 else e.last_used + idle
