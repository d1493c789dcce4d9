#!/usr/bin/env bash
# The first thing to run where a GPU is lent (docs/gpu.md): the device checks
# (tests/device_checks.py, one process each) and the GPU bench preset, then a
# report -- report.md and report.json -- with the device, the versions and
# every figure. Under 10 minutes, each phase under its own time limit, so a
# hang in one still leaves a report.
#
#   tools/gpu_check.sh [--dry-run] [OUT_DIR]
#
# OUT_DIR: the argument, else $OUT (the device tool brings back what is
# written there), else ./gpu_check_out. Without CUDA, or with --dry-run, it
# runs the CPU equivalents: the checks on gloo and the same preset scaled
# down to a tiny Llama (a few seconds a run). Needs torch, not an install of
# the project (PYTHONPATH=src) and not pytest. Exit status 0: every check
# passed or could not run here, and the bench finished with every contender.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)"
CHECKS_LIMIT_S="${GPU_CHECK_CHECKS_LIMIT_S:-180}"
BENCH_LIMIT_S="${GPU_CHECK_BENCH_LIMIT_S:-380}"

# A python that has torch: $PYTHON, the project's .venv, python3, python.
for candidate in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
    if [ -n "$candidate" ] && "$candidate" -c "import torch" 2>/dev/null; then PY="$candidate"; break; fi
done
if [ -z "${PY:-}" ]; then echo "gpu_check: no python with torch found" >&2; exit 2; fi
cd "$ROOT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"

MODE=cpu
if [ "$DRY_RUN" = 1 ]; then
    export CUDA_VISIBLE_DEVICES=""  # the ranks and checks must not find a GPU either
elif "$PY" -c "import sys, torch; a = torch.accelerator.current_accelerator(); sys.exit(0 if a is not None and a.type == 'cuda' else 1)" 2>/dev/null; then
    MODE=cuda
fi
if [ "$MODE" = cuda ]; then
    BENCH_ARGS="--preset gpu"
else
    # The same preset, a tiny Llama: every code path of the GPU run, in seconds.
    BENCH_ARGS="--preset gpu --num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 256 --seq-length 64 --micro-batch-size 1 --steps 1 --warmup 1 --repeats 1 --threads-per-rank 1"
fi

limited() {  # limited LIMIT_S COMMAND...: the command, stopped after LIMIT_S where timeout(1) exists
    local limit="$1"
    shift
    if command -v timeout >/dev/null; then timeout --kill-after=15 "$limit" "$@"; else "$@"; fi
}
: > "$OUT_DIR/phases.txt"
phase() {  # phase NAME LIMIT_S LOG COMMAND...: run it under the limit (output to LOG, "-": here), note "NAME STATUS SECONDS"
    local name="$1" limit="$2" log="$3" start status ms
    shift 3
    start=$(date +%s%N)
    if [ "$log" = - ]; then
        limited "$limit" "$@"
    else
        limited "$limit" "$@" > "$log" 2>&1
    fi
    status=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    printf '%s %d %d.%03d\n' "$name" "$status" $((ms / 1000)) $((ms % 1000)) >> "$OUT_DIR/phases.txt"
    echo "[gpu_check] $name: exit $status" >&2
}

echo "[gpu_check] mode $MODE, python $PY, writing to $OUT_DIR" >&2
phase environment 60 - "$PY" tools/gpu_check/environment.py --mode "$MODE" --out "$OUT_DIR/environment.json"
phase checks "$CHECKS_LIMIT_S" - "$PY" tests/run_device_checks.py --device "$MODE" --timeout 120 \
    --out "$OUT_DIR/device_checks.json"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
phase bench "$BENCH_LIMIT_S" "$OUT_DIR/bench.log" "$PY" -m flatfsdp.bench $BENCH_ARGS --out "$OUT_DIR/bench"
"$PY" tools/gpu_check/report.py "$OUT_DIR" --bench-args "$BENCH_ARGS"
