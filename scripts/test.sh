#!/usr/bin/env bash
# Set up .venv and run the whole test suite (CPU only; no GPU needed). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# pytest's exit code 5 (no tests collected) is a failure here, like any other non-zero code.
# Two pytest workers: many tests wait (rendezvous, time-outs, torchrun start-up), so two at once finish the suite in
# about two thirds of the time on two cores; `-p no:xdist` (or `-n 0`) runs them one by one.
exec .venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=20 "$@"
