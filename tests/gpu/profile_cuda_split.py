"""Where a training step's GPU time goes, per kernel (torch.profiler): the forward, the
backward's preprocess / main / postprocess kernels and the glue around them, for a few
benchmark rows; with --flash the same step through FlexAttention's FLASH backend (FA4
wheels installed) after ours, so that the two backwards' pre- and postprocess kernels and
main kernels can be set side by side. Usage on the device:

    python3 tests/gpu/profile_cuda_split.py [rows] [--flash]   rows: kind@L[@D],... (bench rows)
"""
import os
import sys

import torch

import flexsparse
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from benchmarks.bench import flex_block_mask, make_case, parse_rows  # noqa: E402
from benchmarks.kernel_split import per_kernel as kernel_times, print_split  # noqa: E402

H, TOKENS, DTYPE = 16, 16384, torch.bfloat16


def per_kernel(step, title, reps=5):
    print_split(kernel_times(step, reps), f"{title}, {reps} steps")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    spec = args[0] if args else "sliding@8192,document@16384,full@8192"
    for kind, L, D in parse_rows(spec):
        item = f"{kind}@{L}@{D}"
        B = max(1, TOKENS // L)
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=DTYPE, requires_grad=True)
                   for _ in range(3))
        fs_mask, mask_mod, per_head = make_case(kind, B, L, device=q.device)[:3]
        desc = fs_mask.compile(B, H, H, L, L, device=q.device)
        do = torch.randn(B, H, L, D, device="cuda", dtype=DTYPE)

        def ours():
            out = flexsparse.attention(q, k, v, desc, backend="cuda")
            torch.autograd.grad(out, (q, k, v), do)
        per_kernel(ours, f"{item} cuda")
        if "--flash" in sys.argv:
            from torch.nn.attention.flex_attention import flex_attention
            torch._dynamo.reset()
            fa = torch.compile(flex_attention, dynamic=False)
            bm = flex_block_mask(desc, mask_mod, per_head, L, q.device)

            def flash():
                out = fa(q, k, v, block_mask=bm, kernel_options={"BACKEND": "FLASH"})
                torch.autograd.grad(out, (q, k, v), do)
            per_kernel(flash, f"{item} flex FLASH")


if __name__ == "__main__":
    main()
