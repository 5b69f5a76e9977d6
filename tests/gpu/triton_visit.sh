#!/usr/bin/env bash
# One GPU visit for the Triton block kernels: GPU tests, then benchmark rows, then an optional
# tile-config sweep. Each step has its own time limit; logs go to $OUT (default ./.out).
# Usage: bash tests/gpu/triton_visit.sh "<pytest timeout>" "<bench args>" "<bench timeout>" \
#                                       "<sweep rows>" "<sweep timeout>"
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT="${OUT:-$ROOT/.out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLEXSPARSE_GPU_TESTS=1
T_TEST="${1:-200}"; BENCH_ARGS="${2:---quick --no-indices}"; T_BENCH="${3:-200}"
SWEEP_ROWS="${4:-}"; T_SWEEP="${5:-60}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
# flexsparse importable: editable install, else a bootstrap that maps flexsparse.ops -> ops/
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
   || ! python3 -c "import flexsparse.ops" >> "$OUT/install.log" 2>&1; then
  mkdir -p /tmp/fsboot
  cat > /tmp/fsboot/sitecustomize.py <<PY
import importlib.util, sys
spec = importlib.util.spec_from_file_location(
    "flexsparse", "$ROOT/flexsparse/__init__.py",
    submodule_search_locations=["$ROOT/flexsparse", "$ROOT"])
mod = importlib.util.module_from_spec(spec)
sys.modules["flexsparse"] = mod
spec.loader.exec_module(mod)
PY
  export PYTHONPATH=/tmp/fsboot:$ROOT
  echo "using the sitecustomize bootstrap" | tee -a "$OUT/install.log"
fi
python3 -c "import flexsparse, flexsparse.ops.triton_backend as t; print('flexsparse ok', t.__file__)" 2>&1 | tail -3
if [ "$T_TEST" != "0" ]; then
  timeout "$T_TEST" python3 -m pytest -q -p no:cacheprovider --import-mode=importlib \
    -s ${PYTEST_K:+-k "$PYTEST_K"} tests/gpu/test_triton_gpu.py > "$OUT/gpu_tests.log" 2>&1
  echo "pytest rc=$?"; grep -cE "^\.?out " "$OUT/gpu_tests.log"; grep -E "passed|failed|Error|error" "$OUT/gpu_tests.log" | tail -15
fi
if [ "$T_BENCH" != "0" ]; then
  timeout "$T_BENCH" python3 -m flexsparse.bench --out "$OUT/bench.md" $BENCH_ARGS \
    > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -E "^\||failed" "$OUT/bench.log" | tail -30
fi
if [ -n "$SWEEP_ROWS" ]; then
  timeout "$T_SWEEP" python3 -m flexsparse.bench --sweep --rows "$SWEEP_ROWS" --no-flex \
    --no-sdpa --no-indices > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$?"; grep -E "^sweep" "$OUT/sweep.log" | tail -40
fi
if [ -n "${PROFILE_ROWS:-}" ]; then
  timeout "${T_PROFILE:-60}" python3 -m flexsparse.bench --profile --rows "$PROFILE_ROWS" \
    > "$OUT/profile.log" 2>&1
  echo "profile rc=$?"; grep -vE "^-+$" "$OUT/profile.log" | cut -c1-160 | tail -60
fi
