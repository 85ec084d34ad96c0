#!/usr/bin/env bash
# Set up .venv and run the whole test suite (CPU only; no GPU needed). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# pytest's exit code 5 (no tests collected) is a failure here, like any other non-zero code.
exec .venv/bin/python -m pytest -q --durations=20 "$@"
