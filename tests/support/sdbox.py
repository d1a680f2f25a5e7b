"""A throw-away systemd for tests, built on the project's copy of sdbox.sh (tests/systemd/sdbox.sh).

``SdBox.start()`` runs, in the background and in its own process group::

    tests/systemd/sdbox.sh bash -c '<write "$SDBOX_LEADER $SDBOX_LAB" to CTL/leader>;
                                    <poll every 0.2 s until CTL/stop exists (at most 1 h)>'

sdbox.sh boots systemd in a container (overlay of the host's /, writes vanish with the box) and
only then runs that command on the host, so the leader file appearing means "booted". Commands run
inside the box with ``nsenter -t LEADER -a -r -w``. ``SdBox.stop()`` creates the stop file, the
command exits, and sdbox.sh halts and removes the box.

Never boot systemd any other way: a systemd booted over the host's real root wipes the host's /tmp.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.paths import REPO_ROOT
from tests.support.waiting import wait_until

SDBOX_SH = REPO_ROOT / "tests" / "systemd" / "sdbox.sh"

# The command sdbox.sh runs on the host once the box has booted.
# $1 = control dir, $2 = pid of the test process (if it dies, e.g. SIGKILL, tear the box down too).
_HOLD_SCRIPT = r"""
ctl=$1 owner=$2 ticks=$3
printf '%s %s\n' "$SDBOX_LEADER" "$SDBOX_LAB" > "$ctl/leader.tmp" && mv "$ctl/leader.tmp" "$ctl/leader"
for _ in $(seq "$ticks"); do               # ticks x 0.2 s: KANDEV_SDBOX_MAX_S (1 h unless set) at most
  [ -e "$ctl/stop" ] && exit 0
  kill -0 "$owner" 2>/dev/null || { rm -rf "$ctl"; exit 0; }   # the test process is gone (SIGKILL?)
  sleep 0.2
