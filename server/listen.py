"""The listening socket, bound before anything slow: a taken port fails at once.

Why this module exists: issue 41. Sluice bound its port only after vLLM was
imported and its engines had started, so a port already in use failed tens
of seconds late with a bare OSError (the engine start, running on a worker
thread, had to finish before the process could exit). vLLM's own server binds
before it builds its engine. Here `sluice serve` reads `--host` and `--port`
first (`address`, before vLLM is imported, which alone takes seconds), binds
(`bind`), and hands the bound socket to the app (server/app.py `serve`); a
taken port or a bad address is one `sluice serve: error: ...` line naming
both, exit 2, as any other bad flag. The full command line is still parsed
once, by server/cli.py, and says the same host and port.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Sequence

__all__ = ["BindError", "address", "bind"]


class BindError(Exception):
    """The socket cannot be bound; the message names the host, port and why."""


def address(argv: Sequence[str], host: str, port: int) -> tuple[str, int] | None:
    """`--host` and `--port` from `sluice serve`'s arguments (`host`, `port`: the
    defaults), or None when they cannot be read yet (a bad value, or --help:
    the full parser says what it says)."""
    if any(a in ("-h", "--help") for a in argv):
        return None
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--host", default=host)
    parser.add_argument("--port", default=str(port))
    ns, _ = parser.parse_known_args(list(argv))
    try:
        number = int(ns.port)
    except ValueError:
        return None
    if not 0 <= number <= 65535:
        return None
    return str(ns.host), number


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), listening; BindError names why not."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock
