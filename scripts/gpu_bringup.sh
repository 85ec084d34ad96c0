#!/usr/bin/env bash
# The first run of this version on a GPU, in one command of at most ~5 minutes (an H100):
#
#     bash scripts/gpu_bringup.sh OUTDIR
#
# Runs the steps below in order, each under its own `timeout` and all under one budget (GPU_BRINGUP_BUDGET_S,
# default 285 s: a step gets the smaller of its own limit and what is left, and is skipped when under 20 s are
# left), going on after a step that fails. Writes into OUTDIR (flat, 8 files, so that it fits what a lent
# GPU machine sends back: 8 files, names of letters, digits, '.', '_', '-'):
#   summary.md                     one row per step: status, seconds, the step's result in one line
#   steps.log                      every step's commands and output, one after the other, under a header
#   profile-MODEL-bf16.json        the bf16 profile of GPT3-1B (step 4), for `terapipe plan` and docs/results.md
#   bench-MODEL.md, bench-CUT.md   scripts/bench_gpu.py's tables (steps 5, 8, 9)
#   memory-report.md               `terapipe report` of step 7's run (the memory table among the rest)
#   memory-trace.md                step 8's table: the traced memory estimate against max_memory_allocated
#   operators-bf16.json            step 11's operator table of the GPU (`terapipe profile --operators`)
# summary.md and steps.log are written after every step, so a run stopped from outside still leaves what was done.
#
# Without CUDA (torch.cuda.is_available() False) the same steps run the same commands with --device cpu on the
# tiny models at L = 32-64, the ones cut here narrowed to H = 128 (a dry run: tests/cli/test_gpu_bringup.py runs it,
# about 80 s on two cores, most of it the processes that start PyTorch, ~4-6 s of CPU each), and the table says
# "no CUDA". Steps whose commands another step runs with other numbers (verify-k2-shared, verify-k2-v2, t2-shared,
# bench-llama-long), or the test suite runs (memory, operators), are skipped in the dry run. Python: $PYTHON, else .venv/bin/python when there is one, else python3; the package from
# src/ through PYTHONPATH, so nothing needs installing (the GPU machines have no .venv and perhaps no pytest).
#
# The order is by what a result is worth per second of the budget, most first:
#   1-3  --verify in bf16 on CUDA: K = 1; K = 2 sharing the GPU (gloo through host memory); K = 2 with v = 2.
#        Nothing of this version's GPU path has run on a GPU (docs/status.md); if these fail, every number after
#        them is suspect. Tiny model (L = 128), planned from the example profile, so seconds each.
#   4    `terapipe profile` of GPT3-1B in bf16, quick, no torchrun: the held-out context-fit error (target < 3%
#        mean), and the profile steps 5 and 7 plan from (measured once, used twice).
#   5    bench_gpu.py on GPT3-1B, K = 1, B = 8, L = 2048, bf16: whole sequence vs token slices vs the plan, MFU
#        (target >= 40% for the whole sequence), peak memory, the per-tile floor b = 1, i = 8.
#   6    T = 2 on one GPU: the tensor-parallel collectives staged through host memory on gloo. The runtime allows
#        it (placement.backend_for: more workers than GPUs -> gloo; comm.DistGroup stages every collective of a
#        CUDA tensor on gloo); should the command refuse it (one line, before the run folder is written), the step is
#        skipped with that line.
#        fp32: --verify of T = 2 in bf16 fails on the CPU too (a K = 1 whole-sequence plan has a spread of 0,
#        and the tensor ranks' partial sums in bf16 differ from one process's), a tolerance matter, not the GPU's.
#   7    the memory estimate against measured peaks: GPT3-1B, K = 2 sharing the GPU, B = 4, planned from step 4's
#        profile, trained 3 steps, then `terapipe report` (estimated kept-for-backward and total per stage next to
#        the saved-tensor count and CUDA max allocated). Skipped without step 4's profile.
#   8    the memory estimate traced from the runtime (scripts/bench_memory.py --part device): six shapes, one of them
#        Llama 3 8B's widths at L = 32K with the 128K vocabulary, whole sequence and sliced, each one step on the GPU
#        against the estimate of a profile traced on fake tensors with the caching allocator modelled (target: within
#        5%, never 2% under), and whether a case estimated to fit the usable memory ran without running out of it
#        (two tiny cases without CUDA).
#   9-10 bench_gpu.py on a 2-layer cut of llama3-8b (same widths, heads, K/V heads, vocabulary) written here:
#        L = 2048 (B = 8) and L = 8192 (B = 2), bf16. Planned from the analytic profile of the calibrated H100
#        bf16 hardware file (a second of CPU) instead of a measured one (a minute of GPU each).
#   11   the operator table (`terapipe profile --operators`, the GPU grid) and, for four model shapes off its grid
#        (GPT3-1B's widths at L = 2048 and narrowed to H = 1536 at L = 4096, Llama 3 8B's at L = 8192 and narrowed
#        to H = 3072 at L = 32768, 2 layers each), a profile priced from it (`--analytic --operator-table`) checked
#        against tiles timed on the GPU (`--check-profile`). Past the default budget: run it alone
#        (GPU_BRINGUP_STEPS=operators). Without CUDA its commands run in the test suite on a small grid.
#   12   the tests marked `gpu` (tests/train/test_placement.py: K = 2 sharing the GPU with --verify in fp32, bf16
#        and D = 2, the demo twice). Last: they repeat 1-3's check in other precisions and the demos take
#        minutes, so they get what is left of the budget; "skipped: pytest not installed" where it is missing.
# shellcheck disable=SC2329 # the steps' functions run by name in child shells (run_step), not called here
set -uo pipefail # not -e: a failed step is recorded and the next one runs

