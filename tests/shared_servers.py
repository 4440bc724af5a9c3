"""Servers that several test modules share: one engine start for all of them (issue 64).

Why this module exists: an engine start is most of the suite's time (each of a
server's three processes imports vLLM and torch, about 8 s of a core apiece,
and far more beside the other worker's start). A server whose flags several
modules can live with is started once, on the one worker that runs all of them:

1. Each shared server is a fixture named in `SHARED` (its group). A test that
   asks for one is in that server's group; the other tests of a module go with
   the first shared server its tests ask for, or, asking for none, are a group
   of their own, as `--dist loadfile` made each file. xdist's controller, which
   never collects, schedules each group as one unit to one worker
   (`SharedServerScheduling`, for `--dist loadgroup`: scripts/test) from
   `MEMBERS`, the tests each server's group holds; collection fails, naming
   the test, where `MEMBERS` and the fixtures disagree. So each group's tests
   run on one worker, and the server starts there once. (xdist's own loadgroup
   marks a group in the test's node id, which pytest 9.2 no longer lets it
   change: pytest-xdist issue 1386. Its tests then spread test by test.)
2. A group's tests are made contiguous (a stable sort by the group's first
   test), so without xdist too each server starts once. A test marked
   `ends_shared_server` (it stops the server itself: a drain's end) goes last in
   its group; a group has at most one, and a test that finds its server ended
   fails at once, naming it.
3. A server stops as soon as its worker's next test belongs to another group
   (`pytest_runtest_teardown` in tests/conftest.py), so no idle engine runs beside
   the next module's own, and at the session's end in any case; its exit status
   is checked then (a shared server that does not stop cleanly fails its last test's
   teardown).

A test that changes a shared server's state leaves it as it found it (the
callers file of `callers_server` is written back after the SIGHUP test).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

from tests.support import SluiceProcess

__all__ = [
    "BATCH_DISK",
    "CACHE_GROUP",
    "CALLER_KEYS",
    "GROUP",
    "MEMBERS",
    "POOL",
    "SHARED",
    "SHARED_DRAIN_S",
    "Pool",
    "SharedServerScheduling",
    "callers_path",
    "callers_toml",
    "group_of",
    "scheduled_group",
]

# The shared servers' fixtures (tests/conftest.py), each its group's name.
SHARED = ("sluice_server", "callers_server")

# Rule 1's groups as xdist's controller sees them: the test files (or single
# tests, file::name) whose tests ask for each shared server.
MEMBERS: Mapping[str, tuple[str, ...]] = {
    "sluice_server": (
        *(
            f"tests/integration/test_{name}.py"
            for name in (
                "batches",
                "docs_examples",
                "lm_eval",
                "messages",
                "ollama",
                "prompt_logprobs",
                "request_class",
                "responses",
                "seed",
                "server",
                "tokenize",
                "tools",
            )
        ),
        "tests/system/test_shutdown.py::test_drain_deadline_fails_the_rest_with_503_and_exits",
    ),
    "callers_server": (
        "tests/integration/test_status_page.py",
        "tests/system/test_cache_isolation.py",
        "tests/system/test_callers.py",
        "tests/system/test_shutdown.py::test_second_sigterm_during_drain_stops_at_once",
    ),
}

# An item's group (rule 1), kept for the teardown hook (rule 3).
GROUP = pytest.StashKey[str]()

# sluice_server's --batch-disk-per-caller: far above what its batches keep, low
# enough that test_batches fills it (its quota test).
BATCH_DISK = 64_000_000
# sluice_server's --drain-timeout (seconds): test_shutdown's drain deadline.
SHARED_DRAIN_S = 2.0

# callers_server's callers, name to key: test_status_page's two (chat, batch-jobs)
# and test_cache_isolation's four, two of them in one cache_group. Fresh keys each
# run but the status page's, whose test types them.
CALLER_KEYS: Mapping[str, str] = {
    "chat": "sk-chat",
    "batch-jobs": "sk-batch",
    **{name: f"sk-{name}-{secrets.token_hex(8)}" for name in ("ann", "bob", "cyril", "dora")},
}
CACHE_GROUP = ("cyril", "dora")


def callers_toml(extra: Mapping[str, str] | None = None) -> str:
    """callers_server's callers file, with `extra` callers (name to key) added."""
    keys = {**CALLER_KEYS, **(extra or {})}
    return "".join(
        f'[callers.{name}]\nkey = "{key}"\n'
        + ('cache_group = "team"\n' if name in CACHE_GROUP else "")
        for name, key in keys.items()
    )


def callers_path(log_path: Path) -> Path:
    """Where callers_server's callers file is: beside its log."""
    return log_path.parent / "callers.toml"


class Pool:
    """The shared servers running in this process (one pytest worker)."""

    def __init__(self) -> None:
        self._running: dict[str, SluiceProcess] = {}

    def check(self, name: str) -> None:
        """Rule 2: a shared server a test has ended is refused by name (its
        fixture's value is the session's, so tests/conftest.py asks before each
        test of the group, not only here at a start)."""
        proc = self._running.get(name)
        if proc is not None and proc.proc.poll() is not None:
            raise RuntimeError(
                f"shared server {name} has exited ({proc.proc.returncode}): only its group's"
                " last test may end it (rule 2, the ends_shared_server mark)"
            )

    def get(self, name: str, start: Callable[[], SluiceProcess]) -> SluiceProcess:
        """The running server `name`, started (and waited for) on first use."""
        self.check(name)
        proc = self._running.get(name)
        if proc is None:
            proc = start()
            try:
                proc.wait_ready()
            except BaseException:
                proc.stop()
                raise
            self._running[name] = proc
        return proc

    def stop(self, name: str) -> None:
        """Stop `name` if it runs; a server that does not exit 0 is a failure."""
        proc = self._running.pop(name, None)
        if proc is not None:
            code = proc.stop()
            assert code == 0, f"shared server {name} exited {code}:\n{proc.tail()}"

    def stop_all(self) -> None:
        for name in list(self._running):
            self.stop(name)


POOL = Pool()


def group_of(asks: Collection[str], module_asks: Collection[str], module: str) -> str:
    """Rule 1: the xdist group of a test that asks for the fixtures `asks`, in the
    module whose node id is `module` and whose tests ask for `module_asks`."""
    for names in (asks, module_asks):
        for name in SHARED:
            if name in names:
                return name
    return module


def scheduled_group(nodeid: str) -> str:
    """Rule 1 from a test's node id alone (`MEMBERS`), as xdist's controller needs it."""
    module = nodeid.split("::", 1)[0]
    test = nodeid.split("[", 1)[0]
    for name, members in MEMBERS.items():
        if module in members or test in members:
            return name
    return module


class SharedServerScheduling(LoadScopeScheduling):
    """xdist's scope scheduling, a scope being a rule-1 group: each group goes
    whole to one worker, in the suite's order (--no-loadscope-reorder)."""

    def _split_scope(self, nodeid: str) -> str:
        return scheduled_group(nodeid)
