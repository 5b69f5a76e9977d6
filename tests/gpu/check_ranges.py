"""GPU check of the range builders: Triton (CUDA) vs torch (CPU) descriptors of the bench
masks give the same block sets, and the op takes the same time with either.

    python tests/gpu/check_ranges.py
"""
import os
import sys
import dataclasses

import torch
import triton

from flexsparse import attention, masks as M
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from benchmarks.bench import make_case
from flexsparse.ops.visibility import ranges_to_grid


def block_sets(d):
    """Block grids of the four range-form lists (on the CPU)."""
    if not all(t.dim() == 5 for t in (d.kv_index, d.kv_full_index, d.q_index, d.q_full_index)):
        raise ValueError("check_ranges: descriptor is not in range form")
    nQB, nKB = (-(-n // b) for n, b in zip(d.seq_lengths, d.block_size))
    return [ranges_to_grid(index, n).cpu() for index, n in
            ((d.kv_index, nKB), (d.kv_full_index, nKB), (d.q_index, nQB), (d.q_full_index, nQB))]


def main():
    for kind, L, B in (("document", 8192, 2), ("document", 16384, 1), ("sliding", 8192, 2),
                       ("causal", 8192, 2), ("shared_question", 8192, 2)):
        mask = make_case(kind, B, L)[0]
        M.clear_cache()
        dg = mask.compile(B, 16, 16, L, L, device="cuda")
        M.clear_cache()
        dc = mask.compile(B, 16, 16, L, L, device="cpu")
        same = all(torch.equal(a, b)
                   for a, b in zip(block_sets(dg), block_sets(dc)))
        dc = dataclasses.replace(dc, **{f.name: getattr(dc, f.name).cuda() for f in dataclasses.fields(dc)[3:]
                                        if getattr(dc, f.name) is not None})
        q, k, v = (torch.randn(B, 16, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        times = []
        for d in (dg, dc):
            out = attention(q, k, v, d)
            g = torch.randn_like(out)
            f = triton.testing.do_bench(lambda: attention(q, k, v, d), warmup=10, rep=50)
            b = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True),
                                        warmup=10, rep=50)
            times.append(f"fwd {f:.3f} bwd {b:.3f}")
        print(f"{kind} L={L} B={B}: same block sets {same}; "
              f"partial/full blocks {int(dg.kv_count.sum())}/{int(dg.kv_full_count.sum())}; "
              f"triton-built: {times[0]} ms; torch-built: {times[1]} ms", flush=True)


if __name__ == "__main__":
    main()
