#!/usr/bin/env bash
# One GPU visit for the index kernels: GPU tests, benchmark table, config sweep.
# Usage (on the device, repo root): bash tests/gpu/indices_visit.sh   Logs go to $OUT (or ./.out).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/.out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLEXSPARSE_GPU_TESTS=1
unset TRITON_INTERPRET
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1; then
  # fall back to the installed layout by hand: flexsparse/ with ops/ as flexsparse/ops
  STAGE=$(mktemp -d); cp -r flexsparse "$STAGE/flexsparse"; cp -r ops "$STAGE/flexsparse/ops"
  export PYTHONPATH="$STAGE${PYTHONPATH:+:$PYTHONPATH}"
  echo "pip install failed; using staged copy at $STAGE" | tee -a "$OUT/env.txt"
fi
python3 -c "import flexsparse.ops.triton_indices as t; print('import ok', t.__file__)" 2>&1 | tee -a "$OUT/env.txt"
T_TESTS=${T_TESTS:-125} T_BENCH=${T_BENCH:-165} T_SWEEP=${T_SWEEP:-55}
timeout "$T_TESTS" python3 tests/gpu/test_triton_indices_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^PASS" | tail -40
echo "tests rc=${PIPESTATUS[0]}"
timeout "$T_BENCH" python3 -m flexsparse.bench_indices --out "$OUT/bench_indices.md" --budget-s "${BUDGET:-110}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v -i "warn\|online softmax\|split the reduction\|important use case\|^$" | tail -25
echo "bench rc=${PIPESTATUS[0]}"
if [ "$T_SWEEP" -gt 0 ]; then
  timeout "$T_SWEEP" python3 -m flexsparse.bench_indices --sweep-only 2>&1 | tee "$OUT/sweep.log" | tail -60
  echo "sweep rc=${PIPESTATUS[0]}"
fi
echo "================ table"; cat "$OUT/bench_indices.md" 2>/dev/null
