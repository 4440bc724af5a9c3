"""Fixtures for integration tests: one Sluice server on the real engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import SluiceProcess

# The shared server's --batch-disk-per-caller: far above what the package's
# batches keep, low enough that test_batches fills it (its quota test).
BATCH_DISK = 64_000_000


@pytest.fixture(scope="package")
def sluice_server(
    demo_cache_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SluiceProcess]:
    """One Sluice with the real engine on the demo model, for tests/integration: it
    stops when the package's tests end, so tests/system's own servers do not
    start and run beside an idle one. Compiled, as `sluice serve` runs by default
    (the tests' other servers start eager: tests/support.py SluiceProcess)."""
    log = tmp_path_factory.mktemp("logs") / "sluice.log"
    with SluiceProcess(
        ["--no-enforce-eager", "--log-format", "plain", "--batch-disk-per-caller", str(BATCH_DISK)],
        cache_dir=demo_cache_root,
        log_path=log,
    ).running() as proc:
        yield proc
