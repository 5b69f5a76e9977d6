"""Copy FlexAttention's compiled Triton kernels (source, TTGIR, PTX, cubin) for one bench row
into a folder, to compare them with ours off the device (tests/gpu/aot_stats.py --dump).

    python tests/gpu/dump_flex_kernels.py OUTDIR [--row full@8192] [--d 128]

Uses a fresh Triton and Inductor cache so that only this row's kernels are there.
"""
import argparse
import os
import shutil
import sys
import tempfile


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--row", default="full@8192")
    ap.add_argument("--d", type=int, default=128)
    args = ap.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="flexdump_")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
    from benchmarks import bench
    kind, L = args.row.split("@")
    L = int(L)
    B = max(1, bench.TOKENS // L)
    dev = torch.device("cuda")
    fs_mask, mask_mod, per_head, _, _ = bench.make_case(kind, B, L, device=dev)
    desc = fs_mask.compile(B, bench.H, bench.H, L, L, device=dev)
    bm = bench.flex_block_mask(desc, mask_mod, per_head, L, dev)
    mk = lambda: torch.randn(B, bench.H, L, args.d, device=dev, dtype=torch.bfloat16,  # noqa
                             requires_grad=True)
    q, k, v = mk(), mk(), mk()
    fa = torch.compile(flex_attention, dynamic=False)
    fa(q, k, v, block_mask=bm).sum().backward()
    torch.cuda.synchronize()
    os.makedirs(args.outdir, exist_ok=True)
    n = 0
    for root, _, files in os.walk(cache):
        for f in files:
            path = os.path.join(root, f)
            keep = ("flex_attention" in f) or (f.endswith(".py") and "flex_attention"
                                                in open(path, errors="ignore").read())
            if keep and os.path.getsize(path) < 4_000_000:
                shutil.copy(path, os.path.join(args.outdir, f"{n:02d}_{f}"))
                n += 1
    print(f"dump_flex_kernels: {n} files into {args.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
