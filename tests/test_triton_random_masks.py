"""Triton block kernels (CPU interpreter) vs the reference on random mask trees (hypothesis).

The mask strategy is the one that checks the masks themselves (tests/test_masks.py): random
and_/or_ trees of causal, windows, prefix-LM, documents, dense masks and FlashMask column
ranges, so every predicate combination the kernels read (column ranges, dense tiles,
bitmaps) gets exercised together with odd lengths and partial blocks.
"""
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU)", allow_module_level=True)
pytest.importorskip("triton")

import flexsparse  # noqa: E402
from flexsparse.ops import triton_block  # noqa: E402

from test_masks import _mask_strategy  # noqa: E402


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_mask_trees_match_reference(data):
    L = data.draw(st.integers(1, 70), label="L")
    mask = data.draw(_mask_strategy(L), label="mask")
    block = data.draw(st.sampled_from([(16, 16), (32, 16), (16, 32)]), label="block")
    with_bias = data.draw(st.booleans(), label="bias")
    seed = data.draw(st.integers(0, 10_000), label="seed")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, L, 16, generator=g)
    k = torch.randn(1, 1, L, 16, generator=g)
    v = torch.randn(1, 1, L, 16, generator=g)
    bias = torch.randn(1, 2, L, L, generator=g) if with_bias else None
    go = torch.randn(1, 2, L, 16, generator=g)
    desc = mask.compile(1, 2, 1, L, L, block_size=block)

    def run(backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        b = bias.clone().requires_grad_() if bias is not None else None
        out, lse = flexsparse.attention(*leaves, desc, bias=b, return_lse=True, backend=backend)
        grads = torch.autograd.grad(out, leaves + ([b] if b is not None else []), go)
        return out, lse, grads

    original_empty = triton_block._empty
    triton_block._empty = lambda *s, dtype=None, device=None, **kw: (
        torch.empty(*s, dtype=dtype, device=device, **kw).fill_(
            math.nan if (dtype or torch.float32).is_floating_point else -12345))
    try:
        out, lse, grads = run("triton")
    finally:
        triton_block._empty = original_empty
    ref_out, ref_lse, ref_grads = run("reference")
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)
