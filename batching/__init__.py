"""The policy core of Sluice: admission, the coalescing window, ordering, grouping.

Pure Python in the style of h11: no asyncio, no vLLM, no clock of its own. The
server passes time in (`now`) and acts on what the core returns.

Modules: keys (GroupKey), types (requests, batches, outcomes), config, callers (caller
policies and limits), classes (interactive or background), order (the release key),
coalescer (admission and the window), backlog (fair release order), room (engine
room), adapters (LoRA slots), drain (drain-rate estimate for Retry-After), ledger
(engine time per request), budgets (per-caller day and month budgets), cache (TTL
result cache), events (observability records). Everything public is re-exported
here; import from `batching`, not from the modules.
"""

from .budgets import Budget, Budgets, Clock, Overdraft, Spend
from .cache import ResultCache
from .callers import DEFAULT_CALLER, CallerPolicy, Callers, CallerStats
from .classes import (
    BACKGROUND_PRIORITY,
    RequestClass,
    class_priority,
    is_background,
    queue_timeout,
    request_class,
)
from .coalescer import Coalescer
from .config import CoalescerConfig
from .drain import DrainRate
from .events import Counters, DedupeHit, Ended, Event, Refusal, Released, RoomCounters
from .keys import GroupKey, group_key
from .ledger import Charge, StepLedger, StepOutput
from .order import ReleaseOrder, engine_priority
from .room import EngineCapacity, Hold, underfed
from .types import (
    AdmissionState,
    Admitted,
    Batch,
    EngineLoad,
    EngineStep,
    Entry,
    Outcome,
    RefusalReason,
    Refused,
    ReleaseReason,
    Request,
)
from .warm import WarmCounters, WarmOrder

__all__ = [
    "BACKGROUND_PRIORITY",
    "DEFAULT_CALLER",
    "AdmissionState",
    "Admitted",
    "Batch",
    "Budget",
    "Budgets",
    "CallerPolicy",
    "CallerStats",
    "Callers",
    "Charge",
    "Clock",
    "Coalescer",
    "CoalescerConfig",
    "Counters",
    "DedupeHit",
    "DrainRate",
    "Ended",
    "EngineCapacity",
    "EngineLoad",
    "EngineStep",
    "Entry",
    "Event",
    "GroupKey",
    "Hold",
    "Outcome",
    "Overdraft",
    "Refusal",
    "RefusalReason",
    "Refused",
    "ReleaseOrder",
    "ReleaseReason",
    "Released",
    "Request",
    "RequestClass",
    "ResultCache",
    "RoomCounters",
    "Spend",
    "StepLedger",
    "StepOutput",
    "WarmCounters",
    "WarmOrder",
    "class_priority",
    "engine_priority",
    "group_key",
    "is_background",
    "queue_timeout",
    "request_class",
    "underfed",
]
