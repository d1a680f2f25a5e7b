#!/usr/bin/env bash
# Runs every tests/bench/bench_*.py script (benchmarks print ratios against a baseline measured
# in the same run) with the dev venv's python. Extra arguments are passed to every script.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
REPO=$(cd "$HERE/../.." && pwd -P)
VENV=$(bash "$HERE/setup.sh" | tail -n 1)
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"   # so benchmarks can import tests.support
shopt -s nullglob
scripts=(tests/bench/bench_*.py)
[ "${#scripts[@]}" -gt 0 ] || { echo "bench.sh: no tests/bench/bench_*.py scripts yet"; exit 0; }
failed=()
for s in "${scripts[@]}"; do
  echo "== $s"
  "$VENV/bin/python" "$s" "$@" || failed+=("$s")
done
if [ "${#failed[@]}" -gt 0 ]; then echo "bench.sh: FAILED: ${failed[*]}"; exit 1; fi
echo "bench.sh: ${#scripts[@]} benchmark(s) ran"
