"""The benchmark run: servers in alternating blocks, client jobs, raw engine.

Why it exists: it is the I/O half of `python -m bench` (bench/scenarios.py, what
is run, and bench/report/, what the records say, are the pure halves; the run's
page is bench/report/markdown.py).

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
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bench.log import log
from bench.report.client import combine_mixed, parse_client_result
from bench.report.prometheus import (
    RUNNING_METRICS,
    RUNNING_POLL_S,
    front_cpu,
    parse_prometheus,
    prefill_delta,
    running_summary,
    step_time,
    underfed_share,
)
from bench.report.requests import (
    RequestLog,
    noisy_metrics,
    pooled_metrics,
    share_metrics,
    spread_metrics,
    three_caller_metrics,
)
from bench.report.systems import NOHOLD, RAW, SLUICE, SLUICE_SYSTEMS, SYSTEM_TITLES, VLLM
from bench.report.tables import Record
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
    CALLER_WEIGHTS,
    CONCURRENCY,
    LORA,
    LORA_ADAPTERS,
    LORA_CALLERS,
    LORA_RANK,
    NOISY,
    PREFIX_CALLERS,
    SPREAD,
    THREE,
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
    # Callers whose requests Sluice's callers file marks background (issue 49).
    background_callers: tuple[str, ...] = ()
    systems: tuple[str, ...] = (SLUICE, VLLM)  # servers compared (an A/B: Sluice only)
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
    point: Point, per_role: dict[str, dict[str, float]], logs: dict[str, RequestLog]
) -> dict[str, float]:
    if point.scenario == NOISY:
        return noisy_metrics(per_role, logs)
    if point.scenario == THREE:
        return three_caller_metrics(per_role, logs, BULK_CALLERS)
    if point.scenario == SPREAD:
        return spread_metrics(per_role[ALL], logs.get(ALL))
    if point.scenario == LORA:
        return share_metrics(per_role, logs, LORA_CALLERS)
    if point.scenario == PREFIX_CALLERS:
        return pooled_metrics(per_role, logs)
    if len(per_role) > 1:
        return combine_mixed(per_role)
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


@contextlib.contextmanager
def _running_sampler(server: Server, system: str, on: bool) -> Iterator[list[float]]:
    """The engine's running count from /metrics every RUNNING_POLL_S while the
    block runs (a thread; the list fills as it goes). Empty when `on` is False."""
    samples: list[float] = []
    name = RUNNING_METRICS.get(system)
    if not on or name is None:
        yield samples
        return
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(RUNNING_POLL_S):
            with contextlib.suppress(Exception):  # a missed scrape is a missing sample
                value = parse_prometheus(server.metrics()).get(name)
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
        self.records: list[Record] = []
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

    def add(self, rec: Record) -> None:
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
        counted = point.counters and system in SLUICE_SYSTEMS
        scrape = point.prefix_metrics or counted
        before = parse_prometheus(server.metrics()) if scrape else {}
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
        cpu_s = server.cpu_seconds() - cpu0
        elapsed = time.monotonic() - t0
        per_role: dict[str, dict[str, float]] = {}
        logs: dict[str, RequestLog] = {}
        for (_, result), job, outcome in zip(jobs, point.jobs, outcomes, strict=True):
            if outcome.get("rc") != 0 or not result.exists():
                log(f"  FAILED {tag} {job.role}: {outcome.get('error')} (log: {result})")
                return
            data = json.loads(result.read_text())
            per_role[job.role] = parse_client_result(data)
            detail = RequestLog.from_result(data)
            if detail is not None:
                logs[job.role] = detail
                errors = detail.error_counts()
                if errors:
                    who = "" if job.role == ALL else f" {job.role}"
                    self.note(
                        f"{SYSTEM_TITLES[system]}, {point.scenario} / {point.name}, rep {rep},"
                        f"{who}: {sum(errors.values())} of {len(detail.errors)} requests failed: "
                        + "; ".join(f"{n} x {e!r}" for e, n in errors.items())
                    )
            elif per_role[job.role].get("failed", 0) > 0:
                self.note(
                    f"{SYSTEM_TITLES[system]}, {point.scenario} / {point.name}, rep {rep}, "
                    f"{job.role}: {per_role[job.role]['failed']:.0f} requests failed "
                    f"(see {result.with_suffix('.log').name})"
                )
        metrics = _combine(point, per_role, logs)
        if counted:
            time.sleep(1.0)  # let the engine's last step stats reach /metrics
            after = parse_prometheus(server.metrics())
            for key, name in point.counters:
                if name in after:
                    metrics = {**metrics, key: after[name] - before.get(name, 0.0)}
            metrics = {**metrics, **underfed_share(metrics), **step_time(metrics, elapsed)}
        metrics = {
            **metrics,
            **running_summary(running),
            **front_cpu(cpu_s, per_role.values()),
        }
        if point.prefix_metrics:
            time.sleep(1.0)  # let the engine's last step stats reach /metrics
            metrics = {
                **metrics,
                **prefill_delta(system, before, parse_prometheus(server.metrics())),
            }
        self.add(Record(point.scenario, point.name, system, rep, metrics))
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
        if system not in SLUICE_SYSTEMS or not callers:
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
            keys = {c: self.keys[c] for c in callers}
            f.write(callers_toml(keys, CALLER_WEIGHTS, self.cfg.background_callers))
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
            self.add(Record(CONCURRENCY, res["point"], RAW, rep, res["metrics"]))
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
                order = [SLUICE, VLLM, NOHOLD]
                order = order if rep % 2 else order[::-1]
                order = [system for system in order if system in cfg.systems]
                for engine, points in groups:
                    for system in order:
                        label = SYSTEM_TITLES[system] + (f", {engine.name}" if engine else "")
                        with self.server(
                            system, label, engine=engine, callers=callers_of(points)
                        ) as srv:
                            for point in points:
                                self.run_point(srv, point, rep, system)
                if plan.raw_points:
                    self.run_raw(rep)
            for label, flags in plan.window_configs:
                with self.server(SLUICE, f"Sluice window {label}", flags) as srv:
                    for rep in range(1, cfg.repeat + 1):
                        for wp in plan.window_points:
                            self.run_point(
                                srv,
                                Point(WINDOW, f"{label}, {wp.name}", wp.jobs, seed_name=wp.name),
                                rep,
                                SLUICE,
                            )
        finally:
            self.pool.close()
        self.wall_seconds = time.monotonic() - t_run
