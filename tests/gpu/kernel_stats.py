"""Registers, spills and shared memory of the block kernels as compiled at run time (with
Triton's argument specializations; tests/gpu/aot_stats.py gives the same counts off the
device).

    python tests/gpu/kernel_stats.py [--rows causal@8192,sliding@8192] [--d 128]

Runs one forward + backward per row and backward mode (bf16, H=16, B*L=16K), then prints
one line per compiled kernel variant found in the JIT caches.
"""
import os
import argparse
import sys

import torch

import flexsparse
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from benchmarks import bench
from flexsparse.ops import triton_block_bwd, triton_block_fwd

KERNELS = {"_attn_fwd": triton_block_fwd, "_attn_bwd_dkdv": triton_block_bwd,
           "_attn_bwd_dq": triton_block_bwd, "_attn_bwd_one_launch": triton_block_bwd,
           "_bwd_preprocess": triton_block_bwd}


def compiled_variants(fn):
    """(key, CompiledKernel) for each variant of a JITFunction (Triton 3.x cache layout)."""
    for caches in getattr(fn, "device_caches", {}).values():
        cache = caches[0] if isinstance(caches, tuple) else caches
        for key, kernel in getattr(cache, "items", lambda: [])():
            yield key, kernel


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="causal@8192,sliding@8192")
    ap.add_argument("--d", type=int, default=128)
    args = ap.parse_args(argv)
    dev = torch.device("cuda", torch.cuda.current_device())
    for spec in args.rows.split(","):
        kind, L = spec.split("@")
        L = int(L)
        B = max(1, bench.TOKENS // L)
        fs_mask, *_ = bench.make_case(kind, B, L, device=dev)
        mk = lambda: torch.randn(B, bench.H, L, args.d, device=dev,  # noqa: E731
                                 dtype=torch.bfloat16, requires_grad=True)
        q, k, v = mk(), mk(), mk()
        for mode in ("two_pass", "one_launch", "atomic_dq"):
            flexsparse.attention(q, k, v, fs_mask, backend="triton",
                                 kernel_options={"bwd_mode": mode}).sum().backward()
    torch.cuda.synchronize()
    print(f"{'kernel':24} {'regs':>5} {'spills':>7} {'shared':>7} {'warps':>5}  constexprs")
    for name, module in KERNELS.items():
        fn = getattr(module, name)
        for key, kern in compiled_variants(fn):
            md = kern.metadata
            cx = {k: v for k, v in (getattr(kern.src, "constants", {}) or {}).items()
                  if isinstance(k, str) and k.isupper()}
            print(f"{name:24} {getattr(kern, 'n_regs', '?'):>5} {getattr(kern, 'n_spills', '?'):>7} "
                  f"{md.shared:>7} {md.num_warps:>5}  {cx}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
