#!/usr/bin/env bash
# Idempotent development set-up of a Debian 12 machine (run as root):
#   1. apt packages the build and the systemd tests need (skipped when all are present),
#   2. a virtualenv with `pip install -e '<repo>[test]'` (skipped when nothing changed),
#   3. kandev's modules byte-compiled (only those changed since the last run).
# Progress goes to stderr; the LAST LINE OF STDOUT is the virtualenv path, e.g.
#   VENV=$(bash packaging/dev/setup.sh | tail -n 1)
# Venv location: $KANDEV_VENV if set, else <repo>/.venv, except for a checkout under /tmp:
# /var/tmp/kandev-venv-<hash of repo path> (the sdbox test container hides the host's /tmp,
# and the venv must be visible inside it), with <repo>/.venv made a symbolic link to it, so the
# README's `export PATH="$PWD/.venv/bin:$PATH"` works from any clone.
set -euo pipefail
exec 3>&1 1>&2   # keep stdout for the venv path alone

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
log() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: ERROR: %s\n' "$*"; exit 1; }

# ---- 1. system packages --------------------------------------------------------------------
APT_PKGS=(python3 python3-venv python3-dev gcc pkg-config libsystemd-dev systemd-container
          util-linux iproute2)
# `man kandev` after set-up (the pages go into the venv: step 4)
APT_PKGS+=(man-db)
# every agent runs in a bubblewrap sandbox (daemon/agentctl/sandbox/bubblewrap.py; the package depends on it)
# under a system-call filter built with libseccomp's own Python bindings (sandbox/seccomp_filter.py)
APT_PKGS+=(bubblewrap python3-seccomp)
# the store tests also run against a throwaway PostgreSQL server (tests/support/postgres.py)
APT_PKGS+=(postgresql)
# tests/systemd/test_package*.py build the .deb (dpkg-buildpackage, lintian) and install it inside a
# sdbox, which has no network: apt there resolves the package's Depends from what is installed here.
APT_PKGS+=(build-essential dpkg-dev debhelper dh-python lintian python3-pip
           python3-msgpack python3-psutil python3-systemd python3-sdnotify python3-mako
           python3-markupsafe python3-uvloop polkitd dbus)
# the managed npm agents (claude-code, ...) are prepared with npm and run on node: any node >= 18
# will do; Debian's own packages only when none is on the PATH (a NodeSource node brings its npm)
command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1 || APT_PKGS+=(nodejs npm)
missing=()
if command -v dpkg-query >/dev/null 2>&1; then
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed || missing+=("$p")
  done
else
  log "no dpkg-query: not a Debian system, skipping apt (install the equivalent of: ${APT_PKGS[*]})"
fi
apt_retry() {   # apt may be locked briefly (unattended upgrades, another set-up): wait and retry
  local i
  for i in 1 2 3 4 5 6; do
    DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=60 "$@" && return 0
    log "apt-get $1 failed (attempt $i), retrying in 10 s"; sleep 10
  done
  return 1
}
if [ "${#missing[@]}" -gt 0 ]; then
  [ "$(id -u)" = 0 ] || die "missing apt packages (${missing[*]}); run this script as root"
  log "installing apt packages: ${missing[*]}"
  apt_retry update
  apt_retry install -y --no-install-recommends "${APT_PKGS[@]}"
else
  log "apt packages present"
fi

# ---- 1b. the user agents run as when kandev runs as root --------------------------------------
# No agent is ever host root: kandev as root (development, the tests) runs every agent as this
# unprivileged system user (daemon/host/agent_user.py); the package makes it with sysusers.d.
if ! getent passwd kandev-agent >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    log "creating the system user kandev-agent (agents run as it when kandev runs as root)"
    useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin \
      --comment "Kandev agents" kandev-agent
  else
    log "WARNING: no user kandev-agent; kandev run as root refuses to start agents until it exists"
  fi
fi

# ---- 2. python ---------------------------------------------------------------------------------
# Prefer the distribution's /usr/bin/python3: the systemd tests run the venv's console scripts as the
# unprivileged `kandev` user, which cannot reach an interpreter under /root (e.g. pyenv's).
PY=
for cand in /usr/bin/python3 "$(command -v python3 || true)"; do
  if [ -n "$cand" ] && [ -x "$cand" ] &&
     "$cand" -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    PY=$cand; break
  fi
done
[ -n "$PY" ] || die "no Python >= 3.11 with the venv module (apt-get install python3-venv); kandev needs >= 3.11"

if [ -n "${KANDEV_VENV:-}" ]; then
  VENV=$KANDEV_VENV
