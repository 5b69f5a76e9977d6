"""Registers, spills and shared memory of the kernels a bench row launches, compiled for
sm_90 on a machine without a GPU, with the argument specializations Triton applies at run
time (unit strides as constants, 16-divisible pointers and integers). Its counts agree
with what tests/gpu/kernel_stats.py read on the device (causal 8K hd128: forward 246
registers, no spills; one-launch backward 255 with small spills). For compile coverage
of rare flag combinations see tests/gpu/aot_compile_check.py.

    python tests/gpu/aot_stats.py [--rows causal@8192,causal_bias@4096] [--d 128]
                                  [--modes auto] [--dump DIR] [--configs C]

Runs our launchers (ops/triton_block.py forward and backward) on CPU tensors of the bench
shapes, with each kernel launch replaced by a compile; prints one line per launch.
`--dump DIR` also writes each kernel's TTGIR, PTX and SASS there. Needs TRITON_INTERPRET
unset and Triton's bundled ptxas / cuobjdump.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("aot_stats: unset TRITON_INTERPRET (it compiles for the GPU)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from benchmarks import bench  # noqa: E402
from flexsparse.ops import triton_block as tb  # noqa: E402
from flexsparse.ops.kernel_options import KernelOptions  # noqa: E402

# the kernel options every launch below is built with (--configs forces tiles)
OPTIONS = KernelOptions()

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def resource_usage(cubin):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path],
                              capture_output=True, text=True).stdout
    got = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k: int(v) for k, v in got.items()}


def sass(cubin):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path],
                              capture_output=True, text=True).stdout


def ptxas_spills(ptx):
    """'stores/loads' bytes as ptxas -v reports them for this PTX."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", path, "-o",
                              os.path.join(d, "k.o")], capture_output=True, text=True)
    got = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stdout + res.stderr)
    return f"{got.group(1)}/{got.group(2)}" if got else "?"


class Compiler:
    """Stands in for `kernel[grid](...)`: binds the arguments as the JIT does, compiles."""

    def __init__(self, dump=None, tag=""):
        self.backend = make_backend(TARGET)
        self.binders = {}
        self.dump = dump
        self.tag = tag
        self.lines = []

    def __call__(self, kernel, grid, args, kwargs, warps, stages):
        fn = kernel
        if fn not in self.binders:
            self.binders[fn] = create_function_from_signature(fn.signature, fn.params,
                                                              self.backend)
        kw = dict(kwargs, num_warps=warps, num_stages=stages)
        bound, spec, _ = self.binders[fn](*args, **kw)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kw, bound, spec,
                                                              kw)
        src = ASTSource(fn, signature, constexprs, attrs)
        ck = triton.compile(src, target=TARGET, options=options.__dict__)
        use = resource_usage(ck.asm["cubin"])
        spills = ptxas_spills(ck.asm["ptx"])
        line = (f"{self.tag:28} {fn.__name__:22} {warps}w {stages}s  regs {use.get('REG')}"
                f"  spill st/ld {spills}  stack {use.get('STACK')}"
                f"  shared {ck.metadata.shared}  grid {grid}")
        print(line, flush=True)
        self.lines.append(line)
        if self.dump:
            os.makedirs(self.dump, exist_ok=True)
            base = os.path.join(self.dump, f"{self.tag.replace(' ', '_')}_{fn.__name__}")
            for ext in ("ttgir", "ptx"):
                with open(f"{base}.{ext}", "w") as f:
                    f.write(ck.asm[ext])
            with open(f"{base}.sass", "w") as f:
                f.write(sass(ck.asm["cubin"]))
        return None


def run_row(kind, L, D, modes, dump):
    B = max(1, bench.TOKENS // L)
    dev = torch.device("cpu")
    fs_mask, _, _, _, has_bias = bench.make_case(kind, B, L, device=dev)
    mk = lambda *s: torch.randn(*s, dtype=torch.bfloat16)  # noqa: E731
    q, k, v, do = (mk(B, bench.H, L, D) for _ in range(4))
    bias = mk(B, bench.H, L, L) if has_bias else None
    mt = fs_mask.compile(B, bench.H, bench.H, L, L, device=dev).mask_tensors()
    out, lse = torch.empty_like(q), torch.empty(B, bench.H, L)
    scale = D ** -0.5
    saved = tb._launch
    try:
        tb._launch = Compiler(dump, f"{kind}@{L} d{D} fwd")
        tb.forward(q, k, v, bias, mt, 128, 128, scale, 0.0, False, OPTIONS)
        for mode in modes:
            tb._launch = Compiler(dump, f"{kind}@{L} d{D} bwd {mode}")
            tb.backward(do, None, q, k, v, out, lse, bias, mt, 128, 128, scale, 0.0, False,
                        has_bias, OPTIONS._replace(bwd_mode=mode))
    finally:
        tb._launch = saved


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="causal@8192")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--modes", default="auto")
    ap.add_argument("--dump", default=None)
    ap.add_argument("--configs", default="",
                    help="tile override as in bench --sweep-configs, e.g. "
                         "dkdv:64x64x4x2+dq:64x64x4x2")
    args = ap.parse_args(argv)
    global OPTIONS
    for combo in bench.parse_combos(args.configs):
        OPTIONS = OPTIONS._replace(**{f"{w}_config": c for w, c in combo.items()})
    for spec in args.rows.split(","):
        kind, L = spec.split("@")
        run_row(kind, int(L), args.d, args.modes.split(","), args.dump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
