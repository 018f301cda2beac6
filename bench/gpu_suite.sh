#!/usr/bin/env bash
# The CUDA path on a real GPU, in one run of under 8 minutes (an H200: about 5), from a fresh copy of the tree:
#   1. pytest -m gpu               the compiled Triton kernels against the torch reference
#   2. bench/gpu_plan_check.py     12 plans (2/4/8 GiB GPU budgets x 8k/32k tokens x bf16/fp8 cache) for a
#                                  1.5B-shaped model: predicted vs NVML-measured memory per device, the CUDA overhead
#   3. bench/gpu_kernels.py        decode attention bandwidth (4k/32k/128k tokens, batch 1/16) vs the HBM peak; prefill
#   4. bench/gpu_decode.py         decode tok/s, Stowage vs transformers eager, fully on the GPU and split GPU/CPU
# Each step has its own time limit, and every limit is cut to what is left of the suite's (--budget-s, 500 s), so a
# hang costs one step. Results: the output folder ($OUT if set, else bench/out/gpu): summary.md (paste it into
# docs/benchmarks.md), suite.log, and each step's JSON and markdown: eight files in all.
#
#   bash bench/gpu_suite.sh [--dry-run] [--out DIR] [--budget-s SECONDS]
#
# Python: $PYTHON, else the first of python3, .venv/bin/python, python whose torch is a CUDA build that sees a GPU.
# Nothing is downloaded (the GPU machine has no network): a missing package is installed only from wheels in .whl/
# at the top of the tree, if there are any; platformdirs, which only the CPU matrix-vector kernel's cache folder
# needs, is stood in for when missing. Exit status: 0 all steps passed, 1 a step failed or timed out, 3 no usable
# Python/GPU.
#
# --dry-run (no GPU; what tests/bench/test_gpu_suite_dry_run.py runs): the same environment checks on the CPU,
# prints every command the GPU run would execute, then runs the steps' dry runs: pytest -m gpu (collected and
# skipped without a GPU), the plans made and their splits checked, the kernels at tiny sizes through Triton's
# interpreter, and decode on a tiny model with the GPU simulated by the CPU.
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY=0
OUT_DIR=${OUT:-$ROOT/bench/out/gpu}
BUDGET_S=500
while (($#)); do
  case $1 in
    --dry-run) DRY=1 ;;
    --out) OUT_DIR=$2; shift ;;
    --budget-s) BUDGET_S=$2; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
DEADLINE=$((SECONDS + BUDGET_S))
WORK=${STOWAGE_GPU_WORK:-$ROOT/bench/out/gpu-models}
mkdir -p "$OUT_DIR" "$WORK"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export OUT=$OUT_DIR STOWAGE_GPU_WORK=$WORK
LOG=$OUT_DIR/suite.log
rm -f "$OUT_DIR"/summary.md "$OUT_DIR"/gpu_plan_check.{json,md} "$OUT_DIR"/gpu_kernels.{json,md} "$OUT_DIR"/gpu_decode.{json,md}
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
finish() {  # exit with $1 once tee has written the whole log
  exec 1>&- 2>&-
  wait "$TEE_PID" 2>/dev/null
  exit "$1"
}

