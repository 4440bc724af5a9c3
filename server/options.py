"""`sluice serve`'s own options as data: one `Option` row per flag, in `OPTIONS`.

Why this exists: an option is a name, a type, a default, a help line and the
Settings field it fills; written as argparse calls and again as Settings
arguments, each one cost two edits in a long function and could drift from
docs/serving.md's flag table unseen. Here it is one row. `add_options` puts
rows on a parser, `field_values` reads a parsed namespace back into
`{field path: value}` and `settings_from` turns that into the frozen Settings;
`check_ranges` holds the numeric bounds a row gives. What needs code (key
files, callers, runtime LoRA, the engine's step flags, thinking's model-aware
default) stays in server/cli.py as small named functions. vLLM's engine flags
are not here: they come from vLLM's own argument definitions (server/cli.py).

A row (`Option`), as argparse's `add_argument` would take it:

* `flag`: "--window-ms"; `dest` only where the namespace name is not the
  flag's (the watchdog's thresholds: `pressure_<field>`);
* `type` (int, float, Path; None: a string) or `action` (`SWITCH` for a
  --x / --no-x pair, "store_true" for a lone switch); `choices`, `metavar`
  (a string, or a function returning one when it needs vLLM's registries,
  imported only when a parser is built);
* `help`: argparse's help (`%(default)s` is the default);
* `fills`: the Settings field the value goes to, dotted into nested values
  ("core.order.max_delay"), several separated by spaces; its default is that
  field's default in `Settings()` (so nothing is declared twice), times
  `scale` (1000: the flag is in ms, the field in seconds). A row that fills
  nothing (server/cli.py reads it) gives its own `default`;
* `ge`, `gt`, `le`: bounds; a value outside is a usage error (exit 2);
* `group`: the --help section; `PER_MODEL` rows are also a models-file
  table's keys (server/engines/models_file.py).

Adding an ordinary option is one row here (and one line in docs/serving.md's
table: tests/unit/test_option_docs.py checks both ways).
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import math
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batching.pressure import PressureConfig
from server.settings import Settings

SWITCH = argparse.BooleanOptionalAction  # --x and --no-x

FRONT = "Sluice (HTTP front, coalescer, watchdog)"
WATCHDOG = "memory watchdog thresholds (batching/pressure.py)"
ADMIN = "runtime LoRA loading (/v1/load_lora_adapter) and admin keys"
NETWORK = "on a network: TLS (and mutual TLS), CORS, a root path"
PER_MODEL = "Sluice, per model (a models file's table may give these)"


@dataclass(frozen=True, slots=True)
class Option:
    """One of `sluice serve`'s own options (the module's docstring says each field)."""

    flag: str
    help: str
    type: Callable[[str], Any] | None = None
    action: str | builtins.type[argparse.Action] | None = None
    default: Any = None  # only for a row that fills no field
    choices: tuple[str, ...] | None = None
    metavar: str | Callable[[], str] | None = None
    dest: str | None = None
    fills: str = ""
    scale: float = 1.0
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    group: str = FRONT

    @property
    def name(self) -> str:
        """The namespace attribute argparse stores the value under."""
        return self.dest or self.flag[2:].replace("-", "_")

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self.fills.split())

    def default_in(self, settings: Settings) -> Any:
        """The flag's default: its first field's in `settings`, scaled, else its own."""
        if not self.fills:
            return self.default
        value = _get(settings, self.fields[0])
        return value * self.scale if self.scale != 1 else value


def duration(text: str) -> float:
    """Seconds from "3600", "3600s" or "24h" (argparse's type: ValueError is a usage error)."""
    text = text.strip().lower()
    scale = 3600.0 if text.endswith("h") else 1.0
    value = float(text.rstrip("hs"))
    if not math.isfinite(value):
        raise ValueError(text)
    return value * scale


def _tool_parser_names() -> str:
    from server.engines import vllm_parsers

    return "{" + ",".join(vllm_parsers.tool_parsers()) + "}"


def _watchdog_rows() -> tuple[Option, ...]:
    """One row per field of the watchdog's PressureConfig, so the policy's
    documented defaults are the CLI's defaults and nothing is declared twice:
    a switch for a bool (checked first: a bool is an int), else a number."""
    defaults = PressureConfig()
    rows = []
    for f in dataclasses.fields(PressureConfig):
        value = getattr(defaults, f.name)
        if not isinstance(value, bool | int | float):
            continue
        rows.append(
            Option(
                "--" + f.name.replace("_", "-"),
                dest=f"pressure_{f.name}",
                help="(default: %(default)s)",
                fills=f"pressure.{f.name}",
                group=WATCHDOG,
                **({"action": SWITCH} if isinstance(value, bool) else {"type": type(value)}),
            )
        )
    return tuple(rows)


# fmt: off
OPTIONS: tuple[Option, ...] = (
    Option("--host", fills="host", help="address to bind (default: %(default)s)"),
    Option("--port", type=int, fills="port", ge=0, le=65535, help="port (default: %(default)s)"),
    Option(
        "--window-ms", type=float, fills="core.window", scale=1000,
        help="coalescing window in ms; 0 releases every request at once (default: %(default)s)",
    ),
    Option(
        "--adaptive-window", action=SWITCH, fills="core.adaptive core.release_lone",
        help="skip the window when waiting buys nothing: the engine is idle, or the request "
        "follows a quiet spell longer than the window (default: %(default)s)",
    ),
    Option(
        "--max-batch-seqs", type=int, fills="max_batch_seqs", ge=1,
        help="sequence cap of one coalesced batch (default: the engine's max_num_seqs)",
    ),
    Option(
        "--max-batch-tokens", type=int, fills="max_batch_tokens", ge=1,
        help="prompt-token cap of one batch (default: the engine's per-step budget)",
    ),
    Option(
        "--hold-backlog", action=SWITCH, fills="hold_backlog",
        help="keep the backlog in Sluice and release it as the engine has room (slots, one "
        "step of prefill, KV cache); off releases every eligible request at once "
        "(default: %(default)s)",
    ),
    Option(
        "--interactive-first", action=SWITCH, fills="interactive_first",
        help="each engine's scheduler keeps background work (batch lines, service_tier "
        "flex, background callers) out of the steps an interactive turn waits for or "
        "prefills in, here or on another model, and caps it to the interactive step's "
        "own time while interactive work runs; off leaves the steps to vLLM's scheduler "
        "(default: %(default)s)",
    ),
    Option(
        "--background-step-ratio", type=float, fills="background_step_ratio", gt=0,
        help="with --interactive-first: while interactive work runs, a step that carries "
        "background work lasts at most this many times the interactive work's own "
        "measured step; lower shortens a chat turn's wait for the step under way, at "
        "the background's throughput (default: %(default)s)",
    ),
    Option(
        "--prefix-placement", action=SWITCH, fills="core.prefix_placement",
        help="with data parallelism: send a request to the rank that was given its prompt's "
        "leading blocks (a conversation's earlier turns), unless that rank is busier than "
        "1.25 x the least loaded one + 1; off places by room alone (default: %(default)s)",
    ),
    Option(
        "--prefix-order", action=SWITCH, fills="core.prefix_order",
        help="with the engine's prefix cache on: among the requests the release order "
        "allows to go, prefer one whose prompt's leading blocks the engine is believed "
        "to hold, so a system prompt's or context's requests run while it is cached; "
        "never past a more urgent request, a caller's fair share, or "
        "--short-first-max-delay's bound; off releases in the order alone "
        "(default: %(default)s)",
    ),
    Option(
        "--engine-priority", choices=("request", "order"), fills="engine_priority",
        help="the priority each request gets in the engine: its own `priority`, or "
        "Sluice's release key (priority, then short-first with aging: batching/order.py; "
        "for vLLM's --scheduling-policy priority) (default: %(default)s)",
    ),
    Option(
        "--kv-reserve-short", type=float, fills="core.kv_reserve_short",
        help="share of the KV cache that prompts longer than --short-prompt-tokens may not "
        "use, kept for short requests; 0 = off (default: %(default)s)",
    ),
    Option(
        "--short-prompt-tokens", type=int, fills="core.short_prompt_tokens",
        help="a prompt this long or shorter counts as short (default: %(default)s)",
    ),
    Option(
        "--backlog-feed-steps", type=float, fills="core.feed_steps",
        help="the engine's own queue holds what this many of its steps take, as its last "
        "step showed: free running slots and the token budget its decodes left "
        "(default: %(default)s)",
    ),
    Option(
        "--backlog-long-prefills", type=int, fills="core.long_prefills",
        help="while more than one caller has work: how many released prompts longer than "
        "one prefill chunk may be unstarted at once, so a short turn finds room in the "
        "engine's next step; 0 = no bound (default: %(default)s)",
    ),
    Option(
        "--backlog-adapter-wait", type=float, fills="core.adapter_wait",
        help="with --enable-lora: seconds the least-served caller may wait for a LoRA "
        "slot (--max-loras) before the adapter held longest is drained for it "
        "(default: %(default)s)",
    ),
    Option(
        "--short-first-rate", type=float, fills="core.order.exchange_rate",
        help="short-first exchange rate: prompt tokens one second of waiting is worth; a "
        "prompt N tokens longer waits about N / rate seconds more (default: %(default)s)",
    ),
    Option(
        "--short-first-max-delay", type=float, fills="core.order.max_delay",
        help="seconds: the most a request falls behind first-come-first-served within "
        "its caller and priority, however long its prompt; 0 = first-come-first-served "
        "(default: %(default)s)",
    ),
    Option(
        "--max-pending-requests", type=int, fills="core.max_pending_requests",
        help="admission limit: queued + running requests (default: %(default)s)",
    ),
    Option(
        "--max-pending-tokens", type=int, fills="core.max_pending_tokens",
        help="admission limit: queued + running prompt+max_tokens (default: %(default)s)",
    ),
    Option(
        "--queue-timeout", type=float, fills="queue_timeout", gt=0,
        help="seconds a request may wait in Sluice's queue (default: %(default)s)",
    ),
    Option(
        "--background-queue-timeout", type=float, fills="background_queue_timeout", gt=0,
        help="seconds a background request (a batch line, service_tier flex, a background "
        "caller's) may wait in Sluice's queue (default: %(default)s)",
    ),
    Option(
        "--dedupe", action=SWITCH, fills="core.dedupe",
        help="share one generation among identical deterministic requests (default: %(default)s)",
    ),
    Option(
        "--result-cache-ttl", type=float, fills="result_cache_ttl", ge=0,
        help="seconds to cache deterministic non-thinking results; 0 = off",
    ),
    Option(
        "--api-key-file", type=Path,  # read by server/cli.py (`_callers`)
        help="file holding the bearer API key (or set SLUICE_API_KEY): one caller; "
        "none and no --callers = open, the OpenAI `user` field names the caller",
    ),
    Option(
        "--callers", type=Path, metavar="FILE", fills="callers_file",
        help="TOML file of callers: [callers.NAME] key, weight, max_concurrency, "
        "max_queued, tokens_per_minute, budgets per day and month (see docs/queue.md); "
        "reloaded on SIGHUP",
    ),
    Option(
        "--shared-prefix-cache", action="store_true", fills="shared_prefix_cache",
        help="let every caller's prompts share the engine's prefix cache; by default, "
        "with a callers file or an API key, each caller (or cache_group) has its own, so "
        "no caller can tell from cached tokens or timing what another sent",
    ),
    Option(
        "--max-body-bytes", type=int, fills="max_body_bytes", ge=1,
        help="largest request body accepted (default: %(default)s)",
    ),
    Option("--max-n", type=int, fills="max_n", ge=1, help="largest n (default: %(default)s)"),
    Option(
        "--log-format", choices=("json", "plain"),
        default="json",  # read by server/__main__.py before parsing, to set up logging first
        help="request log format (default: %(default)s)",
    ),
    Option(
        "--drain-timeout", type=float, fills="drain_timeout", ge=0,
        help="seconds to let in-flight work finish on SIGTERM (default: %(default)s)",
    ),
    Option(
        "--warmup", action=SWITCH, fills="warmup",
        help="run one generation before reporting ready (default: %(default)s)",
    ),
    Option(
        "--watchdog-interval-ms", type=float, fills="watchdog_interval", scale=1000, gt=0,
        help="memory poll interval (default: %(default)s)",
    ),
    Option(
        "--demo-cache-dir", type=Path,  # read by server/cli.py (the demo model's directory)
        help="cache root under which the demo model is built "
        "(default: $SLUICE_CACHE_DIR, else $XDG_CACHE_HOME, else ~/.cache)",
    ),
    Option(
        "--models", type=Path, metavar="FILE", fills="models_file",
        help="TOML file of the models to serve, one [models.NAME] table each with its "
        "engine flags and load = start | on-demand (docs/models.md); instead of --model",
    ),
    Option(
        "--load-timeout", type=float, fills="load_timeout", gt=0,
        help="seconds a request for an on-demand model waits for its engine to start, "
        "then 503 with Retry-After (default: %(default)s)",
    ),
    # A dead engine's restarts (server/engines/restarts.py; issue 41).
    Option(
        "--engine-restarts", type=int, fills="restarts.restarts", ge=0, metavar="N",
        help="restarts of a model's dead engine per restart window; a death beyond "
        "them leaves the model failed (for the one model, or a model marked essential: "
        "the process exits 1) (default: %(default)s)",
    ),
    Option(
        "--engine-restart-window", type=float, fills="restarts.window", gt=0,
        metavar="SECONDS",
        help="the window in which the restarts are counted (default: %(default)s)",
    ),
    Option(
        "--engine-restart-backoff-max", type=float, fills="restarts.cap", ge=1,
        metavar="SECONDS",
        help="the longest wait before a restart: 1 s after a first death, doubled "
        "for each restart in the window, up to this (default: %(default)s)",
    ),
    Option(
        "--engine-health-timeout", type=float, fills="health_timeout", gt=0,
        metavar="SECONDS",
        help="an engine that does not answer its health check (every 2 s) within "
        "this is hung: its processes are ended and it restarts (default: %(default)s)",
    ),
    Option(
        "--state-dir", type=Path, metavar="DIR",  # read by server/cli.py (`_state_dir`)
        help="directory of what outlives a restart (state.db: stored responses), created "
        "0700 (default: $STATE_DIRECTORY from systemd's StateDirectory=, else "
        "$XDG_STATE_HOME/sluice, else ~/.local/state/sluice)",
    ),
    Option(
        "--responses-retention", type=duration, metavar="SECONDS|Nh", gt=0,
        fills="responses_retention",
        help="how long a stored response (/v1/responses) is kept: seconds, or hours as "
        "24h (default: %(default)s s, 30 days as OpenAI)",
    ),
    # The Batch API (server/http/batches.py; issue 42).
    Option(
        "--batch-file-max-bytes", type=int, fills="batch_file_max_bytes", gt=0, metavar="BYTES",
        help="the largest file /v1/files takes (a 413 past it) (default: %(default)s, "
        "200 MB as OpenAI's batch input files)",
    ),
    Option(
        "--batch-retention", type=duration, metavar="SECONDS|Nh", gt=0,
        fills="batch_retention",
        help="how long files (/v1/files, a batch's results) and ended batches are kept: "
        "seconds, or hours as 24h (default: %(default)s s, 30 days)",
    ),
    Option(
        "--batch-disk-per-caller", type=int, fills="batch_disk_per_caller", gt=0,
        metavar="BYTES",
        help="the bytes of files one caller may keep (uploads past it: 413) "
        "(default: %(default)s, 10 GB)",
    ),
    Option(
        "--batch-lines-in-flight", type=int, fills="batch_lines_in_flight", gt=0, metavar="N",
        help="lines of one batch sent at once (the rest stream from disk; the held "
        "backlog orders them behind interactive work) (default: %(default)s)",
    ),
    *_watchdog_rows(),
    # On a network (vLLM's server's names and defaults): read by server/cli.py
    # `_network`, which builds Settings' tls, cors and root_path from them.
    Option("--ssl-keyfile", type=Path, metavar="FILE", group=NETWORK, help="the TLS key"),
    Option(
        "--ssl-certfile", type=Path, metavar="FILE", group=NETWORK,
        help="the TLS certificate chain (PEM): serve HTTPS; SIGHUP loads it again",
    ),
    Option(
        "--ssl-ca-certs", type=Path, metavar="FILE", group=NETWORK,
        help="CA bundle that client certificates are checked against (mutual TLS)",
    ),
    Option(
        "--ssl-cert-reqs", default="0", metavar="{0,1,2}", group=NETWORK,
        help="client certificates: 0 (none), 1 (optional), 2 (required), or those "
        "names; 1 and 2 check them against the CA bundle (default: %(default)s)",
    ),
    Option(
        "--ssl-ciphers", group=NETWORK,
        help="OpenSSL cipher list for TLS 1.2 (1.3's are fixed)",
    ),
    Option(
        "--allowed-origins", metavar="JSON", group=NETWORK,
        help="origins a browser page may call from: a JSON list as vLLM's ('[\"https://a\"]', "
        '"*" for any) or comma-separated; default: none (CORS off)',
    ),
    Option(
        "--allowed-methods", default='["*"]', metavar="JSON", group=NETWORK,
        help="methods allowed cross-origin (default: %(default)s)",
    ),
    Option(
        "--allowed-headers", default='["*"]', metavar="JSON", group=NETWORK,
        help="request headers allowed cross-origin (default: %(default)s)",
    ),
    Option(
        "--allow-credentials", action="store_true", default=False, group=NETWORK,
        help="let pages send cookies and client certificates cross-origin",
    ),
    Option(
        "--root-path", metavar="PATH", group=NETWORK,
        help="path prefix behind a proxy (/llm): /llm/v1/... is served as /v1/... (which "
        "stays served too)",
    ),
    # Runtime LoRA loading (server/api/lora_admin/endpoint.py): off unless asked
    # for, and then only with an admin key and a root directory (checked in
    # server/cli.py `_runtime_lora`); and the keys of the operator's views.
    Option(
        "--allow-runtime-lora", action="store_true", fills="allow_runtime_lora", group=ADMIN,
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "bodies); needs --enable-lora, --lora-root and --admin-key-file",
    ),
    Option(
        "--lora-root", type=Path, metavar="DIR", group=ADMIN,
        help="runtime loads take adapter directories under DIR only (symlinks resolved)",
    ),
    Option(
        "--admin-key-file", type=Path, metavar="FILE", group=ADMIN,
        help="file holding the admin bearer key (not readable by other users): it opens the "
        "runtime LoRA endpoints and the full /status.json (every caller's series); no "
        "caller key opens them",
    ),
    Option(
        "--metrics-key-file", type=Path, metavar="FILE", group=ADMIN,
        help="file holding the bearer key /metrics then needs (Prometheus: "
        "authorization.credentials_file); default: /metrics is open",
    ),
    # Per model, beside vLLM's engine flags: a models file's table may give them.
    Option(
        "--default-thinking", action=SWITCH, group=PER_MODEL,
        # None: resolved by server/cli.py default_thinking(), as it depends on the model
        help="Qwen3 thinking mode when a request does not say (default: on, off for the "
        "demo model, whose random weights never close a thought)",
    ),
    Option(
        "--tool-call-parser", fills="tool_call_parser", metavar=_tool_parser_names,
        group=PER_MODEL,
        help="vLLM's tool-call parser that reads the model's calls into OpenAI tool_calls, "
        "as with `vllm serve` (default: %(default)s, for Qwen3)",
    ),
    Option(
        "--enable-auto-tool-choice", action=SWITCH, fills="enable_auto_tool_choice",
        group=PER_MODEL,
        help="let the model decide when to call a tool (tool_choice auto) through "
        "--tool-call-parser, as with `vllm serve`; off refuses tool_choice auto with a 400 "
        "(default: %(default)s)",
    ),
)
# fmt: on
MODEL_OPTIONS = tuple(o for o in OPTIONS if o.group == PER_MODEL)
SERVER_OPTIONS = tuple(o for o in OPTIONS if o.group != PER_MODEL)


def add_options(parser: argparse.ArgumentParser, rows: Iterable[Option]) -> None:
    """Each row as one argument of `parser`, in a group per `group` (in row order)."""
    defaults = Settings()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for row in rows:
        if row.group not in groups:
            groups[row.group] = parser.add_argument_group(row.group)
        kwargs: dict[str, Any] = {"default": row.default_in(defaults), "help": row.help}
        for key in ("type", "action", "choices", "dest"):
            if (value := getattr(row, key)) is not None:
                kwargs[key] = value
        if row.metavar is not None:
            kwargs["metavar"] = row.metavar if isinstance(row.metavar, str) else row.metavar()
        groups[row.group].add_argument(row.flag, **kwargs)


def field_values(ns: argparse.Namespace, rows: Iterable[Option]) -> dict[str, Any]:
    """`{field path: value}` of every row that fills a field, read from `ns`."""
    out: dict[str, Any] = {}
    for row in rows:
        value = getattr(ns, row.name)
        for path in row.fields:
            out[path] = value / row.scale if row.scale != 1 else value
    return out


def settings_from(values: Mapping[str, Any]) -> Settings:
    """Settings() with `values` ({"port": 1, "core.window": 0.01}) put in; each
    nested value is rebuilt once, so its own checks run (ValueError)."""
    result: Settings = _replace(Settings(), values)
    return result


def check_ranges(ns: argparse.Namespace, rows: Iterable[Option]) -> None:
    """ValueError with one line for the first value outside its row's bounds; a
    value not given (None: the engine's own, the batch caps) is not checked."""
    for row in rows:
        value = getattr(ns, row.name)
        if value is None:
            continue
        for bound, ok, relation in (
            (row.ge, operator.ge, ">="),
            (row.gt, operator.gt, ">"),
            (row.le, operator.le, "<="),
        ):
            if bound is not None and (math.isnan(value) or not ok(value, bound)):
                raise ValueError(f"{row.flag} must be {relation} {bound:g}, got {value}")


def _get(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _replace(obj: Any, values: Mapping[str, Any]) -> Any:
    direct: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            direct[head] = value
    for head, inner in nested.items():
        direct[head] = _replace(getattr(obj, head), inner)
    return dataclasses.replace(obj, **direct)
