"""Index lists on the block kernels (flexsparse/index_blocks.py, masks.indices(layout=...)).

Conversion checks (exact, no kernels): the descriptor's visible set equals the lists', its
block classes are sound, duplicates are refused. Attention checks: outputs, lse and
gradients of the block path (Triton under TRITON_INTERPRET=1, fp16/fp32, and the
reference) against the gather path and an independent float64 attention (tests/naive.py).
"""
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import flexsparse
from flexsparse import index_blocks as ib
from flexsparse import masks as M
from flexsparse.descriptor import FULL, PARTIAL, SKIP

import naive

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Kernel outputs start as NaN: rows and key blocks that no listed pair reaches must be
    written (zeros / -inf) by the block kernels, not left as whatever memory held."""
    from flexsparse.ops import triton_block
    monkeypatch.setattr(triton_block, "_empty", lambda *s, dtype=None, device=None, **kw: (
        torch.empty(*s, dtype=dtype, device=device, **kw).fill_(
            math.nan if (dtype or torch.float32).is_floating_point else -12345)))


# ------------------------------------------------------------------ patterns

def local(Lq, Lk, W, stride=1):
    """Keys i' - stride*t for t < W, i' = i + (Lk - Lq); outside [0, Lk) -> -1."""
    i = torch.arange(Lq)[:, None] + (Lk - Lq)
    k = i - stride * torch.arange(W)[None, :]
    return torch.where((k >= 0) & (k < Lk), k, -1)[None, None]


def random_lists(Bi, Hi, Lq, Lk, W, gen, drop=0.3):
    """Distinct keys per row (W <= Lk), some entries -1."""
    keys = torch.argsort(torch.rand((Bi, Hi, Lq, Lk), generator=gen), dim=-1)[..., :W]
    return torch.where(torch.rand(keys.shape, generator=gen) < drop, -1, keys)


def _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((B, Hq, Lq, D), generator=g).to(dtype),
            torch.randn((B, Hkv, Lk, D), generator=g).to(dtype),
            torch.randn((B, Hkv, Lk, D), generator=g).to(dtype))


# ------------------------------------------------------------------ conversion

def _check_conversion(idx, Lq, Lk, block, Hq=None, Hkv=None):
    Hkv = Hkv or idx.shape[1]
    Hq = Hq or Hkv
    desc = ib.indices_to_blocks(idx, Lq, Lk, block, num_heads=(Hq, Hkv))
    assert desc is not None and not desc.is_index_mask
    want = M.indices(idx).compile(idx.shape[0], Hq, Hkv, Lq, Lk).to_dense()
    got = desc.to_dense()
    assert got.shape == want.shape and torch.equal(got, want)
    state = desc.block_state()
    bq, bk = block
    pbi = desc.partial_bits_index
    for b in range(state.shape[0]):
        for h in range(state.shape[1]):
            for qb in range(state.shape[2]):
                for kb in range(state.shape[3]):
                    s = int(state[b, h, qb, kb])
                    tile = got[b, h, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
                    has_bits = pbi is not None and int(pbi[b, h, qb, kb]) >= 0
                    assert has_bits == (s == PARTIAL)
                    if s == FULL:
                        assert bool(tile.all())
                    elif s == SKIP:
                        assert not bool(tile.any())
                    else:
                        assert bool(tile.any()) and not bool(tile.all())
    if desc.partial_bits is not None:     # no bits past Lq / Lk
        from flexsparse.ops.visibility import _bits_visible
        vis = _bits_visible(desc.mask_tensors(), 0, state.shape[2], state.shape[2] * bq,
                            state.shape[3] * bk, bq, bk)
        st_el = state.repeat_interleave(bq, 2).repeat_interleave(bk, 3)
        outside = (st_el == PARTIAL) & vis
        outside[:, :, :Lq, :Lk] = False
        assert not bool(outside.any())
    return desc


@pytest.mark.parametrize("block", [(16, 16), (8, 32), (32, 8), (4, 4), (16, 64)])
def test_conversion_patterns(block):
    Lq, Lk = 37, 45
    _check_conversion(local(Lq, Lk, 9), Lq, Lk, block)
    _check_conversion(local(Lq, Lk, 6, stride=3), Lq, Lk, block)
    g = torch.Generator().manual_seed(sum(block))
    idx = random_lists(2, 3, Lq, Lk, 7, g)
    idx[0, 1, 5] = -1                                       # an empty row
    _check_conversion(idx, Lq, Lk, block, Hq=6, Hkv=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 12),
       st.sampled_from([(16, 16), (8, 32), (4, 8)]), st.integers(0, 2 ** 16),
       st.floats(0.0, 1.0))
def test_conversion_random(Lq, Lk, W, block, seed, drop):
    g = torch.Generator().manual_seed(seed)
    idx = random_lists(1, 2, Lq, Lk, min(W, Lk), g, drop=drop)
    _check_conversion(idx.to(torch.int32), Lq, Lk, block)


def test_all_listed_blocks_are_full_and_chunking():
    # every key of a 16x16 block listed -> FULL, no bitmaps; tiny chunks give the same result
    L, bq = 32, 16
    idx = (torch.arange(L)[:, None] // bq * bq + torch.arange(bq)[None, :])[None, None]
    desc = ib.indices_to_blocks(idx, L, L, (bq, bq))
    assert desc.partial_bits is None
    assert desc.block_state()[0, 0].tolist() == [[FULL, SKIP], [SKIP, FULL]]
    idx = local(40, 40, 11, stride=2)
    old = ib.CHUNK_ENTRIES
    try:
        ib.CHUNK_ENTRIES = 5
        small = ib.indices_to_blocks(idx, 40, 40, (16, 16))
    finally:
        ib.CHUNK_ENTRIES = old
    big = ib.indices_to_blocks(idx, 40, 40, (16, 16))
    for name in ("kv_count", "kv_index", "kv_full_count", "q_count", "partial_bits_index",
                 "partial_bits"):
        assert torch.equal(getattr(small, name), getattr(big, name)), name


def test_duplicates_refused():
    idx = local(20, 20, 5)
    assert ib.indices_to_blocks(idx, 20, 20, (16, 16)) is not None
    idx[0, 0, 10, 3] = idx[0, 0, 10, 0]
    assert ib.has_duplicates(idx, 20)
    assert ib.indices_to_blocks(idx, 20, 20, (16, 16)) is None
    assert M.indices(idx, layout="auto").compile(1, 1, 1, 20, 20, block_size=(16, 16)).is_index_mask
    with pytest.raises(ValueError, match="repeated keys"):
        M.indices(idx, layout="blocks").compile(1, 1, 1, 20, 20, block_size=(16, 16))
    # repeated -1 and out-of-range entries are not duplicates
    idx = local(20, 20, 5)
    idx[0, 0, 3, :] = torch.tensor([3, -1, -1, 20, 20])
    assert not ib.has_duplicates(idx, 20)


def test_density_and_auto_decision():
    L = 1024
    dens = ib.estimate_density(local(L, L, 64), L, L, (128, 128))
    assert 0.2 < dens < 0.3                  # 64 x 128 pairs in ~2 blocks of 128 x 128
    assert not ib.prefer_blocks(local(L, L, 64), L, L, (128, 128))   # below MIN_DENSITY
    assert ib.prefer_blocks(local(L, L, 256), L, L, (128, 128))
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(0, 4096, (1, 1, 4096, 64), generator=g)
    assert ib.estimate_density(rnd, 4096, 4096, (128, 128)) < 0.03
    assert not ib.prefer_blocks(rnd, 4096, 4096, (128, 128))
    assert ib.estimate_density(torch.full((1, 1, 8, 4), -1), 8, 8, (16, 16)) == 0.0
    assert M.indices(rnd, layout="auto").compile(1, 1, 1, 4096, 4096).is_index_mask
    assert not M.indices(local(L, L, 256), layout="auto").compile(1, 1, 1, L, L).is_index_mask
    assert M.indices(local(L, L, 64), layout="auto").compile(1, 1, 1, L, L).is_index_mask


def test_layout_argument(monkeypatch):
    idx = local(8, 8, 3)
    with pytest.raises(ValueError, match="layout"):
        M.indices(idx, layout="dense")
    assert repr(M.indices(idx)) == "indices(<(1, 1, 8, 3)>, causal=False)"
    assert "layout='blocks'" in repr(M.indices(idx, layout="blocks"))
    # inside torch.compile: "auto" is the gather path, "blocks" says how to do it instead
    monkeypatch.setattr(M, "_is_compiling", lambda: True)
    assert M.indices(idx, layout="auto").compile(1, 1, 1, 8, 8).is_index_mask
    with pytest.raises(ValueError, match="torch.compile"):
        M.indices(idx, layout="blocks").compile(1, 1, 1, 8, 8)


# ------------------------------------------------------------------ attention

def _attend(q, k, v, mask, backend, bias=None, seed=7, **kw):
    """out, lse and the gradients of q, k, v (and bias) for loss = <out, dO> + <lse, dL>."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    b = None if bias is None else bias.detach().clone().requires_grad_()
    out, lse = flexsparse.attention(*leaves, mask, bias=b, backend=backend, return_lse=True, **kw)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(out.shape, generator=g).half().to(out.dtype)   # same values in every dtype
    dl = torch.randn(lse.shape, generator=g)
    loss = (out.double() * do.double()).sum()
    loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * dl.double()).sum()
    grads = torch.autograd.grad(loss, leaves + ([b] if b is not None else []))
    return [out.detach(), lse.detach(), *grads]


