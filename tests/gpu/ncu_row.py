"""One forward + backward of a bench row, ours then FlexAttention's, each exactly once after
a warm-up outside the profiled range: the workload for an Nsight Compute comparison of
the two backward kernels (tests/gpu.sh ncu runs it under ncu).

    ncu --clock-control none --profile-from-start off -k regex:"..." \
        python3 tests/gpu/ncu_row.py full@8192[@64]

Warm-up (compiles, autotune-free) runs before cudaProfilerStart, so ncu sees only the
measured launches.
"""
import os
import sys
import argparse

import torch

import flexsparse
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from benchmarks import bench


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("row", help="kind@L[@D], e.g. full@8192 or full@8192@64")
    ap.add_argument("--backend", default="triton", help="ours: triton or cuda")
    ap.add_argument("--no-flex", action="store_true", help="ours only")
    ap.add_argument("--flash", action="store_true",
                    help="FlexAttention with its FLASH backend (FA4 wheels installed) in place of Triton")
    args = ap.parse_args()
    [(kind, L, D)] = bench.parse_rows(args.row)
    dev = torch.device("cuda")
    B = max(1, bench.TOKENS // L)
    H = bench.H
    mk = lambda *s: torch.randn(*s, device=dev, dtype=bench.DTYPE, requires_grad=True)  # noqa
    q, k, v = mk(B, H, L, D), mk(B, H, L, D), mk(B, H, L, D)
    do = torch.randn(B, H, L, D, device=dev, dtype=bench.DTYPE)
    fs_mask, mask_mod, per_head, _, has_bias = bench.make_case(kind, B, L, device=dev)
    # the bias row: a (B, H, L, L) bias with dbias, as in the bench
    bias = mk(B, H, L, L) if has_bias else None
    desc = fs_mask.compile(B, H, H, L, L, device=dev)
    from torch.nn.attention.flex_attention import flex_attention
    fa = torch.compile(flex_attention, dynamic=False)
    bm = bench.flex_block_mask(desc, mask_mod, per_head, L, dev)
    flash = {"BACKEND": "FLASH"} if args.flash else None
    score_mod = (lambda score, b, h, qi, kv: score + bias[b, h, qi, kv]) if has_bias else None
    steps = [lambda: flexsparse.attention(q, k, v, desc, bias=bias,
                                          backend=args.backend).backward(do),
             lambda: fa(q, k, v, score_mod=score_mod, block_mask=bm,
                        kernel_options=flash).backward(do)]
    if args.no_flex:
        steps = steps[:1]
    for step in steps:            # compile and warm up
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for step in steps:
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"ncu_row {kind} L={L} D={D}: ours and flex ran once each in the profiled range")


if __name__ == "__main__":
    main()
