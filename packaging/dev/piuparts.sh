#!/usr/bin/env bash
# piuparts' tests of kandev's package, among them its upgrade test from an earlier release
# (Issue 45 item 6): in a fresh Debian 12 chroot, install the earlier release's .deb with its
# dependencies from the Debian mirror, upgrade it in place to the .deb of this checkout, purge it,
# and compare the chroot with its state before (nothing left behind, nothing of another package
# touched). piuparts first runs its install-and-purge test of this checkout's .deb alone.
#
#   sudo bash packaging/dev/piuparts.sh                 from the previous release (packaging/releases.txt)
#   sudo bash packaging/dev/piuparts.sh --from 0.2.0    from a recorded release of your choice
#
# Both packages are built by the test helpers (tests/support/debs.py, tests/support/releases.py)
# and cached in /var/tmp/kandev-deb-cache, as the package tests build them. The earlier .deb is
# offered to the chroot's apt as a local repository (piuparts' upgrade test installs the "old"
# version through apt-get, then the given .deb over it).
#
# systemd and polkitd are kept in the base chroot (--fake-essential-packages): kandev runs only on a
# systemd host with polkit, and their own maintainer scripts change what piuparts would otherwise
# blame on kandev's purge: systemd's postinst (systemd-tmpfiles --create of its tmpfiles.d) makes
# directories no package owns (/root/.ssh, /var/lib/private, /var/lib/systemd/coredump...), and
# polkitd's gives /usr/share/polkit-1/rules.d (shared with systemd and kandev) to polkitd, mode
# 0700, and leaves it so when polkitd is purged.
#
# Needs root, piuparts, debootstrap, dpkg-dev and the Debian mirror (KANDEV_PIUPARTS_MIRROR,
# default http://deb.debian.org/debian). It takes minutes (two chroots' worth of dependencies:
# nodejs and npm's ~300 packages) and runs in no CI job. The log is kept in the printed directory.
# Exit status: piuparts' own (0: every test passed), or 1 when piuparts skipped the upgrade test.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
REPO=$(cd "$HERE/../.." && pwd -P)
from=""
while [ $# -gt 0 ]; do
  case "$1" in
    --from) from=${2:?--from needs a version, e.g. --from 0.2.0}; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "piuparts.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "piuparts.sh: piuparts needs root (it builds a chroot)" >&2; exit 2; }
for tool in piuparts debootstrap dpkg-scanpackages; do
  command -v "$tool" >/dev/null || {
    echo "piuparts.sh: $tool not found: apt-get install piuparts debootstrap dpkg-dev" >&2; exit 2; }
done
mirror=${KANDEV_PIUPARTS_MIRROR:-http://deb.debian.org/debian}
VENV=$(bash "$HERE/setup.sh" | tail -n 1)

echo "== building the packages (cached in /var/tmp/kandev-deb-cache)"
t0=$SECONDS
cd "$REPO"
debs=$(PYTHONPATH="$REPO" "$VENV/bin/python" - "$from" <<'EOF'
"""Print the earlier release's .deb and this checkout's .deb, one path a line."""
import sys

from _pytest.outcomes import OutcomeException

from tests.support.debs import build_packages, build_release_package
from tests.support.releases import previous_release, recorded_release

try:
    release = recorded_release(sys.argv[1]) if sys.argv[1] else previous_release()
    print(build_release_package(release))
    print(build_packages()["deb"])
except OutcomeException as e:  # the helpers report through pytest.fail / pytest.skip
    sys.exit(f"piuparts.sh: {e.msg}")
EOF
)
old_deb=$(sed -n 1p <<<"$debs")
new_deb=$(sed -n 2p <<<"$debs")
echo "   $old_deb"
echo "   $new_deb"
echo "   ($((SECONDS - t0)) s)"
work=$(mktemp -d /var/tmp/kandev-piuparts.XXXXXX)
mkdir -p "$work/repo" "$work/tmp"
cp "$old_deb" "$work/repo/"
(cd "$work/repo" && dpkg-scanpackages --multiversion . > Packages 2>/dev/null)

echo "== piuparts (log: $work/piuparts.log)"
t0=$SECONDS
rc=0
piuparts -d bookworm -m "$mirror" -t "$work/tmp" \
  --fake-essential-packages=systemd,polkitd \
  --bindmount "$work/repo" --extra-repo "deb [trusted=yes] file://$work/repo ./" \
  -l "$work/piuparts.log" "$new_deb" >/dev/null 2>&1 || rc=$?
grep -E '^[0-9]+m[0-9.]+s (INFO|ERROR): (PASS|FAIL|SKIP|Can.t test)' "$work/piuparts.log" || true
[ "$rc" = 0 ] || grep -E -A12 '^[0-9]+m[0-9.]+s ERROR' "$work/piuparts.log" | head -60 || true
if [ "$rc" = 0 ] && ! grep -q 'PASS: Installation, upgrade and purging tests' "$work/piuparts.log"; then
  echo "piuparts.sh: piuparts ran no upgrade test (did the chroot's apt see $(basename "$old_deb")?)" >&2
  rc=1
fi
echo "   ($((SECONDS - t0)) s, piuparts exit status $rc)"
exit "$rc"