def _naive(q, k, v, idx, bias=None, seed=7, causal=False):
    B, Hq, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if causal:
        i = torch.arange(Lq)[:, None] + (Lk - Lq)
        idx = torch.where(idx > i, -1, idx)
    counts = naive.index_counts(idx, B, Hkv, Hq // Hkv, Lq, Lk)
    d = lambda t: None if t is None else t.double()
    leaves = [d(t).requires_grad_() for t in (q, k, v)]
    b = None if bias is None else d(bias).requires_grad_()
    out, lse = naive.attention(*leaves, bias=b, counts=counts)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(out.shape, generator=g).half()
    dl = torch.randn(lse.shape, generator=g)
    loss = (out * do.double()).sum() + (torch.where(torch.isfinite(lse), lse, 0) * dl.double()).sum()
    grads = torch.autograd.grad(loss, leaves + ([b] if b is not None else []))
    return [out.detach(), lse.detach(), *grads]


NAMES = ["out", "lse", "dq", "dk", "dv", "dbias"]
TOL = {torch.float32: 2e-5, torch.float16: 2e-2, torch.float64: 1e-10}


def _close(got, want, tol, what):
    for name, a, b in zip(NAMES, got, want):
        a, b = a.double(), b.double()
        assert a.shape == b.shape, (what, name, a.shape, b.shape)
        assert not torch.isnan(a).any(), f"{what} {name}: NaN"
        fin = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), fin), f"{what} {name}: inf pattern"
        err = (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
        scale = max(1.0, b[fin].abs().max().item()) if fin.any() else 1.0
        t = tol if name in ("out", "lse") else 2 * tol
        assert err <= t * scale, f"{what} {name}: max err {err:.2e} > {t:.1e} * {scale:.3g}"


def _compare(q, k, v, idx, block, causal=False, bias=None, triton=True):
    """Block path == gather path == float64 naive, for the Triton kernels and the reference."""
    want = _naive(q, k, v, idx, bias=bias, causal=causal)
    blocks = M.indices(idx, causal=causal, layout="blocks")
    desc = blocks.compile(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2],
                          block_size=block)
    assert not desc.is_index_mask
    ref_blocks = _attend(q.double(), k.double(), v.double(), blocks, "reference",
                         bias=None if bias is None else bias.double(), block_size=block)
    _close(ref_blocks, want, TOL[torch.float64], "reference blocks")
    if not triton:
        return
    tol = TOL[q.dtype]
    got = _attend(q, k, v, blocks, "triton", bias=bias, block_size=block)
    _close(got, want, tol, "triton blocks")
    gathered = _attend(q, k, v, M.indices(idx, causal=causal), "triton", bias=bias)
    _close(got, gathered, tol, "triton blocks vs gather")
    return got


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_local_window_gqa(dtype):
    # Hq=4 over Hkv=2 with lists shared by all heads (head dim 1) and both batches; Lq, Lk
    # not block multiples, two blocks each way (21 x 37, was 37 x 45: the interpreter's time
    # grows with the query tiles of the gather path)
    q, k, v = _qkv(2, 4, 2, 21, 37, 16, dtype, seed=1)
    _compare(q, k, v, local(21, 37, 20), (16, 32))


