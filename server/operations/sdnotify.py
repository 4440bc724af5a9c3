"""sd_notify(3) from the standard library: READY, STOPPING, STATUS, WATCHDOG.

Why not libsystemd or a package: the protocol is one datagram of
``KEY=value`` lines to the AF_UNIX socket named in NOTIFY_SOCKET, and that is
twenty lines of Python with no C dependency.

Rules this class keeps:

* Built once from the environment mapping the caller read (config is read once,
  in server/__main__.py); it never looks at os.environ itself.
* Without NOTIFY_SOCKET (not under systemd, or Type= is not notify) every
  method is a no-op.
* The socket is non-blocking and a failed send is logged once and otherwise
  ignored: systemd being busy must never stall or crash the event loop.
* systemd arms its watchdog at READY=1 (or at the first WATCHDOG=1), not at
  exec, so a long model load before ready() is covered by TimeoutStartSec
  alone; after ready(), ping every ``watchdog_interval`` seconds (half of
  WatchdogSec, as sd_watchdog_enabled(3) recommends) from the event loop, so
  a wedged loop is what systemd detects.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

log = logging.getLogger("sluice.sdnotify")

__all__ = ["SdNotify"]


class SdNotify:
    def __init__(
        self,
        notify_socket: str | None,
        watchdog_usec: str | int | None = None,
        *,
        watchdog_pid: str | int | None = None,
        pid: int | None = None,
    ) -> None:
        self._address = self._parse_address(notify_socket)
        self._sock: socket.socket | None = None
        self._error_logged = False
        self.watchdog_interval = self._parse_watchdog(watchdog_usec, watchdog_pid, pid)

    @staticmethod
    def _parse_address(value: str | None) -> str | bytes | None:
        if not value:
            return None
        if value.startswith("@"):
            # Abstract namespace: the name is a leading NUL plus the rest.
            return b"\0" + value[1:].encode()
        if value.startswith("/"):
            return value
        # vsock: (systemd 254+ in VMs) and relative paths are not for us.
        log.warning("NOTIFY_SOCKET=%r is not a unix socket address; not notifying", value)
        return None

    @staticmethod
    def _parse_watchdog(
        usec: str | int | None, watchdog_pid: str | int | None, pid: int | None
    ) -> float | None:
        """Half of WATCHDOG_USEC in seconds, or None when no watchdog is ours."""
        try:
            value = int(usec) if usec is not None and str(usec).strip() else 0
        except ValueError:
            return None
        if value <= 0:
            return None
        if watchdog_pid is not None and str(watchdog_pid).strip():
            # Set by systemd to the main PID; a child that inherited it is not watched.
            try:
                if int(watchdog_pid) != (pid if pid is not None else os.getpid()):
                    return None
            except ValueError:
                return None
        return value / 2 / 1_000_000

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines; keys are upper-cased. True when sent."""
        if self._address is None:
            return False
        lines = []
        for key, value in fields.items():
            # One assignment per line: a newline inside a value would start a new one.
            text = str(value).replace("\n", " ")
            lines.append(f"{key.upper()}={text}")
        return self._send("\n".join(lines).encode())

    def ready(self, status: str | None = None) -> bool:
        if status is None:
            return self.notify(ready=1)
        return self.notify(ready=1, status=status)

    def stopping(self, status: str | None = None) -> bool:
        if status is None:
            return self.notify(stopping=1)
        return self.notify(stopping=1, status=status)

    def status(self, text: str) -> bool:
        return self.notify(status=text)

    def watchdog(self) -> bool:
        return self.notify(watchdog=1)

    def extend_timeout(self, seconds: float) -> bool:
        """EXTEND_TIMEOUT_USEC: ask for more start/stop time (a slow model load)."""
        return self.notify(extend_timeout_usec=max(0, int(seconds * 1_000_000)))

    async def ping_forever(self) -> None:
        """WATCHDOG=1 every ``watchdog_interval`` until cancelled; returns at once
        when systemd set no watchdog. Run it in the task group after ready()."""
        interval = self.watchdog_interval
        if interval is None or not self.enabled:
            return
        while True:
            self.watchdog()
            await asyncio.sleep(interval)

    def _send(self, data: bytes) -> bool:
        address = self._address
        if address is None:
            return False
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(data, address)
        except OSError as exc:
            # ENOENT/ECONNREFUSED (manager gone), EAGAIN (its queue is full)...
            if not self._error_logged:
                self._error_logged = True
                log.warning(
                    "sd_notify to %r failed: %s (further failures not logged)", self._address, exc
                )
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
