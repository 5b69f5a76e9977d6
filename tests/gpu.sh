#!/usr/bin/env bash
# One GPU visit: install, GPU tests, demo, benchmark, scale; short tables last.
# Usage (on the device): bash tests/gpu.sh [tests|bench|scale|all ...]   (default: all)
# Logs and tables go to $OUT (or ./.out when $OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/.out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLEXSPARSE_GPU_TESTS=1
parts="${*:-all}"
want() { [[ " $parts " == *" all "* || " $parts " == *" $1 "* ]]; }
status=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
# Wheels carried in .whl (expecttest etc.), if any.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { echo "install failed"; tail -20 "$OUT/install.log"; exit 1; }
if want tests; then
  timeout 420 python3 -m pytest -x -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  timeout 120 python3 -m flexsparse demo 2>&1 | tee "$OUT/demo.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want bench; then
  timeout 420 python3 -m flexsparse.bench --out "$OUT/bench.md" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -5
fi
if want scale && [ -f tests/gpu/scale.py ]; then
  timeout 300 python3 tests/gpu/scale.py --out "$OUT/scale.md" 2>&1 | tee "$OUT/scale.log" | tail -5
fi
echo "================ tables"
for f in "$OUT"/bench.md "$OUT"/bench_indices.md "$OUT"/scale.md; do [ -f "$f" ] && { echo "## $(basename "$f")"; cat "$f"; }; done
grep -E "passed|failed|error" "$OUT/gpu_tests.log" 2>/dev/null | tail -3
exit $status
