"""The backend's systemd notifications under a real systemd (sdbox, units from units/): STATUS=
with capability, adoption outcome and re-tracked count, and the watchdog: WATCHDOG=1 pings from
the event loop keep a healthy backend alive; a wedged one (SIGSTOP) is killed and restarted."""

from __future__ import annotations

import time

import pytest

from tests.support.sdbox import SdBox

BACKEND = "kandev-backend.service"
DROPIN = f"/etc/systemd/system/{BACKEND}.d/zz-test-watchdog.conf"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def started(sdbox: SdBox) -> SdBox:
    sdbox.install_units()
    sdbox.systemctl("start", BACKEND)
    return sdbox


def test_status_line_and_watchdog_setting(started: SdBox) -> None:
    box = started
    assert box.prop(BACKEND, "WatchdogUSec") == "30s"
    status = box.prop(BACKEND, "StatusText")
    # survival is off by default: capability disabled, no adoption, nothing re-tracked
    assert "capability=disabled(operator_disabled)" in status
    assert "adoption=disabled" in status and "retracked=0" in status, status


def test_pings_keep_it_alive_and_a_wedged_loop_is_restarted(started: SdBox) -> None:
    box = started
    box.write_file(DROPIN, "[Service]\nWatchdogSec=2s\nTimeoutAbortSec=2s\n")
    try:
        box.systemctl("daemon-reload")
        box.systemctl("restart", BACKEND)
        assert box.prop(BACKEND, "WatchdogUSec") == "2s"
        pid, restarts = box.prop(BACKEND, "MainPID"), int(box.prop(BACKEND, "NRestarts"))
        time.sleep(5)  # 2.5 watchdog periods: only the pings (every 1 s) keep it up
        assert box.prop(BACKEND, "MainPID") == pid and box.prop(BACKEND, "ActiveState") == "active"
        box.run("kill", "-STOP", pid)  # a wedged process: no more pings
        assert box.wait_for(lambda: box.prop(BACKEND, "MainPID") not in ("0", pid)
                            and box.prop(BACKEND, "ActiveState") == "active", timeout=30), \
            box.run("journalctl", "-u", BACKEND, "--no-pager", "-n", "30", check=False).stdout
        assert int(box.prop(BACKEND, "NRestarts")) == restarts + 1
        log = box.run("journalctl", "-u", BACKEND, "--no-pager", check=False).stdout
        assert "Watchdog timeout" in log, log
    finally:
        box.run("rm", "-f", DROPIN)
        box.systemctl("daemon-reload")
