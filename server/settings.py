"""The frozen settings object: built once in server/__main__.py, passed down.

Like uvicorn's Config, every knob Sluice has is read once (CLI flags plus the
few environment variables listed in `EnvView`) into this value. No other module
reads `os.environ`; code that needs a setting gets it from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class EnvView:
    """The environment variables Sluice honours, read once by the CLI."""

    notify_socket: str | None = None  # NOTIFY_SOCKET, set by systemd for Type=notify
    watchdog_usec: int | None = None  # WATCHDOG_USEC, set by systemd with WatchdogSec=
    watchdog_pid: int | None = None  # WATCHDOG_PID: the watchdog is ours only if it is our pid
    cuda_visible_devices: str | None = None  # which GPUs the engine (and NVML) use
    api_key: str | None = None  # SLUICE_API_KEY; a key file (--api-key-file) wins
    cache_root: Path | None = None  # SLUICE_CACHE_DIR or XDG_CACHE_HOME (demo model)

    @classmethod
    def from_mapping(cls, env: Mapping[str, str]) -> EnvView:
        usec = env.get("WATCHDOG_USEC")
        wpid = env.get("WATCHDOG_PID")
        cache = env.get("SLUICE_CACHE_DIR") or env.get("XDG_CACHE_HOME")
        home = env.get("HOME")
        if not cache and home:
            cache = str(Path(home) / ".cache")
        return cls(
            notify_socket=env.get("NOTIFY_SOCKET") or None,
            watchdog_usec=int(usec) if usec and usec.isdigit() else None,
            watchdog_pid=int(wpid) if wpid and wpid.isdigit() else None,
            cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
            api_key=env.get("SLUICE_API_KEY") or None,
            cache_root=Path(cache) if cache else None,
        )


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything `sluice serve` was told. Times are seconds, sizes bytes."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "demo"  # the name clients use in "model"
    model_path: str = ""  # what the engine loads
    demo_model: bool = False  # True when serving the built-in offline demo model

    # The coalescer (batching/).
    window: float = 0.010
    adaptive_window: bool = True
    max_batch_seqs: int = 256
    max_batch_tokens: int = 8192
    max_pending_requests: int = 1024
    max_pending_tokens: int = 4_000_000
    queue_timeout: float = 60.0
    dedupe: bool = True
    prefix_leader: bool = False
    prefix_block: int = 16
    result_cache_ttl: float = 0.0

    # The HTTP front.
    api_key: str | None = field(default=None, repr=False)  # never printed
    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 8
    max_logprobs: int = 20
    default_thinking: bool = True
    log_format: str = "json"
    log_prompts: bool = False
    drain_timeout: float = 30.0
    warmup: bool = True

    # The watchdog: interval and thresholds (batching/pressure.py's config).
    watchdog_interval: float = 0.25
    pressure: Any = None  # batching.pressure.PressureConfig

    env: EnvView = field(default_factory=EnvView)
    # vLLM's own engine flags, as parsed by vLLM's argument definitions
    # (an AsyncEngineArgs). Built once by the CLI and never mutated afterwards.
    engine_args: Any = None
