#!/usr/bin/env bash
# Run the whole test suite several times in a row while other processes keep every core busy, as on a shared CI
# machine: no test may depend on timing or on an idle machine. Prints each run's wall time and pytest's result line;
# exits non-zero at the first run that fails.
#
#   bash scripts/test_under_load.sh            # 3 runs, one busy process per core
#   RUNS=1 bash scripts/test_under_load.sh -x  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
bash scripts/setup.sh

busy=()
stop_load() { [ ${#busy[@]} -eq 0 ] || kill "${busy[@]}" 2>/dev/null || true; }
trap stop_load EXIT
for _ in $(seq "$(nproc)"); do
  python3 -c "while True: pass" &
  busy+=($!)
done
echo "[load] ${#busy[@]} busy processes (one per core)" >&2

for run in $(seq "$RUNS"); do
  start=$(date +%s)
  log=$(mktemp)
  if bash scripts/test.sh "$@" >"$log" 2>&1; then status=passed; else status=FAILED; fi
  echo "[load] run $run/$RUNS: $status in $(( $(date +%s) - start )) s — $(grep -E '(passed|failed|error)' "$log" | tail -1)"
  if [ "$status" = FAILED ]; then
    tail -40 "$log"
    exit 1
  fi
  rm -f "$log"
done
