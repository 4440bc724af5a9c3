"""Issue 44's benchmark point: what TLS and OpenTelemetry traces cost the front.

Why this module exists: TLS and a span per request are work on the server's
own process (handshakes and encryption; building, encoding and sending
spans), next to the engine's. This point prices them as `vllm bench serve`
sees them: req/s, TTFT, and front CPU per request (the CPU seconds of the
server's own process, not its engine-core child, over the run, divided by
the requests), for each server (Sluice, then vLLM's own server with the same
engine flags) in three configurations, each its own start:

    plain    HTTP, no tracing
    tls      HTTPS (`--ssl-certfile/--ssl-keyfile`, a certificate made here with trustme)
    traces   HTTP with `--otlp-traces-endpoint` at an OTLP/HTTP receiver this
             process runs (vLLM's server exports over OTLP/HTTP too:
             OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf)

The same random prompts (128 in, 64 out, `ignore_eos`) at concurrency 32
through the `openai-chat` backend, `--repeat` runs per start; the receiver
counts the spans it got (decoded with opentelemetry-proto), so a
configuration that traced nothing shows. The readiness probe trusts the
test CA through SSL_CERT_FILE (this process only); the load generator runs
with `--insecure` (it encrypts, without checking the certificate); the
receiver's CPU is this process's, not the server's.

    python -m bench.points.network_point [--repeat 3] [--prompts 256] \
        [--out bench/results/network-cpu.md]
    ./scripts/bench network [...]   # the same
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.points.api_point import result_args
from bench.report.cells import median, runs_cell, write_lines
from bench.report.systems import SLUICE, VLLM
from bench.run.engine_flags import demo_flags
from bench.run.servers import HOST, Server, free_port, server_command
from bench.run.vllm_client import main as bench_serve

CONFIGS = ("plain", "tls", "traces")


@dataclass
class _Server(Server):
    """A bench server that may speak HTTPS (its readiness probe too: the CA is
    in SSL_CERT_FILE)."""

    scheme: str = "http"

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{HOST}:{self.port}"


class _Receiver:
    """An OTLP/HTTP receiver on loopback in a thread: counts the spans posted."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}/v1/traces"
        self.spans = 0
        self._lock = threading.Lock()

    @contextmanager
    def running(self) -> Iterator[_Receiver]:
        from aiohttp import web
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        async def handle(request: web.Request) -> web.Response:
            req = ExportTraceServiceRequest()
            req.ParseFromString(await request.read())
            n = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
            with self._lock:
                self.spans += n
            return web.Response(
                body=ExportTraceServiceResponse().SerializeToString(),
                content_type="application/x-protobuf",
            )

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", handle)
        runner = web.AppRunner(app, access_log=None)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()

        async def start() -> None:
            await runner.setup()
            await web.TCPSite(runner, HOST, self.port).start()

        asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


def _certificate(d: Path) -> tuple[Path, Path, Path]:
    """A test CA and a certificate for 127.0.0.1: (cert, key, ca)."""
    import trustme

    ca = trustme.CA()
    leaf = ca.issue_cert(HOST, "localhost")
    cert, key, ca_pem = d / "cert.pem", d / "key.pem", d / "ca.pem"
    cert.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_pem))
    return cert, key, ca_pem


def _run(server: Server, tokenizer: str, prompts: int, seed: int, out: Path) -> dict[str, Any]:
    # `vllm bench serve` checks certificates against aiohttp's default context,
    # made when aiohttp was imported (before SSL_CERT_FILE was set here): it
    # skips the check instead (the server's side of TLS is the same work).
    insecure = ["--insecure"] if server.base_url.startswith("https") else []
    cpu0 = server.cpu_seconds()
    bench_serve(
        [
            "--backend",
            "openai-chat",
            "--endpoint",
            "/v1/chat/completions",
            "--base-url",
            server.base_url,
            "--model",
            "sluice-demo",
            "--tokenizer",
            tokenizer,
            "--dataset-name",
            "random",
            "--random-input-len",
            "128",
            "--random-output-len",
            "64",
            "--ignore-eos",
            "--num-prompts",
            str(prompts),
            "--max-concurrency",
            "32",
            "--extra-body",
            json.dumps({"chat_template_kwargs": {"enable_thinking": False}}),
            *insecure,
            *result_args(seed, "ttft", out),
        ]
    )
    cpu = server.cpu_seconds() - cpu0
    result = json.loads(out.read_text())
    done = result["completed"]
    return {
        "req_s": result["request_throughput"],
        "ttft_p50": result["p50_ttft_ms"],
        "ttft_p99": result["p99_ttft_ms"],
        "cpu_ms": 1000 * cpu / max(done, 1),
        "done": done,
        "failed": result.get("failed", prompts - done),
    }


