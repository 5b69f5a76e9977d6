"""Host time per call of the CUDA backend's forward and backward, layer by layer, beside
FlexAttention's compiled call on the same row: where the host's ~0.1 ms per forward goes
(docs/perf-notes.md C124). The GPU is kept busy (a sleep kernel ahead of the calls), so
that no launch waits for the GPU and the time is the host's alone.

    python3 tests/gpu/host_cuda_layers.py [rows]   rows: kind@L[@D],... (bench rows)
"""
import os
import sys

import torch

import flexsparse
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from benchmarks.bench import _no_donated_buffers, flex_block_mask, make_case, parse_rows  # noqa: E402
from benchmarks.cuda_bench import DTYPE, H, TOKENS  # noqa: E402
from benchmarks.timing_probe import host_ms  # noqa: E402
from flexsparse import api  # noqa: E402
from flexsparse.ops import schema  # noqa: E402


def host_us(fn):
    """Median over five runs of 50 calls of the host's µs per call, the GPU busy throughout."""
    fn()
    return host_ms(fn, n=50, runs=5) * 1e3


def main():
    from torch.nn.attention.flex_attention import flex_attention
    spec = next((a for a in sys.argv[1:] if not a.startswith("--")), "sliding256@8192@64,causal@8192")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host µs per call, GPU kept busy")
    print("| row | layer | host µs |\n|---|---|---|")
    for kind, L, D in parse_rows(spec):
        B = max(1, TOKENS // L)
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=DTYPE) for _ in range(3))
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        fs_mask, mask_mod, per_head = make_case(kind, B, L, device=q.device)[:3]
        desc = fs_mask.compile(B, H, H, L, L, device=q.device)
        captured = []
        real = api.cuda_attention_with_grad

        def capture(*args):
            captured.append(args)
            return real(*args)
        api.cuda_attention_with_grad = capture
        flexsparse.attention(q, k, v, desc, backend="cuda")
        api.cuda_attention_with_grad = real
        args = captured[0]
        out = flexsparse.attention(qg, kg, vg, desc, backend="cuda")
        do = torch.randn_like(out)
        fa = torch.compile(flex_attention, dynamic=False)
        bm = flex_block_mask(desc, mask_mod, per_head, L, q.device)
        with _no_donated_buffers():
            flex_out = fa(qg, kg, vg, block_mask=bm)
        layers = {
            "flexsparse.attention, no input needs grad": lambda: flexsparse.attention(q, k, v, desc, backend="cuda"),
            "  the same under no_grad": lambda: _no_grad(lambda: flexsparse.attention(q, k, v, desc, backend="cuda")),
            "flexsparse.attention, inputs need grad": lambda: flexsparse.attention(qg, kg, vg, desc, backend="cuda"),
            "  cuda_attention_with_grad(args), no grad": lambda: schema.cuda_attention_with_grad(*args),
            "  _EagerCudaAttention.apply(args)": lambda: schema._EagerCudaAttention.apply(*args),
            "  torch.ops.flexsparse.cuda_attention(args)": lambda: torch.ops.flexsparse.cuda_attention(*args),
            "  ... .default(args)": lambda: torch.ops.flexsparse.cuda_attention.default(*args),
            "backward (autograd.grad of a forward)": lambda: torch.autograd.grad(out, (qg, kg, vg), do,
                                                                                 retain_graph=True),
            "flex compiled forward, no input needs grad": lambda: fa(q, k, v, block_mask=bm),
            "flex compiled backward": lambda: torch.autograd.grad(flex_out, (qg, kg, vg), do, retain_graph=True),
            "baseline: torch.empty(1) on the GPU": lambda: torch.empty(1, device="cuda"),
            "baseline: q.add_(0) (one launch)": lambda: q.add_(0),
        }
        for name, fn in layers.items():
            try:
                with _no_donated_buffers():
                    us = host_us(fn)
                print(f"| {kind}@{L}@{D} | {name} | {us:.1f} |", flush=True)
            except Exception as e:  # report, keep going
                print(f"| {kind}@{L}@{D} | {name} | failed: {type(e).__name__}: {str(e)[:200]} |", flush=True)


def _no_grad(fn):
    with torch.no_grad():
        return fn()


if __name__ == "__main__":
    main()