if [[ $# -ne 1 ]]; then
    echo "usage: bash scripts/gpu_bringup.sh OUTDIR" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
if [[ -n "${PYTHON:-}" ]]; then
    PY=$PYTHON
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY=$ROOT/.venv/bin/python
else
    PY=python3
fi
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_bringup.XXXXXX") || exit 2
BIG_SCRATCH=$SCRATCH
trap 'rm -rf "$SCRATCH" "$BIG_SCRATCH"' EXIT

BUDGET_S=${GPU_BRINGUP_BUDGET_S:-285}
# Each step's own limit times this (a loaded machine's dry run: tests/cli/test_gpu_bringup.py sets 10, so a busy CI
# machine slows the steps without timing them out; the budget above still bounds the whole).
STEP_SCALE=${GPU_BRINGUP_STEP_SCALE:-1}
MIN_STEP_S=20
STARTED=$(date +%s)
DEADLINE=$((STARTED + BUDGET_S))
ROWS=$SCRATCH/rows.tsv
LOG=$OUT/steps.log
: >"$ROWS"
: >"$LOG"

# Stable, wide, colourless output from rich in the logs; the package from this checkout; every temporary file
# of the commands (torchrun's, bench_gpu.py's) in the scratch folder, which goes at the end.
export PY ROOT OUT SCRATCH BIG_SCRATCH TMPDIR=$SCRATCH
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" COLUMNS=160 NO_COLOR=1 TERM=dumb

# Without an NVIDIA driver (no working nvidia-smi, as on a CI machine) there is no CUDA to ask torch about: its version
# comes from the installed package's metadata, without the seconds of CPU that importing torch takes.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    probe=$("$PY" - <<'EOF' 2>&1
import torch
if torch.cuda.is_available():
    print(f"1\t{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
else:
    print(f"0\tno CUDA: a dry run on the CPU with the tiny models, torch {torch.__version__}")
EOF
    )
else
    probe=$("$PY" - <<'EOF' 2>&1
from importlib.metadata import version
print(f"0\tno CUDA (no NVIDIA driver): a dry run on the CPU with the tiny models, torch {version('torch')}")
EOF
    )
fi
if [[ $probe == 1$'\t'* ]]; then
    CUDA=1
else
    CUDA=0
fi
export CUDA # the steps run in child shells
DEVICE_NOTE=${probe#*$'\t'}
[[ $probe == [01]$'\t'* ]] || DEVICE_NOTE="no CUDA: torch did not load ($(tail -n 1 <<<"$probe"))"

# ------------------------------------------------------------------------------------------ sizes per device
set -a # every setting below is read by the steps, which run in child shells (under `timeout`)
TINY_PROFILE=configs/profiles/example-tiny-cpu.json # fp32, made up: plans the tiny model anywhere
HARDWARE=h100-bf16-calibrated
if ((CUDA)); then
    DEVICE=cuda DEVICE_COLUMN=cuda
    VERIFY_L=128 VERIFY_STEPS=2
    GPT_SOURCE=configs/models/gpt3-1b.toml GPT_BATCH=8 PROFILE_BATCHES=1,8
    MEM_BATCH=4 MEM_STEPS=3
    LLAMA_SOURCE=configs/models/llama3-8b.toml LLAMA_SHORT=2048:8 LLAMA_LONG=8192:2
    CUT_HIDDEN= # the models' own widths
    # The operator table's check: SOURCE:L:H (H 0: the model's own width), 2 layers each.
    OPS_MODELS="configs/models/gpt3-1b.toml:2048:0 configs/models/gpt3-1b.toml:4096:1536 configs/models/llama3-8b.toml:8192:0 configs/models/llama3-8b.toml:32768:3072"
    BENCH_ARGS="--rounds 3 --warmup 1 --floor-repeats 20"
else
    DEVICE=cpu DEVICE_COLUMN="cpu (no CUDA)"
    # The smallest settings that take the GPU run's code paths. L = 32: the K = 2 plan still slices tokens
    # ([(1, [16, 16])] * 2). The models the script cuts (steps 4, 5, 7, 9, 10) are narrowed to H = 128: bf16 on a CPU
    # without bf16 instructions takes about ten times fp32's time, and their layer at H = 128 a quarter of H = 256's;
    # at H = 64 a tile's fixed costs outweigh its products, and the memory step's plan stops slicing tokens. The
    # profile keeps L = 64: enough distinct context tiles for the quick fit (24 of 34 at batch sizes 1 and 2).
    VERIFY_L=32 VERIFY_STEPS=2
    GPT_SOURCE=configs/models/tiny.toml GPT_BATCH=2 PROFILE_BATCHES=1,2
    MEM_BATCH=2 MEM_STEPS=3
    LLAMA_SOURCE=configs/models/llama-tiny.toml LLAMA_SHORT=64:2 LLAMA_LONG=128:2
    CUT_HIDDEN=128
    BENCH_ARGS="--rounds 1 --warmup 0 --floor-repeats 3"
    # One thread per process, as the runtime gives each CPU worker: on a shared two-core machine two threads per
    # process spin against each other's (tests/conftest.py measured an in-process step 100x slower).
    export OMP_NUM_THREADS=1
fi
set +a

# Step 7's run checkpoints GPT3-1B after its last step (the runtime always does: ~16 GB of weights and AdamW
# state); into memory when /dev/shm has room for it, as a disk can take tens of seconds to write that.
shm_free_kib=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
if ((CUDA)) && ((${shm_free_kib:-0} > 40 * 1024 * 1024)); then
    BIG_SCRATCH=$(mktemp -d /dev/shm/gpu_bringup.XXXXXX) || BIG_SCRATCH=$SCRATCH
fi
export BIG_SCRATCH

# The GPT model of steps 4, 5, 7: GPT3-1B as it is on CUDA; on the CPU the tiny model cut to L = 64, H = 128.
if ((CUDA)); then
    GPT_MODEL=$GPT_SOURCE
else
    GPT_MODEL=$SCRATCH/tiny-cut.toml
    "$PY" scripts/gpu_bringup.py cut "$GPT_SOURCE" "$GPT_MODEL" --seq-len 64 --hidden "$CUT_HIDDEN" >>"$LOG" 2>&1
fi
GPT_NAME=$(sed -n 's/^name = "\(.*\)"/\1/p' "$GPT_MODEL" | head -n 1)
PROFILE=$OUT/profile-${GPT_NAME:-gpt}-bf16.json
export GPT_MODEL GPT_NAME PROFILE

# ------------------------------------------------------------------------------------------ helpers for steps
tp() { # terapipe, the command shown first in the log
    echo "\$ terapipe $*"
    "$PY" -m terapipe_cli "$@"
}
py() {
    echo "\$ python $*"
    "$PY" "$@"
}
skip() { # end the step as skipped, with the reason
    echo "$*" >"$SCRATCH/skip"
    echo "skipped: $*"
    exit 77
}
line() { # the helper's one line of result for the summary
    "$PY" scripts/gpu_bringup.py "$@"
}

# ------------------------------------------------------------------------------------------ the steps
# step_NAME runs the step's commands (its exit status is the step's); result_NAME, when there is one, prints the
# step's result in one line from the files it wrote, also after a failure or a timeout.

verify_tiny() { # K v: train the tiny model on K stages (v chunks each) with --verify, in bf16
    local run=$SCRATCH/verify-k$1-v$2
    tp plan --profile "$TINY_PROFILE" --stages "$1" --virtual-stages "$2" --batch 2 --seq-len "$VERIFY_L" \
        --out "$run.plan.json" || return
    # The plan is priced in the example profile's fp32; --accept-precision trains it in bf16 all the same.
    tp train --plan "$run.plan.json" --steps "$VERIFY_STEPS" --verify --device "$DEVICE" --precision bf16 \
        --accept-precision --grace-s 5 --timeout-s 60 --out "$run"
}
step_verify_k1() { verify_tiny 1 1; }
result_verify_k1() { line verify "$SCRATCH/verify-k1-v1"; }
step_verify_k2_shared() {
    # Without CUDA: the command of verify-k1 at K = 2, and K = 2 verifies through torchrun in the test suite.
    ((CUDA)) || skip "no CUDA: verify-k1's command at K = 2; K = 2 is verified on the CPU by the test suite (tests/train)"
    verify_tiny 2 1
}
result_verify_k2_shared() { line verify "$SCRATCH/verify-k2-v1"; }
step_verify_k2_v2() {
    # Without CUDA the dry run verifies K = 2 once (verify-k2-shared); interleaving's verify runs in the test suite.
    ((CUDA)) || skip "no CUDA: v = 2 is verified on the CPU by the test suite (tests/engine)"
    verify_tiny 2 2
}
result_verify_k2_v2() { line verify "$SCRATCH/verify-k2-v2"; }

step_profile() {
    # --no-comm --no-allreduce: one process, no torchrun (K = 1 in step 5 sends nothing; step 7's two stages
    # share a GPU, so a measured NVLink or PCIe link would not be theirs anyway).
    tp profile --model "$GPT_MODEL" --quick --device "$DEVICE" --precision bf16 --batch-sizes "$PROFILE_BATCHES" \
        --no-comm --no-allreduce --out "$PROFILE"
}
result_profile() { line profile "$PROFILE"; }

step_bench_gpt() {
    local given=()
    [[ -f $PROFILE ]] && given=(--profile "$PROFILE") # else bench_gpu.py measures its own, as it does alone
    # shellcheck disable=SC2086 # BENCH_ARGS is a list of words
    py scripts/bench_gpu.py --device "$DEVICE" --model "$GPT_MODEL" --precision bf16 --batch "$GPT_BATCH" \
        $BENCH_ARGS ${given[@]+"${given[@]}"} --markdown | tee "$SCRATCH/bench-gpt.md"
    local rc=${PIPESTATUS[0]}
    cp "$SCRATCH/bench-gpt.md" "$OUT/bench-$GPT_NAME.md"
    return "$rc"
}
result_bench_gpt() { line bench "$SCRATCH/bench-gpt.md" --target-mfu 40; }

step_reference() {
    # The plain PyTorch GPT of the same shape, eager and compiled per block (the dry run: eager, fp32, seconds; the
    # CPU's compile takes minutes). Appended to step 5's file: the files sent back are few.
    local modes=eager,compiled precision=bf16
    ((CUDA)) || modes=eager precision=fp32
    # shellcheck disable=SC2086 # BENCH_ARGS is a list of words
    py scripts/bench_reference.py --device "$DEVICE" --model "$GPT_MODEL" --batch "$GPT_BATCH" --modes "$modes" \
        --precision "$precision" $(((CUDA)) && echo --rounds 5 --warmup 2) --markdown | tee "$SCRATCH/reference.md"
    local rc=${PIPESTATUS[0]}
    cat "$SCRATCH/reference.md" >>"$OUT/bench-$GPT_NAME.md"
    return "$rc"
}
result_reference() { line reference "$SCRATCH/reference.md"; }

step_t2_shared() {
    # Without CUDA: verify-k1's command with --tensor-parallel 2, which verifies through torchrun in the test suite.
    ((CUDA)) || skip "no CUDA: verify-k1's command at T = 2; T = 2 is verified on the CPU by the test suite (tests/train)"
    local run=$SCRATCH/t2 rc
    tp plan --profile "$TINY_PROFILE" --stages 1 --batch 2 --seq-len "$VERIFY_L" --out "$run.plan.json" || return
    tp train --plan "$run.plan.json" --tensor-parallel 2 --steps "$VERIFY_STEPS" --verify --device "$DEVICE" \
        --precision fp32 --grace-s 5 --timeout-s 60 --out "$run" 2>"$SCRATCH/t2.err"
    rc=$?
    cat "$SCRATCH/t2.err" >&2
    # The command checks every setting before it writes the run folder: a "terapipe: error:" line with no
    # config.json written is the runtime refusing T = 2 here (not a failure of the run), so the step is skipped.
    if ((rc == 2)) && [[ ! -f $run/config.json ]] && grep -q '^terapipe: error:' "$SCRATCH/t2.err"; then
        skip "the runtime refuses T = 2 here: $(grep -m 1 '^terapipe: error:' "$SCRATCH/t2.err" | cut -c 18-)"
    fi
    return "$rc"
}
result_t2_shared() { line verify "$SCRATCH/t2"; }

step_memory() {
    # Without CUDA: plan --memory-limit, train and report --no-baseline run in the test suite (tests/train, on a
    # resumed run's report), and this step's line reads a report's memory table as tests/report checks.
    ((CUDA)) || skip "no CUDA: its commands run in the test suite (tests/train), its line on a report in tests/report"
    [[ -f $PROFILE ]] || skip "needs the profile step 'profile' writes, and there is none"
    local run=$BIG_SCRATCH/memory rc
    # Two stages share one GPU, while the planner's limit is per device: 35 GiB each keeps both within 80 GB.
    tp plan --profile "$PROFILE" --stages 2 --virtual-stages 1 --batch "$MEM_BATCH" --memory-limit 35 \
        --out "$SCRATCH/memory.plan.json" || return
    tp train --plan "$SCRATCH/memory.plan.json" --steps "$MEM_STEPS" --device "$DEVICE" --precision bf16 \
        --grace-s 5 --timeout-s 60 --out "$run"
    rc=$?
    rm -rf "$run/checkpoints" # the report reads metrics and timelines; the weights only fill the disk
    ((rc == 0)) || return "$rc"
    tp report "$run" --no-baseline --warmup 1 --out "$SCRATCH/memory-report" || return
    cp "$SCRATCH/memory-report/report.md" "$OUT/memory-report.md"
}
result_memory() { line memory "$SCRATCH/memory-report/report.json"; }

step_memory_trace() {
    py scripts/bench_memory.py --part device --device "$DEVICE" --hardware "$HARDWARE" \
        --markdown "$OUT/memory-trace.md"
}
result_memory_trace() { line memory-trace "$OUT/memory-trace.md"; }

bench_llama() { # L:B
    local L=${1%%:*} B=${1##*:}
    local model=$SCRATCH/llama-cut-L$L.toml profile=$SCRATCH/llama-cut-L$L-profile.json name
    py scripts/gpu_bringup.py cut "$LLAMA_SOURCE" "$model" --layers 2 --seq-len "$L" ${CUT_HIDDEN:+--hidden "$CUT_HIDDEN"} ||
        return
    name=$(sed -n 's/^name = "\(.*\)"/\1/p' "$model")
    tp profile --analytic --hardware "$HARDWARE" --model "$model" --batch-sizes 1,2,4,8 --out "$profile" || return
    # shellcheck disable=SC2086 # BENCH_ARGS is a list of words
    py scripts/bench_gpu.py --device "$DEVICE" --model "$model" --precision bf16 --batch "$B" --profile "$profile" \
        $BENCH_ARGS --markdown | tee "$SCRATCH/bench-llama-L$L.md"
    local rc=${PIPESTATUS[0]}
    # Both lengths in one file: the files sent back are few.
    cat "$SCRATCH/bench-llama-L$L.md" >>"$OUT/bench-${name%-L*}.md"
    return "$rc"
}
step_bench_llama_short() { bench_llama "$LLAMA_SHORT"; }
result_bench_llama_short() { line bench "$SCRATCH/bench-llama-L${LLAMA_SHORT%%:*}.md"; }
step_bench_llama_long() {
    ((CUDA)) || skip "no CUDA: bench-llama-short's commands at another length"
    bench_llama "$LLAMA_LONG"
}
result_bench_llama_long() { line bench "$SCRATCH/bench-llama-L${LLAMA_LONG%%:*}.md"; }

step_operators() {
    ((CUDA)) || skip "no CUDA: its commands (profile --operators, --analytic --operator-table, --check-profile) run in the test suite on a small grid (tests/profile/test_operator_table.py)"
    local table=$OUT/operators-bf16.json spec source L H model name
    tp profile --operators --device "$DEVICE" --precision bf16 --out "$table" --force || return
    : >"$SCRATCH/operators-check.txt"
    for spec in $OPS_MODELS; do
        IFS=: read -r source L H <<<"$spec"
        model=$SCRATCH/ops-$(basename "$source" .toml)-L$L.toml
        # shellcheck disable=SC2046 # no --hidden for the model's own width
        py scripts/gpu_bringup.py cut "$source" "$model" --layers 2 --seq-len "$L" $( ((H)) && echo --hidden "$H") ||
            return
        name=$(sed -n 's/^name = "\(.*\)"/\1/p' "$model")
        tp profile --analytic --operator-table "$table" --model "$model" --batch-sizes 1,2 --token-step 256 \
            --out "${model%.toml}.json" || return
        tp profile --check-profile "${model%.toml}.json" | tee "$SCRATCH/operators-one.txt"
        ((PIPESTATUS[0] == 0)) || return
        echo "$name: $(grep -m 1 '^check: ' "$SCRATCH/operators-one.txt")" >>"$SCRATCH/operators-check.txt"
    done
}
result_operators() { line operators "$SCRATCH/operators-check.txt"; }

step_gpu_tests() {
    ((CUDA)) || skip "no CUDA: the tests marked gpu need one"
    "$PY" -c "import pytest" 2>/dev/null || skip "pytest not installed"
    # Only the file that holds tests marked gpu: collecting the whole suite would take longer than they do here.
    # -v: one line per test as it ends, so a run cut short by its timeout still says how far it got.
    py -m pytest -m gpu -v -p no:cacheprovider tests/train/test_placement.py | tee "$SCRATCH/pytest.out"
    return "${PIPESTATUS[0]}"
}
result_gpu_tests() { line pytest "$SCRATCH/pytest.out" --device "$DEVICE"; }

export -f tp py skip line verify_tiny bench_llama
for fn in $(compgen -A function | grep -E '^(step|result)_'); do export -f "${fn?}"; done

# ------------------------------------------------------------------------------------------ the runner
summarize() {
    local used=$(($(date +%s) - STARTED))
    "$PY" scripts/gpu_bringup.py summary "$ROWS" "$OUT/summary.md" \
        --title "GPU bring-up ($(date -u +%Y-%m-%dT%H:%MZ))" \
        --note "device: $DEVICE_NOTE" \
        --note "checkout: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(
            [[ -n $(git status --porcelain 2>/dev/null | head -n 1) ]] && echo ' with uncommitted changes'
        )" \
        --note "time: ${used} s of the ${BUDGET_S} s budget; steps.log holds every step's output" ||
        echo "summary.md could not be written" >&2
}

# The steps in order (the header says why this order) and each one's own time limit, seconds.
STEPS=(
    "verify-k1 60" "verify-k2-shared 75" "profile 100" "bench-gpt 100" "memory-trace 330" "reference 150"
    "verify-k2-v2 75" "t2-shared 75" "memory 100" "bench-llama-short 90" "bench-llama-long 90" "operators 300"
    "gpu-tests 300"
)
# GPU_BRINGUP_STEPS="NAME ...": only these steps, in the order above (each one runs alone; a step that reads another's
# files says so and is skipped without them).
if [[ -n ${GPU_BRINGUP_STEPS:-} ]]; then
    chosen=()
    for step in "${STEPS[@]}"; do
        [[ " $GPU_BRINGUP_STEPS " == *" ${step%% *} "* ]] && chosen+=("$step")
    done
    if ((${#chosen[@]} == 0)); then
        echo "gpu_bringup: GPU_BRINGUP_STEPS names none of: ${STEPS[*]%% *}" >&2
        exit 2
    fi
    STEPS=("${chosen[@]}")
fi
TOTAL=${#STEPS[@]}
N=0
FAILED=0
run_step() { # NAME LIMIT_S: run step_NAME under its own timeout, record its row
    local name=$1 limit=$2 fn=${1//-/_}
    N=$((N + 1))
    local left=$((DEADLINE - $(date +%s)))
    limit=$((limit * STEP_SCALE))
    local t=$((limit < left ? limit : left))
    local status result="" rc=0 t0 t1 seconds
    printf '\n===== [%d/%d] %s  (%s, timeout %s s) =====\n' "$N" "$TOTAL" "$name" "$DEVICE" "$t" >>"$LOG"
    rm -f "$SCRATCH/skip"
    t0=$(date +%s.%N)
    if ((t < MIN_STEP_S)); then
        status="skipped: out of time (${left} s of the ${BUDGET_S} s budget left)"
    else
        # timeout signals the step's whole process group (the launcher stops its torchrun workers on SIGTERM,
        # within --grace-s), and kills it 10 s later if it is still there.
        timeout -k 10 "$t" bash -c "step_$fn" >>"$LOG" 2>&1 </dev/null
        rc=$?
        case $rc in
            0) status=ok ;;
            77) status="skipped: $(cat "$SCRATCH/skip" 2>/dev/null)" ;;
            124 | 137) status="timed out after $t s" ;;
            *) status="failed (exit $rc)" ;;
        esac
        if [[ $rc != 77 ]] && declare -F "result_$fn" >/dev/null; then
            result=$(timeout 60 bash -c "result_$fn" 2>>"$LOG" | tail -n 1)
        fi
    fi
    t1=$(date +%s.%N)
    seconds=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", b - a}')
    [[ $status == ok || $status == skipped* ]] || FAILED=$((FAILED + 1))
    printf '===== %s: %s (%s s) %s\n' "$name" "$status" "$seconds" "$result" >>"$LOG"
    printf '[%d/%d] %-20s %-12s %6s s  %s\n' "$N" "$TOTAL" "$name" "${status%%:*}" "$seconds" "${result:-${status#*: }}"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$N" "$name" "$DEVICE_COLUMN" "$status" "$seconds" "$result" |
        tr -d '\r' >>"$ROWS"
    summarize
}

echo "gpu_bringup: $DEVICE_NOTE -> $OUT (budget $BUDGET_S s)"
for step in "${STEPS[@]}"; do
    # shellcheck disable=SC2086 # "NAME LIMIT_S"
    run_step $step
done
echo
cat "$OUT/summary.md"
exit $((FAILED > 0))