@needs_interpreter
def test_dilated_window_causal():
    q, k, v = _qkv(1, 2, 1, 40, 40, 16, torch.float16, seed=2)
    keys = torch.arange(40)[:, None] + 2 - 3 * torch.arange(8)[None, :]   # 2 keys into the future
    idx = torch.where((keys >= 0) & (keys < 40), keys, -1)[None, None]
    _compare(q, k, v, idx, (16, 16), causal=True)


@needs_interpreter
def test_random_lists_kv_heads_empty_rows():
    # per-kv-head lists, random with -1 padding, empty rows, Lq != Lk, a 64-wide key block
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(1, 4, 2, 33, 70, 16, torch.float32, seed=3)
    idx = random_lists(1, 2, 33, 70, 9, g)
    idx[0, 0, 4] = -1
    idx[0, 1, 32] = -1
    _compare(q, k, v, idx, (16, 64))


@needs_interpreter
def test_bias_and_dbias():
    # a bias is added at the same (q, k) on both paths; dbias is zero where nothing is listed
    q, k, v = _qkv(1, 2, 2, 24, 30, 16, torch.float32, seed=4)
    bias = torch.randn((1, 2, 24, 30), generator=torch.Generator().manual_seed(5))
    got = _compare(q, k, v, local(24, 30, 7, stride=2), (16, 16), bias=bias)
    listed = M.indices(local(24, 30, 7, stride=2)).to_dense(1, 2, 24, 30)
    assert not got[5].masked_select(~listed).any()


