"""Rate of fp32 atomic adds of whole rows into random rows (perf-notes, "Why the
deterministic backward trails Triton's atomic one"): what a query-major index backward
that adds dK and dV rows by atomics would pay. `Tensor.index_add_` on CUDA adds each
source row into its destination row with per-element atomics, one warp's addresses
contiguous, so the L2 sees 32-byte sector atomics, as Triton's atomic backward makes.

    python -m benchmarks.atomic_probe [--rows 32768] [--adds 2097152] [--dims 64,128,256]

Prints, per head dim, the time of N row adds into a (rows, D) fp32 table, the payload rate
(N * D * 4 bytes / time) and the 32-byte sector atomics per second.
"""
import argparse

import torch
from triton.testing import do_bench


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32768, help="destination rows (B*Hkv*Lk)")
    ap.add_argument("--adds", type=int, default=1 << 21, help="row adds (list entries)")
    ap.add_argument("--dims", default="64,128,256")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.adds} row adds "
          f"into {args.rows} random rows")
    print("| D | ms | payload GB/s | sector atomics G/s |")
    print("|---|---|---|---|")
    for D in (int(d) for d in args.dims.split(",")):
        dst = torch.zeros(args.rows, D, device="cuda")
        src = torch.randn(args.adds, D, device="cuda")
        idx = torch.randint(0, args.rows, (args.adds,), device="cuda")
        ms = do_bench(lambda: dst.index_add_(0, idx, src), warmup=5, rep=50)
        payload = args.adds * D * 4
        print(f"| {D} | {ms:.3f} | {payload / ms / 1e6:.0f} | {payload / 32 / ms / 1e6:.1f} |")


if __name__ == "__main__":
    main()
