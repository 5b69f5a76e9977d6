#!/usr/bin/env bash
# One GPU visit: install, GPU tests, demo, benchmark, scale; short tables last.
# Usage (on the device): bash tests/gpu.sh [tests|demo|bench|scale|all|sweep|profile|ncu|ncusrc|sanitize|csanitize|fuzz|cuda|cudabench|timing|ab|build_ab|desc_ab|split|trace|btrace|ifwd|ifwdsan|ibwd|ibwdprof|ibwdrace|topk|hf|probe|step|build|buildgraph|fwdedges|hostlayers ...]
# (default: all = tests, demo, bench, scale)
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
# Wheels carried in .whl (expecttest etc.), if any. The checkout does not keep .whl (git
# ignores it); make it before a visit with
#   pip download --no-deps -d .whl expecttest nvidia-cutlass==4.2.0
# (both py3-none-any; the CUTLASS headers of the build come from the second) and pass
# carry=[".whl"] to the device call.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# transformers and what it imports, carried in .hfw (cp312 wheels): only the distributions
# the device lacks, so that its own packages are not shadowed.
if ls .hfw/*.whl >/dev/null 2>&1; then
  python3 - <<'PY'
import glob, importlib.metadata as md, re, subprocess, sys
need = []
for w in sorted(glob.glob(".hfw/*.whl")):
    try:
        md.version(re.split(r"-\d", w.split("/")[-1])[0])
    except md.PackageNotFoundError:
        need.append(w)
if need:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--no-compile", "--target", "/tmp/site", *need])
print("hf wheels installed:", [w.split("/")[-1].split("-")[0] for w in need])
PY
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# A pytest run under compute-sanitizer (FLEXSPARSE_UNDER_SANITIZER=1 tells the tests that
# the profiler sees no kernels there): sanitized_pytest TOOL SECONDS NAME TEST_FILE K_EXPR
# [SANITIZER_ARGS...] (log $OUT/NAME.log; its rc line, named NAME with spaces, and the
# log's summary lines). "--kernel-name kns=index_" keeps racecheck to our kernels: it
# reports cuBLAS's nvjet kernels (the tests' references) and ran past its limit there.
sanitized_pytest() {
  FLEXSPARSE_UNDER_SANITIZER=1 timeout "$2" compute-sanitizer --tool "$1" "${@:6}" --error-exitcode 9 \
    python3 -m pytest -p no:cacheprovider -o addopts= -q "$4" -k "$5" > "$OUT/$3.log" 2>&1
  local rc=$?; echo "${3//_/ } rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/$3.log" | tail -3
}
# A second build of the extension for probes (trace, build_ab): a copy of the tree in $1,
# built in place with extra nvcc flags $2, its log in $3, and csrc/ taken from directory $4
# where given (an older csrc/, for an A/B across commits); the build's exit status.
side_build() {
  rm -rf "$1"; mkdir -p "$1"
  cp -a setup.py pyproject.toml README.md csrc flexsparse ops benchmarks "$1"/
  if [ -n "${4:-}" ]; then rm -rf "$1/csrc"; cp -a "$4" "$1/csrc"; fi
  rm -f "$1"/flexsparse/_C*.so
  (cd "$1" && FLEXSPARSE_NVCC_FLAGS="$2" FLEXSPARSE_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" \
     python3 setup.py -q build_ext --inplace > "$3" 2>&1)
}
# build_ab (below): the second build starts here in the background, beside the main build
# (16 cores hold both): this tree with extra nvcc flags AB_FLAGS and/or with csrc/ from the
# directory AB_CSRC (e.g. `git archive <commit> csrc | tar -x -C .ab_base`, carried).
# desc_ab is build_ab with AB_FLAGS=-DFLEXSPARSE_DESC32 (CuTe's 32-bit descriptor add, C59).
if [[ " $parts " == *" desc_ab "* ]]; then parts="$parts build_ab"; AB_FLAGS="${AB_FLAGS:--DFLEXSPARSE_DESC32}"; fi
ab_tree=/tmp/flexsparse_ab
# btrace (below): its -DFLEXSPARSE_BWD_TRACE build starts here too, beside the main build.
btr=/tmp/flexsparse_btrace
if [[ " $parts " == *" btrace "* ]]; then
  bt0=$(date +%s)
  (side_build "$btr" -DFLEXSPARSE_BWD_TRACE "$OUT/btrace_build.log"; echo $? > "$btr.rc") &
  btrace_pid=$!
fi
# trace (below): its -DFLEXSPARSE_FWD_TRACE build likewise.
trb=/tmp/flexsparse_trace
if [[ " $parts " == *" trace "* ]]; then
  tr0=$(date +%s)
  (side_build "$trb" -DFLEXSPARSE_FWD_TRACE "$OUT/trace_build.log"; echo $? > "$trb.rc") &
  trace_pid=$!
fi
if [[ " $parts " == *" build_ab "* || " $parts " == *" ifwd_ab "* ]]; then
  (side_build "$ab_tree" "${AB_FLAGS:-}" "$OUT/ab_build.log" "${AB_CSRC:-}"; echo $? > "$ab_tree/.rc") &
fi
# Waits for that second build; true when it succeeded, else says so with its errors.
second_build_ok() {
  wait
  [ "$(cat "$ab_tree/.rc" 2>/dev/null)" = 0 ] && return 0
  echo "second build failed"; grep -E "error" "$OUT/ab_build.log" | head
  return 1
}
# Builds flexsparse._C from csrc/ (CUTLASS headers from the carried nvidia-cutlass wheel).
# A machine still warm from the last call keeps flexsparse/_C*.so (ignored by git, so the
# device keeps it): when csrc/ and the build files hash the same as for that build, the
# ~145 s build is skipped.
t0=$(date +%s)
stamp=$(cat setup.py pyproject.toml $(find csrc -type f | sort) | sha256sum | cut -c1-16)
if [ "${SKIP_MAIN_BUILD:-0}" = 1 ]; then
  # For a visit that needs only a probe build (trace, btrace): that build alone takes ~200 s,
  # beside the main build ~400 s (16 cores, 18 translation units each). The trace's plain
  # TIME line then needs an earlier visit's number.
  echo "main build skipped (SKIP_MAIN_BUILD=1)"
elif ls flexsparse/_C*.so >/dev/null 2>&1 && [ "$(cat flexsparse/.csrc_stamp 2>/dev/null)" = "$stamp" ]; then
  echo "csrc unchanged since this machine's last build ($stamp): build skipped"
else
  rm -f flexsparse/.csrc_stamp
  MAX_JOBS="${MAX_JOBS:-16}" python3 -m pip install -v --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
    || { echo "install failed"; grep -E "error|Error" "$OUT/install.log" | head -30; tail -20 "$OUT/install.log"; exit 1; }
  echo "$stamp" > flexsparse/.csrc_stamp
  echo "install + csrc build: $(( $(date +%s) - t0 )) s"
fi
python3 -c "from flexsparse.ops import backends; print('backends', backends.available())"
if want tests; then
  xdist=""; python3 -c "import xdist" 2>/dev/null && xdist="-n ${JOBS:-8}"
  timeout "${T_TESTS:-330}" python3 -m pytest -p no:cacheprovider $xdist tests/gpu \
    > "$OUT/gpu_tests.log" 2>&1
  rc=$?; echo "gpu tests rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -15
fi
if want cuda; then
  timeout "${T_CUDA:-300}" python3 -m pytest -p no:cacheprovider tests/gpu/test_cuda_gpu.py \
    > "$OUT/cuda_tests.log" 2>&1
  rc=$?; echo "cuda tests rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/cuda_tests.log" | cut -c1-300 | tail -25
fi
# Hugging Face on the GPU (needs .hfw carried): the model tests, then the training-step row.
if [[ " $parts " == *" hf "* ]]; then
  timeout "${T_HF:-240}" python3 -m pytest -p no:cacheprovider tests/gpu/test_transformers_gpu.py \
    > "$OUT/hf_tests.log" 2>&1
  rc=$?; echo "hf tests rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "^FAILED|^ERROR|passed|failed|skipped" "$OUT/hf_tests.log" | cut -c1-300 | tail -15
  timeout "${T_HFBENCH:-300}" python3 -m benchmarks.bench_hf ${HF_ARGS:-} --out "$OUT/bench_hf.md" \
    > "$OUT/bench_hf.log" 2>&1
  echo "bench_hf rc=$?"; grep -v Warning "$OUT/bench_hf.log" | tail -12
fi
# masks.topk (issue 17): the CUDA op (csrc/topk.cu) and the Triton kernel, their tests
# (the op's also under compute-sanitizer memcheck and racecheck), then the table against
# torch.topk with the Triton kernel's line per row.
if [[ " $parts " == *" topk "* ]]; then
  timeout "${T_TOPK:-200}" python3 -m pytest -p no:cacheprovider -o addopts= -q \
    tests/gpu/test_triton_indices_gpu.py -k topk > "$OUT/topk_tests.log" 2>&1
  rc=$?; echo "topk tests rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "^FAILED|^ERROR|passed|failed|skipped" "$OUT/topk_tests.log" | cut -c1-300 | tail -8
  for tool in memcheck racecheck; do
    sanitized_pytest "$tool" "${T_TOPK_CSAN:-150}" "topk_$tool" tests/gpu/test_triton_indices_gpu.py \
      topk_cuda_op
  done
  timeout "${T_TOPKBENCH:-300}" python3 -m benchmarks.topk_bench --lengths "${TOPK_LENGTHS:-8192,16384,32768}" \
    --chunk-elements "" --kernel-configs "${TOPK_CONFIGS:-8192x8}" --cuda-warps "${TOPK_WARPS:-1,4,8,16}" --out "$OUT/topk.md" 2>&1 | grep -v Warn
fi
# The CUDA index forward (csrc/index_fwd.cu, issue 17): its tests, some under
# compute-sanitizer memcheck (the two-rows kernel at hd128 under racecheck too), then its
# table against Triton and the gather ceiling, by default with the one-row kernel's
# column (bit 4294967296, the default before perf-notes C79; IFWD_ARGS="--variants 1,2":
# columns under other FLEXSPARSE_CUDA_DEBUG values).
if [[ " $parts " == *" ifwd "* ]]; then
  timeout "${T_IFWD:-300}" python3 -m pytest -p no:cacheprovider tests/gpu/test_cuda_index_gpu.py \
    > "$OUT/ifwd_tests.log" 2>&1
  rc=$?; echo "ifwd tests rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/ifwd_tests.log" | cut -c1-300 | tail -25
  # columns: the default (two rows per warp where G <= 8) and one row per warp
  timeout "${T_IFWDBENCH:-240}" python3 -m benchmarks.cuda_index_bench ${IFWD_ARGS:---rounds 3 --variants 4294967296} 2>&1 \
    | grep -v Warning | tee "$OUT/cuda_index_bench.md"
fi
# The index forward's tests under compute-sanitizer: with ifwd unless IFWD_SAN=0, or alone
# as ifwdsan (a second call on the warm machine after "IFWD_SAN=0 ... ifwd").
if [[ ( " $parts " == *" ifwd "* && "${IFWD_SAN:-1}" != 0 ) || " $parts " == *" ifwdsan "* ]]; then
  sanitized_pytest memcheck "${T_IFWD_CSAN:-200}" ifwd_memcheck tests/gpu/test_cuda_index_gpu.py \
    "half_rows or narrow_addressing or one_stage or fully_padded or gqa or out_of_range or nan_in or two_rows"
  sanitized_pytest racecheck "${T_IFWD_RACE:-120}" ifwd_racecheck tests/gpu/test_cuda_index_gpu.py \
    "(two_rows and 128-3)"
fi
# The index forward's table from the second build (AB_CSRC, e.g. an older csrc/), after
# this build's (ifwd): IFWD_ARGS="--variants ''" AB_CSRC=.ab_base/csrc bash tests/gpu.sh ifwd ifwd_ab
if [[ " $parts " == *" ifwd_ab "* ]]; then
  if second_build_ok; then
    (cd "$ab_tree" && PYTHONPATH="$ab_tree${PYTHONPATH:+:$PYTHONPATH}" timeout "${T_IFWDBENCH:-240}" \
       python3 -m benchmarks.cuda_index_bench --variants "" ${IFWD_AB_ARGS:-} 2>&1) | grep -v Warning \
      | tee "$OUT/cuda_index_bench_other.md"
  fi
fi
# The CUDA index backward (csrc/index_bwd.cu, issue 17): its tests, some under
# compute-sanitizer memcheck, then its table with the variant bits' columns (68719476736:
# the dK/dV pass with one chain, before C80; 137438953472: the preprocess with 2-byte
# loads, before C81; 549755813888: the transposed lists on the caller's stream only,
# before C83; 755914244096: all three, the default before C80-C83; 17179869184: the dK/dV
# pass on the CUDA cores, C78, and 34359738368, the pipelined dQ pass, C74, by IBWD_ARGS)
# and the per-kernel split; then hd64 and hd256 against the default before C80-C83.
# ibwdprof (a second call on the warm machine): ncu of the dK/dV kernels, then ibwdrace's
# racecheck.
if [[ " $parts " == *" ibwd "* ]]; then
  timeout "${T_IBWD:-400}" python3 -m pytest -p no:cacheprovider tests/gpu/test_cuda_index_bwd_gpu.py \
    > "$OUT/ibwd_tests.log" 2>&1
  rc=$?; echo "ibwd tests rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/ibwd_tests.log" | cut -c1-300 | tail -25
  sanitized_pytest memcheck "${T_IBWD_CSAN:-200}" ibwd_memcheck tests/gpu/test_cuda_index_bwd_gpu.py \
    "(variant_kernels and 128) or (tensor_core and 128) or (short_chains and 128) or (vector_prep and 128) or side_stream or tensor_core_dkdv_pass_bias or fully_padded or duplicates"
  timeout "${T_IBWDBENCH:-300}" python3 -m benchmarks.cuda_index_bench --backward ${IBWD_ARGS:---split --rounds 3 --variants 68719476736,137438953472,549755813888,755914244096} 2>&1 \
    | grep -v Warning | tee "$OUT/cuda_index_bwd_bench.md"
  for d in 64 256; do
    timeout "${T_IBWDBENCH_D:-120}" python3 -m benchmarks.cuda_index_bench --backward --head-dim $d \
      --rounds 2 --variants 755914244096 2>&1 | grep -v Warning | tee -a "$OUT/cuda_index_bwd_bench.md"
  done
fi
if [[ " $parts " == *" ibwdprof "* ]]; then
  # What bounds the dK/dV pass (C77, C78, C80): ncu's instruction and stall counts of the
  # default on the tensor cores (C80), the one-chain kernel and the FMA one, 8K W=64 hd128.
  for bits in 0 68719476736 17179869184; do
    FLEXSPARSE_CUDA_DEBUG=$bits timeout "${T_IBWD_NCU:-90}" ncu --clock-control none -k regex:dkdv -c 1 \
      --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section InstructionStats \
      --section Occupancy --print-details all python3 -m benchmarks.index_bwd_once > "$OUT/ibwd_ncu_$bits.txt" 2>&1
    echo "ibwd ncu (debug $bits) rc=$?"
    grep -E "dkdv_|Duration|Executed Instructions  |Issued Warp Per|Warp Cycles Per Issued|Achieved Active Warps|L2 Cache Throughput|DRAM Throughput|Stall (Wait|Long|Short|Not Sel|Math)" \
      "$OUT/ibwd_ncu_$bits.txt" | cut -c1-120
  done
fi
# Racecheck of the index kernels without cuBLAS (tests/gpu/race_index_kernels.py: the
# tensor-core dK/dV test's configurations, no reference matmuls), then the test itself
# under racecheck with a kernel filter that matches nothing: under racecheck that test
# stopped in the cuBLAS matmuls of its reference whichever of our kernels was
# instrumented (perf-notes C78); this tells whether racecheck's presence alone does it.
if [[ " $parts " == *" ibwdprof "* || " $parts " == *" ibwdrace "* ]]; then
  for bits in ${RACE_BITS:-0 755914244096}; do   # the default; before C80-C83
    FLEXSPARSE_CUDA_DEBUG=$bits timeout "${T_IBWD_RACE:-120}" compute-sanitizer --tool racecheck \
      --kernel-name kns=index_ --error-exitcode 9 python3 tests/gpu/race_index_kernels.py ${RACE_DIMS:-128} \
      > "$OUT/index_racecheck_$bits.log" 2>&1
    rc=$?; echo "index kernels racecheck (debug $bits) rc=$rc"; [ $rc -eq 0 ] || status=1
    grep -E "RACECHECK SUMMARY|Internal|D=|Error" "$OUT/index_racecheck_$bits.log" | tail -6
  done
  [ "${RACE_NOFILTER:-1}" = 0 ] || sanitized_pytest racecheck "${T_IBWD_RACE0:-60}" ibwd_racecheck_nofilter_match \
    tests/gpu/test_cuda_index_bwd_gpu.py "tensor_core_dkdv_pass and 128-bf16" --kernel-name kns=no_such_kernel
fi
# Same-build A/B of CUDA kernel variants (FLEXSPARSE_CUDA_DEBUG bits), not part of "all":
#   AB_ROWS=full@8192@64,sliding@8192 AB_ARGS="--variants 0,256 --bwd" bash tests/gpu.sh ab
if [[ " $parts " == *" ab "* ]]; then
  timeout "${T_AB:-300}" python3 -m benchmarks.cuda_ab ${AB_ROWS:-} ${AB_ARGS:---bwd} 2>&1 \
    | grep -v Warning | tee "$OUT/cuda_ab.md"
fi
# Same-machine A/B of two builds (this one and the second one started above, with AB_FLAGS
# and/or AB_CSRC): cuda_bench --cuda-only over AB_ROWS, this build and the other in turn,
# AB_PASSES times each.
#   AB_ROWS=full@8192,causal@16384 AB_CSRC=.ab_base/csrc bash tests/gpu.sh build_ab
if [[ " $parts " == *" build_ab "* ]]; then
  if second_build_ok; then
    rows="${AB_ROWS:-full@8192,causal@16384,document@16384,sliding@8192,full@8192@64,full@8192@256}"
    for pass in $(seq "${AB_PASSES:-2}"); do
      for build in this other; do
        tree="$PWD"; [ $build = other ] && tree="$ab_tree"
        (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" timeout 200 python3 -m benchmarks.cuda_bench \
           "$rows" --cuda-only 2>&1) | grep "^| [a-z]" | grep -v "^| mask" \
          | awk -F'|' -v t="$build" -v p="$pass" '{print t, p, $2, $3, $4, "fwd", $5, "bwd", $10}' \
          | tee -a "$OUT/build_ab.txt"
      done
    done
  fi
fi
# The CUDA forward's timeline per key tile and at the edge between two work tiles (a second
# build, with -DFLEXSPARSE_FWD_TRACE, in a copy of the tree, started beside the main build;
# not part of "all"): TRACE_ROWS="full@8192@128 sliding@8192@128" bash tests/gpu.sh trace
if [[ " $parts " == *" trace "* ]]; then
  [ "${SKIP_MAIN_BUILD:-0}" = 1 ] || timeout 120 python3 tests/gpu/fwd_trace.py ${TRACE_ROWS:-} ${TRACE_ARGS:-} --plain-time 2>&1 \
    | grep TIME | tee "$OUT/fwd_trace_plain.txt"
  wait "$trace_pid"
  [ "$(cat "$trb.rc" 2>/dev/null)" = 0 ] \
    || { echo "trace build failed"; grep -E "error" "$OUT/trace_build.log" | head; }
  echo "trace build done $(( $(date +%s) - tr0 )) s after it started"
  # A call inside a kernel (a printf) makes ptxas serialize all its wgmmas (C7510): the
  # trace would then time another kernel than the plain build's.
  grep -q C7510 "$OUT/trace_build.log" && echo "WARNING: the trace build has serialized wgmmas (ptxas C7510)"
  (cd "$trb" && python3 -c "import flexsparse._C")  2>&1 | tail -1 | grep -i error && echo "the trace build does not load"
  PYTHONPATH="$trb${PYTHONPATH:+:$PYTHONPATH}" timeout "${T_TRACE:-240}" python3 tests/gpu/fwd_trace.py \
    ${TRACE_ROWS:-} ${TRACE_ARGS:-} --raw "$OUT" 2>&1 | tee "$OUT/fwd_trace.txt"
fi
# The CUDA backward's timeline per query step (a second build, with -DFLEXSPARSE_BWD_TRACE, in
# a copy of the tree; not part of "all"):
#   BTRACE_ROWS="full@8192@128 causal@8192@128" BTRACE_BITS=0,268435456 bash tests/gpu.sh btrace
if [[ " $parts " == *" btrace "* ]]; then
  wait "$btrace_pid"
  [ "$(cat "$btr.rc" 2>/dev/null)" = 0 ] \
    || { echo "backward trace build failed"; grep -E "error" "$OUT/btrace_build.log" | head; }
  echo "backward trace build done $(( $(date +%s) - bt0 )) s after it started"
  grep -q C7510 "$OUT/btrace_build.log" && echo "WARNING: the backward trace build has serialized wgmmas (ptxas C7510)"
  (cd "$btr" && python3 -c "import flexsparse._C")  2>&1 | tail -1 | grep -i error && echo "the backward trace build does not load"
  PYTHONPATH="$btr${PYTHONPATH:+:$PYTHONPATH}" timeout "${T_BTRACE:-240}" python3 tests/gpu/bwd_trace.py \
    ${BTRACE_ROWS:-} --bits "${BTRACE_BITS:-0}" --raw "$OUT" 2>&1 | tee "$OUT/bwd_trace.txt"
fi
# Per-kernel GPU time of a training step (torch.profiler): ours, and with SPLIT_ARGS=--flash
# FlexAttention's FLASH backend beside it (FA4 wheels installed, PYTHONPATH as in the
# two-call carry): SPLIT_ROWS=sliding@8192,causal@8192 SPLIT_ARGS=--flash bash tests/gpu.sh split
if [[ " $parts " == *" split "* ]]; then
  timeout "${T_SPLIT:-240}" python3 tests/gpu/profile_cuda_split.py ${SPLIT_ROWS:-} ${SPLIT_ARGS:-} 2>&1 \
    | grep -v Warning | tee "$OUT/split.txt"
fi
# Issue 16's whole step: fwd+bwd with a tensor-holding mask built every step against its
# descriptor compiled once (eager and compiled), 8K; then where an eager step's host time
# goes (both autograd paths of the CUDA op) and a profiler timeline of pipelined steps.
# Issue 16's mask builds: the build-op tests (among them the opt-in fused one-launch build
# against the two-kernel build), the fused kernel under memcheck and racecheck, then build
# times with the two builds taking turns (BUILD_ARGS replaces the default arguments).
if [[ " $parts " == *" build "* ]]; then
  timeout "${T_BUILD:-300}" python3 -m pytest -p no:cacheprovider tests/gpu/test_build_op_gpu.py \
    > "$OUT/build_tests.log" 2>&1
  rc=$?; echo "build tests rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/build_tests.log" | cut -c1-300 | tail -15
  # the fused build's kernel (opt-in bit) and grid_list_kernel (shared-memory tiles) on
  # small cases
  for tool in memcheck racecheck; do
    sanitized_pytest "$tool" "${T_BUILD_CSAN:-200}" "build_$tool" tests/gpu/test_build_op_gpu.py \
      "(fused_build and not 262144) or (grid_tiles and not 131072)"
  done
  timeout "${T_BUILDBENCH:-240}" python3 -m benchmarks.build_bench \
    ${BUILD_ARGS:---op-only --no-flex --graphed --lengths 8192,131072 --variants 0,8589934592,274877906944} 2>&1 \
    | grep -v Warning | tee "$OUT/build_bench.md"
fi
# buildgraph (issue 16): the build op at 8K and 128K replayed from a CUDA graph beside the
# eager op and FlexAttention's compiled create_block_mask, and each replay checked against
# an eager build after its input changed in place.
if [[ " $parts " == *" buildgraph "* ]]; then
  timeout "${T_BUILDGRAPH:-240}" python3 -m benchmarks.build_bench --op-only --graphed --lengths 8192,131072 2>&1 \
    | grep -v Warning | tee "$OUT/build_graph.md"
fi
# fwdedges (issue 15): the forward's work-tile edges. The two-query-buffer kernel's bitwise
# test (against the one-buffer kernel), then forward TFLOP/s in turns: the default and
# 2^44 = 17592186044416 (two query buffers at hd128, opt-in) on the one-buffer rows (hd128
# and hd256). Other variants: 2^48 = 281474976710656 (one buffer at hd64, where two are the
# default since C92), with hd64 rows such as causal@8192@64,
# sliding256@8192@64, sliding@8192@64, document@16384@64.
# EDGE_VARIANTS adds e.g. the probes 2^42 = 4398046511104 (queries loaded once per
# buffer) and 2^43 = 8796093022208 (no O store) (wrong results by design: their error
# column is large).
if [[ " $parts " == *" fwdedges "* ]]; then
  timeout "${T_EDGES_TESTS:-240}" python3 -m pytest -p no:cacheprovider -o addopts= -q -rA \
    tests/gpu/test_cuda_gpu.py -k two_query_buffers > "$OUT/fwdedges_tests.log" 2>&1
  rc=$?; echo "two-query-buffer tests rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "^PASSED|^FAILED|^ERROR" "$OUT/fwdedges_tests.log" | cut -c1-200 | tail -10
  [ "${EDGES_MEMCHECK:-1}" = 1 ] && sanitized_pytest memcheck "${T_EDGES_CSAN:-240}" fwdedges_memcheck \
    tests/gpu/test_cuda_gpu.py "two_query_buffers and (layout_64 or document)"
  timeout "${T_EDGES:-300}" python3 -m benchmarks.cuda_ab \
    ${EDGE_ROWS:-full@8192,causal@8192,sliding@8192,document@16384,prefix_lm@16384,sliding4096@8192,full@8192@256,causal@8192@256} \
    --variants ${EDGE_VARIANTS:-0,17592186044416} --rounds 3 2>&1 | grep -v Warning \
    | tee "$OUT/fwd_edges.md"
fi
if [[ " $parts " == *" step "* ]]; then
  timeout "${T_STEP:-240}" python3 -m benchmarks.step_bench ${STEP_ARGS:-} 2>&1 | grep -v Warning \
    | tee "$OUT/step_bench.md"
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 120 python3 tests/gpu/profile_step_host.py --steps 200 2>&1 | grep -v Warning \
    > "$OUT/step_host.txt"; grep "^|" "$OUT/step_host.txt"
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 120 python3 tests/gpu/profile_step_timeline.py 2>&1 | grep -v Warning \
    | tee "$OUT/step_timeline.md"
fi
if want cudabench; then
  # CUDABENCH_ARGS="--rounds 3": the backends take turns, medians (steadier ratios).
  # CUDABENCH_PROCS=N: N processes (same-build processes differ by up to 10% on one GPU,
  # each in its own direction), their tables merged by medians (cuda_bench --merge).
  procs="${CUDABENCH_PROCS:-1}"
  for p in $(seq 1 "$procs"); do
    timeout "${T_CUDABENCH:-240}" python3 -m benchmarks.cuda_bench ${CUDABENCH_ROWS:-} ${CUDABENCH_ARGS:-} 2>&1 \
      | grep -v Warning | tee "$OUT/cuda_bench.$p.md"
  done
  if [ "$procs" -gt 1 ]; then
    python3 -m benchmarks.cuda_bench --merge $(seq -f "$OUT/cuda_bench.%g.md" 1 "$procs") | tee "$OUT/cuda_bench.md"
  else
    mv "$OUT/cuda_bench.1.md" "$OUT/cuda_bench.md"
  fi
fi
# How the timer moves the ratios (docs/perf-notes.md C123): the timing probe, then the
# forward table by each timer in TIMING_TIMERS, each timing printed with its round (and
# place, where the backends take turns by runs). Needs FA4 (the carry's second call).
if [[ " $parts " == *" timing "* ]]; then
  rows="${TIMING_ROWS:-causal@8192,prefix_lm@16384,sliding4096@8192,full@8192}"
  timeout "${T_TIMING:-200}" python3 -m benchmarks.timing_probe "$rows" --host-ops 2>&1 | grep -v Warning \
    > "$OUT/timing.md"; grep "^|" "$OUT/timing.md"
  for timer in ${TIMING_TIMERS:-do_bench call_by_call}; do
    timeout "${T_TIMING_BENCH:-200}" python3 -m benchmarks.cuda_bench "$rows" --no-bwd --rounds 3 --per-round \
      --timer "$timer" 2>&1 | grep -v Warning | tee "$OUT/timing_$timer.md" | grep "^|"
  done
fi
# Host time per call of the CUDA backend, layer by layer, beside Flex's compiled call
# (tests/gpu/host_cuda_layers.py, docs/perf-notes.md C124), then the timing probe of the
# same rows with Flex's Triton backend (kernel times beside host times).
if [[ " $parts " == *" hostlayers "* ]]; then
  rows="${HOST_ROWS:-sliding256@8192@64,causal@8192}"
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "${T_HOST:-150}" python3 tests/gpu/host_cuda_layers.py "$rows" \
    2>&1 | grep -v Warning | tee "$OUT/host_layers.md" | grep "^|"
  # With build_ab in the same call: the same layers on the second build (AB_FLAGS/AB_CSRC),
  # its flexsparse imported from the side tree, after the first (both on a warm GPU).
  if [[ " $parts " == *" build_ab "* ]] && second_build_ok; then
    echo "hostlayers, second build (${AB_FLAGS:-} ${AB_CSRC:-}):"
    PYTHONPATH="$ab_tree${PYTHONPATH:+:$PYTHONPATH}" timeout "${T_HOST:-150}" python3 tests/gpu/host_cuda_layers.py "$rows" \
      2>&1 | grep -v Warning | tee "$OUT/host_layers_ab.md" | grep "^|"
  fi
  timeout "${T_HOST:-150}" python3 -m benchmarks.timing_probe "$rows" --flex 2>&1 | grep -v Warning \
    | tee "$OUT/host_timing.md" | grep "^|"
fi
if want tests || want demo; then
  timeout 150 python3 -m flexsparse demo 2>&1 | tee "$OUT/demo.txt" | grep -v Warning
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want bench; then
  timeout "${T_BENCH:-240}" python3 -m benchmarks.bench --no-indices --out "$OUT/bench.md" \
    ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -E "failed" "$OUT/bench.log" | tail -5
  timeout "${T_BENCH_IDX:-150}" python3 -m benchmarks.bench_indices --budget-s "${BUDGET_IDX:-80}" \
    --out "$OUT/bench_indices.md" > "$OUT/bench_indices.log" 2>&1
  echo "bench_indices rc=$?"
fi
if want scale && [ -f tests/gpu/scale.py ]; then
  timeout "${T_SCALE:-200}" python3 tests/gpu/scale.py --budget "${BUDGET_SCALE:-180}" \
    --out "$OUT/scale.md" > "$OUT/scale.log" 2>&1
  echo "scale rc=$?"
fi
# Issue 17's measurements, not part of "all": the random-row gather ceiling
# (PROBE_ARGS=--quick for the short sweep) and masks.topk against torch.topk.
if [[ " $parts " == *" probe "* ]]; then
  timeout "${T_PROBE:-150}" python3 -m benchmarks.gather_probe ${PROBE_ARGS:-} --out "$OUT/gather_probe.md" \
    > "$OUT/gather_probe.log" 2>&1
  echo "gather_probe rc=$?"; cat "$OUT/gather_probe.md" 2>/dev/null
  timeout "${T_TOPK:-240}" python3 -m benchmarks.topk_bench --out "$OUT/topk_bench.md" \
    > "$OUT/topk_bench.log" 2>&1
  echo "topk_bench rc=$?"; cat "$OUT/topk_bench.md" 2>/dev/null
fi
# Tuning aids, not part of "all": per-pass tile sweeps and per-kernel profiles.
#   SWEEP_ROWS=sliding@8192,document@8192 SWEEP_PASSES=dkdv,dq SWEEP_INDICES=0 bash tests/gpu.sh sweep
#   (SWEEP_ARGS: more bench flags, e.g. --bwd-mode two_pass --sweep-configs dkdv:64x64x4x2+dq:64x64x4x2)
#   PROFILE_ROWS=document@8192 PROFILE_ARGS= bash tests/gpu.sh profile   (empty: with Flex)
if [[ " $parts " == *" sweep "* ]]; then
  timeout "${T_SWEEP:-300}" python3 -m benchmarks.bench --sweep --rows "${SWEEP_ROWS:-causal@8192}" \
    --sweep-passes "${SWEEP_PASSES:-fwd,dkdv,dq}" --no-flex --no-sdpa --no-indices ${SWEEP_ARGS:-} 2>&1 \
    | grep -E "^sweep" | tee "$OUT/sweep.log"
  [ "${SWEEP_INDICES:-1}" = 0 ] || timeout "${T_SWEEP:-300}" python3 -m benchmarks.bench_indices --sweep-only 2>&1 | tail -40 \
    | tee "$OUT/sweep_indices.log"
fi
if [[ " $parts " == *" profile "* ]]; then
  timeout "${T_PROFILE:-120}" python3 -m benchmarks.bench --profile --rows "${PROFILE_ROWS:-causal@8192}" \
    --no-sdpa --no-indices ${PROFILE_ARGS---no-flex} > "$OUT/profile.log" 2>&1
  grep -vE "^-+$" "$OUT/profile.log" | cut -c1-160 | tail -40
fi
# Nsight Compute on the backward kernels of one row, ours vs FlexAttention's (hardware
# counters; clocks left alone): NCU_ROW=full@8192 bash tests/gpu.sh ncu
# (the CUDA forward alone: NCU_KERNELS=fwd_kernel NCU_ARGS="--backend cuda --no-flex";
# NCU_EXTRA adds ncu arguments, e.g. "--section MemoryWorkloadAnalysis_Tables" for the
# shared-memory table; the whole report is in $OUT/ncu.log)
if [[ " $parts " == *" ncu "* ]]; then
  timeout "${T_NCU:-300}" ncu --clock-control none --profile-from-start off \
    -k "regex:${NCU_KERNELS:-_attn_bwd_one_launch|triton_tem_fused_flex_attention_backward}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" ${NCU_EXTRA:-} \
    python3 tests/gpu/ncu_row.py "${NCU_ROW:-full@8192}" ${NCU_ARGS:-} > "$OUT/ncu.log" 2>&1
  echo "ncu rc=$?"
  grep -E "^  [a-z_]+.*\(|Duration|Elapsed Cycles|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Active Warps Per|Eligible Warps|Executed Ipc A|DRAM Throughput|stalled" "$OUT/ncu.log" \
    | awk '$NF+0 >= 0.05 || !/stalled/' | head -90
fi
# Per-instruction warp-stall samples of one kernel (SourceCounters):
#   NCU_KERNELS=fwd_kernel NCU_ARGS="--backend cuda --no-flex" bash tests/gpu.sh ncusrc
if [[ " $parts " == *" ncusrc "* ]]; then
  timeout "${T_NCU:-300}" ncu --clock-control none --profile-from-start off -c 1 \
    -k "regex:${NCU_KERNELS:-fwd_kernel}" --section SourceCounters --section WarpStateStats \
    -o "$OUT/src" -f python3 tests/gpu/ncu_row.py "${NCU_ROW:-full@8192}" ${NCU_ARGS:-} \
    > "$OUT/ncusrc.log" 2>&1
  echo "ncusrc rc=$?"
  ncu --import "$OUT/src.ncu-rep" --page source --csv --print-source sass > "$OUT/src.csv" 2>&1
  python3 tests/gpu/ncu_source_top.py "$OUT/src.csv" --top "${NCU_TOP:-40}" 2>&1 | tee "$OUT/ncusrc_top.txt"
  rm -f "$OUT/src.ncu-rep"
fi
# Executed instructions per opcode, our CUDA kernels against FLASH's (FA4 wheels installed,
# PYTHONPATH set as in the two-call carry), rows: NCU_ROW=full@8192,sliding@8192 bash tests/gpu.sh ncuhist
# (docs/perf-notes.md C24; the counts are per 128x128 forward tile and per 64-row backward
# step of a CTA for B*L = 16K, H = 16). NCUHIST_KERNELS="FlashAttentionBackwardSm90|bwd_kernel":
# the backward kernels only (the forward's histogram then reports no rows).
if [[ " $parts " == *" ncuhist "* ]]; then
  for row in $(echo "${NCU_ROW:-full@8192}" | tr ',' ' '); do
    d="$OUT/ncuhist_${row//@/_}"; mkdir -p "$d"
    timeout "${T_NCU:-300}" ncu --clock-control none --profile-from-start off \
      -k "regex:${NCUHIST_KERNELS:-FlashAttentionForwardSm90|FlashAttentionBackwardSm90|fwd_kernel|bwd_kernel}" \
      --section SourceCounters -o "$d/src" -f python3 tests/gpu/ncu_row.py "$row" \
      --backend cuda --flash > "$d/ncuhist.log" 2>&1
    echo "ncuhist $row rc=$?"
    for k in fwd_kernel bwd_kernel FlashAttentionForwardSm90 FlashAttentionBackwardSm90; do
      ncu --import "$d/src.ncu-rep" -k "regex:$k" --page source --csv --print-source sass > "$d/$k.csv" 2>&1
    done
    rm -f "$d/src.ncu-rep"
    L=$(echo "$row" | cut -d@ -f2); tiles=$(( (16384 / L) * 16 * (L / 128) * (L / 128) ))
    python3 tests/gpu/ncu_opcode_hist.py "$d/fwd_kernel.csv" "$d/FlashAttentionForwardSm90.csv" --per "$tiles" --top 40
    python3 tests/gpu/ncu_opcode_hist.py "$d/bwd_kernel.csv" "$d/FlashAttentionBackwardSm90.csv" --per $(( tiles * 2 )) --top 45
    # where the warps wait, by opcode, and how the exponentials are spaced (perf-notes C63)
    python3 tests/gpu/ncu_opcode_hist.py "$d/bwd_kernel.csv" "$d/FlashAttentionBackwardSm90.csv" --stall stall_wait --top 12
    python3 tests/gpu/sass_gaps.py "$d"/*.csv
    # the backward's stall samples by phase of the step, ours and FLASH's (perf-notes C110)
    python3 tests/gpu/ncu_phases.py "$d/bwd_kernel.csv" "$d/FlashAttentionBackwardSm90.csv" --min 1
    gzip -f "$d"/*.csv
  done
fi
# Corrupted and reused descriptors on the GPU backends under compute-sanitizer memcheck.
if [[ " $parts " == *" fuzz "* ]]; then
  FLEXSPARSE_UNDER_SANITIZER=1 timeout "${T_FUZZ:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -p no:cacheprovider -o addopts= -q tests/gpu/test_fuzz_gpu.py ${FUZZ_K:+-k "$FUZZ_K"} \
    > "$OUT/fuzz.log" 2>&1
  rc=$?; echo "fuzz under compute-sanitizer rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "ERROR SUMMARY|Invalid|passed|failed|FAILED" "$OUT/fuzz.log" | tail -12
fi
# Out-of-bounds check of the kernels on odd sizes: compute-sanitizer memcheck (slow; a few tests).
if [[ " $parts " == *" sanitize "* ]]; then
  FLEXSPARSE_UNDER_SANITIZER=1 timeout "${T_SANITIZE:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -x -p no:cacheprovider tests/gpu/test_triton_gpu.py tests/gpu/test_triton_indices_gpu.py \
    -k "${SANITIZE_K:-odd_lengths or fully_masked or noncontiguous or full_bias_hd128 or (mask_kinds and bf16) or gqa}" > "$OUT/sanitize.log" 2>&1
  rc=$?; echo "compute-sanitizer rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "ERROR SUMMARY|Invalid|passed|failed" "$OUT/sanitize.log" | tail -8
fi
# The CUDA backend (csrc/) under compute-sanitizer: memcheck over its tests of odd sizes and
# masks; racecheck and synccheck over a few small calls (tests/gpu/cuda_sanitize_cases.py).
# CSAN_PYTEST=0 skips the pytest memcheck (only the cases file's, with CSAN_TOOLS=memcheck).
if [[ " $parts " == *" csanitize "* ]] && [ "${CSAN_PYTEST:-1}" = 1 ]; then
  FLEXSPARSE_UNDER_SANITIZER=1 timeout "${T_CSAN:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -p no:cacheprovider -o addopts= -q tests/gpu/test_cuda_gpu.py \
    -k "${CSAN_K:-odd_lengths or fully_masked or gqa or (mask_kinds and bf16) or head_dims or poisoned or bias or softcap or store_variants}" \
    > "$OUT/csan_memcheck.log" 2>&1
  rc=$?; echo "csrc memcheck rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "ERROR SUMMARY|Invalid|passed|failed|FAILED" "$OUT/csan_memcheck.log" | tail -8
fi
if [[ " $parts " == *" csanitize "* ]]; then
  for tool in ${CSAN_TOOLS:-racecheck synccheck}; do
    timeout "${T_CSAN_TOOL:-200}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      python3 tests/gpu/cuda_sanitize_cases.py ${CSAN_CASES:+--only "$CSAN_CASES"} > "$OUT/csan_$tool.log" 2>&1
    rc=$?; echo "csrc $tool rc=$rc"; [ $rc -eq 0 ] || status=1
    grep -E "ERROR SUMMARY|RACE|Race|hazard|Error|: ok" "$OUT/csan_$tool.log" | sort | uniq -c | sort -rn | head -8
  done
fi
echo "================ tables"
for f in "$OUT"/bench.md "$OUT"/bench_indices.md "$OUT"/scale.md; do [ -f "$f" ] && { echo "## $(basename "$f")"; cat "$f"; }; done
exit $status
