#!/usr/bin/env bash
# The whole test suite: set-up, lint (ruff), type check (mypy), then pytest over tests/unit,
# tests/integration and tests/systemd (the systemd tests boot throw-away systemd containers with
# tests/systemd/sdbox.sh).
# usage: bash packaging/dev/test.sh [PYTEST ARGS...]     e.g.  -k ownership   or   -x
# Exit 0 only if ruff and mypy are clean and pytest passed (or collected no tests at all, exit code 5).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
REPO=$(cd "$HERE/../.." && pwd -P)
VENV=$(bash "$HERE/setup.sh" | tail -n 1)
[ -x "$VENV/bin/python" ] || { echo "test.sh: setup.sh did not report a usable venv ($VENV)" >&2; exit 1; }
cd "$REPO"

lint_dirs=()
for d in daemon ipc tests; do [ -d "$d" ] && lint_dirs+=("$d"); done
echo "== ruff check ${lint_dirs[*]}"
if "$VENV/bin/ruff" check "${lint_dirs[@]}"; then ruff_rc=0; ruff_msg="ruff: clean"
else ruff_rc=$?; ruff_msg="ruff: FAILED (exit $ruff_rc)"; fi

# the packages and options are in pyproject.toml ([tool.mypy]); a few seconds with a warm cache
echo "== mypy"
mypy_log=$(mktemp /var/tmp/kandev-mypy.XXXXXX)
mypy_rc=0
"$VENV/bin/mypy" >"$mypy_log" 2>&1 || mypy_rc=$?
cat "$mypy_log"
# mypy's last line is its summary, e.g. "Found 3 errors in 2 files (checked 114 source files)"
mypy_summary=$(grep -v '^[[:space:]]*$' "$mypy_log" | tail -n 1)
rm -f "$mypy_log"
if [ "$mypy_rc" = 0 ]; then mypy_msg="mypy: clean"
else mypy_msg="mypy: FAILED (exit $mypy_rc): ${mypy_summary:-see output above}"; fi

echo "== pytest"
log=$(mktemp /var/tmp/kandev-pytest.XXXXXX)
trap 'rm -f "$log"' EXIT
set +e
# Most tests wait on real daemons and agents; five workers keep both cores busy (measured ~90% busy with
# vmstat over a whole run): one test file per worker (--dist loadfile keeps each
# module's systemd box and fixtures on one worker), the longest modules first
# (tests/support/schedule.py; --no-loadscope-reorder keeps that order instead of starting the
# modules with the most tests first, which left the few longest to run on alone at the end).
# KANDEV_TEST_WORKERS=0 runs serially.
workers=${KANDEV_TEST_WORKERS:-5}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -ra "${parallel[@]}" "$@" 2>&1 | tee "$log"
pytest_rc=${PIPESTATUS[0]}
set -e
# pytest's last line is its summary, e.g. "12 passed, 1 skipped in 3.21s"
summary=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
case $pytest_rc in
  0) pytest_msg="pytest: ${summary:-ok}" ;;
  5) pytest_msg="pytest: no tests were collected (exit 5) - treated as success"; pytest_rc=0 ;;
  *) pytest_msg="pytest: FAILED (exit $pytest_rc): ${summary:-see output above}" ;;
esac

echo "== summary: $ruff_msg; $mypy_msg; $pytest_msg"
[ "$ruff_rc" = 0 ] && [ "$mypy_rc" = 0 ] && [ "$pytest_rc" = 0 ]
