#!/usr/bin/env bash
# Set up .venv with terapipe and its dependencies (idempotent; fast when nothing changed).
#
# torch: on a machine without an NVIDIA GPU the CPU build is installed FIRST and explicitly (torch==2.13.0, which
# this kind of machine serves as a local CPU wheel), so that the package's `torch>=2.11` is already satisfied and
# pip never pulls the multi-GB CUDA wheels. Elsewhere, point pip at a CPU wheel index with TERAPIPE_TORCH_INDEX.
# With a GPU, pip's default torch (CUDA) is used.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_CPU=${TERAPIPE_TORCH_CPU:-torch==2.13.0}
log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
# pip warns about every configured index folder that lacks a package; keep its other messages, and its exit code.
# pip compiles what it installs one file after another; installing without that and compiling the whole environment
# afterwards on every core (`compile_all`) made a fresh set-up faster. The compiled files matter: where
# PYTHONDONTWRITEBYTECODE is set (CI machines), every process would compile torch again on each import.
pip_install() { "${PIP[@]}" install --no-compile "$@" 2> >(grep -v "^WARNING: Location" >&2); }
compile_all() { .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true; }

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    log "NVIDIA GPU found: installing torch with CUDA"
    pip_install "torch>=2.11"
  else
    log "no NVIDIA GPU: installing the CPU build of torch ($TORCH_CPU)"
    if [ -n "${TERAPIPE_TORCH_INDEX:-}" ]; then
      pip_install "$TORCH_CPU" --index-url "$TERAPIPE_TORCH_INDEX"
    else
      pip_install "$TORCH_CPU"
    fi
  fi
fi

stamp=.venv/.terapipe-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log "installing terapipe (editable) with its dependencies"
  pip_install -e '.[test]'
  compile_all
  .venv/bin/python -c "import terapipe_cli, typer, rich, numpy, scipy, matplotlib, torch" \
    || { log "installation failed"; exit 1; }
  echo "$want" > "$stamp"
fi
# A real Slurm for tests/train/test_slurm.py, which skips without it: Debian's packages, installed where this runs as
# root with apt-get (CI), quietly left out elsewhere; nothing is done where the programs are already there. The
# tests start their own daemons on a private socket and ports: an installed Slurm is never configured or started.
SLURM_PACKAGES=(slurmctld slurmd slurm-client munge)
has_slurm() {
  local program
  for program in slurmctld slurmd sbatch munged; do PATH="$PATH:/usr/sbin:/sbin" command -v "$program" || return 1; done
}
if ! has_slurm >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  log "installing Slurm and munge for the Slurm tests: ${SLURM_PACKAGES[*]}"
  apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${SLURM_PACKAGES[@]}"; }
  if ! apt_install >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 && apt_install >/dev/null 2>&1 || log "could not install them: the Slurm tests will skip"
  fi
fi

# The package's own modules compiled too (an editable install leaves them as sources): where PYTHONDONTWRITEBYTECODE
# is set, every process — each torchrun worker, each command — would compile them again on import (about a second of
# CPU each on a slow core). Python still reads these files there, and compiles any source edited since in memory.
.venv/bin/python -m compileall -q -j 0 src >/dev/null || true

.venv/bin/python - <<'PY' >&2
import torch
gpu = torch.cuda.is_available()
print(f"[setup] torch {torch.__version__} ({'CUDA ' + torch.version.cuda if gpu else 'CPU'}) ready in .venv")
PY
