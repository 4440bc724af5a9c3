"""The unit file: directives the design depends on, and `systemd-analyze verify`.

Parsing catches a lost directive in review; verify catches what systemd itself
rejects (a typo in a directive name, a bad DeviceAllow= group). verify needs the
ExecStart binary to exist, so it runs on a copy pointed at a real executable.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "sluice.service"
ENV = UNIT.with_name("sluice.env")
EXEC = "/opt/sluice/.venv/bin/sluice"


def _directives(text: str) -> dict[tuple[str, str], list[str]]:
    """(section, key) -> values, in order; repeated keys accumulate."""
    out: dict[tuple[str, str], list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        out.setdefault((section, key.strip()), []).append(value.strip())
    return out


@pytest.fixture(scope="module")
def unit() -> dict[tuple[str, str], list[str]]:
    return _directives(UNIT.read_text())


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("Type", "notify"),
        ("NotifyAccess", "main"),
        ("WatchdogSec", "30s"),
        ("Restart", "on-failure"),
        ("KillMode", "mixed"),
        ("TimeoutStartSec", "15min"),
        ("TimeoutStopSec", "60s"),
        ("EnvironmentFile", "-/etc/sluice/sluice.env"),
        ("StateDirectory", "sluice"),
        ("CacheDirectory", "sluice"),
        ("User", "sluice"),
        ("NoNewPrivileges", "yes"),
        # An engine's start priority is set back once ready (issue 49, item 3).
        ("LimitNICE", "20"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("DevicePolicy", "closed"),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6 AF_NETLINK"),
    ],
)
def test_required_directive(unit: dict[tuple[str, str], list[str]], key: str, value: str) -> None:
    assert unit.get(("Service", key)) == [value]


def test_cuda_devices_allowed_without_private_devices(
    unit: dict[tuple[str, str], list[str]],
) -> None:
    allowed = unit[("Service", "DeviceAllow")]
    for entry in ("char-nvidia-frontend rw", "char-nvidia-uvm rw", "/dev/nvidiactl rw"):
        assert entry in allowed
    # Globs are not valid in DeviceAllow=; PrivateDevices= would hide the GPU.
    assert not any("*" in entry for entry in allowed)
    assert ("Service", "PrivateDevices") not in unit
    assert ("Service", "DynamicUser") not in unit


def test_stop_timeout_exceeds_drain_timeout(unit: dict[tuple[str, str], list[str]]) -> None:
    drain_default = 30  # Settings.drain_timeout
    stop = unit[("Service", "TimeoutStopSec")][0]
    assert stop.endswith("s") and int(stop[:-1]) > drain_default


def test_reload_sends_sighup_to_the_main_process(unit: dict[tuple[str, str], list[str]]) -> None:
    # SIGHUP re-reads the callers file (server/app.py reload_callers).
    assert unit[("Service", "ExecReload")] == ["/bin/kill -HUP $MAINPID"]


def test_exec_start_and_caches(unit: dict[tuple[str, str], list[str]]) -> None:
    (exec_start,) = unit[("Service", "ExecStart")]
    assert exec_start.startswith(EXEC + " serve ")
    assert "$SLUICE_ARGS" in exec_start
    env = " ".join(unit[("Service", "Environment")])
    assert "HF_HOME=/var/lib/sluice/" in env
    assert unit[("Install", "WantedBy")] == ["multi-user.target"]


def test_env_example_defines_what_exec_start_uses() -> None:
    keys = {
        line.partition("=")[0]
        for line in ENV.read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert {"SLUICE_MODEL", "SLUICE_HOST", "SLUICE_PORT", "SLUICE_ARGS"} <= keys


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed (Debian/Ubuntu package: systemd)")
    # verify insists the ExecStart binary exists and is executable.
    fake = tmp_path / "sluice"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    copy = tmp_path / "sluice.service"
    copy.write_text(UNIT.read_text().replace(EXEC, str(fake)))
    proc = subprocess.run(
        [tool, "verify", str(copy)], capture_output=True, text=True, timeout=60, check=False
    )
    # Lines about the host itself (no running manager in a container) are not ours.
    ours = [line for line in proc.stderr.splitlines() if "sluice.service" in line]
    assert proc.returncode == 0 and not ours, proc.stderr
