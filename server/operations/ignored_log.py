"""The I/O half of rule 2 (server/wire/ignored.py): log once, count every time.

Why this module exists: the parsers only note what they accepted and ignored;
this is where an operator sees it. Each (api, field) is logged once at info,
in the client's own spelling, with the label it is counted under; every
occurrence is counted in ``sluice_ignored_fields_total{api,field}``,
whose ``field`` label holds only the names server/wire/ignored.py lists or
``other``. What was logged is remembered per app (one per process in
production), at most ``_LOGGED_MAX`` names: past that, new unknown names are
counted but no longer logged, so a client sending a fresh name per request
cannot grow the server's memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Final

from prometheus_client import Counter

from server.wire.ignored import Api, Ignored

__all__ = ["IgnoredFields"]

log = logging.getLogger("sluice.ignored")

# Distinct (api, name) pairs logged before new ones are only counted: the
# lists of server/wire/ignored.py hold about 60; a client that sends
# hundreds of new names is broken or hostile, and the counter still shows it.
_LOGGED_MAX: Final = 512


class IgnoredFields:
    """Records what the parsers accepted and ignored (one per app)."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._logged: set[tuple[str, str]] = set()

    def record(self, api: Api, items: Iterable[Ignored]) -> None:
        for item in items:
            self._counter.labels(api, item.field).inc()
            key = (api, item.name)
            if key in self._logged or len(self._logged) >= _LOGGED_MAX:
                continue
            self._logged.add(key)
            log.info(
                "accepted and ignored",
                extra={"fields": {"api": api, "field": item.name, "counted_as": item.field}},
            )
