"""tests/shared_servers.py: which group a test joins, and a shared server ended early.

The collection hook's grouping is what lets several modules share one engine
start; a wrong group would start a shared server on both workers (or run a test
on a server another test has ended), so the rules are checked here on their own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.shared_servers import SHARED, Pool, group_of, scheduled_group
from tests.support import SluiceProcess

MODULE = "tests/system/test_x.py"


def test_a_test_that_asks_for_a_shared_server_joins_its_group() -> None:
    for name in SHARED:
        assert group_of({"tmp_path", name}, {name}, MODULE) == name


def test_a_modules_other_tests_go_with_the_server_it_asks_for() -> None:
    assert group_of({"tmp_path"}, {"callers_server"}, MODULE) == "callers_server"
    # A test's own server wins over its module's first.
    asks = {"sluice_server", "callers_server"}
    assert group_of({"callers_server"}, asks, MODULE) == "callers_server"


def test_a_module_that_asks_for_none_is_its_own_group() -> None:
    assert group_of({"tmp_path"}, {"tmp_path"}, MODULE) == MODULE


def test_a_server_a_test_ended_is_refused_by_name(tmp_path: Path) -> None:
    """A group's test after the one that ended its server fails at once, naming
    it, rather than on a refused connection."""
    pool = Pool()

    def start() -> SluiceProcess:
        proc = SluiceProcess.__new__(SluiceProcess)
        proc.proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.proc.wait()
        return proc

    pool._running["callers_server"] = start()
    with pytest.raises(RuntimeError, match="shared server callers_server has exited"):
        pool.get("callers_server", start)


def test_the_controller_groups_by_node_id_as_collection_does() -> None:
    """xdist's controller sees node ids only (scheduled_group); a file in MEMBERS
    is whole in its group, parameters and all, and a single test named there
    joins it without its file."""
    assert scheduled_group("tests/integration/test_tools.py::test_x[a@b]") == "sluice_server"
    shutdown = "tests/system/test_shutdown.py::"
    assert scheduled_group(shutdown + "test_second_sigterm_during_drain_stops_at_once") == (
        "callers_server"
    )
    assert scheduled_group(shutdown + "test_another") == "tests/system/test_shutdown.py"
    assert scheduled_group("tests/unit/test_access.py::test_y") == "tests/unit/test_access.py"
