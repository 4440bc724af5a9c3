"""Logging (server/operations/logs.py): a traceback reaches the line as its own field, in
both formats, through the queue to the writer thread."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import orjson
import pytest

from server.operations.logs import setup_logging


@pytest.fixture
def sluice_logger() -> Iterator[logging.Logger]:
    """The "sluice" logger, restored after the test (setup_logging replaces its handlers)."""
    log = logging.getLogger("sluice")
    saved = (log.handlers[:], log.level, log.propagate)
    try:
        yield log
    finally:
        log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]


def _fail(log: logging.Logger) -> None:
    try:
        1 / 0  # noqa: B018 - the exception under test
    except ZeroDivisionError:
        log.exception("it broke on %s", "purpose", extra={"fields": {"request_id": "r-1"}})


def test_a_traceback_is_its_own_json_field(
    sluice_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    listener = setup_logging("json")
    _fail(sluice_logger)
    listener.stop()
    line = orjson.loads(capsys.readouterr().err.strip())
    assert line["msg"] == "it broke on purpose"  # the message alone, formatted once
    assert line["request_id"] == "r-1"
    assert line["exc"].startswith("Traceback (most recent call last):")
    assert line["exc"].rstrip().endswith("ZeroDivisionError: division by zero")


def test_a_plain_line_keeps_the_traceback_below_it(
    sluice_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    listener = setup_logging("plain")
    _fail(sluice_logger)
    listener.stop()
    first, *rest = capsys.readouterr().err.strip().splitlines()
    assert first.endswith("sluice: it broke on purpose request_id=r-1")
    assert rest[0] == "Traceback (most recent call last):"
    assert rest[-1] == "ZeroDivisionError: division by zero"