@needs_interpreter
def test_all_inactive():
    q, k, v = _qkv(1, 2, 1, 20, 20, 16, torch.float16, seed=6)
    idx = torch.full((1, 1, 20, 4), -1)
    desc = M.indices(idx, layout="blocks").compile(1, 2, 1, 20, 20, block_size=(16, 16))
    assert int(desc.kv_count.sum()) + int(desc.kv_full_count.sum()) == 0
    out, lse, dq, dk, dv = _attend(q, k, v, desc, "triton")
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    for t in (dq, dk, dv):
        assert torch.equal(t, torch.zeros_like(t))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 24), st.integers(1, 24), st.integers(1, 8), st.sampled_from([1, 2]),
       st.sampled_from([1, 2]), st.booleans(), st.integers(0, 2 ** 16))
def test_reference_random(Lq, Lk, W, Bi, Hi, causal, seed):
    # the reference backend on the block descriptor == float64 naive gather attention
    g = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(2, 4, 2, Lq, Lk, 8, torch.float64, seed=seed)
    idx = random_lists(Bi, Hi, Lq, Lk, min(W, Lk), g)
    _compare(q, k, v, idx, (8, 8), causal=causal, triton=False)


@needs_interpreter
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 10), st.sampled_from([1, 2]),
       st.sampled_from([(16, 16), (16, 32), (32, 16)]), st.booleans(), st.integers(0, 2 ** 16))
def test_triton_random(Lq, Lk, W, Hi, block, causal, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(1, 4, 2, Lq, Lk, 16, torch.float32, seed=seed)
    idx = random_lists(1, Hi, Lq, Lk, min(W, Lk), g)
    _compare(q, k, v, idx, block, causal=causal)
