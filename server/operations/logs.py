"""Logging set-up: one line per event, JSON by default, plain by flag.

Under systemd, stdout and stderr go to the journal, so Sluice writes lines to
stderr and never manages files. Request lines come from `sluice.access` with
their fields in `extra={"fields": {...}}`; in JSON they become top-level keys,
in the plain format `key=value` pairs. Prompt and output text never appear:
request lines carry ids, sizes and timings only.
"""

from __future__ import annotations

import copy
import logging
import queue
import sys
import time
from logging.handlers import QueueHandler, QueueListener
from typing import Any

import orjson

ACCESS = logging.getLogger("sluice.access")


def _traceback(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    """The record's traceback text: formatted on the loop thread by `_Handoff`,
    or here for a record that did not come through the queue."""
    if record.exc_text:
        return record.exc_text
    return formatter.formatException(record.exc_info) if record.exc_info else None


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
        if exc := _traceback(self, record):
            out["exc"] = exc
        return orjson.dumps(out, default=str).decode()


class PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{stamp}.{int(record.msecs):03d} {record.levelname:<7} {record.name}: "
        line += record.getMessage()
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if exc := _traceback(self, record):
            line += "\n" + exc
        return line


class _Handoff(QueueHandler):
    """A QueueHandler that keeps the traceback out of the message.

    The stock `prepare` formats the record with the handler's formatter
    (message plus traceback, one string) and clears `exc_info`, so the writer
    thread's formatter never sees a traceback and the JSON line carried it
    inside `msg`. Here the message is merged with its arguments and the
    traceback is rendered to `exc_text` here on the loop thread, as the stock
    handler does (the frames it shows may change once the loop moves on),
    each for the writer's formatter to place.
    """

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        out = copy.copy(record)
        out.msg, out.args = record.getMessage(), None
        out.message = out.msg
        if record.exc_info:
            out.exc_text = logging.Formatter().formatException(record.exc_info)
        out.exc_info = None
        return out


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
    sluice.handlers[:] = [_Handoff(records)]
    sluice.setLevel(level)
    sluice.propagate = False
    return listener


def access(fields: dict[str, Any], level: int = logging.INFO) -> None:
    ACCESS.log(level, "request", extra={"fields": fields})
