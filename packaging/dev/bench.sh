#!/usr/bin/env bash
# Runs every tests/bench/bench_*.py script with the dev venv's python, then prints the figures of
# the performance table together (each benchmark prints its figure next to a baseline measured in
# the same run). bench_recovery.py runs twice: N=1000 (its default) and N=10000.
#
#   bash packaging/dev/bench.sh            every benchmark, then the summary
#   bash packaging/dev/bench.sh --quick    without the N=10000 recovery run (the slow one)
#
# A benchmark is a measurement, not a gate: the exit status is non-zero only when a script fails
# to run. On a shared or busy machine repeat the run and compare ratios, not absolute times.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
REPO=$(cd "$HERE/../.." && pwd -P)
quick=0
[ "${1:-}" = "--quick" ] && quick=1
VENV=$(bash "$HERE/setup.sh" | tail -n 1)
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"   # so benchmarks can import tests.support
shopt -s nullglob
scripts=(tests/bench/bench_*.py)
[ "${#scripts[@]}" -gt 0 ] || { echo "bench.sh: no tests/bench/bench_*.py scripts yet"; exit 0; }
runs=()
for s in "${scripts[@]}"; do
  runs+=("$s")
  if [ "$s" = tests/bench/bench_recovery.py ] && [ "$quick" = 0 ]; then runs+=("$s 10000"); fi
done
out=$(mktemp)
trap 'rm -f "$out"' EXIT
failed=()
start=$SECONDS
for r in "${runs[@]}"; do
  read -r -a argv <<<"$r"
  echo "== $r"
  t0=$SECONDS
  if ! "$VENV/bin/python" "${argv[@]}" 2>&1 | tee -a "$out"; then failed+=("$r"); fi
  echo "   ($((SECONDS - t0)) s)"
done
echo
echo "== the performance table (each figure against its baseline of the same run)"
grep -E 'store bytes per chunk:|session show last page seconds:|baseline, one enumeration|recovery, first contact|ratio cli / interpreter start:|ratio library floor / interpreter start:|down seconds:|^re-tracking N=|ratio recovery / enumeration:|restart seconds with|restart seconds to every|open files once streaming|backend RSS after re-tracking:|control-server memory per idle instance:|^-- |ratio [0-9]|^flood N=|ratio end-to-end / baseline:|ratio proxy / direct throughput:|proxy connect overhead ms:|ratio cluster board / local board:|remote prompt overhead ms:|baseline spread between rounds:|NOT MEASURED|largest N that fits|PASS|FAIL' "$out" || true
echo "bench.sh: ${#runs[@]} run(s) in $((SECONDS - start)) s"
if [ "${#failed[@]}" -gt 0 ]; then echo "bench.sh: FAILED: ${failed[*]}"; exit 1; fi
