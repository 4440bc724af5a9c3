"""The usage tables at scale (issue 52's benchmark): 30,000 requests over 30 days.

Why it exists: the usage ledger (server/operations/usage.py) keeps a row per
minute and per hour for each (caller, model, adapter, kind, class, batch) seen;
an operator needs to know what that costs on disk and what a month's report
costs to read. This records 30,000 requests spread evenly over the 30 days
before now (8 callers, 2 models, both kinds and classes, a batch id on a tenth),
writing them as the server does (a flush every 2 s of simulated time, the
clock injected so retention prunes minute rows older than 2 days), then reports
the state database's size and the time of the Usage API's queries: 30 days in
`1d` buckets grouped by caller and model, and 7 days in `1h` buckets.

    python -m bench.points.usage_store [--requests 30000] [--days 30] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

CALLERS = [f"team-{i}" for i in range(8)]
MODELS = ["qwen3-14b", "embed"]


async def _run(requests: int, days: int, repeat: int, folder: Path) -> dict[str, object]:
    from server.operations.state_db import DB_NAME, StateDB
    from server.operations.usage import UsageBook, UsageEvent, UsageQuery

    end = time.time()
    start = end - days * 86400
    now = [start]
    db = StateDB(folder)
    await db.open()
    book = UsageBook(db, clock=lambda: now[0])
    gap = (end - start) / requests
    t_write = 0.0
    last_flush = start
    for i in range(requests):
        at = now[0] = start + i * gap
        embed = i % 5 == 0
        book.record(
            UsageEvent(
                at=at,
                caller=CALLERS[i % len(CALLERS)],
                model=MODELS[embed],
                adapter=None,
                kind="embeddings" if embed else "completions",
                request_class="background" if i % 10 == 0 else "interactive",
                batch_id=f"batch_{i // 3000}" if i % 10 == 0 else None,
                prompt_tokens=200 + i % 1000,
                cached_tokens=i % 100,
                completion_tokens=0 if embed else 50 + i % 300,
                engine_seconds=0.05 + (i % 7) * 0.01,
                block_seconds=1.5,
            )
        )
        if at - last_flush >= 2.0:
            t0 = time.perf_counter()
            await book.flush()
            t_write += time.perf_counter() - t0
            last_flush = at
    now[0] = end
    await book.flush()
    await db._run(lambda: db._db().execute("PRAGMA wal_checkpoint(TRUNCATE)"))
    size = await asyncio.to_thread(
        lambda: sum(p.stat().st_size for p in folder.glob(DB_NAME + "*"))
    )
    rows = await db._run(
        lambda: [
            db._db().execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
            for t in ("usage_minutes", "usage_hours")
        ]
    )

    async def timed(q: UsageQuery) -> list[float]:
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            page = await book.query(q)
            out.append(1000 * (time.perf_counter() - t0))
        assert sum(r.requests for b in page.buckets for r in b.results) > 0
        return out

    month = await timed(
        UsageQuery(
            "completions",
            int(start),
            int(end),
            width=86400,
            group_by=frozenset({"caller", "model"}),
        )
    )
    week = await timed(UsageQuery("completions", int(end - 7 * 86400), int(end), width=3600))
    await db.close()
    return {
        "requests": requests,
        "days": days,
        "db_bytes": size,
        "minute_rows": rows[0],
        "hour_rows": rows[1],
        "write_s_total": round(t_write, 3),
        "query_30d_1d_ms": [round(x, 2) for x in month],
        "query_7d_1h_ms": [round(x, 2) for x in week],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=30000)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=5)
    ns = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = asyncio.run(_run(ns.requests, ns.days, ns.repeat, Path(tmp)))
    print(json.dumps(out))
    m, w = out["query_30d_1d_ms"], out["query_7d_1h_ms"]
    assert isinstance(m, list) and isinstance(w, list)
    kib = cast(int, out["db_bytes"]) / 1024
    print(
        f"{ns.requests} requests over {ns.days} days: state.db {kib:.0f} KiB "
        f"({out['hour_rows']} hour rows, {out['minute_rows']} minute rows kept); "
        f"30 days in 1d buckets by caller and model: {statistics.median(m):.1f} ms "
        f"[{min(m):.1f}-{max(m):.1f}]; 7 days in 1h buckets: {statistics.median(w):.1f} ms "
        f"[{min(w):.1f}-{max(w):.1f}]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