elif [[ "$REPO/" == /tmp/* ]]; then
  VENV=/var/tmp/kandev-venv-$(printf '%s' "$REPO" | sha256sum | cut -c1-12)
else
  VENV=$REPO/.venv
fi
[[ "$VENV" == /* ]] || VENV=$PWD/$VENV
[[ "$VENV/" == /tmp/* ]] && log "WARNING: $VENV is under /tmp, which the sdbox systemd tests cannot see"

# A checkout under /tmp: <repo>/.venv is a link to the venv in /var/tmp (the README's quick start
# puts <repo>/.venv/bin on the PATH). Made before the venv, so a set-up that fails later still
# leaves it pointing at the right place.
link_venv() {
  local link=$REPO/.venv
  if [ -L "$link" ]; then
    [ "$(readlink "$link")" = "$VENV" ] && return 0
    rm -f "$link"
  elif [ -e "$link" ]; then
    die "$link exists and is not a link to $VENV (a checkout under /tmp keeps its venv in /var/tmp, which the" \
        "sdbox tests can see); remove $link, or set KANDEV_VENV=$link to use it"
  fi
  ln -s "$VENV" "$link"
  log "$link -> $VENV"
}
if [ -z "${KANDEV_VENV:-}" ] && [ "$VENV" != "$REPO/.venv" ]; then link_venv; fi

# one set-up per venv at a time (test.sh, bench.sh and demo.sh may be started side by side)
LOCK=/var/tmp/kandev-setup-$(printf '%s' "$VENV" | sha256sum | cut -c1-12).lock
exec 9>"$LOCK"
flock -w 900 9 || die "another setup.sh has held $LOCK for 15 min"

venv_ok() {
  # made from $PY (a venv of another interpreter, e.g. one under /root, is made again)
  grep -qxF "home = $(dirname "$PY")" "$VENV/pyvenv.cfg" 2>/dev/null &&
  [ -x "$VENV/bin/python" ] &&
    "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11) or sys.prefix == sys.base_prefix)' \
      2>/dev/null
}
if ! venv_ok; then
  if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ] && [ -n "$(ls -A "$VENV" 2>/dev/null)" ]; then
    die "$VENV exists, is not empty and is not a virtualenv; remove it or set KANDEV_VENV"
  fi
  log "creating virtualenv $VENV with $PY"
  "$PY" -m venv --clear "$VENV"
fi

# ---- 3. the project, editable -----------------------------------------------------------------
# Re-install only when something the install depends on changed: pyproject.toml's [build-system],
# [project] and [tool.setuptools] tables, the repo path, the interpreter, or which top-level
# packages exist (the install records them).
stamp_input() {
  printf 'repo=%s\n' "$REPO"
  "$VENV/bin/python" -c 'import sys; print("python=" + sys.version)'
  # only the tables that shape the install: editing the ruff or pytest config must not re-install
  "$VENV/bin/python" - "$REPO/pyproject.toml" <<'PYEOF'
import json, sys, tomllib
with open(sys.argv[1], "rb") as f:
    doc = tomllib.load(f)
relevant = {k: doc.get(k) for k in ("build-system", "project")}
relevant["setuptools"] = doc.get("tool", {}).get("setuptools")
print(json.dumps(relevant, sort_keys=True))
PYEOF
  for pkg in daemon ipc; do [ -f "$REPO/$pkg/__init__.py" ] && echo "pkg=$pkg"; done
  echo "editable_mode=compat"
  return 0
}
STAMP_FILE=$VENV/.kandev-setup-stamp
STAMP=$(stamp_input | sha256sum | cut -d' ' -f1)
# the installed packages must resolve to THIS checkout, from outside it (as a systemd unit sees them)
installed_ok() {
  (cd / && "$VENV/bin/python" - "$REPO" <<'EOF'
import importlib.metadata, importlib.util, os, sys
repo = sys.argv[1]
importlib.metadata.distribution("kandev")
for name in ("daemon", "ipc"):
    if os.path.isfile(os.path.join(repo, name, "__init__.py")):
        spec = importlib.util.find_spec(name)
        if spec is None or not (spec.origin or "").startswith(repo + os.sep):
            sys.exit(f"{name} resolves to {spec and spec.origin}, not {repo}")
EOF
  ) >/dev/null 2>&1
}
if [ "$(cat "$STAMP_FILE" 2>/dev/null)" = "$STAMP" ] && installed_ok; then
  log "kandev already installed in $VENV"
else
  log "pip install -e '$REPO[test]' into $VENV"
  # compat: the checkout as one path line in a .pth file, instead of setuptools' default import
  # hook, which every python process of the venv would import at start (each CLI call, daemon and
  # agent of the suite: ~15 ms of CPU each, the hook's own imports)
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$REPO[test]" \
    --config-settings editable_mode=compat
  installed_ok || die "kandev installed, but its packages do not resolve to $REPO from outside the checkout"
  printf '%s\n' "$STAMP" > "$STAMP_FILE"
fi

# libseccomp's Python bindings are not on PyPI: the venv (of Debian's python3, see above) sees Debian's
# python3-seccomp module through a link, and nothing else of dist-packages. The package's own prefix
# has dist-packages on its path (debian/rules).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
for so in /usr/lib/python3/dist-packages/seccomp.cpython-*.so; do
  [ -e "$so" ] && ln -sfn "$so" "$SITE/"
done
"$VENV/bin/python" -c 'import seccomp' 2>/dev/null ||
  log "WARNING: the venv cannot import seccomp (python3-seccomp for $("$VENV/bin/python" -V)): agents cannot be sandboxed"

# Every daemon, CLI call and agent that the tests, the benchmarks and the demo start imports kandev's
# code: compile it once, as an installed package is (the .deb's postinst). With PYTHONDONTWRITEBYTECODE
# set (this machine's environment sets it), or after an edit, no process would write the bytecode and
# each would compile the modules it imports again (a backend start ~0.4 s of CPU, a CLI call ~10 ms,
# some thousand processes a test run); the agents, run as another user, could not write it anyway.
# Readable by all. Up-to-date modules are skipped: a second run takes a moment.
log "byte-compiling daemon ipc tests"
(cd "$REPO" && umask 022 && "$VENV/bin/python" -m compileall -q -j 0 daemon ipc tests >/dev/null) ||
  log "compileall failed; each process compiles what it imports"

# ---- 4. the man pages ------------------------------------------------------------------------
# kandev(1), kandev-backend(8) and kandev-agentctl(8) into the venv's share/man: man(1) looks in
# <dir>/../share/man for every <dir>/bin on the PATH, so `man kandev` works once .venv/bin is on the
# PATH, as the README's quick start puts it (the Debian package installs them under /usr/share/man).
for page in "$REPO"/packaging/man/*.[0-9]; do
  section=${page##*.}
  install -D -m 644 "$page" "$VENV/share/man/man$section/$(basename "$page")"
done

echo "$VENV" >&3
