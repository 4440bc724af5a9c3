"""Micro-benchmark of the front's own CPU per engine output (issue 27, item 3).

Why it exists: on the 2-core machines the front shares the CPU with the engine
(at c=512 on data parallelism vLLM's steps ran 9% slower beside Sluice than
beside vLLM's server), and a whole-server run (`python -m bench`) measures the
front together with vLLM's output handler, under the engine's own noise. This
runs Sluice's real app in this process (aiohttp on uvloop, the middlewares, the
pipeline, the driver and the core, the encoders) on loopback, with a stand-in
for the engine: one task that, every `--step` seconds, hands each of up to
`--slots` running requests one output, as vLLM's output handler does after an
engine step, as real vLLM `RequestOutput` deltas into real vLLM
`RequestOutputCollector`s; the rest wait in its queue, so at c=512 Sluice's
backlog holds work as it does beside the real engine. The stand-in never
tokenizes: the client sends token-id prompts. Sampling parameters are built by
the real adapter's `sampling_params`.

Clients run in a subprocess (aiohttp, streaming /v1/completions, reading bytes
only). Reported per point: this process's CPU time (all threads) per request
and per output, less the stand-in's own step work (timed on its thread), and
req/s. It is a stand-in only here, to price the front alone: every test of the
front against an engine runs the real one (tests/integration).

    python -m bench.points.front_bench [--points 128x64,512x32] [--requests 512,1536] [--repeat 3]

`--accounting both` prices issue 52's accounting: each repetition runs every
point without it (no step ledger in the stand-in, no usage record or budget
spend per request: the pipeline's `_account` left out) and with it, alternating,
and reports the ratio of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

MODEL = "front-bench"
TOKEN_TEXT = " ab"  # every generated token's text (a short word, as the demo model's)


@dataclass
class _Running:
    collector: Any
    left: int  # tokens still to generate
    prompt: int  # prompt tokens, prefilled in the step that admits it
    first: bool = True


@dataclass
class StepEngine:
    """The engine surface the app uses (server/engines/interface.py's Engine), producing
    vLLM's own output objects one engine step at a time; see the module docstring."""

    step: float
    slots: int
    steps: int = 0
    step_cpu: float = 0.0  # thread CPU seconds spent in step bodies (subtracted)
    _running: dict[str, _Running] = field(default_factory=dict)
    _waiting: deque[tuple[str, _Running]] = field(default_factory=deque)
    # The steps reported to the driver (the room releases from them, issue 27).
    _steps: list[Any] = field(default_factory=list)
    _on_step: Callable[[], None] | None = None
    # The engine adapter's per-step accounting (batching/ledger.py), run as the
    # adapter runs it (`--no-accounting` leaves it out); counted as the front's.
    ledger: Any = None

    def __post_init__(self) -> None:
        from server.engines.interface import ModelInfo

        self.info = ModelInfo(
            name=MODEL,
            max_model_len=8192,
            eos_token_id=None,
            created=0,
            max_num_seqs=self.slots,
            max_num_batched_tokens=2048,
        )
        self.errored = False

    # -- the engine's life -----------------------------------------------------

    async def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    async def check_health(self) -> None:
        pass

    def processes(self) -> tuple[tuple[int, int | None], ...]:
        return ()

    def stats(self) -> Any:
        from batching.pressure import EngineStats

        return EngineStats(
            kv_cache_usage=0.1,
            running=len(self._running),
            waiting=len(self._waiting),
            preemptions_total=0,
            steps_total=self.steps,
        )

    async def run(self) -> None:
        """The engine's steps: one output per running request each `step` seconds."""
        from vllm.outputs import CompletionOutput, RequestOutput

        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self.step
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            t0 = time.thread_time()
            prefill = 0
            while self._waiting and len(self._running) < self.slots:
                rid, run = self._waiting.popleft()
                self._running[rid] = run
                prefill += run.prompt
            scheduled = len(self._running)
            seen = []
            for rid, run in list(self._running.items()):
                seen.append((rid, run.first, run.prompt))
                run.first = False
                run.left -= 1
                done = run.left <= 0
                out = CompletionOutput(
                    index=0,
                    text=TOKEN_TEXT,
                    token_ids=[17],
                    cumulative_logprob=None,
                    logprobs=None,
                    finish_reason="length" if done else None,
                )
                ro = RequestOutput(rid, None, None, None, [out], done, num_cached_tokens=0)
                if done:
                    del self._running[rid]
                run.collector.put(ro)
            self.steps += 1
            self._report_step(prefill, scheduled)
            self.step_cpu += time.thread_time() - t0
            if self.ledger is not None:
                self._account(prefill, seen)

    def _account(self, prefill: int, seen: list[tuple[str, bool, int]]) -> None:
        """The step into the ledger, as the adapter's `_observe` puts it."""
        from batching import StepOutput

        outs = [StepOutput(rid, 1, prompt if first else None, False) for rid, first, prompt in seen]
        decode = sum(1 for _, first, _ in seen if not first)
        self.ledger.step(self.step, prefill, decode, outs)

    def step_share(self) -> None:
        return None

    def set_unshown(self, rank: int, count: int) -> None:
        pass

    def charge(self, request_id: str) -> Any:
        from batching import Charge

        return Charge() if self.ledger is None else self.ledger.close(request_id)

    def _report_step(self, prefill: int, scheduled: int) -> None:
        """The step as vLLM's stat logger reports it to Sluice's driver."""
        from batching import EngineStep

        self._steps.append(
            EngineStep(
                rank=0,
                prefill_tokens=prefill,
                decode_tokens=scheduled,
                requests=scheduled,
                running=len(self._running),
                waiting=len(self._waiting),
                kv_usage=0.1,
            )
        )
        if self._on_step is not None:
            self._on_step()

    def pooling_params(self, task: Any, dimensions: Any = None, use_activation: Any = None) -> Any:
        raise NotImplementedError("the front benchmark serves a generative model")

    async def tokenize_pooling(self, inputs: Sequence[Any], **kw: Any) -> list[list[int]]:
        raise NotImplementedError("the front benchmark serves a generative model")

    async def tokenize_pairs(
        self, query: str, documents: Sequence[str], params: Any, **kw: Any
    ) -> list[tuple[list[int], Any]]:
        raise NotImplementedError("the front benchmark serves a generative model")

    async def sleep(self) -> None:
        raise NotImplementedError("the front benchmark serves one model, loaded")

    async def wake_up(self) -> None:
        raise NotImplementedError("the front benchmark serves one model, loaded")

    def take_steps(self) -> list[Any]:
        steps, self._steps = self._steps, []
        return steps

    def watch_steps(self, callback: Callable[[], None] | None) -> None:
        self._on_step = callback

    # -- requests --------------------------------------------------------------

    async def tokenize_chat(self, conversations: Sequence[Any]) -> list[list[int]]:
        raise NotImplementedError("the front benchmark sends token-id prompts")

    async def tokenize_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        raise NotImplementedError("the front benchmark sends token-id prompts")

    def detokenize(self, ids: Sequence[int]) -> str:
        return TOKEN_TEXT * len(ids)

    def tokenizer_info(self) -> dict[str, Any]:
        return {"eos_token": None, "tokenizer_class": type(self).__name__}

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def chat_parser(self, req: Any) -> Any:
        raise NotImplementedError

    async def check_constraint(self, constraint: Any) -> None:
        pass

    @staticmethod
    def sampling_params(s: Any, max_tokens: int) -> Any:
        from server.engines.vllm_adapter import EngineAdapter

        return EngineAdapter.sampling_params(s, max_tokens)

    def prefix_hashes(
        self, prompt_tokens: Any, cache_salt: str | None, adapter: Any = None
    ) -> tuple[int, ...]:
        return ()  # one rank: no placement

    async def add(
        self,
        request_id: str,
        prompt_tokens: Sequence[int],
        params: Any,
        priority: int,
        adapter: Any = None,
        cache_salt: str | None = None,
        rank: int | None = None,
        background: bool = False,
    ) -> Any:
        from vllm.v1.engine.output_processor import RequestOutputCollector

        collector = RequestOutputCollector(params.output_kind, request_id)
        if self.ledger is not None:
            self.ledger.admit(request_id, len(prompt_tokens))
        self._waiting.append(
            (request_id, _Running(collector, int(params.max_tokens), len(prompt_tokens)))
        )
        return collector

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._running.pop(rid, None)

    async def load_adapter(self, adapter: Any) -> None:
        raise NotImplementedError


# ------------------------------------------------------------------ the client


async def _client(url: str, concurrency: int, requests: int, prompt: int, out: int) -> None:
    """`requests` streamed completions, `concurrency` at a time; prints a JSON line."""
    import aiohttp

    body = {
        "model": MODEL,
        "prompt": [7] * prompt,
        "max_tokens": out,
        "ignore_eos": True,
        "stream": True,
    }
    left = requests
    failed = 0
    t0 = time.monotonic()
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def worker() -> None:
            nonlocal left, failed
            while left > 0:
                left -= 1
                async with session.post(url, json=body) as r:
                    if r.status != 200:
                        failed += 1
                    async for _ in r.content.iter_any():
                        pass

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    print(json.dumps({"seconds": time.monotonic() - t0, "failed": failed}), flush=True)


# ------------------------------------------------------------------ the server


@dataclass(frozen=True, slots=True)
class PointResult:
    concurrency: int
    output_len: int
    requests: int
    cpu_ms_per_request: float
    sys_ms_per_request: float  # of which system time (mostly the socket writes)
    us_per_output: float
    req_s: float
    failed: int


async def _serve_point(
    concurrency: int,
    output_len: int,
    requests: int,
    *,
    step: float,
    slots: int,
    prompt: int,
    accounting: bool = True,
) -> PointResult:
    from unittest import mock

    from batching import StepLedger
    from server.http import pipeline

    engine = StepEngine(step=step, slots=slots, ledger=StepLedger() if accounting else None)
    with contextlib.ExitStack() as stack:
        if not accounting:
            stack.enter_context(mock.patch.object(pipeline, "_account", lambda *a: None))
        return await _serve_app(engine, concurrency, output_len, requests, prompt)


async def _serve_app(
    engine: StepEngine, concurrency: int, output_len: int, requests: int, prompt: int
) -> PointResult:
    from aiohttp import web

    from batching import CoalescerConfig
    from bench.run.servers import HOST, free_port
    from server.app import build_app
    from server.settings import Settings

    settings = dataclasses.replace(
        Settings(model_name=MODEL, model_path="/models/front-bench"),
        core=CoalescerConfig(),
        warmup=False,
    )
    app = build_app(settings, engine)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, HOST, port)
    await site.start()
    try:
        async with asyncio.TaskGroup() as tg:
            stepper = tg.create_task(engine.run())
            cmd = [
                sys.executable,
                "-m",
                "bench.points.front_bench",
                "--client",
                f"http://{HOST}:{port}/v1/completions",
                str(concurrency),
                str(requests),
                str(prompt),
                str(output_len),
            ]
            cpu0, step0 = time.process_time(), engine.step_cpu
            sys0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE)
            stdout, _ = await proc.communicate()
            cpu = time.process_time() - cpu0 - (engine.step_cpu - step0)
            sys_cpu = resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0
            stepper.cancel()
    finally:
        await runner.cleanup()
    if proc.returncode != 0:
        raise RuntimeError(f"the client exited with {proc.returncode}")
    done = json.loads(stdout.decode().strip().splitlines()[-1])
    ok = requests - int(done["failed"])
    return PointResult(
        concurrency=concurrency,
        output_len=output_len,
        requests=requests,
        cpu_ms_per_request=1000 * cpu / max(ok, 1),
        sys_ms_per_request=1000 * sys_cpu / max(ok, 1),
        us_per_output=1e6 * cpu / max(ok * output_len, 1),
        req_s=ok / float(done["seconds"]),
        failed=int(done["failed"]),
    )


