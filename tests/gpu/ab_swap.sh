#!/usr/bin/env bash
# Same-machine A/B of two csrc trees where no FLEXSPARSE_CUDA_DEBUG switch can compare them
# in one build: benchmarks the CUDA backend (cuda_bench --cuda-only) with csrc/ (new), then
# old_csrc/ (old), then csrc/ again, so that drift between runs shows.
#   here:   git archive <old commit> csrc | tar -x -C /tmp && mv /tmp/csrc old_csrc
#           (old_csrc/ git-ignored through .git/info/exclude, carried in the device call)
#   device: bash tests/gpu.sh cuda && bash tests/gpu/ab_swap.sh full@8192,causal@16384
# Prints "new1|old|new2 kind L D fwd bwd" (TFLOP/s) per row. Run after tests/gpu.sh, which
# installs the carried wheels into /tmp/site. AB_PASSES=N benchmarks each build N times (the
# hd128 rows are bimodal between runs on these machines); AB_BENCH_ARGS="--cuda-only
# --no-bwd" times the forward only.
set -u
ROWS="$1"
OUT="${OUT:-$PWD/.out}"; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# ninja compares times: touch the swapped-in sources so that they are rebuilt.
build() { find csrc -type f -exec touch {} +; MAX_JOBS=16 python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/build_$1.log" 2>&1 || { echo "build $1 failed"; tail -20 "$OUT/build_$1.log"; exit 1; }; }
bench() { for _ in $(seq "${AB_PASSES:-1}"); do bench_once "$1"; done; }
bench_once() { python3 -m benchmarks.cuda_bench "$ROWS" ${AB_BENCH_ARGS:---cuda-only} 2>&1 | grep "^|" | grep -v "^|---\|mask" | awk -F'|' -v t="$1" '{print t, $2, $3, $4, $5, $10}'; }
bench new1
mv csrc new_csrc && mv old_csrc csrc && build old && bench old
mv csrc old_csrc && mv new_csrc csrc && build new && bench new2
