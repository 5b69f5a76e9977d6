"""Probe (GPU): what do TMA loads and Triton's Hopper warp specialization buy a dense
attention forward on this machine? A minimal dense forward (no mask, no lists) in three
forms: pointer loads (as ops/triton_block.py), tensor-descriptor (TMA) loads, and TMA
loads in a `tl.range(..., warp_specialize=True)` loop; timed next to our real kernel
(flexsparse.attention, full mask) in the same process. Not a test: prints a table.

    python3 tests/gpu/tma_probe.py [--L 8192] [--B 2] [--D 128]
"""
import argparse
import math

import torch
import triton
import triton.language as tl


@triton.jit
def _probe_fwd(Q, K, V, Out, L, qk_scale,
               USE_TMA: tl.constexpr, WS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    base = bh * L * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if USE_TMA:
        desc_k = tl.make_tensor_descriptor(K + base, shape=[L, D], strides=[D, 1],
                                           block_shape=[BLOCK_N, D])
        desc_v = tl.make_tensor_descriptor(V + base, shape=[L, D], strides=[D, 1],
                                           block_shape=[BLOCK_N, D])
    for start in tl.range(0, L, BLOCK_N, warp_specialize=WS):
        if USE_TMA:
            k = desc_k.load([start, 0])
            qk = tl.dot(q, k.T)
        else:
            kT = tl.load(K + base + (start + offs_n)[None, :] * D + offs_d[:, None])
            qk = tl.dot(q, kT)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = desc_v.load([start, 0])
        else:
            v = tl.load(V + base + (start + offs_n)[:, None] * D + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + base + offs_m[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=8192)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=128)
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    B, H, L, D = args.B, args.H, args.L, args.D
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = 1.0 / math.sqrt(D)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    flops = 4.0 * B * H * L * L * D
    rows = []

    def timed(name, fn):
        try:
            out = fn()
            err = (out.float() - ref.float()).abs().max().item()
            ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            rows.append((name, ms, flops / ms / 1e9, err))
        except Exception as e:  # a variant that does not compile here is a result too
            rows.append((name, float("nan"), float("nan"), f"{type(e).__name__}: {str(e)[:90]}"))
        print(rows[-1], flush=True)

    import flexsparse
    from flexsparse import masks
    timed("ours (flexsparse, full)", lambda: flexsparse.attention(q, k, v, masks.full()))
    for use_tma, ws in ((False, False), (True, False), (True, True)):
        for bm, bn, warps, stages in ((128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3),
                                      (128, 128, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3)):
            if D > 128 and bn == 128:
                continue
            out = torch.empty_like(q)

            def fn(bm=bm, bn=bn, warps=warps, stages=stages, use_tma=use_tma, ws=ws, out=out):
                _probe_fwd[(L // bm, B * H)](q, k, v, out, L, scale * 1.4426950408889634,
                                            USE_TMA=use_tma, WS=ws, BLOCK_M=bm, BLOCK_N=bn,
                                            D=D, num_warps=warps, num_stages=stages)
                return out
            timed(f"{'tma' if use_tma else 'ptr'}{'+ws' if ws else ''} {bm}x{bn} w{warps} s{stages}",
                  fn)
    print(f"\n| variant (dense fwd, B={B} H={H} L={L} D={D}, bf16) | ms | TFLOP/s | max err |")
    print("|---|---|---|---|")
    for name, ms, tf, err in rows:
        e = f"{err:.2e}" if isinstance(err, float) else err
        print(f"| {name} | {ms:.3f} | {tf:.0f} | {e} |")


if __name__ == "__main__":
    main()
