#!/usr/bin/env bash
# Set up .venv and run the main job on the embedded default: profile -> plan -> train -> report on the tiny model,
# on CPU, K = 2 stages, B = 1 (`terapipe run`; extra arguments go to it, e.g. --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/terapipe run "$@"
