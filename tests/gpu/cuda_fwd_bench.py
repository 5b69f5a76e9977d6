"""Forward A/B of the CUDA backend against our Triton kernels, FlexAttention (compiled,
Triton path) and SDPA, in one process; effective TFLOP/s (visible entries, 4*D each).

    python tests/gpu/cuda_fwd_bench.py [rows]   rows: kind@L[@D],... (default: a quick set)
"""
import sys

import torch
import triton.testing

import flexsparse
from flexsparse.bench import flex_block_mask, make_case

H, TOKENS, DTYPE = 16, 16384, torch.bfloat16
DEFAULT = "full@8192,causal@8192,causal@16384,document@8192,document@16384,sliding@8192,prefix_lm@16384,shared_question@16384,block_sparse@8192,full@8192@64,causal@8192@64"


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def row(kind, L, D):
    from torch.nn.attention.flex_attention import flex_attention
    B = max(1, TOKENS // L)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=DTYPE) for _ in range(3))
    fs_mask, mask_mod, per_head, sdpa_causal, _ = make_case(kind, B, L, device=q.device)
    desc = fs_mask.compile(B, H, H, L, L, device=q.device)
    flops = 4.0 * D * desc.num_visible(batch=B)
    res = {}
    ref = flexsparse.attention(q, k, v, desc, backend="triton")
    got = flexsparse.attention(q, k, v, desc, backend="cuda")
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    res["cuda"] = bench(lambda: flexsparse.attention(q, k, v, desc, backend="cuda"))
    res["triton"] = bench(lambda: flexsparse.attention(q, k, v, desc, backend="triton"))
    try:
        fa = torch.compile(flex_attention, dynamic=False)
        bm = flex_block_mask(desc, mask_mod, per_head, L, q.device)
        res["flex"] = bench(lambda: fa(q, k, v, block_mask=bm))
    except Exception as e:  # report, keep going
        print(f"flex {kind}: {type(e).__name__}: {str(e)[:200]}")
    if sdpa_causal is not None:
        F = torch.nn.functional
        res["sdpa"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=sdpa_causal))
    tf = {n: flops / ms * 1e-9 for n, ms in res.items()}
    cells = " | ".join(f"{tf.get(n, float('nan')):6.0f}" for n in ("cuda", "triton", "flex", "sdpa"))
    ratio = tf["cuda"] / tf["flex"] if "flex" in tf else float("nan")
    print(f"| {kind} | {L // 1024}K | {D} | {cells} | {ratio:.2f} | {err:.1e} |", flush=True)


def main():
    spec = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, H={H}, B*L=16K")
    print("| mask | L | D | cuda fwd | triton fwd | flex fwd | sdpa fwd | cuda/flex | rel err vs triton |")
    print("|---|---|---|---|---|---|---|---|---|")
    for item in spec.split(","):
        parts = item.split("@")
        try:
            row(parts[0], int(parts[1]), int(parts[2]) if len(parts) > 2 else 128)
        except Exception as e:  # report, keep going
            print(f"| {item} | failed: {type(e).__name__}: {str(e)[:300]} |", flush=True)


if __name__ == "__main__":
    main()