cd "$ROOT" || finish 3
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TRANSFORMERS_VERBOSITY=error QT_QPA_PLATFORM=offscreen
# The checkout's folders as the `stowage.*` package without installing it (the GPU image has no network): links
# under $WORK/pkg/stowage/, so nothing puts the repository root itself on sys.path.
mkdir -p "$WORK/pkg/stowage"
for folder in app engine kernels assets; do ln -sfn "$ROOT/$folder" "$WORK/pkg/stowage/$folder"; done
export PYTHONPATH=$WORK/pkg:$ROOT/bench:$ROOT/tests/support${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET
MODE=$([ $DRY = 1 ] && echo "dry run (CPU)" || echo "GPU run")
echo "== bench/gpu_suite.sh, $MODE, $(date -Is); tree at $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
echo "   output folder $OUT_DIR, models under $WORK, time budget ${BUDGET_S}s"

# -- which Python -------------------------------------------------------------------------------------------------
has_cuda_torch='import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)'
has_torch='import torch'
PY=
if [ $DRY = 1 ]; then
  CANDIDATES=("${PYTHON:-}" "$ROOT/.venv/bin/python" python3 python)  # the project's venv first on a CPU machine
else
  CANDIDATES=("${PYTHON:-}" python3 "$ROOT/.venv/bin/python" python)  # the GPU image's python3 holds its CUDA torch
fi
for candidate in "${CANDIDATES[@]}"; do
  [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
  if "$candidate" -c "$([ $DRY = 1 ] && echo "$has_torch" || echo "$has_cuda_torch")" >/dev/null 2>&1; then
    PY=$(command -v "$candidate"); break
  fi
done
if [ -z "$PY" ]; then
  if [ $DRY = 1 ]; then
    echo "no Python with torch found (tried \$PYTHON, python3, .venv/bin/python, python): run 'make venv' first"
  else
    echo "no Python whose torch is a CUDA build that sees a GPU (tried \$PYTHON, python3, .venv/bin/python, python)."
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L || echo "nvidia-smi: not found (no NVIDIA driver here?)"
    echo "This suite needs a CUDA GPU; without one, run: bash bench/gpu_suite.sh --dry-run"
  fi
  finish 3
fi
echo "== python: $PY"

# -- what it has, what is missing ---------------------------------------------------------------------------------
REQUIRED="torch triton numpy safetensors tokenizers jinja2 psutil pynvml transformers pytest"
missing() { "$PY" -c "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))" "$@"; }
MISSING=$(missing $REQUIRED)
if [ -n "$MISSING" ] && compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  echo "== missing: $MISSING; installing the wheels in .whl/ (no index) into $WORK/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" "$ROOT"/.whl/*.whl
  export PYTHONPATH=$PYTHONPATH:$WORK/site
  MISSING=$(missing $REQUIRED)
fi
if [ -n "$MISSING" ]; then
  echo "missing Python packages: $MISSING. There is no network here: put their wheels in .whl/ at the top of the tree"
  echo "('pip download --no-deps --only-binary=:all: NAME==VERSION -d .whl' on a machine with a network) and run again."
  finish 3
fi
if [ -n "$(missing platformdirs)" ]; then
  # kernels/cpu_gemv.py imports platformdirs for its cache folder before it reads STOWAGE_KERNEL_CACHE
  mkdir -p "$WORK/shim"
  cat >"$WORK/shim/platformdirs.py" <<'PY'
"""Stand-in written by bench/gpu_suite.sh where platformdirs is not installed: only user_cache_dir is used."""
import os


def user_cache_dir(appname=None, *args, **kwargs):
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), appname or "")
PY
  export PYTHONPATH=$PYTHONPATH:$WORK/shim
  echo "== platformdirs is missing: a stand-in from $WORK/shim serves kernels/cpu_gemv.py"
fi
"$PY" - <<'PY'
import importlib, os, sys
import torch
versions = []
for name in ("triton", "transformers", "safetensors", "tokenizers", "pytest", "accelerate"):
    try:
        versions.append(f"{name} {importlib.import_module(name).__version__}")
    except ImportError:
        versions.append(f"{name} -")
print(f"== python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), " + ", ".join(versions))
print(f"   {os.cpu_count()} CPU cores; GPU: " + (f"{torch.cuda.get_device_name(0)}, compute capability "
      f"{'.'.join(map(str, torch.cuda.get_device_capability(0)))}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB" if torch.cuda.is_available() else "none"))
PY
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader

# -- the steps ----------------------------------------------------------------------------------------------------
# name | limit (s) | command: the GPU run's commands; a dry run prints them, then runs each with --dry-run.
GPU_TESTS=$(grep -rl --include='*.py' 'pytest.mark.gpu' tests | sort | tr '\n' ' ')
STEP_NAMES=("pytest -m gpu" "plan check" "kernels" "decode")
STEP_LIMITS=(150 140 75 120)  # 485 s; with ~15 s of checks before, inside the 500 s budget
STEP_COMMANDS=(
  "$PY -m pytest -q -p no:cacheprovider -m gpu -rs $GPU_TESTS"
  "$PY bench/gpu_plan_check.py"
  "$PY bench/gpu_kernels.py"
  "$PY bench/gpu_decode.py"
)
DRY_SUFFIX=("" " --dry-run" " --dry-run" " --dry-run")
ROWS=()

run_step() {  # index
  local i=$1 name=${STEP_NAMES[$1]} limit=${STEP_LIMITS[$1]} command=${STEP_COMMANDS[$1]}
  [ $DRY = 1 ] && command+=${DRY_SUFFIX[$i]}
  local left=$((DEADLINE - SECONDS - 5))
  ((limit > left)) && limit=$left
  if ((limit < 10)); then
    echo "== $name: skipped, the suite's ${BUDGET_S}s are spent"
    ROWS+=("| $name | skipped (no time left) | 0 s | - | \`$command\` |")
    FAILED=1
    return
  fi
  echo
  echo "== $name (limit ${limit}s): $command"
  local started=$SECONDS
  # shellcheck disable=SC2086  # the command is words on purpose
  timeout --kill-after=10 "$limit" $command
  local rc=$? took=$((SECONDS - started)) status
  case $rc in
    0) status=ok ;;
    124|137) status="**timed out**"; FAILED=1 ;;
    *) status="**failed** (exit $rc)"; FAILED=1 ;;
  esac
  echo "== $name: $status after ${took}s"
  ROWS+=("| $name | $status | $took s | $limit s | \`$command\` |")
}

if [ $DRY = 1 ]; then
  echo
  echo "== the GPU run would execute (from the top of the tree, each under its limit):"
  for i in "${!STEP_NAMES[@]}"; do
    echo "   [${STEP_LIMITS[$i]}s] ${STEP_COMMANDS[$i]}"
  done
fi
FAILED=0
for i in "${!STEP_NAMES[@]}"; do
  run_step "$i"
done

# -- the summary --------------------------------------------------------------------------------------------------
{
  echo "## CUDA path on a GPU ($([ $DRY = 1 ] && echo 'dry run on the CPU' || echo 'measured'))"
  echo
  echo "\`bash bench/gpu_suite.sh$([ $DRY = 1 ] && echo ' --dry-run')\`, $(date -Is), tree at $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), ${SECONDS}s in all."
  echo
  echo "| step | status | took | limit | command |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  for name in gpu_plan_check gpu_kernels gpu_decode; do
    if [ -f "$OUT_DIR/$name.md" ]; then
      echo
      cat "$OUT_DIR/$name.md"
    fi
  done
} >"$OUT_DIR/summary.md"
echo
echo "== done in ${SECONDS}s: $OUT_DIR/summary.md ($([ $FAILED = 0 ] && echo 'every step ok' || echo 'a step failed'))"
finish $FAILED
