#!/usr/bin/env bash
# The one prepared device check of issue #22, for a fresh CUDA machine (an H200) holding a copy
# of this working tree and no network: what the machine has; the engine on an 8B-shaped Llama
# (batch-1 decode against the HBM read floor with and without CUDA graphs, offline throughput
# at batch 32 and 256, prefill MFU at 4k tokens); greedy parity with transformers; the Triton
# kernels timed against the torch reference and SDPA; the gpu-marked tests. At most ~7.5
# minutes in all (a 7-minute budget for the steps, then the summary).
#
#   bash bench/gpu/check.sh [OUT_DIR]      (default: $OUT, else bench/gpu/out)
# Writes OUT_DIR/summary.txt and summary.json (and each step's log and json). Every step has
# its own time limit and the script goes on after a failed one. CHECK_SMOKE=1 runs the engine,
# parity and kernel steps on CPU at tiny sizes under the Triton interpreter (a check of this
# script, which CI makes).
set -u

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT_DIR="${1:-${OUT:-$REPO/bench/gpu/out}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$REPO" || exit 1

if [ -n "${PYTHON:-}" ]; then :
elif [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"
else PYTHON="$(command -v python3 || command -v python)"; fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_COMPILE_THREADS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/splitserve-triton-cache}"
SMOKE="${CHECK_SMOKE:-0}"
# Off explicitly, not unset: the tests' conftest turns the interpreter on where it finds no
# nvidia-smi (some GPU images lack it), unless the variable is already set.
if [ "$SMOKE" = 1 ]; then export TRITON_INTERPRET=1; else export TRITON_INTERPRET=0; fi

# pytest for the gpu-marked tests: the image's, else wheels brought beside this script
# (`make gpu-wheels`: pytest and what it needs, pure Python, under 2 MB; the machine has no
# network), installed into a scratch folder.
WHEELS="${CHECK_WHEELS:-$REPO/bench/gpu/wheels}"
if ! "$PYTHON" -c 'import pytest' 2>/dev/null && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  DEPS="${TMPDIR:-/tmp}/splitserve-gpu-pydeps"
  "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --target "$DEPS" pytest \
    && export PYTHONPATH="$PYTHONPATH:$DEPS"
fi

BUDGET_S="${CHECK_BUDGET_S:-420}"  # every step but the summary; 8 minutes hold all of it
T0=$SECONDS
: >"$OUT_DIR/steps.tsv"

# step NAME LIMIT_S COMMAND...: run with a limit (cut to what is left of the budget), log to
# OUT_DIR/NAME.log, record "NAME<TAB>rc<TAB>seconds"; never stops the script.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - (SECONDS - T0)))
  if [ "$left" -lt 15 ]; then
    echo "== [$name] skipped: ${left}s of the budget left"
    printf '%s\tskipped\t0\n' "$name" >>"$OUT_DIR/steps.tsv"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== [$name] start (limit ${limit}s, $((SECONDS - T0))s elapsed) $(date -u +%H:%M:%S)"
  local start=$SECONDS
  # SIGINT first: pytest still writes its junit file, the Python steps what they measured.
  timeout -s INT --kill-after=10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT_DIR/$name.log"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >>"$OUT_DIR/steps.tsv"
  echo "== [$name] rc $rc after $((SECONDS - start))s"
}

echo "splitserve device check: repo $REPO, out $OUT_DIR, python $PYTHON, smoke $SMOKE"
step env 45 "$PYTHON" bench/gpu/check.py env --out "$OUT_DIR"
if command -v nvidia-smi >/dev/null; then
  step nvidia-smi 20 nvidia-smi
fi

SMOKE_ARGS=()
[ "$SMOKE" = 1 ] && SMOKE_ARGS=(--smoke)
# Most telling first: the engine on an 8B shape (decode against the read floor, throughput,
# prefill MFU), parity with transformers, the kernels timed, then the gpu-marked tests.
step engine 180 "$PYTHON" bench/gpu/check.py engine --out "$OUT_DIR" ${SMOKE_ARGS[@]+"${SMOKE_ARGS[@]}"}
step parity 100 "$PYTHON" bench/gpu/check.py parity --out "$OUT_DIR" ${SMOKE_ARGS[@]+"${SMOKE_ARGS[@]}"}
step kernels 90 "$PYTHON" bench/gpu/check.py kernels --out "$OUT_DIR" ${SMOKE_ARGS[@]+"${SMOKE_ARGS[@]}"}

PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -o addopts= -rfE)
if "$PYTHON" -c 'import pytest' 2>/dev/null; then
  step gpu-tests 150 "${PYTEST[@]}" --junitxml="$OUT_DIR/gpu-tests.xml" \
    tests/kernels/test_decode_graphs.py tests/engine/test_step_inputs.py \
    tests/engine/test_sampling_batched.py \
    tests/kernels/test_triton_decode_attention.py tests/kernels/test_triton_prefill_attention.py \
    tests/kernels/test_triton_rmsnorm.py tests/kernels/test_triton_rotary_kv.py
else
  echo "== [gpu-tests] skipped: no pytest here and no wheels in $WHEELS (make gpu-wheels)"
  printf 'gpu-tests\tskipped (no pytest)\t0\n' >>"$OUT_DIR/steps.tsv"
fi
# (tests/kv_transfer/test_kv_nccl.py is gpu-marked too but needs two GPUs: not run here.)

BUDGET_S=$((BUDGET_S + 30))  # the summary runs whatever happened before it
step summary 20 "$PYTHON" bench/gpu/check.py summary --out "$OUT_DIR"
echo "done in $((SECONDS - T0))s; results in $OUT_DIR"
