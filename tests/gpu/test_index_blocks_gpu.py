"""Index lists on the block kernels (masks.indices(layout="blocks"), flexsparse/index_blocks.py)
on CUDA (skipped without CUDA).

Same accuracy rule as tests/gpu/test_triton_indices_gpu.py (whose naive gather reference,
gradients and rule are reused): the kernel's max error vs float64 must be <= 2x the error
of the naive computation in the input dtype plus 2 ulps at the tensor group's scale.

Runs under pytest (FLEXSPARSE_GPU_TESTS=1), or directly: python tests/gpu/test_index_blocks_gpu.py
"""
import math
import os
import sys

os.environ.setdefault("FLEXSPARSE_GPU_TESTS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

from test_triton_indices_gpu import (HAVE_CUDA, _grads, _padded, _param, _rule,  # noqa: E402
                                     run_direct)

try:
    import pytest
except ImportError:  # the direct runner below needs no pytest
    pytest = None

if pytest is not None:
    pytestmark = pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA (and no TRITON_INTERPRET)")

if HAVE_CUDA:
    import flexsparse
    from flexsparse import index_blocks as ib
    from flexsparse import masks

DEV = "cuda"


# ------------------------------------------------------------------ patterns

def window(Lq, Lk, W, stride=1, shift=0):
    """Keys i' + shift - stride*t, t < W, i' = i + (Lk - Lq); outside [0, Lk) -> -1."""
    i = torch.arange(Lq, device=DEV)[:, None] + (Lk - Lq) + shift
    k = i - stride * torch.arange(W, device=DEV)[None, :]
    return torch.where((k >= 0) & (k < Lk), k, -1)[None, None].to(torch.int32)


def clustered(Bi, Hi, Lq, Lk, W, span, seed=0):
    """Top-k-like lists: W distinct keys per row drawn from a span-wide window near the
    diagonal (so neighbouring queries share key blocks), 10% dropped to -1."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    pick = torch.argsort(torch.rand((Bi, Hi, Lq, span), device=DEV, generator=g), -1)[..., :W]
    start = (torch.arange(Lq, device=DEV) * Lk // max(Lq, 1) - span // 2).clamp(0, max(Lk - span, 0))
    k = start[:, None] + pick
    k = torch.where(k < Lk, k, -1)
    return torch.where(torch.rand(k.shape, device=DEV, generator=g) < 0.1, -1, k).to(torch.int32)


def _inputs(B, Hq, Hkv, Lq, Lk, D, dtype, seed):
    torch.manual_seed(seed)
    q = torch.randn((B, Hq, Lq, D), device=DEV).to(dtype)
    return q, _padded((B, Hkv, Lk, D), dtype), _padded((B, Hkv, Lk, D), dtype)


def _run_blocks(q, k, v, idx, causal=False, bias=None, block_size=(128, 128), dlse=True,
                softcap=0.0):
    """Block path through the public API, fwd + bwd, checked by the rule against the
    naive gather attention on the same lists (causal applied to the lists first)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    desc = masks.indices(idx, causal=causal, layout="blocks").compile(
        B, Hq, Hkv, Lq, Lk, device=q.device, block_size=block_size)
    assert not desc.is_index_mask and desc.device == q.device
    scale = 1.0 / math.sqrt(D)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    b = bias.detach().clone().requires_grad_() if bias is not None else None
    out, lse = flexsparse.attention(*leaves, desc, bias=b, softcap=softcap or None,
                                    backend="triton", return_lse=True)
    torch.manual_seed(99)
    do = torch.randn(out.shape, device=DEV).to(q.dtype)
    gl = torch.randn(lse.shape, device=DEV) if dlse else None
    loss = (out.float() * do.float()).sum()
    if gl is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0) * gl).sum()
    wrt = leaves + ([b] if b is not None else [])
    got = torch.autograd.grad(loss, wrt)
    ref_idx = idx
    if causal:
        i = torch.arange(Lq, device=DEV)[:, None] + (Lk - Lq)
        ref_idx = torch.where(idx > i, -1, idx)
    o64, l64, g64 = _grads(q, k, v, ref_idx, bias, scale, softcap, torch.float64, do, gl)
    olp, llp, glp = _grads(q, k, v, ref_idx, bias, scale, softcap, q.dtype, do, gl)
    msgs = _rule([("out", out.detach(), o64, olp)], q.dtype)
    msgs += _rule([("lse", lse.detach(), l64, llp)], q.dtype)
    names = ["dq", "dk", "dv"] + (["dbias"] if bias is not None else [])
    msgs += _rule(list(zip(names, got, g64, glp)), q.dtype)
    return desc, msgs


