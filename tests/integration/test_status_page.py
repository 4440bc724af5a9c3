"""The status page (server/http/static/) in a real browser: headless Chromium
(Debian's `chromium`) driven by Playwright.

Each test opens the page, waits for a few refreshes, and checks that every
plot drew with data (the page's own record of what uPlot drew, `sluiceStatus`),
that the header shows the state, and that the console stayed free of errors;
it writes a screenshot to test-output/ at the repository root.

Without a browser (`chromium` on PATH, or SLUICE_CHROMIUM) the tests skip
with the reason; in CI (CI=true) they fail.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from batching.pressure import RankStats
from server.callers import CallerDirectory
from server.http.middleware import install
from server.http.status_page import add_status_routes, index
from server.operations.metrics import Metrics
from server.operations.status_samples import Snapshot, StatusSampler
from server.settings import Settings
from server.state import CALLERS, METRICS, SETTINGS, STATUS
from tests.shared_servers import CALLER_KEYS as SHARED_KEYS
from tests.support import SluiceProcess

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "server" / "operations" / "static"
OUTPUT = ROOT / "test-output"
# The browser reaches nothing but the server under test.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ALL_CHARTS = (
    "requests",
    "tokens",
    "queue",
    "ttft",
    "batches",
    "kv",
    "memory",
    "refusals",
    "callers",
    "adapters",
    "steps",
    "held",
)
# Drawn only with data-parallel ranks: the made-up server has two, the demo
# server one (check_page then asserts that they stay hidden).
RANK_CHARTS = ("rank-queue", "rank-kv")


def chromium_path() -> str:
    """The browser, or a skip (a failure in CI) saying what is missing."""
    problem = None
    path = os.environ.get("SLUICE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        problem = "playwright is not installed (setup.cfg's dev extra)"
    if problem is None and not Path(path).exists():
        problem = f"no Chromium at {path} (apt-get install chromium)"
    if problem is None:
        return path
    if os.environ.get("CI") == "true":
        pytest.fail(f"browser test in CI: {problem}")
    pytest.skip(problem)


@pytest.fixture
async def browser_page(tmp_path: Path) -> AsyncIterator[Any]:
    """A fresh headless Chromium profile and one page in it."""
    executable = chromium_path()
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            user_data_dir=str(tmp_path / "profile"),
            executable_path=executable,
            headless=True,
            args=FLAGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            page = context.pages[0] if context.pages else await context.new_page()
            yield page
        finally:
            await context.close()


class Console:
    """Console errors and uncaught exceptions of a page."""

    def __init__(self, page: Any, allow: Callable[[str], bool] = lambda _: False) -> None:
        self.errors: list[str] = []
        page.on("console", lambda m: m.type == "error" and self._add(m.text, allow))
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def _add(self, text: str, allow: Callable[[str], bool]) -> None:
        if not allow(text):
            self.errors.append(text)


async def check_page(
    page: Any,
    url: str,
    *,
    charts: tuple[str, ...],
    screenshot: str,
    min_points: int = 3,
    before: Callable[[Any], Any] | None = None,
    optional: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Open the page, wait for data, check the plots (`optional` ones may draw or
    not: data the run may not produce); returns the page's record."""
    await page.goto(url)
    if before is not None:
        await before(page)
    await page.wait_for_function(
        "n => window.sluiceStatus && window.sluiceStatus.updates >= 3"
        " && Object.keys(window.sluiceStatus.charts).length >= n",
        arg=len(charts),
        timeout=30_000,
    )
    probe: dict[str, Any] = await page.evaluate("window.sluiceStatus")
    assert probe["error"] is None
    for chart in charts:
        drawn = probe["charts"].get(chart)
        assert drawn, f"plot {chart} never drew"
        assert max(drawn["points"], default=0) >= min_points, f"plot {chart}: {drawn}"
        assert await page.is_visible(f"#chart-{chart} canvas")
    assert set(probe["charts"]) <= {*charts, *optional}, "a plot drew that should be hidden"
    state = await page.text_content("#state")
    assert state in ("ok", "shedding", "critical", "draining")
    OUTPUT.mkdir(exist_ok=True)
    await page.screenshot(path=str(OUTPUT / screenshot), full_page=True)
    return probe


async def give_key(page: Any, key: str) -> None:
    """Answer the page's key form."""
    await page.wait_for_selector("#key-form:not([hidden])")
    await page.fill("#key", key)
    await page.click("#key-form button")


# ---------------------------------------------- a made-up busy server, no engine


