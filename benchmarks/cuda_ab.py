"""Same-run A/B of CUDA kernel variants chosen by FLEXSPARSE_CUDA_DEBUG bits: forward (and
optionally backward) effective TFLOP/s per row, the variants interleaved, several rounds,
medians reported. Also checks each variant's output against the serial one.

    python -m benchmarks.cuda_ab [rows] [--variants 0,32] [--rounds 3] [--bwd] [--bwd-only]

rows: kind@L[@D],... as in benchmarks.cuda_bench. A variant "bits/bq" (e.g. 0/384) runs
with the mask compiled at query blocks of bq rows (key blocks 128) instead of the mask's
own block size. The variants take turns in an order rotated every round (no variant holds
one place in every round). --bwd-only: the backward's columns only (the forward still runs
once per variant for the error column).
"""
import os
import statistics
import sys

import torch
import triton.testing

import flexsparse
from flexsparse import masks
from benchmarks.bench import make_case, parse_rows
from benchmarks.debug_bits import rotated

H, TOKENS, DTYPE = 16, 16384, torch.bfloat16
DEFAULT = "full@8192,causal@16384,prefix_lm@16384,document@16384,sliding@8192,full@8192@64,full@8192@256"


def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main():
    rows = [a for a in sys.argv[1:] if "@" in a]
    spec = rows[0] if rows else DEFAULT
    variants = arg("--variants", "0,32").split(",")
    rounds = int(arg("--rounds", "3"))
    bwd = "--bwd" in sys.argv or "--bwd-only" in sys.argv
    fwd = "--bwd-only" not in sys.argv
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, H={H}, B*L=16K; "
          f"FLEXSPARSE_CUDA_DEBUG variants {variants}, {rounds} rounds, medians")
    head = " | ".join([f"fwd {v}" for v in variants if fwd] + [f"bwd {v}" for v in variants if bwd])
    print(f"| row | {head} | max rel err vs first (out, grads) |")
    print("|---" * (1 + len(variants) * (int(fwd) + int(bwd)) + 1) + "|")
    for kind, L, D in parse_rows(spec):
        item = f"{kind}@{L}" + (f"@{D}" if D != 128 else "")
        B = max(1, TOKENS // L)
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=DTYPE) for _ in range(3))
        fs_mask, _, _, _, has_bias = make_case(kind, B, L, device=q.device)
        bias = torch.randn(B, H, L, L, device="cuda", dtype=DTYPE) if has_bias else None
        descs = {var: fs_mask.compile(B, H, H, L, L, device=q.device,
                                      block_size=(int(var.split("/")[1]), 128) if "/" in var
                                      else masks.DEFAULT_BLOCK_SIZE)
                 for var in variants}
        flops = 4.0 * D * descs[variants[0]].num_visible(batch=B)
        times = {(v, p): [] for v in variants for p in ("fwd", "bwd")}
        outs, grads = {}, {}
        for r in range(rounds):
            for var in (variants[i] for i in rotated(len(variants), r)):
                os.environ["FLEXSPARSE_CUDA_DEBUG"] = var.split("/")[0]
                desc = descs[var]
                fn = lambda: flexsparse.attention(q, k, v, desc, bias=bias, backend="cuda")  # noqa: E731
                outs[var] = fn().float()
                if fwd:
                    times[(var, "fwd")].append(triton.testing.do_bench(fn, warmup=10, rep=60))
                if bwd:
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                    # a bias is trainable here (its gradient is part of the backward timed)
                    bg = None if bias is None else bias.detach().requires_grad_()
                    leaves = (qg, kg, vg) + (() if bg is None else (bg,))
                    out = flexsparse.attention(qg, kg, vg, desc, bias=bg, backend="cuda")
                    do = torch.randn(out.shape, device="cuda", dtype=DTYPE,
                                     generator=torch.Generator("cuda").manual_seed(1))
                    grads[var] = [g.float() for g in
                                  torch.autograd.grad(out, leaves, do, retain_graph=True)]
                    times[(var, "bwd")].append(triton.testing.do_bench(
                        lambda: torch.autograd.grad(out, leaves, do, retain_graph=True),
                        warmup=10, rep=60))
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = "0"
        first = outs[variants[0]]
        err = max(((o - first).norm() / first.norm()).item() for o in outs.values())
        for gs in grads.values():   # dq, dk, dv of each variant against the first's
            err = max([err] + [((g - g0).norm() / g0.norm()).item()
                               for g, g0 in zip(gs, grads[variants[0]])])
        cells = [f"{flops / statistics.median(times[(v, 'fwd')]) * 1e-9:.0f}" for v in variants if fwd]
        if bwd:
            cells += [f"{2.5 * flops / statistics.median(times[(v, 'bwd')]) * 1e-9:.0f}"
                      if times[(v, "bwd")] else "-" for v in variants]
        print(f"| {item} | " + " | ".join(cells) + f" | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
