#!/usr/bin/env bash
# Same-machine A/B of the Python around the mask-build op (issue 16): benchmarks.build_bench
# --op-only with this checkout's flexsparse/ (new), then with flexsparse/ and ops/ of an
# older commit beside this build's flexsparse._C (old), then new again, so that drift
# between runs shows. Only Python differs; the extension is the one tests/gpu.sh built.
#   device: bash tests/gpu.sh none && bash tests/gpu/build_host_ab.sh 12c2ffd [8192,131072]
# (the commit must be in the carried checkout's history; the default is the commit before
# the Python trim of 099fe74)
set -u
OLD="${1:-12c2ffd}"
LENGTHS="${2:-8192,131072}"
OUT="${OUT:-$PWD/.out}"; mkdir -p "$OUT"
tree=/tmp/flexsparse_old; rm -rf "$tree"; mkdir -p "$tree"
git archive "$OLD" flexsparse ops benchmarks | tar -x -C "$tree" || { echo "no commit $OLD"; exit 1; }
cp flexsparse/_C*.so "$tree/flexsparse/" || { echo "flexsparse._C not built"; exit 1; }
# the editable install maps flexsparse.ops to ops/; the old tree gets the same through a link
ln -s ../ops "$tree/flexsparse/ops" 2>/dev/null || true
bench() {   # $1 = label, $2 = tree
  (cd "$2" && PYTHONPATH="$2:/tmp/site" python3 -m benchmarks.build_bench --lengths "$LENGTHS" --op-only 2>&1) \
    | grep "^| [a-z]" | awk -F'|' -v t="$1" '{print t, $2, $3, $4}' | tee -a "$OUT/build_host_ab.txt"
}
bench new1 "$PWD"; bench old "$tree"; bench new2 "$PWD"
