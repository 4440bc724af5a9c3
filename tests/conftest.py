"""Fixtures shared by integration and system tests: the demo model, built once.

Integration tests run the real vLLM engine on the demo model (see
server/engines/demo/model.py). The model is built into pytest's cache directory under a
path keyed by its recipe digest: building takes well under a second, but a
stable path lets vLLM reuse its torch.compile cache between sessions, which
cuts engine start on this machine from about 40 s to about 18 s.

Servers that several modules share (`sluice_server`, `callers_server`) are
started once per run on the worker that runs all their modules:
tests/shared_servers.py says how.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from server.engines.demo.model import build_demo_model, default_demo_dir
from tests.shared_servers import (
    BATCH_DISK,
    GROUP,
    POOL,
    SHARED,
    SHARED_DRAIN_S,
    SharedServerScheduling,
    callers_path,
    callers_toml,
    group_of,
    scheduled_group,
)
from tests.support import SluiceProcess

# The engine, transformers and huggingface_hub read these when imported, in
# this process and in the engine processes it spawns (which inherit the
# environment), so they are set at conftest import, before any test imports
# vLLM. Tests must never reach a model hub, and the machines have no network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
# One OpenMP thread per engine process (inherited by every engine a test starts,
# Sluice's and vLLM's own server alike). The demo model's matrices are tiny: on
# two cores one thread ran 128 requests in 5.2-5.6 s where two threads took
# 7.4-8.4 s, and beside a second engine (the suite's two workers, a balancer's
# twin) two threads each spun on each other's core: 29-30 s against 6.6 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Speed is measured in benchmarks, not asserted in tests: hypothesis's per-example
# deadline (200 ms) and its too-slow health check are timed assertions, and on a
# shared 2-core machine they failed examples that passed on replay
# (FlakyFailure from DeadlineExceeded in the Messages stream property).
settings.register_profile("sluice", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("sluice")


@pytest.fixture(scope="session")
def demo_model_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A complete demo model directory, built on first use."""
    # config.cache is missing under `-p no:cacheprovider`: fall back to a
    # per-session directory (correct, only slower to start the engine).
    cache = getattr(request.config, "cache", None)
    root = (
        cache.mkdir("sluice-demo-model") if cache is not None else tmp_path_factory.mktemp("cache")
    )
    return build_demo_model(default_demo_dir(root))


@pytest.fixture(scope="session")
def demo_cache_root(request: pytest.FixtureRequest, demo_model_dir: Path) -> Path:
    """The SLUICE_CACHE_DIR under which `sluice serve` finds demo_model_dir."""
    return demo_model_dir.parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--agents-latest",
        action="store_true",
        help="run the coding-agent tests on the newest published versions of the agents "
        "(also SLUICE_AGENTS_LATEST=1) instead of the pinned ones (tests/agents/install.py)",
    )


# ------------------------------------------------- servers shared across modules


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """tests/shared_servers.py rules 1-2: each test's group (a shared server's,
    or its module's own), the same as xdist's controller schedules it; each
    group's tests made contiguous, a test that ends its group's server last in it."""

    def module_of(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    asks: dict[str, set[str]] = {}
    for item in items:
        asks.setdefault(module_of(item), set()).update(item.fixturenames)
    first: dict[str, int] = {}
    ends: dict[str, list[str]] = {}
    wrong = []
    for i, item in enumerate(items):
        module = module_of(item)
        group = group_of(item.fixturenames, asks[module], module)
        scheduled = scheduled_group(item.nodeid)
        if scheduled != group:
            wrong.append(f"{item.nodeid}: {group}, not {scheduled}")
        if item.get_closest_marker("ends_shared_server") is not None:
            ends.setdefault(group, []).append(item.nodeid)
        item.stash[GROUP] = group
        first.setdefault(group, i)
    if wrong:
        raise pytest.UsageError(
            "tests/shared_servers.py MEMBERS disagrees with the fixtures the tests ask"
            " for (test: group by its fixtures, not by MEMBERS):\n  " + "\n  ".join(wrong)
        )
    twice = [ids for ids in ends.values() if len(ids) > 1]
    if twice:
        raise pytest.UsageError(f"more than one test ends one shared server: {twice}")
    # A stable sort: the suite's order within a group, its ending test last.
    items.sort(
        key=lambda item: (first[item.stash[GROUP]], item.nodeid in ends.get(item.stash[GROUP], ()))
    )


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Rule 1 for xdist's controller: --dist loadgroup schedules by group."""
    if config.getvalue("dist") == "loadgroup":
        return SharedServerScheduling(config, log)
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Rule 2: a test of a group whose server a test has ended fails at once, naming it."""
    group = item.stash.get(GROUP, None)
    if group in SHARED:
        POOL.check(group)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Rule 3: a shared server stops once its group's last test on this worker is done."""
    result = yield
    group = item.stash.get(GROUP, None)
    if group in SHARED and (nextitem is None or nextitem.stash.get(GROUP, None) != group):
        POOL.stop(group)
    return result


def pytest_sessionfinish(session: pytest.Session) -> None:
    POOL.stop_all()


def _shared_log(factory: pytest.TempPathFactory, name: str) -> Path:
    return factory.mktemp(name) / "sluice.log"


@pytest.fixture(scope="session")
def sluice_server(demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> SluiceProcess:
    """One Sluice with the real engine on the demo model, shared by every module
    that asks for it (tests/shared_servers.py). Compiled, as `sluice serve` runs by
    default (the tests' other servers start eager: tests/support.py SluiceProcess).
    Its drain lasts 2 s at most: test_shutdown's drain deadline ends it."""
    return POOL.get(
        "sluice_server",
        lambda: SluiceProcess(
            [
                "--no-enforce-eager",
                "--log-format",
                "plain",
                "--batch-disk-per-caller",
                str(BATCH_DISK),
                "--drain-timeout",
                str(SHARED_DRAIN_S),
            ],
            cache_dir=demo_cache_root,
            log_path=_shared_log(tmp_path_factory, "shared"),
        ),
    )


@pytest.fixture(scope="session")
def callers_server(
    demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> SluiceProcess:
    """Sluice with a callers file (`callers_toml()`, at callers_path(server)):
    the status page's two callers, cache isolation's four, the SIGHUP test's.
    Its drain may last 120 s: test_shutdown's second SIGTERM ends one early."""

    def start() -> SluiceProcess:
        log = _shared_log(tmp_path_factory, "callers")
        path = callers_path(log)
        path.write_text(callers_toml())
        # Readable by others: test_callers checks the warning this gives at start.
        path.chmod(0o644)
        args = ["--callers", str(path), "--log-format", "plain", "--drain-timeout", "120"]
        return SluiceProcess(args, cache_dir=demo_cache_root, log_path=log)

    return POOL.get("callers_server", start)
