"""Host time per call: forward and forward + backward on a problem so small that the GPU
waits for the CPU, so wall time per call is the Python / dispatch / launch cost. Ours
(flexsparse.attention, backend="triton"), optionally an older copy of ops/triton_block.py
(--ab-old, as in flexsparse.bench) and FlexAttention (compiled).

    python3 tests/gpu/host_overhead.py [--kind sliding] [--ab-old PATH] [--calls 300]
"""
import argparse
import contextlib
import time

import torch

import flexsparse
from flexsparse import bench


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="sliding")
    ap.add_argument("--L", type=int, default=256)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--ab-old", metavar="PATH")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile our forward + backward calls (top functions by own time)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    B, H, L, D = 1, 2, args.L, 64
    mk = lambda: torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16,  # noqa: E731
                             requires_grad=True)
    q, k, v = mk(), mk(), mk()
    do = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)
    fs_mask, mask_mod, per_head, _, _ = bench.make_case(args.kind, B, L, device=dev)
    desc = fs_mask.compile(B, H, H, L, L, device=dev)
    impls = {"ours": contextlib.nullcontext}
    if args.ab_old:
        old = bench.load_block_module(args.ab_old)
        impls["old"] = lambda: bench._block_module(old)
    for name, ctx in impls.items():
        with ctx():
            with torch.no_grad():
                fwd = per_call_us(lambda: flexsparse.attention(q, k, v, desc, backend="triton"),
                                  args.calls)
            fb = per_call_us(lambda: flexsparse.attention(q, k, v, desc, backend="triton")
                             .backward(do), args.calls)
        print(f"host {name} {args.kind} L={L}: fwd {fwd:.0f} us/call, fwd+bwd {fb:.0f} us/call")
    if args.profile:
        import cProfile
        import pstats
        step = lambda: flexsparse.attention(q, k, v, desc, backend="triton").backward(do)  # noqa
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            step()
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    from torch.nn.attention.flex_attention import flex_attention
    fa = torch.compile(flex_attention, dynamic=False)
    bm = bench.flex_block_mask(desc, mask_mod, per_head, L, dev)
    with torch.no_grad():
        fwd = per_call_us(lambda: fa(q, k, v, block_mask=bm), args.calls)
    fb = per_call_us(lambda: fa(q, k, v, block_mask=bm).backward(do), args.calls)
    print(f"host flex {args.kind} L={L}: fwd {fwd:.0f} us/call, fwd+bwd {fb:.0f} us/call")


if __name__ == "__main__":
    main()