def _points(text: str) -> list[tuple[int, int]]:
    """`128x64,512x32` -> [(concurrency, output tokens), ...]."""
    out = []
    for part in text.split(","):
        c, o = part.split("x")
        out.append((int(c), int(o)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--client":
        url, *nums = argv[1:6]
        asyncio.run(_client(url, *map(int, nums)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--points", default="128x64,512x32", help="CONCURRENCYxOUTPUT,...")
    ap.add_argument("--requests", default="512,1536", help="requests per point, in order")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--step", type=float, default=0.05, help="seconds per engine step")
    ap.add_argument("--slots", type=int, default=128, help="the engine's running slots")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--accounting",
        choices=("on", "off", "both"),
        default="on",
        help="usage accounting per request (issue 52); both: alternate, report the ratio",
    )
    ns = ap.parse_args(argv)
    points = _points(ns.points)
    counts = [int(x) for x in ns.requests.split(",")]
    if len(counts) != len(points):
        ap.error("--requests needs one count per point")

    import logging

    # The access lines go to a logger nobody reads here (as to a journal that keeps
    # up): the records are still made and handed over, as in the server.
    from server.operations.logs import setup_logging

    with open(os.devnull, "w") as sink:
        stderr, sys.stderr = sys.stderr, sink
        try:
            listener = setup_logging("plain", logging.INFO)
        finally:
            sys.stderr = stderr
        return _run(ns, points, counts, listener)


def _run(
    ns: argparse.Namespace, points: list[tuple[int, int]], counts: list[int], listener: Any
) -> int:
    import uvloop

    results: dict[tuple[int, int, bool], list[PointResult]] = {}
    modes = {"on": [True], "off": [False], "both": [False, True]}[ns.accounting]
    try:
        # A short point first, not reported: imports and first-call paths
        # (vLLM's output classes, the adapter's sampling_params) are paid here.
        uvloop.run(_serve_point(8, 4, 16, step=ns.step, slots=ns.slots, prompt=ns.prompt))
        for i in range(ns.repeat):
            for (c, o), n in zip(points, counts, strict=True):
                # Alternated, the order flipped each repetition: drift is shared.
                for acct in modes if i % 2 == 0 else modes[::-1]:
                    r = uvloop.run(
                        _serve_point(
                            c, o, n, step=ns.step, slots=ns.slots, prompt=ns.prompt, accounting=acct
                        )
                    )
                    results.setdefault((c, o, acct), []).append(r)
                    print(json.dumps({**dataclasses.asdict(r), "accounting": acct}), flush=True)
    finally:
        listener.stop()
    from statistics import median

    from bench.report.cells import spread_cell

    def cell(vals: list[float]) -> str:
        return spread_cell(vals, ".2f")

    for (c, o, acct), rs in results.items():
        label = f"accounting {'on' if acct else 'off'}: " if len(modes) > 1 else ""
        print(
            f"c={c}, {o} out: {label}front CPU {cell([r.cpu_ms_per_request for r in rs])} "
            f"ms/request (system {cell([r.sys_ms_per_request for r in rs])}), "
            f"{cell([r.us_per_output for r in rs])} us/output, "
            f"{cell([r.req_s for r in rs])} req/s, failed {sum(r.failed for r in rs)}"
        )
    if len(modes) > 1:
        for (c, o), _ in zip(points, counts, strict=True):
            on = median(r.cpu_ms_per_request for r in results[(c, o, True)])
            off = median(r.cpu_ms_per_request for r in results[(c, o, False)])
            print(f"c={c}, {o} out: front CPU with accounting / without: {on / off:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