def busy_snapshots(n: int) -> list[Snapshot]:
    """Five minutes of a made-up busy server: load waves, a shedding spell with
    refusals (samples 200-229), two callers, two data-parallel ranks, NVML present."""
    out = []
    req = prompt = gen = 0.0
    refused = steps = underfed = 0.0
    held = {"feed": 0.0, "kv": 0.0}
    for i in range(n):
        load = 20 + 15 * math.sin(i / 25)
        req += load
        steps += 40
        underfed += 1 if i % 5 == 0 else 0
        held = {"feed": held["feed"] + 0.6, "kv": held["kv"] + (0.3 if load > 25 else 0.0)}
        prompt += 130 * load
        gen += 64 * load
        shedding = 200 <= i < 230
        refused += 4 if shedding else 0
        out.append(
            Snapshot(
                "shedding" if shedding else "ok",
                "host: 900 MiB available" if shedding else "",
                requests=req,
                prompt_tokens=prompt,
                generated_tokens=gen,
                refusals={"memory": refused, "queue_full": 0.0},
                callers={"chat": 0.3 * gen, "batch-jobs": 0.7 * gen},
                adapters={"Qwen/Qwen3-14B": 0.5 * req, "sql": 0.3 * req, "support": 0.2 * req},
                queued=max(0.0, load - 25),
                engine_running=min(load, 32),
                kv_cache_usage=min(1.0, load / 40),
                ranks=(
                    RankStats(min(1.0, load / 30), int(min(load, 32) * 0.6), 1),
                    RankStats(min(1.0, load / 60), int(min(load, 32) * 0.4), 0),
                ),
                gpu_free_bytes=(6 - 5.2 * shedding) * 1024**3,
                host_available_bytes=(12 - 11.1 * shedding) * 1024**3,
                ttft=tuple(0.01 + 0.001 * load * (k % 7) for k in range(int(load))),
                batch_sizes=tuple(1 + k % int(load / 4 + 1) for k in range(10)),
                steps_held=steps,
                underfed_steps=underfed,
                held_seconds=held,
            )
        )
    return out


def page_app(sampler: StatusSampler, key: str | None = None) -> web.Application:
    """Sluice's own page routes and middlewares around a made-up ring buffer
    (no engine): what the browser gets is what `sluice serve` sends."""
    app = web.Application()
    install(app)
    settings = Settings(api_key=key)
    app[SETTINGS] = settings
    app[CALLERS] = CallerDirectory(settings.caller_table, settings.api_key)
    app[METRICS] = Metrics()
    app[STATUS] = sampler
    add_status_routes(app)
    # `/` is the app's (server/router.py `root`: the page for a browser,
    # Ollama's probe for its clients); here, the page.
    app.router.add_get("/", index)
    return app


def filled_sampler(n: int = 300) -> StatusSampler:
    clock = {"t": 1_800_000_000.0}
    snaps = busy_snapshots(n)
    it = iter(snaps)
    s = StatusSampler(
        lambda: next(it),
        {
            "model": "Qwen/Qwen3-14B",
            "engine": "vllm 0.32.0",
            "version": "0.1.0",
            "thresholds": {
                "gpu_shed_free_mib": 1024,
                "gpu_critical_free_mib": 512,
                "host_shed_available_mib": 1024,
                "host_critical_available_mib": 512,
            },
        },
        wall=lambda: clock["t"],
        mono=lambda: clock["t"],
    )
    for _ in range(n):
        s.sample()
        clock["t"] += 1.0
    return s


@pytest.fixture
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[TestServer]:
    key = getattr(request, "param", None)
    server = TestServer(page_app(filled_sampler(), key=key), host="127.0.0.1")
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


async def test_every_plot_draws_a_busy_server(harness: TestServer, browser_page: Any) -> None:
    console = Console(browser_page)
    probe = await check_page(
        browser_page,
        str(harness.make_url("/")),
        charts=ALL_CHARTS + RANK_CHARTS,
        screenshot="harness.png",
    )
    assert probe["charts"]["refusals"]["series"] == ["all", "memory", "queue_full"]
    assert probe["charts"]["callers"]["series"] == ["batch-jobs", "chat"]
    assert probe["charts"]["adapters"]["series"] == ["Qwen/Qwen3-14B", "sql", "support"]
    assert probe["charts"]["memory"]["series"] == ["free VRAM", "host available"]
    assert probe["charts"]["rank-queue"]["series"] == [
        f"rank {i} {what}" for i in (0, 1) for what in ("running", "waiting")
    ]
    assert probe["charts"]["rank-kv"]["series"] == ["rank 0", "rank 1"]
    assert probe["charts"]["steps"]["series"] == ["steps", "under-fed"]
    assert probe["charts"]["held"]["series"] == ["feed", "kv"]
    assert probe["marks"] == 3  # ok, shedding, ok
    assert await browser_page.text_content("#model") == "Qwen/Qwen3-14B"
    assert console.errors == []


