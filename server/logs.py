"""Logging set-up: one line per event, JSON by default, plain by flag.

Under systemd, stdout and stderr go to the journal, so Sluice writes lines to
stderr and never manages files. Request lines come from `sluice.access` with
their fields in `extra={"fields": {...}}`; in JSON they become top-level keys,
in the plain format `key=value` pairs. Prompt and output text never appear:
request lines carry ids, sizes and timings only.
"""

from __future__ import annotations

import logging
import queue
import sys
import time
from logging.handlers import QueueHandler, QueueListener
from typing import Any

import orjson

ACCESS = logging.getLogger("sluice.access")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{stamp}.{int(record.msecs):03d} {record.levelname:<7} {record.name}: "
        line += record.getMessage()
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(fmt: str = "json", level: int = logging.INFO) -> QueueListener:
    """Route Sluice's loggers through a queue to a writer thread.

    A write to stderr (a pipe to journald under systemd) can block when the
    reader lags; on the event loop that would stall every stream. The loop
    only enqueues; the listener thread formats and writes. Call `.stop()` on
    the returned listener at exit to flush it.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = QueueListener(records, handler, respect_handler_level=True)
    listener.start()
    sluice = logging.getLogger("sluice")
    sluice.handlers[:] = [QueueHandler(records)]
    sluice.setLevel(level)
    sluice.propagate = False
    return listener


def access(fields: dict[str, Any]) -> None:
    ACCESS.info("request", extra={"fields": fields})
