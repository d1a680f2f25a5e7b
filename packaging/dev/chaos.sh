#!/usr/bin/env bash
# Chaos under systemd, as long as you like (Issue 45 item 1): the test of Issue 45 scenario A
# (tests/systemd/test_chaos_systemd.py) with N faults instead of CI's 50. It boots a throw-away
# systemd (tests/systemd/sdbox.sh, root and the hybrid cgroup layout needed), installs the units,
# streams 4 to 8 mock-agent sessions through a random schedule of faults and checks the invariants
# after each; at the end it prints the seed, how many of each fault ran, and every invariant
# violation with the seed and the fault it followed.
#
#   bash packaging/dev/chaos.sh 1000                    1000 faults, a fresh seed
#   KANDEV_CHAOS_SEED=1234 bash packaging/dev/chaos.sh 50   replays the schedule of seed 1234
#
# Exit status: 0 when every invariant held, else pytest's.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
REPO=$(cd "$HERE/../.." && pwd -P)
N=${1:-50}
case "$N" in ''|*[!0-9]*|0) echo "chaos.sh: N must be a whole number of faults from 1, got '$N'" >&2; exit 2;; esac
VENV=$(bash "$HERE/setup.sh" | tail -n 1)
cd "$REPO"
export KANDEV_CHAOS_FAULTS=$N
export KANDEV_SDBOX_MAX_S=$((600 + 20 * N))  # the box outlives the run (the test's own bound is 240 + 20 N s)
exec "$VENV/bin/python" -m pytest -q -s -p no:cacheprovider tests/systemd/test_chaos_systemd.py
