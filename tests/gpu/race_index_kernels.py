"""The CUDA index kernels (csrc/index_fwd.cu, csrc/index_bwd.cu) alone, for
compute-sanitizer racecheck: the configurations of the GPU tests of the tensor-core dK/dV
pass and the two-rows forward (G = 1, 3, 8, 17, 4; W = 7 to 1000; hd 64, 128, 256; fp16
and bf16; -1, out-of-range and duplicate entries; keys no list names; a bias and softcap),
each run twice.
No reference computation, so no cuBLAS kernel runs: under racecheck the
GPU tests stopped inside cuBLAS's matmuls of their float64 rule (perf-notes C78), whose
kernels racecheck also reports on. Checks what it can without a reference: the
gradients finite, two runs bitwise equal, keys no list names get dk = dv = 0.

    compute-sanitizer --tool racecheck --kernel-name kns=index_ python3 tests/gpu/race_index_kernels.py [D ...]
"""
import sys

import torch

from flexsparse.ops import MaskTensors

DEV = "cuda"


def lists(B, Hkv, Lq, Lk, W, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    idx = torch.randint(0, Lk, (B, Hkv, Lq, W), device=DEV, generator=g)
    idx = torch.where(torch.rand(idx.shape, device=DEV, generator=g) < 0.1, -1, idx)
    idx = torch.where(idx >= Lk - 13, -1, idx)             # the last 13 keys unlisted
    idx[0, 0, 1 % Lq] = -1                                  # a fully padded row
    idx[-1, 0, 0, W // 2] = Lk + 3                          # out of range: read nothing
    idx[-1, -1, 3 % Lq, : min(W, 3)] = 7                    # duplicates of key 7
    return idx.to(torch.int32)


def one(B, G, Hkv, Lq, Lk, D, W, dtype, seed, bias=False, softcap=0.0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, device=DEV).to(dtype)
               for h, n in ((Hkv * G, Lq), (Hkv, Lk), (Hkv, Lk)))
    idx = lists(B, Hkv, Lq, Lk, W, seed)
    b = torch.randn(B, Hkv * G, Lq, Lk, device=DEV).to(dtype) if bias else None
    scale = D ** -0.5
    mt = MaskTensors(attn_indices=idx)
    out, lse = torch.ops.flexsparse.cuda_attention(q, k, v, b, *mt, 128, 128, scale, softcap, False)
    do = torch.randn(out.shape, device=DEV).to(dtype)
    dlse = torch.randn(lse.shape, device=DEV)
    runs = [torch.ops.flexsparse.cuda_attention_backward(do, dlse, q, k, v, out, lse, b, *mt, 128,
                                                         128, scale, softcap, False, False)[:3]
            for _ in range(2)]
    for name, x, y in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(x, y), (name, "two runs differ", G, W, D)
        assert bool(x.isfinite().all()), (name, "not finite", G, W, D)
    _, dk, dv = runs[0]
    assert torch.all(dk[:, :, Lk - 13:] == 0) and torch.all(dv[:, :, Lk - 13:] == 0), (G, W, D)
    assert bool(out.isfinite().all())


def main(dims):
    for D in dims:
        for dtype in (torch.float16, torch.bfloat16):
            for G, W, seed in ((1, 7, 1), (3, 40, 2), (8, 100, 3), (17, 16, 4)):
                one(2, G, 2, 61, 203, D, W, dtype, seed + D)
            one(2, 4, 2, 9, 203, D, 1000, dtype, 5 + D)
        one(2, 4, 2, 33, 257, D, 100, torch.float16, 6, bias=True, softcap=5.0)
        print(f"D={D}: index forward and backward ran twice, bitwise equal and finite")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [64, 128, 256])
