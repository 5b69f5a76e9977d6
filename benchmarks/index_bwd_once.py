"""One CUDA index backward (csrc/index_bwd.cu) for a profiler to look at: random sorted
lists, bf16, B=1, Hq=16, Hkv=4, through flexsparse.attention(..., deterministic=True),
whose gradients take the CUDA index backward. FLEXSPARSE_CUDA_DEBUG picks kernel
variants as usual.

    ncu -k regex:dkdv -c 1 --section InstructionStats python -m benchmarks.index_bwd_once [L] [W] [D]
"""
import sys

import torch

import flexsparse
from flexsparse import masks


def main(L=8192, W=64, D=128):
    torch.manual_seed(0)
    q = torch.randn(1, 16, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 4, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    lists = torch.sort(torch.randint(0, L, (1, 4, L, W), device="cuda", dtype=torch.int32),
                       -1).values
    out = flexsparse.attention(q, k, v, masks.indices(lists), backend="cuda", deterministic=True)
    out.float().sum().backward()
    torch.cuda.synchronize()
    print(f"one index backward: L={L} W={W} D={D}, grads finite:",
          all(bool(t.grad.isfinite().all()) for t in (q, k, v)))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