@pytest.mark.parametrize("harness", ["s3cret-key"], indirect=True)
async def test_the_key_is_asked_once_and_sent_as_a_header(
    harness: TestServer, browser_page: Any
) -> None:
    urls: list[str] = []
    auth: list[str | None] = []
    browser_page.on("request", lambda r: urls.append(r.url))
    browser_page.on(
        "request",
        lambda r: r.url.endswith("/status.json") and auth.append(r.headers.get("authorization")),
    )
    # The first, keyless read is refused: the browser logs that 401 itself.
    console = Console(browser_page, allow=lambda text: "401" in text)

    await check_page(
        browser_page,
        str(harness.make_url("/")),
        charts=ALL_CHARTS + RANK_CHARTS,
        screenshot="harness-key.png",
        before=lambda page: give_key(page, "s3cret-key"),
    )
    assert auth[0] is None and set(auth[1:]) == {"Bearer s3cret-key"}
    assert not any("s3cret" in u for u in urls)
    stored = await browser_page.evaluate("sessionStorage.getItem('sluice.apiKey')")
    assert stored == "s3cret-key"
    assert await browser_page.is_hidden("#key-form")
    assert console.errors == []


# ------------------------------------------------------- the real demo server

# The two callers whose traffic the page shows: callers_server's (tests/shared_servers.py)
# file names them, beside other modules' callers, which the page sums as "(other callers)".
CALLER_KEYS = {name: SHARED_KEYS[name] for name in ("chat", "batch-jobs")}


async def _traffic(base: str, stop: asyncio.Event, key: str, streams: int = 3) -> int:
    """Chat requests from `streams` concurrent clients of the caller with API key
    `key` until `stop` is set; the count."""
    done = 0
    body = {
        "model": "sluice-demo",
        "messages": [{"role": "user", "content": "Tell me about rivers."}],
        "max_tokens": 24,
    }

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal done
        while not stop.is_set():
            r = await client.post(base + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            done += 1

    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=60, headers=headers) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(streams)))
    return done


# Samples the server takes with traffic in them before the page is read (one a second).
SAMPLES = 8


async def _samples_since(base: str, since: float, n: int, key: str) -> None:
    """Until the server's status samples hold `n` taken after `since` (wall clock)."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        async with asyncio.timeout(120):
            while True:
                r = await client.get(base + "/status.json")
                assert r.status_code == 200, r.text
                if sum(1 for t in r.json()["series"]["t"] if t is not None and t > since) >= n:
                    return
                await asyncio.sleep(0.25)


@pytest.mark.engine
async def test_the_demo_server_status_page(
    callers_server: SluiceProcess, browser_page: Any
) -> None:
    """Sluice on the demo model with two callers' traffic, read with one caller's
    key: every plot draws (the callers plot, in the caller's view, and the
    backlog series included), the header says ok, the console is clean but for
    the keyless first read's 401."""
    base = callers_server.base
    console = Console(browser_page, allow=lambda text: "401" in text)
    stop = asyncio.Event()
    traffic = [asyncio.create_task(_traffic(base, stop, key=key)) for key in CALLER_KEYS.values()]
    try:
        await _samples_since(base, time.time(), SAMPLES, CALLER_KEYS["chat"])
        probe = await check_page(
            browser_page,
            base + "/",
            # The backlog holds work only when the engine's next steps are fed.
            # Each caller's engine time (the usage ledger) and the engine's step with
            # interactive work present (Sluice's scheduler) draw from real traffic.
            # The engine's prefix-cache hits draw from the traffic's repeated prompt
            # (the demo engine caches prefixes); the prefix-warm order's own two
            # plots stay hidden with --prefix-order off, the default.
            charts=(
                *(c for c in ALL_CHARTS if c != "held"),
                "caller-engine",
                "step-class",
                "prefix-hits",
            ),
            optional=("held",),
            screenshot="status-page.png",
            before=lambda page: give_key(page, CALLER_KEYS["chat"]),
        )
    finally:
        stop.set()
        sent = [await t for t in traffic]
    assert all(n > 5 for n in sent), sent
    # A caller's key shows its own series and the rest as one total (issue 28):
    # "chat" never learns that a caller named "batch-jobs" exists.
    assert probe["charts"]["callers"]["series"] == ["chat", "(other callers)"]
    assert probe["charts"]["adapters"]["series"] == ["sluice-demo"]  # no LoRA: the base only
    assert "backlog held" in probe["charts"]["queue"]["series"]
    assert probe["charts"]["memory"]["series"] == ["host available"]  # no NVML here
    assert await browser_page.text_content("#state") == "ok"
    assert await browser_page.text_content("#model") == "sluice-demo"
    assert console.errors == []
