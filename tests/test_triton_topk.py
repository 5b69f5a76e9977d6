"""The Triton top-k kernel (flexsparse/triton_topk.py, the CUDA path of masks.topk) under the
interpreter, against the torch path of topk_indices (which defines the result): the same
number of kept keys per row, the same multiset of kept scores (ties may pick other
positions), positions ascending with -1 padding last, -inf / NaN never kept, causal rows,
every float type (the kernel reads the score bits as integers, so bf16 runs here too)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from flexsparse.topk import _by_descending_score, topk_indices
from flexsparse.triton_topk import supports, topk_rows


def _check(s, k, causal, got):
    want = topk_indices(s, k, causal=causal)                  # the torch path (CPU)
    assert got.dtype == torch.int32 and got.shape == want.shape
    n_got, n_want = (got >= 0).sum(-1), (want >= 0).sum(-1)
    assert torch.equal(n_got, n_want)
    assert torch.equal(got >= 0, torch.arange(k) < n_got[..., None])          # -1 entries last
    parked = got.masked_fill(got < 0, s.shape[-1])
    assert torch.equal(parked, parked.sort(-1).values)                       # ascending

    def kept_scores(idx):
        v = torch.gather(s.float(), -1, idx.clamp_min(0).long()).masked_fill(idx < 0, -math.inf)
        return v.sort(-1, descending=True).values
    assert torch.equal(kept_scores(got), kept_scores(want))
    if causal:
        Lq, Lk = s.shape[-2], s.shape[-1]
        i = torch.arange(Lq)[:, None]
        assert not ((got > i + Lk - Lq) & (got >= 0)).any()


def _scores(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(shape, generator=g).to(dtype)
    Lq = shape[-2]
    s[..., 0, 1::3] = -math.inf
    if Lq > 1:
        s[..., 1, :5] = math.inf
    if Lq > 2:
        s[..., 2, ::2] = float("nan")
    if Lq > 3:
        s[..., 3, :] = (s[..., 3, :].float() * 2).round().to(dtype)     # many ties
    if Lq > 4:
        s[..., 4, :] = 0.0
        s[..., 4, ::4] = -0.0                                              # -0 ties +0
    return s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Lq,Lk,k,block", [(6, 7, 3, 16), (5, 9, 20, 16), (7, 5, 2, 16), (5, 40, 9, 16)])
def test_topk_rows_against_the_torch_path(dtype, causal, Lq, Lk, k, block):
    s = _scores((1, Lq, Lk), dtype, seed=Lq * 7 + Lk + k)
    _check(s, k, causal, topk_rows(s, k, causal=causal, block=block, num_warps=1))


def test_topk_rows_strided_scores_and_chunks_of_rows():
    base = _scores((2, 2, 9, 24), torch.float32, seed=3)
    s = base.transpose(0, 1)[..., ::2]                       # (2, 2, 9, 12), not contiguous
    _check(s, 4, False, topk_rows(s, 4, block=16, num_warps=1))
    # rows 5..8 of 9 as their own chunk, causal: row r is query 5 + r
    got = topk_rows(s[..., 5:, :], 4, causal=True, row0=5, num_queries=9, block=16, num_warps=1)
    want = topk_indices(s, 4, causal=True)[..., 5:, :]
    assert torch.equal((got >= 0).sum(-1), (want >= 0).sum(-1))
    assert torch.equal(got, want)                            # no ties in these rows


def test_topk_rows_degenerate_and_unsupported():
    assert topk_rows(torch.randn(2, 3, 4), 0).shape == (2, 3, 0)
    assert torch.equal(topk_rows(torch.randn(1, 3, 0), 2, block=16, num_warps=1),
                       torch.full((1, 3, 2), -1, dtype=torch.int32))
    assert torch.equal(topk_rows(torch.full((1, 2, 5), -math.inf), 3, block=16, num_warps=1),
                       torch.full((1, 2, 3), -1, dtype=torch.int32))
    # Lq > Lk, causal: the first Lq - Lk rows see nothing
    got = topk_rows(torch.randn(1, 5, 2), 2, causal=True, block=16, num_warps=1)
    assert (got[0, :3] == -1).all() and (got[0, 3:, 0] == 0).all()
    assert not supports(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="scores: dtype torch.int64"):
        topk_rows(torch.zeros(2, 2, dtype=torch.int64), 1)


def test_descending_score_order_of_kept_positions():
    s = torch.tensor([[[0.5, 3.0, -1.0, 2.0, 7.0]]])
    ind = torch.tensor([[[1, 3, 4, -1]]], dtype=torch.int32)
    assert _by_descending_score(s, ind).tolist() == [[[4, 1, 3, -1]]]


@settings(max_examples=10, deadline=None)
@given(Lq=st.integers(1, 6), Lk=st.integers(1, 40), k=st.integers(1, 12), causal=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       levels=st.sampled_from([0, 3, 1000]), hist_digits=st.sampled_from([0, 1, 2]),
       seed=st.integers(0, 2**16))
def test_topk_rows_random(Lq, Lk, k, causal, dtype, levels, hist_digits, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn((1, Lq, Lk), generator=g)
    if levels:                                   # few distinct values: ties everywhere
        s = (s * levels).round() / levels
    special = torch.rand((1, Lq, Lk), generator=g)
    s = s.masked_fill(special < 0.1, float("nan")).masked_fill(special > 0.9, -math.inf)
    s = s.to(dtype)
    _check(s, k, causal, topk_rows(s, k, causal=causal, block=16, num_warps=1, hist_digits=hist_digits))
