"""The reference backend against the naive dense float64 computation, forward and backward."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import flexsparse
from flexsparse import masks as M
from flexsparse.ops import visibility

import naive

DT = torch.float64


def rand(*shape, g, requires_grad=True):
    return torch.randn(*shape, dtype=DT, generator=g).requires_grad_(requires_grad)


def compare(mask, dense_vis, *, B=2, Hq=4, Hkv=2, Lq=19, Lk=23, D=8, Dv=None, bias_shape=None,
            softcap=0.0, seed=0, counts=None, lse_grad=True):
    g = torch.Generator().manual_seed(seed)
    Dv = Dv or D
    q, k, v = rand(B, Hq, Lq, D, g=g), rand(B, Hkv, Lk, D, g=g), rand(B, Hkv, Lk, Dv, g=g)
    bias = rand(*bias_shape, g=g) if bias_shape else None
    out, lse = flexsparse.attention(q, k, v, mask, bias=bias, softcap=softcap or None,
                                    return_lse=True, backend="reference")
    ref_out, ref_lse = naive.attention(q, k, v, dense_vis, bias, softcap=softcap, counts=counts)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)
    go = torch.randn(out.shape, dtype=DT, generator=g)
    gl = torch.randn(lse.shape, dtype=DT, generator=g) if lse_grad else torch.zeros_like(lse)
    finite = torch.isfinite(ref_lse)
    inputs = [q, k, v] + ([bias] if bias is not None else [])
    loss = (out * go).sum() + (torch.where(finite, lse, 0) * gl).sum()
    ref_loss = (ref_out * go).sum() + (torch.where(finite, ref_lse, 0) * gl).sum()
    grads = torch.autograd.grad(loss, inputs)
    ref_grads = torch.autograd.grad(ref_loss, inputs)
    for name, a, b in zip("q k v bias".split(), grads, ref_grads):
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=lambda m: f"d{name}: {m}")
    return out, lse


def test_every_mask_kind():
    Lq, Lk = 19, 23
    g = torch.Generator().manual_seed(5)
    dm = torch.rand(2, 1, Lq, Lk, generator=g) > 0.3
    layout = torch.rand(1, 4, 3, 3, generator=g) > 0.4
    cr = torch.randint(0, Lq + 1, (1, 2, Lk, 4), generator=g, dtype=torch.int32)
    cases = [
        (None, None),
        (M.causal(), naive.predicate_dense(naive.causal(Lq, Lk), 1, 1, Lq, Lk)),
        (M.sliding_window(4, 2), naive.predicate_dense(naive.sliding(Lq, Lk, 4, 2), 1, 1, Lq, Lk)),
        (M.prefix_lm(6), naive.predicate_dense(naive.prefix_lm(Lq, Lk, 6), 1, 1, Lq, Lk)),
        (dm, dm),
        (M.block_sparse(layout, 8), naive.predicate_dense(naive.block_layout(layout, 8, 8), 1, 4, Lq, Lk)),
        (M.column_ranges(cr, False), naive.predicate_dense(naive.flashmask(cr, False, Lq, Lk), 1, 2, Lq, Lk)),
        (M.causal() & M.dense(dm), naive.predicate_dense(naive.causal(Lq, Lk), 1, 1, Lq, Lk) & dm),
        (M.or_(M.sliding_window(2), M.dense(dm)),
         naive.predicate_dense(naive.sliding(Lq, Lk, 2, 0), 1, 1, Lq, Lk) | dm),
    ]
    for mask, vis in cases:
        for block in [(8, 8), (128, 128)]:
            if mask is not None and not isinstance(mask, torch.Tensor):
                mask_c = mask.compile(2, 4, 2, Lq, Lk, block_size=block)
            else:
                mask_c = mask
            compare(mask_c, vis, Lq=Lq, Lk=Lk, bias_shape=(2, 4, Lq, Lk))


def test_documents_and_shared_question():
    L = 24
    compare(M.document([5, 12, 7]), naive.predicate_dense(naive.document([5, 12, 7], True), 1, 1, L, L),
            Lq=L, Lk=L)
    compare(M.shared_question(6, [6, 8, 4]), naive.predicate_dense(naive.shared_question(6, [6, 8, 4]), 1, 1, L, L),
            Lq=L, Lk=L)


@pytest.mark.parametrize("bias_shape", [(2, 4, 19, 23), (1, 4, 19, 23), (2, 2, 19, 23), (1, 1, 19, 23),
                                        (2, 1, 1, 23), (1, 4, 19, 1), (1, 1, 1, 1), (2, 2, 1, 23)])
def test_bias_broadcasts(bias_shape):
    compare(M.causal(), naive.predicate_dense(naive.causal(19, 23), 1, 1, 19, 23), bias_shape=bias_shape)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1), (6, 3)])
def test_gqa_softcap_dv(Hq, Hkv):
    compare(M.sliding_window(5), naive.predicate_dense(naive.sliding(19, 23, 5, 0), 1, 1, 19, 23),
            Hq=Hq, Hkv=Hkv, Dv=12, softcap=2.5, bias_shape=(1, Hkv, 19, 23))


def test_index_lists():
    g = torch.Generator().manual_seed(9)
    B, Hq, Hkv, Lq, Lk = 2, 4, 2, 11, 17
    idx = torch.randint(-1, Lk, (B, Hkv, Lq, 6), generator=g)
    idx[0, 0, 3] = -1                               # a fully inactive row
    idx[1, 1, 2, :3] = 5                            # duplicates count once per occurrence
    counts = naive.index_counts(idx, B, Hkv, Hq // Hkv, Lq, Lk)
    for bias_shape in [None, (B, Hq, Lq, Lk), (1, Hkv, 1, Lk)]:
        out, lse = compare(M.indices(idx), None, B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, counts=counts,
                           bias_shape=bias_shape, softcap=3.0)
        assert torch.all(out[0, :2, 3] == 0) and torch.all(torch.isneginf(lse[0, :2, 3]))


def test_fully_masked_rows():
    dm = torch.ones(1, 1, 10, 12, dtype=torch.bool)
    dm[..., 3, :] = False
    dm[..., 7, :] = False
    out, lse = compare(dm, dm, B=1, Hq=2, Hkv=1, Lq=10, Lk=12, bias_shape=(1, 2, 10, 12))
    assert torch.all(out[:, :, [3, 7]] == 0)
    assert torch.all(torch.isneginf(lse[:, :, [3, 7]]))
    # a window that leaves the first rows empty (Lq > Lk, bottom-right aligned)
    compare(M.causal(), naive.predicate_dense(naive.causal(15, 6), 1, 1, 15, 6), B=1, Lq=15, Lk=6)


def test_chunking_matches_unchunked(monkeypatch):
    """Force tiny row chunks: results must not depend on the chunking."""
    g = torch.Generator().manual_seed(3)
    q, k, v = rand(1, 2, 70, 8, g=g), rand(1, 2, 70, 8, g=g), rand(1, 2, 70, 8, g=g)
    bias = rand(1, 2, 70, 70, g=g)
    args = dict(bias=bias, return_lse=True, backend="reference", block_size=(16, 16))
    mask = M.document([30, 40])
    out1, lse1 = flexsparse.attention(q, k, v, mask, **args)
    g1 = torch.autograd.grad(out1.sum() + lse1.sum(), (q, k, v, bias))
    monkeypatch.setattr(visibility, "CHUNK_ELEMENTS", 1)
    out2, lse2 = flexsparse.attention(q, k, v, mask, **args)
    g2 = torch.autograd.grad(out2.sum() + lse2.sum(), (q, k, v, bias))
    torch.testing.assert_close(out1, out2, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse1, lse2, atol=1e-12, rtol=0)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_gradcheck():
    g = torch.Generator().manual_seed(11)
    q, k, v = rand(1, 2, 6, 4, g=g), rand(1, 1, 7, 4, g=g), rand(1, 1, 7, 3, g=g)
    bias = rand(1, 2, 1, 7, g=g)
    cases = [M.causal(), M.indices(torch.randint(-1, 7, (1, 1, 6, 3), generator=g)),
             M.or_(M.sliding_window(1), M.dense(torch.rand(1, 1, 6, 7, generator=g) > 0.5))]
    for mask in cases:
        def f(q, k, v, bias):
            out, lse = flexsparse.attention(q, k, v, mask, bias=bias, softcap=1.5, return_lse=True,
                                            backend="reference")
            return out, torch.where(torch.isfinite(lse), lse, 0)
        assert torch.autograd.gradcheck(f, (q, k, v, bias))


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_shapes(data):
    B = data.draw(st.integers(1, 2))
    Hkv = data.draw(st.integers(1, 2))
    Hq = Hkv * data.draw(st.integers(1, 3))
    Lq, Lk = data.draw(st.integers(1, 20)), data.draw(st.integers(1, 20))
    D = data.draw(st.sampled_from([1, 3, 8]))
    seed = data.draw(st.integers(0, 1000))
    kind = data.draw(st.sampled_from(["causal", "window", "dense", "bias_only"]))
    g = torch.Generator().manual_seed(seed)
    if kind == "causal":
        mask, vis = M.causal(), naive.predicate_dense(naive.causal(Lq, Lk), 1, 1, Lq, Lk)
    elif kind == "window":
        mask, vis = M.sliding_window(2, 1), naive.predicate_dense(naive.sliding(Lq, Lk, 2, 1), 1, 1, Lq, Lk)
    elif kind == "dense":
        vis = torch.rand(B, 1, Lq, Lk, generator=g) > 0.5
        mask = vis
    else:
        mask, vis = None, None
    block = (data.draw(st.sampled_from([1, 4, 16])),) * 2
    if mask is not None and not isinstance(mask, torch.Tensor):
        mask = mask.compile(B, Hq, Hkv, Lq, Lk, block_size=block)
    compare(mask, vis, B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, seed=seed, bias_shape=(1, Hq, Lq, Lk))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_index_padding_reads_nothing(backend):
    """-1 padding reads no key: NaN/inf in key/value/bias row 0 (where clamped padding would
    point) reaches no row that does not list key 0, forward and backward (issue 17)."""
    import flexsparse
    from flexsparse import masks as M
    if backend == "triton":
        pytest.importorskip("triton")
    g = torch.Generator().manual_seed(3)
    B, H, L, D, W = 1, 2, 9, 16, 4
    q = torch.randn(B, H, L, D, generator=g)
    k = torch.randn(B, H, L, D, generator=g)
    v = torch.randn(B, H, L, D, generator=g)
    bias = torch.randn(B, H, L, L, generator=g)
    k[:, :, 0] = float("nan")
    v[:, :, 0] = float("inf")
    bias[..., 0] = float("nan")
    idx = torch.randint(1, L, (B, H, L, W), generator=g, dtype=torch.int32)
    idx[..., -1] = -1
    idx[:, :, 3] = -1                      # a fully padded row
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = flexsparse.attention(*leaves[:3], M.indices(idx), bias=leaves[3], backend=backend)
    assert torch.isfinite(out).all()
    assert torch.all(out[:, :, 3] == 0)
    grads = torch.autograd.grad(out.sum(), leaves)
    for name, gr in zip(("dq", "dk", "dv", "dbias"), grads):
        rest = gr[:, :, 1:] if name in ("dk", "dv") else gr
        if name == "dbias":
            rest = gr[..., 1:]
        assert torch.isfinite(rest).all(), name