# ------------------------------------------------------------------ tests

@_param("dtype", [torch.float16, torch.bfloat16])
@_param("pattern", ["local64", "local256", "dilated4", "clustered"])
@_param("D", [64, 128])
def test_patterns(dtype, pattern, D):
    L = 1000                                        # not a multiple of the 128 blocks
    if pattern == "local64":
        idx = window(L, L, 64)
    elif pattern == "local256":
        idx = window(L, L, 256)
    elif pattern == "dilated4":
        idx = window(L, L, 64, stride=4)
    else:
        idx = clustered(1, 1, L, L, 48, 300)
    q, k, v = _inputs(2, 8, 2, L, L, D, dtype, seed=D)
    _run_blocks(q, k, v, idx)


@_param("idx_heads", [1, 2])
def test_gqa_batch_causal(idx_heads):
    # per-kv-head lists or shared ones, B=2 with per-batch lists, Lq != Lk, causal filter
    q, k, v = _inputs(2, 8, 2, 300, 517, 128, torch.bfloat16, seed=idx_heads)
    idx = clustered(2, idx_heads, 300, 517, 40, 200, seed=idx_heads)
    _run_blocks(q, k, v, idx, causal=True)


@_param("block_size", [(64, 128), (128, 64), (128, 128)])
def test_block_sizes_shift(block_size):
    # windows reaching 17 keys into the future, cut by causal
    q, k, v = _inputs(1, 4, 4, 513, 513, 64, torch.float16, seed=3)
    _run_blocks(q, k, v, window(513, 513, 100, shift=17), causal=True, block_size=block_size)


def test_bias_softcap_dbias():
    q, k, v = _inputs(1, 4, 2, 257, 257, 64, torch.float16, seed=4)
    q = (q.float() * 3).half()
    bias = torch.randn((1, 4, 257, 257), device=DEV).half()
    _run_blocks(q, k, v, window(257, 257, 48, stride=2), bias=bias, softcap=5.0)


def test_empty_rows_and_all_inactive():
    q, k, v = _inputs(1, 4, 2, 300, 300, 64, torch.bfloat16, seed=5)
    idx = window(300, 300, 32).clone()
    idx[..., 130:260, :] = -1                       # a whole 128-row query block sees nothing
    _run_blocks(q, k, v, idx)
    _run_blocks(q, k, v, torch.full_like(idx, -1), dlse=False)


def test_conversion_matches_cpu_and_auto():
    idx = clustered(2, 2, 700, 900, 40, 256, seed=6)
    got = ib.indices_to_blocks(idx, 700, 900, (128, 128), num_heads=(4, 2))
    want = ib.indices_to_blocks(idx.cpu(), 700, 900, (128, 128), num_heads=(4, 2))
    for name in ("kv_count", "kv_index", "kv_full_count", "kv_full_index", "q_count",
                 "q_index", "q_full_count", "q_full_index", "partial_bits_index",
                 "partial_bits"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.is_cuda and torch.equal(a.cpu(), b), name
    L = 4096
    assert not masks.indices(window(L, L, 256), layout="auto").compile(
        1, 16, 4, L, L, device=DEV).is_index_mask
    rnd = torch.randint(0, L, (1, 4, L, 64), device=DEV).sort(-1).values
    assert masks.indices(rnd, layout="auto").compile(1, 16, 4, L, L, device=DEV).is_index_mask


if __name__ == "__main__":
    sys.exit(run_direct(globals()))
