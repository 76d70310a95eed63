#!/usr/bin/env bash
# The whole suite on a clean clone of HEAD (as it was when the script started), RUNS times, each beside one busy loop per core: the proof
# that no test depends on the host's speed or load. Each run is CI's own script (.ci/run: a fresh
# venv, the install, the README's test command) with the 20 slowest tests listed. Prints each run's
# result and duration; the logs stay in OUT.
#
#   benchmarks/suite_under_load.sh [RUNS=3] [OUT=/tmp/suite-under-load]
set -uo pipefail
RUNS="${1:-3}"
OUT="${2:-/tmp/suite-under-load}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$OUT"
COMMIT="$(git -C "$REPO" rev-parse HEAD)"
CORES="$(nproc)"
echo "commit $COMMIT, $CORES busy loops beside each run, logs in $OUT"

busy=()
stop_busy() { [ "${#busy[@]}" -gt 0 ] && kill "${busy[@]}" 2>/dev/null; busy=(); }
trap stop_busy EXIT
for _ in $(seq "$CORES"); do
  ( while :; do :; done ) &
  busy+=($!)
done

failed=0
for run in $(seq "$RUNS"); do
  clone="$OUT/clone-$run"
  rm -rf "$clone"
  # Every run tests the same commit, whatever is committed while the runs go on.
  git clone -q "$REPO" "$clone" && git -C "$clone" checkout -q "$COMMIT"
  started=$(date +%s)
  PYTEST_ADDOPTS="--durations=20" "$clone/.ci/run" >"$OUT/run-$run.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - started ))
  summary="$(grep -E '^=+ .*(passed|failed|error).* =+$' "$OUT/run-$run.log" | tail -1)"
  echo "run $run: exit $rc in ${seconds} s: $summary"
  [ "$rc" -eq 0 ] || failed=1
  rm -rf "$clone/.venv"  # a gigabyte each
done
exit "$failed"