done
echo "sdbox hold: no stop file after $((ticks / 5)) s, giving up" >&2
exit 124
"""


def max_lifetime_s() -> int:
    """How long a box may stay up (a leak's safety net): ``KANDEV_SDBOX_MAX_S`` seconds, 1 h unless
    set; ``packaging/dev/chaos.sh N`` sets it to its run's bound (1,000 faults take more than 1 h)."""
    raw = os.environ.get("KANDEV_SDBOX_MAX_S", "").strip()
    if not raw:
        return 3600
    if not raw.isdigit() or int(raw) < 60:
        raise ValueError(f"KANDEV_SDBOX_MAX_S must be a whole number of seconds from 60, got {raw!r}")
    return int(raw)


class SdBoxError(RuntimeError):
    """The box could not be started or stopped cleanly."""


class BoxCommandError(subprocess.CalledProcessError):
    """A command inside the box failed; unlike CalledProcessError, str() shows its output."""

    def __str__(self) -> str:
        return (
            f"{super().__str__()}\n--- stdout:\n{(self.stdout or '').rstrip()}"
            f"\n--- stderr:\n{(self.stderr or '').rstrip()}"
        )


def _mounts() -> dict[str, str]:
    """mount point -> fs type, from /proc/self/mounts (last mount wins)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    out[parts[1]] = parts[2]
    except OSError:
        pass
    return out


def on_ci() -> bool:
    """Whether this run is CI's (``CI=true``), where a harness that cannot run is a failure, not a skip."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def unavailable_reason() -> str | None:
    """Why sdbox.sh cannot run on this host, or None if it can."""
    if not sys.platform.startswith("linux"):
        return f"not Linux (sys.platform={sys.platform!r})"
    if os.geteuid() != 0:
        return "needs root (sdbox.sh mounts an overlay of / and boots systemd-nspawn)"
    try:
        with open("/proc/self/status") as f:
            cap_eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
        if not cap_eff & (1 << 21):
            return "root without CAP_SYS_ADMIN (an unprivileged container?): cannot mount or boot a container"
    except (OSError, StopIteration, ValueError):
        pass
    for tool in ("systemd-nspawn", "nsenter", "unshare", "setpriv", "systemd-id128"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install --no-install-recommends systemd-container util-linux)"
    if not Path("/usr/lib/systemd/systemd").exists():
        return "systemd is not installed (/usr/lib/systemd/systemd missing), nothing to boot in the box"
    mounts = _mounts()
    if mounts.get("/sys/fs/cgroup") == "cgroup2":
        return (
            "host has the unified (cgroup v2 only) layout; this copy of sdbox.sh needs the hybrid layout "
            "(/sys/fs/cgroup/unified + /sys/fs/cgroup/systemd) - see tests/README.md"
        )
    if mounts.get("/sys/fs/cgroup/unified") != "cgroup2" or mounts.get("/sys/fs/cgroup/systemd") != "cgroup":
        return (
            "no hybrid cgroup layout (need cgroup2 at /sys/fs/cgroup/unified and the named "
            "'systemd' v1 hierarchy at /sys/fs/cgroup/systemd)"
        )
    for d in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd"):
        if not os.access(d, os.W_OK):
            return f"{d} is not writable (read-only cgroup mount?)"
    if not os.access(SDBOX_SH, os.X_OK):
        return f"{SDBOX_SH} is not executable (it re-executes itself): chmod +x it"
    return None


class SdBox:
    """One booted box. Helpers run things inside it; see tests/README.md for the API."""

    def __init__(self, repo_root: Path, venv_bin: Path) -> None:
        self.repo_root = Path(repo_root)
        self.venv_bin = Path(venv_bin)  # e.g. <repo>/.venv/bin (not resolved: the venv path itself)
        self.leader: int = 0  # PID (in the host's namespace) of the box's systemd
        self.lab: Path | None = None  # sdbox.sh's scratch dir on the host
        self.share: Path | None = None  # host side of the box's /sdbox (live, both ways)
        self.boot_seconds: float | None = None
        self._ctl: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._env = dict(os.environ, SYSTEMD_PAGER="", PAGER="cat", SYSTEMD_COLORS="0", LC_ALL="C.UTF-8")
        for k in ("SDBOX_UNITS", "SDBOX_SHARE", "SDBOX_LEADER", "SDBOX_LAB", "NOTIFY_SOCKET"):
            self._env.pop(k, None)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, boot_timeout: float = 60.0) -> SdBox:
        self._ctl = Path(tempfile.mkdtemp(prefix="kandev-sdbox-", dir="/var/tmp"))
        t0 = time.monotonic()
        with open(self._ctl / "sdbox.log", "wb") as log:  # Popen keeps its own copy of the fd
            self._proc = subprocess.Popen(
                [str(SDBOX_SH), "bash", "-c", _HOLD_SCRIPT, "sdbox-hold", str(self._ctl), str(os.getpid()),
                 str(5 * max_lifetime_s())],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,  # own process group: teardown may kill exactly this group
            )
        leader_file = self._ctl / "leader"
        deadline = t0 + boot_timeout
        while not leader_file.exists():
            rc = self._proc.poll()
            if rc is not None:
                log_tail = self._log_tail()
                self._discard_ctl()
                self._proc = None
                raise SdBoxError(f"sdbox.sh exited with {rc} before the box was up:\n{log_tail}")
            if time.monotonic() > deadline:
                log_tail = self._log_tail()
                try:
                    self.stop()
                except SdBoxError:
                    pass
                raise SdBoxError(f"box not booted after {boot_timeout:g}s:\n{log_tail}")
            time.sleep(0.05)
        leader, lab = leader_file.read_text().split()
        self.leader, self.lab = int(leader), Path(lab)
        self.share = self.lab / "share"
        self.boot_seconds = time.monotonic() - t0
        if (str(self.repo_root) + "/").startswith("/tmp/"):
            try:
                self._mirror_repo()
            except BaseException:
                try:
                    self.stop()
                except SdBoxError:
                    pass
                raise
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the hold command to exit; sdbox.sh then halts the box and cleans up. Bounded: if it
        does not exit in time, its process group (and only that) is killed."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        assert self._ctl is not None
        (self._ctl / "stop").touch()
        killed = None
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            killed = "SIGTERM"
            self._killpg(proc, signal.SIGTERM)
            try:
                rc = proc.wait(15)
            except subprocess.TimeoutExpired:
                killed = "SIGKILL"
                self._killpg(proc, signal.SIGKILL)
                rc = proc.wait(10)
        log_tail = self._log_tail()
        self._discard_ctl()
        self.leader = 0
        if killed or rc != 0:
            how = f"had to be killed ({killed})" if killed else f"exited with {rc}"
            raise SdBoxError(f"sdbox.sh {how} on teardown:\n{log_tail}")

    @staticmethod
    def _killpg(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        try:
            os.killpg(proc.pid, sig)  # proc.pid is its process group id (start_new_session)
        except ProcessLookupError:
            pass

    def _log_tail(self, lines: int = 40) -> str:
        try:
            text = (self._ctl / "sdbox.log").read_text(errors="replace")  # type: ignore[operator]
        except OSError:
            return "(no sdbox.sh log)"
        return "\n".join(text.splitlines()[-lines:]) or "(sdbox.sh printed nothing)"

    def _discard_ctl(self) -> None:
        if self._ctl is not None:
            shutil.rmtree(self._ctl, ignore_errors=True)
            self._ctl = None

    def _mirror_repo(self) -> None:
        """A checkout under /tmp is invisible in the box (its /tmp is a fresh tmpfs): copy a snapshot
        of it (without .git and .venv) to the same path inside the box, so the editable install,
        which points at that path, imports the same code there."""
        tar = subprocess.Popen(
            ["tar", "-C", str(self.repo_root), "--exclude=./.git", "--exclude=./.venv", "-cf", "-", "."],
            stdout=subprocess.PIPE,
        )
        assert tar.stdout is not None
        try:
            box = subprocess.run(
                ["nsenter", "-t", str(self.leader), "-a", "-r", "-w", "sh", "-c",
                 'mkdir -p "$1" && tar -C "$1" -xf -', "sh", str(self.repo_root)],
                stdin=tar.stdout, capture_output=True, text=False, timeout=120, env=self._env,
            )
        finally:
            tar.stdout.close()
            tar.wait(30)
        if box.returncode or tar.returncode:
            err = box.stderr.decode(errors="replace")
            raise SdBoxError(f"copying {self.repo_root} into the box failed: {err}")

    def visibility_problems(self) -> list[str]:
        """What of the checkout and the venv the box cannot see or run (empty list: all fine)."""
        problems = []
        checks = [
            ("the checkout", ["test", "-f", str(self.repo_root / "pyproject.toml")]),
            ("the venv python", ["test", "-x", str(self.venv_bin / "python")]),
            ("the venv python (running)", [str(self.venv_bin / "python"), "-c", "import sys"]),
        ]
        for what, argv in checks:
            p = self.run(*argv, check=False)
            if p.returncode:
                problems.append(f"{what}: `{' '.join(argv)}` failed inside the box ({p.stderr.strip()})")
        return problems

    # ---- helpers -----------------------------------------------------------------------------

    def run(
        self,
        *argv: str | os.PathLike[str] | int,
        check: bool = True,
        timeout: float = 60,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv inside the box (all its namespaces, its root, its cwd /); text output captured."""
        if not self.leader:
            raise SdBoxError("the box is not running")
        cmd = ["nsenter", "-t", str(self.leader), "-a", "-r", "-w", *map(str, argv)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input, env=self._env)
        if check and p.returncode:
            raise BoxCommandError(p.returncode, cmd, p.stdout, p.stderr)
        return p

    def systemctl(
        self, *args: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", *args, check=check, timeout=timeout)

    def prop(self, unit: str, name: str) -> str:
        """One unit property as `systemctl show -p NAME --value UNIT` prints it."""
        return self.systemctl("show", "-p", name, "--value", unit).stdout.strip()

    def journal_json(self, *matches: str) -> list[dict[str, Any]]:
        """The box journal as parsed records (`journalctl -o json --no-pager MATCHES...`)."""
        p = self.run("journalctl", "-o", "json", "--no-pager", *matches, check=False)
        if p.returncode and p.stdout.strip() == "":
            if "No entries" in p.stderr or not p.stderr.strip():
                return []
            raise BoxCommandError(p.returncode, ["journalctl", *matches], p.stdout, p.stderr)
        return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]

    def alive(self, pid: int | str) -> bool:
        """Whether pid (a pid in the box's pid namespace) exists inside the box."""
        return self.run("kill", "-0", str(pid), check=False).returncode == 0

    @staticmethod
    def wait_for(fn: Callable[[], Any], timeout: float = 10, interval: float = 0.1) -> Any:
        """Poll fn every 0.1 s until it returns something truthy; return that, or False after timeout
        (``wait_until`` with a falsy answer instead of ``TimeoutError``, for ``assert box.wait_for(...)``)."""
        try:
            return wait_until(fn, timeout, interval)
        except TimeoutError:
            return False

    def write_file(self, path: str | os.PathLike[str], text: str, mode: int | str = 0o644) -> None:
        """Create or replace a file inside the box (parent directories are created)."""
        mode_s = format(mode, "o") if isinstance(mode, int) else mode
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod "$2" "$1"'
        self.run("sh", "-c", script, "sh", str(path), mode_s, input=text)

    def read_file(self, path: str | os.PathLike[str]) -> str:
        return self.run("cat", str(path)).stdout

    def install_units(
        self, units_dir: str | os.PathLike[str] | None = None, venv_bin: str | os.PathLike[str] | None = None
    ) -> list[str]:
        """Copy units_dir/*.service (default: the repo's units/) into the box's /etc/systemd/system
        with /usr/bin/kandev... rewritten to <venv_bin>/kandev... (ExecStart then runs the dev venv's
        console scripts), then `systemctl daemon-reload`. Returns the unit names."""
        units = Path(units_dir) if units_dir is not None else self.repo_root / "units"
        vbin = Path(venv_bin) if venv_bin is not None else self.venv_bin
        self.install_system_files()
        # PrivateTmp= gives each unit its own /tmp and /var/tmp: a checkout or venv there (CI may clone
        # under /tmp; setup.sh then puts the venv in /var/tmp) is bound read-only into the unit.
        binds = sorted({str(p) for p in (self.repo_root, vbin.parent)
                        if str(p).startswith(("/tmp/", "/var/tmp/"))})
        names = []
        for f in sorted(units.glob("*.service")):
            text = f.read_text().replace("/usr/bin/kandev", f"{vbin}/kandev")
            self.write_file(f"/etc/systemd/system/{f.name}", text, 0o644)
            if binds:
                self.write_file(f"/etc/systemd/system/{f.name}.d/dev-paths.conf",
                                "[Service]\nBindReadOnlyPaths=" + " ".join(binds) + "\n", 0o644)
            names.append(f.name)
        if not names:
            raise SdBoxError(f"no *.service files in {units}")
        self.systemctl("daemon-reload")
        return names

    def install_system_files(self) -> None:
        """What the package installs besides the units (packaging/): the `kandev` system user and
        group (sysusers.d, home /var/lib/kandev), tmpfiles.d, the polkit rule (plus its probe
        action) that lets that user start kandev-agentctl.service, and the man pages. Idempotent."""
        pkg = self.repo_root / "packaging"
        self.write_file("/etc/sysusers.d/kandev.conf", (pkg / "sysusers.d/kandev.conf").read_text())
        self.write_file("/etc/tmpfiles.d/kandev.conf", (pkg / "tmpfiles.d/kandev.conf").read_text())
        self.write_file("/etc/polkit-1/rules.d/50-kandev.rules", (pkg / "polkit/50-kandev.rules").read_text())
        self.write_file("/usr/share/polkit-1/actions/org.kandev.policy", (pkg / "polkit/org.kandev.policy").read_text())
        for page in sorted((pkg / "man").glob("*.[18]")):  # the units' Documentation= (verify runs man)
            self.write_file(f"/usr/share/man/man{page.suffix[1:]}/{page.name}", page.read_text())
        self.run("systemd-sysusers", "/etc/sysusers.d/kandev.conf")
        self.run("systemd-tmpfiles", "--create", "/etc/tmpfiles.d/kandev.conf")
