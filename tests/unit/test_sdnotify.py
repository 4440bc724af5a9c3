"""sd_notify over real unix datagram sockets: a path in tmp_path and an abstract one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.operations.sdnotify import SdNotify
from tests.support import until


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    try:
        yield sock, str(path)
    finally:
        sock.close()


def recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_messages_over_a_path_socket(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    n = SdNotify(path)
    try:
        assert n.enabled
        assert n.ready()
        assert recv(sock) == "READY=1"
        assert n.status("loading Qwen3-14B\nstep 2")
        assert recv(sock) == "STATUS=loading Qwen3-14B step 2"  # one line per assignment
        assert n.watchdog()
        assert recv(sock) == "WATCHDOG=1"
        assert n.stopping("draining 3 requests")
        assert recv(sock) == "STOPPING=1\nSTATUS=draining 3 requests"
        assert n.extend_timeout(90)
        assert recv(sock) == "EXTEND_TIMEOUT_USEC=90000000"
    finally:
        n.close()


def test_abstract_socket() -> None:
    name = f"sluice-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    n = SdNotify("@" + name)
    try:
        assert n.ready()
        assert recv(sock) == "READY=1"
    finally:
        n.close()
        sock.close()


def test_no_socket_means_no_op() -> None:
    n = SdNotify(None)
    assert not n.enabled and n.watchdog_interval is None
    assert not n.ready() and not n.stopping() and not n.status("x") and not n.watchdog()


def test_unsupported_address_is_a_no_op() -> None:
    assert not SdNotify("vsock:2:1234").enabled


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    usec = "30000000"
    assert SdNotify("/run/x", usec, watchdog_pid="42", pid=42).watchdog_interval == 15.0
    # The watchdog belongs to another process (we were started by the main one).
    assert SdNotify("/run/x", usec, watchdog_pid="42", pid=43).watchdog_interval is None
    assert SdNotify("/run/x", usec, watchdog_pid="", pid=1).watchdog_interval == 15.0
    assert SdNotify("/run/x", "0").watchdog_interval is None
    assert SdNotify("/run/x", "junk").watchdog_interval is None
    assert SdNotify("/run/x", None).watchdog_interval is None
    assert SdNotify("/run/x", 2_000_000, watchdog_pid=os.getpid()).watchdog_interval == 1.0


def test_send_errors_are_logged_once_and_never_raise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    n = SdNotify(str(tmp_path / "missing.sock"))
    try:
        for _ in range(5):
            assert n.watchdog() is False
    finally:
        n.close()
    assert len([r for r in caplog.records if "sd_notify" in r.getMessage()]) == 1


def test_full_socket_buffer_does_not_block(listener: tuple[socket.socket, str]) -> None:
    _, path = listener  # nobody reads: the receive queue fills up
    n = SdNotify(path)
    try:
        results = [n.status("x" * 1000) for _ in range(2000)]
    finally:
        n.close()
    assert results[0] is True and results[-1] is False  # EAGAIN, not a hang


async def test_ping_forever(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    n = SdNotify(path, 20_000)  # 20 ms -> ping every 10 ms
    task = asyncio.ensure_future(n.ping_forever())
    sock.settimeout(0)
    pings: list[str] = []

    def two_pings() -> bool:
        with contextlib.suppress(BlockingIOError):
            while True:
                pings.append(recv(sock))
        return len(pings) >= 2

    await until(two_pings, what="two pings")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    n.close()
    assert set(pings) == {"WATCHDOG=1"}


async def test_ping_forever_returns_without_watchdog() -> None:
    await asyncio.wait_for(SdNotify(None, "30000000").ping_forever(), 1)
    await asyncio.wait_for(SdNotify("/run/x").ping_forever(), 1)
