#!/usr/bin/env bash
# Set up .venv and run the main job on the embedded default: the tiny model on CPU, K = 2 stages, B = 1.
# Until `terapipe profile`, `train` and `report` land, the main job plans on the shipped example profile.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/terapipe plan --profile configs/profiles/example-tiny-cpu.json --stages 2 --batch 1 \
  --out runs/demo/plan.json "$@"
