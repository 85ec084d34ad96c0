#!/usr/bin/env bash
# Set up .venv and run the main job on the embedded default: profile -> plan -> train -> report on the tiny model,
# K = 2 stages, B = 1 (`terapipe run`; extra arguments go to it, e.g. --quick). It runs on the CPU even on a
# machine with a GPU, as `terapipe run` does; `--device cuda` runs it on the GPU (stages share it if need be).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/terapipe run "$@"
