"""The frozen settings object: built once in server/__main__.py, passed down.

Like uvicorn's Config, every knob Sluice has is read once (CLI flags plus the
few environment variables listed in `EnvView`) into this value. No other module
reads `os.environ`; code that needs a setting gets it from here.
"""

from __future__ import annotations

import math
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from batching import CoalescerConfig, EngineCapacity
from batching.pressure import PressureConfig
from server.callers import CallerTable
from server.engines.demo.model import default_cache_root
from server.engines.interface import ModelInfo
from server.engines.lora import Adapter
from server.engines.registry import ModelSpec
from server.engines.restarts import RestartPolicy


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """The TLS flags (vLLM's --ssl-*): the server's certificate chain and key,
    and mutual TLS; server/http/tls.py builds and reloads the context."""

    certfile: Path
    keyfile: Path | None = None  # None: the key is in the certificate file
    ca_certs: Path | None = None  # client certificates are checked against these
    cert_reqs: ssl.VerifyMode = ssl.CERT_NONE
    ciphers: str | None = None  # TLS 1.2 and below (1.3's suites are OpenSSL's)


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials
    (server/http/cors.py holds the rules)."""

    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def allows(self, origin: str) -> bool:
        """cors.py's rule 1."""
        return "*" in self.origins or origin in self.origins


@dataclass(frozen=True, slots=True)
class EnvView:
    """The environment variables Sluice honours, read once by the CLI."""

    notify_socket: str | None = None  # NOTIFY_SOCKET, set by systemd for Type=notify
    watchdog_usec: int | None = None  # WATCHDOG_USEC, set by systemd with WatchdogSec=
    watchdog_pid: int | None = None  # WATCHDOG_PID: the watchdog is ours only if it is our pid
    cuda_visible_devices: str | None = None  # which GPUs the engine (and NVML) use
    api_key: str | None = None  # SLUICE_API_KEY; a key file (--api-key-file) wins
    # SLUICE_CACHE_DIR, XDG_CACHE_HOME or ~/.cache: where the demo model is built
    cache_root: Path = field(default_factory=lambda: default_cache_root({}))
    # STATE_DIRECTORY (systemd's StateDirectory=), XDG_STATE_HOME/sluice or
    # ~/.local/state/sluice: the default --state-dir
    state_root: Path = field(default_factory=lambda: default_state_dir({}))
    # SLUICE_BUDGET_DAY_SECONDS, for tests only: a budget's day is this many
    # seconds from the epoch and its month 30 of them (batching/budgets.py rule
    # 2), so a test sees a budget reset; unset (or not a number > 0): UTC days.
    budget_day: float | None = None

    @classmethod
    def from_mapping(cls, env: Mapping[str, str]) -> EnvView:
        usec = env.get("WATCHDOG_USEC")
        wpid = env.get("WATCHDOG_PID")
        return cls(
            notify_socket=env.get("NOTIFY_SOCKET") or None,
            watchdog_usec=int(usec) if usec and usec.isdigit() else None,
            watchdog_pid=int(wpid) if wpid and wpid.isdigit() else None,
            cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
            api_key=env.get("SLUICE_API_KEY") or None,
            cache_root=default_cache_root(env),
            state_root=default_state_dir(env),
            budget_day=_positive(env.get("SLUICE_BUDGET_DAY_SECONDS")),
        )


def _positive(text: str | None) -> float | None:
    """A number > 0 from an environment variable's text, else None."""
    try:
        value = float(text or "")
    except ValueError:
        return None
    return value if 0 < value < math.inf else None


