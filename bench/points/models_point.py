"""Issue 30's check that loading one model does not stall another that is serving.

Why this module exists: an on-demand model's engine starts inside the Sluice
process that streams the other models' tokens (server/engines/loader.py). The
start runs on a worker thread, and its engine core is a process of its own; this
point measures what a chat stream on model A sees while model B loads: the
gaps between its chunks before B's load and during it (p50, p99, max), and
B's load time. One Sluice, two demo models from one models file (`chat` at
start, `spare` on demand), both eager (no torch.compile).

    python -m bench.points.models_point [--tokens 2000] [--out bench/results/models-load-cpu.json]

On CPU both engines share the same cores, so the gaps during the load measure
the CPU the load takes as much as any stall of the event loop; compare the
max gap with the load time (a stalled loop would show a gap of the load's
length).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.report.systems import SLUICE
from bench.run.servers import Server, free_port, server_command

MODELS = """
[models.chat]
kv-cache-memory-bytes = 67108864
max-model-len = 4096
enforce-eager = true

[models.spare]
load = "on-demand"
kv-cache-memory-bytes = 67108864
max-model-len = 4096
enforce-eager = true
"""


def _stream(base: str, tokens: int, stamps: list[float]) -> None:
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.monotonic())


def _gaps_ms(stamps: list[float], lo: float, hi: float) -> dict[str, float]:
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(stamps) if lo <= a and b <= hi]
    if len(gaps) < 2:
        return {"n": len(gaps)}
    q = statistics.quantiles(gaps, n=100)
    return {
        "n": len(gaps),
        "p50": round(q[49], 1),
        "p99": round(q[98], 1),
        "max": round(max(gaps), 1),
    }


def run(tokens: int, workdir: Path) -> dict[str, Any]:
    models = workdir / "models.toml"
    models.write_text(MODELS)
    port = free_port()
    cmd = server_command(SLUICE, port, [], ["--models", str(models)])
    server = Server(SLUICE, port, cmd, workdir / "sluice.log")
    with server:
        server.start(dict(os.environ))
        base = server.base_url
        stamps: list[float] = []
        reader = threading.Thread(target=_stream, args=(base, tokens, stamps))
        reader.start()
        while len(stamps) < tokens // 4 and reader.is_alive():
            time.sleep(0.05)
        t_load = time.monotonic()
        r = httpx.post(
            base + "/v1/chat/completions",
            json={
                "model": "spare",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 1,
            },
            timeout=600,
        )
        t_loaded = time.monotonic()
        reader.join()
        r.raise_for_status()
    return {
        "load_s": round(t_loaded - t_load, 1),
        "chunks": len(stamps),
        "before_load_ms": _gaps_ms(stamps, 0.0, t_load),
        "during_load_ms": _gaps_ms(stamps, t_load, t_loaded),
        "after_load_ms": _gaps_ms(stamps, t_loaded, float("inf")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-models-point-") as tmp:
        result = run(args.tokens, Path(tmp))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