def report(
    results: dict[tuple[str, str], list[dict[str, Any]]],
    spans: dict[tuple[str, str], int],
    repeat: int,
    prompts: int,
) -> list[str]:
    lines = [
        "# What TLS and OpenTelemetry traces cost the front, on Sluice and vLLM's own "
        "server (issue 44)",
        "",
        f"`python -m bench.points.network_point --repeat {repeat} --prompts {prompts}`: the demo "
        "model on CPU, random prompts of 128 tokens in and 64 out (`ignore_eos`), "
        "concurrency 32, `vllm bench serve --backend openai-chat`; each server in each "
        "configuration is its own start, with the runs of one start in a row; medians "
        "[min-max] over the repetitions. Front CPU: the server process's own CPU time per "
        "request (engine core excluded). `tls`: HTTPS with a trustme certificate; "
        "`traces`: `--otlp-traces-endpoint` at an OTLP/HTTP receiver in the benchmark's "
        "process (spans/req: what it received, over the requests). Other work shared "
        "the machine's two cores.",
        "",
        "| server | config | req/s | TTFT p50 ms | TTFT p99 ms | front CPU ms/req "
        "| spans/req | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (system, config), runs in results.items():
        done = sum(r["done"] for r in runs)
        per = spans.get((system, config), 0) / max(done, 1)
        lines.append(
            f"| {system} | {config} | {runs_cell(runs, 'req_s', '.1f')} | "
            f"{runs_cell(runs, 'ttft_p50', '.0f')} | {runs_cell(runs, 'ttft_p99', '.0f')} | "
            f"{runs_cell(runs, 'cpu_ms', '.2f')} | {per:.2f} | "
            f"{sum(r['failed'] for r in runs)} |"
        )
    lines += ["", "Against the same server's `plain` (medians):", ""]
    for system in dict.fromkeys(s for s, _ in results):
        base = results.get((system, "plain"))
        for config in CONFIGS[1:]:
            got = results.get((system, config))
            if base is None or got is None:
                continue
            rate = median(got, "req_s") / median(base, "req_s")
            cpu, cpu0 = median(got, "cpu_ms"), median(base, "cpu_ms")
            lines.append(
                f"* {system} {config}: req/s {rate:.3f}x; front CPU {cpu:.2f} against "
                f"{cpu0:.2f} ms/req ({cpu - cpu0:+.2f} ms, {100 * (cpu / cpu0 - 1):+.1f}%)."
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("bench/results/network-cpu.md"))
    ap.add_argument("--systems", default=f"{SLUICE},{VLLM}")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="of " + ",".join(CONFIGS))
    ns = ap.parse_args(argv)
    configs = [c for c in ns.configs.split(",") if c]
    if set(configs) - set(CONFIGS):
        ap.error(f"--configs takes {','.join(CONFIGS)}")
    flags, tokenizer = demo_flags()
    tmp = Path(tempfile.mkdtemp(prefix="network-"))
    cert, key, ca = _certificate(tmp)
    os.environ["SSL_CERT_FILE"] = str(ca)  # this process's clients trust the test CA
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    spans: dict[tuple[str, str], int] = {}
    with _Receiver().running() as receiver:
        # Alternated: each configuration on both servers before the next.
        for config in configs:
            for system in ns.systems.split(","):
                extra: list[str] = ["--no-default-thinking"] if system == SLUICE else []
                env = dict(os.environ)
                env.pop("SSL_CERT_FILE", None)
                if config == "tls":
                    extra += ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
                if config == "traces":
                    extra += ["--otlp-traces-endpoint", receiver.url]
                    env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"  # vLLM's
                port = free_port()
                cmd = server_command(system, port, flags, extra if system == SLUICE else ())
                if system != SLUICE:
                    cmd += extra
                log = tmp / f"{system}-{config}.log"
                scheme = "https" if config == "tls" else "http"
                with _Server(system, port, cmd, log, scheme=scheme) as srv:
                    srv.start(env)
                    before = receiver.spans
                    for rep in range(ns.repeat):
                        out = tmp / f"{system}-{config}-{rep}.json"
                        results.setdefault((system, config), []).append(
                            _run(srv, tokenizer, ns.prompts, rep, out)
                        )
                # Stopped: its exporter flushed what it still held.
                spans[(system, config)] = receiver.spans - before
    lines = report(results, spans, ns.repeat, ns.prompts)
    write_lines(ns.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