def default_state_dir(env: Mapping[str, str]) -> Path:
    """systemd's ``$STATE_DIRECTORY`` (``StateDirectory=``; of several, the
    first), else ``$XDG_STATE_HOME/sluice``, else ``~/.local/state/sluice``."""
    unit = env.get("STATE_DIRECTORY", "")
    if unit:
        return Path(unit.split(":")[0])
    xdg = env.get("XDG_STATE_HOME", "")
    if xdg and os.path.isabs(xdg):  # the XDG spec: a relative value is ignored
        return Path(xdg) / "sluice"
    return Path.home() / ".local" / "state" / "sluice"


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything `sluice serve` was told. Times are seconds, sizes bytes."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "demo"  # the name clients use in "model"
    model_path: str = ""  # what the engine loads
    demo_model: bool = False  # True when serving the built-in offline demo model
    # The static LoRA adapters (--lora-modules, checked at start: server/engines/lora.py);
    # the app's AdapterRegistry is built from them once.
    adapters: tuple[Adapter, ...] = ()
    max_lora_rank: int = 16  # vLLM's --max-lora-rank (its default), for runtime loads
    # Runtime LoRA loading (server/api/lora_admin/endpoint.py): --allow-runtime-lora, the
    # directory loads must come from (resolved) and the admin key (never
    # printed), which also opens /status.json's full view.
    allow_runtime_lora: bool = False
    lora_root: Path | None = None
    admin_key: str | None = field(default=None, repr=False)
    # --metrics-key-file: the Bearer key /metrics then needs (None: open).
    metrics_key: str | None = field(default=None, repr=False)

    # The coalescer (batching/): its whole config. The batch caps below, when
    # not given, become the engine's resolved max_num_seqs and
    # max_num_batched_tokens at start, and so does the engine capacity the
    # backlog is held against, unless `hold_backlog` is off (see `core_for`).
    core: CoalescerConfig = field(default_factory=CoalescerConfig)
    max_batch_seqs: int | None = None
    max_batch_tokens: int | None = None
    hold_backlog: bool = True
    # Sluice's scheduler in each engine puts interactive work first in its steps and
    # holds background work across models (server/engines/vllm_scheduler.py).
    interactive_first: bool = True
    # Rule 4's budget, as a multiple of the interactive work's own step
    # (batching/step_share.py; it reaches each engine's scheduler through vLLM's
    # additional_config: server/engines/board.py RATIO_KEY).
    background_step_ratio: float = 1.0
    # What the engine gets as a request's priority: "request" (its own field) or
    # "order" (the release key, batching/order.py: server/engines/driver.py order_priority).
    engine_priority: str = "request"
    queue_timeout: float = 60.0
    # A background request's (batching/classes.py rule 4).
    background_queue_timeout: float = 900.0
    result_cache_ttl: float = 0.0

    # The HTTP front.
    api_key: str | None = field(default=None, repr=False)  # never printed
    # --callers FILE and what it held at start (its policies are also in
    # core.callers); SIGHUP reloads the file.
    callers_file: Path | None = None
    caller_table: CallerTable | None = field(default=None, repr=False)
    # --shared-prefix-cache: every caller's prompts share the engine's prefix
    # cache (no per-caller cache_salt; server/callers.py says what that leaks).
    shared_prefix_cache: bool = False
    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 8
    # vLLM's --max-logprobs of the one --model (engine flags; models-file models
    # carry their own in their spec).
    max_logprobs: int = 20
    default_thinking: bool = True
    # vLLM's --tool-call-parser and --enable-auto-tool-choice (the reasoning
    # parser is an engine flag: engine_args.reasoning_parser). Defaults: Qwen3's.
    tool_call_parser: str = "hermes"
    enable_auto_tool_choice: bool = True
    drain_timeout: float = 30.0
    # --state-dir (created 0700, checked at start by server/cli.py): state.db,
    # what outlives a restart (server/operations/state_db.py); None: kept in
    # memory only (an app built without the CLI: tests).
    state_dir: Path | None = None
    # --responses-retention: seconds a stored response is kept (OpenAI: 30 days).
    responses_retention: float = 30 * 24 * 3600.0
    # The Batch API (server/api/openai_batches/runner.py): the largest upload, and how many
    # of one batch's lines are sent at once.
    batch_file_max_bytes: int = 200 * 10**6
    batch_lines_in_flight: int = 256
    # --batch-retention (files and ended batches, then deleted) and the bytes of
    # files one caller may keep (--batch-disk-per-caller).
    batch_retention: float = 30 * 24 * 3600.0
    batch_disk_per_caller: int = 10 * 10**9
    warmup: bool = True

    # On a network (issue 44, vLLM's flag names): TLS with --ssl-* (None: plain
    # HTTP; server/http/tls.py), CORS with --allowed-origins (None: off;
    # server/http/cors.py), --root-path ("": none; server/http/root_path.py)
    # and --otlp-traces-endpoint, the OTLP/HTTP URL of the trace receiver
    # (None: no tracing, no OpenTelemetry import; server/operations/tracing.py).
    tls: TlsConfig | None = None
    cors: CorsPolicy | None = None
    root_path: str = ""
    otlp_traces_endpoint: str | None = None

    # The watchdog: its poll interval and the policy's thresholds.
    watchdog_interval: float = 0.25
    pressure: PressureConfig = field(default_factory=PressureConfig)

    env: EnvView = field(default_factory=EnvView)
    # vLLM's own engine flags, as parsed by vLLM's argument definitions
    # (an AsyncEngineArgs). Built once by the CLI and never mutated afterwards.
    engine_args: Any = None

    # --models FILE (server/engines/models_file.py): one spec per table, in the
    # file's order; empty with --model, whose one model the fields above give
    # (`specs`). `memory_budget`: bytes the models may take of the card
    # together (0: not counted); `load_timeout`: how long a request waits for
    # its model's engine to start (--load-timeout).
    models_file: Path | None = None
    models: tuple[ModelSpec, ...] = ()
    memory_budget: int = 0
    load_timeout: float = 120.0
    # A dead engine's restarts (server/engines/restarts.py): --engine-restarts
    # per --engine-restart-window, the back-off's cap, and how long a health
    # check may go unanswered before the engine counts as hung.
    restarts: RestartPolicy = field(default_factory=RestartPolicy)
    health_timeout: float = 10.0

    @property
    def url(self) -> str:
        """The API's base URL as a client on this host reaches it."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.port}{self.root_path}/v1"

    @property
    def several(self) -> bool:
        """Models from a models file: per-model labels, states and views appear."""
        return bool(self.models)

    def specs(self) -> tuple[ModelSpec, ...]:
        """The served models: the models file's, or the one `--model` gives."""
        if self.models:
            return self.models
        return (
            ModelSpec(
                name=self.model_name,
                path=self.model_path,
                demo=self.demo_model,
                engine_args=self.engine_args,
                adapters=self.adapters,
                max_lora_rank=self.max_lora_rank,
                tool_call_parser=self.tool_call_parser,
                enable_auto_tool_choice=self.enable_auto_tool_choice,
                default_thinking=self.default_thinking,
                max_logprobs=self.max_logprobs,
                essential=True,  # the one model: its final failure ends the process
            ),
        )

    def core_for(self, info: ModelInfo) -> CoalescerConfig:
        """The coalescer's config once the engine has resolved its limits."""
        engine = engine_capacity(info)
        return replace(
            self.core,
            max_batch_seqs=self.max_batch_seqs or info.max_num_seqs or self.core.max_batch_seqs,
            max_batch_tokens=(
                self.max_batch_tokens or info.max_num_batched_tokens or self.core.max_batch_tokens
            ),
            engine=engine if self.hold_backlog else EngineCapacity(),
            interactive_first=info.interactive_first,
        )


def engine_capacity(info: ModelInfo) -> EngineCapacity:
    """The room's numbers, per data-parallel rank (batching/room.py rule 6).

    vLLM reports max_num_seqs and max_num_batched_tokens per rank and sums
    num_gpu_blocks over ranks at the handshake: the KV is split back.
    """
    ranks = max(1, info.dp_ranks)
    return EngineCapacity(
        max_seqs=info.max_num_seqs,
        step_tokens=info.max_num_batched_tokens,
        kv_tokens=info.kv_cache_tokens // ranks,
        ranks=ranks,
        max_loras=info.max_loras,
        prefill_chunk=info.prefill_chunk,
        prefix_block=info.prefix_block,
    )
