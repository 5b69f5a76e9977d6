"""masks.topk (the index mask of flexsparse.topk.topk_indices) against a brute-force
per-row reference: -1 padding, causal (bottom-right aligned), -inf / NaN never kept,
chunked and callable scores, and attention through it (reference backend, CPU)."""
import math

import pytest
import torch

import flexsparse
from flexsparse import masks as M
from flexsparse.topk import topk_indices


def _brute(scores, k, causal):
    """bool (B, H, Lq, Lk): per row, the k allowed keys of largest score, by a Python loop."""
    B, H, Lq, Lk = scores.shape
    out = torch.zeros((B, H, Lq, Lk), dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                keys = [j for j in range(Lk)
                        if (not causal or j <= i + Lk - Lq)
                        and not math.isnan(scores[b, h, i, j]) and scores[b, h, i, j] != -math.inf]
                keys.sort(key=lambda j: -float(scores[b, h, i, j]))
                for j in keys[:k]:
                    out[b, h, i, j] = True
    return out


def _scores(B, H, Lq, Lk, seed, dtype=torch.float32):
    s = torch.randn((B, H, Lq, Lk), generator=torch.Generator().manual_seed(seed)).to(dtype)
    s[..., 0, 1::3] = -math.inf
    if Lq > 2:
        s[..., 2, ::2] = float("nan")
    return s


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k", [1, 3, 8, 20])
@pytest.mark.parametrize("Lq,Lk", [(7, 7), (5, 9), (9, 6), (1, 13)])
def test_topk_mask_against_brute_force(causal, k, Lq, Lk):
    B, H = 2, 2
    s = _scores(B, H, Lq, Lk, seed=Lq * 31 + Lk + k)
    want = _brute(s, k, causal)
    for chunk in (None, 1, 3):
        mask = M.topk(s, k, causal=causal, chunk_rows=chunk)
        idx = mask.indices
        assert idx.dtype == torch.int32 and idx.shape == (B, H, Lq, k)
        # each row: the kept keys ascending, then -1 padding exactly where fewer than k
        n_keep = want.sum(-1)
        valid = idx >= 0
        assert torch.equal(valid.sum(-1), n_keep)
        assert torch.equal(valid, torch.arange(k) < n_keep[..., None])      # -1 entries last
        kept = idx.masked_fill(~valid, Lk)
        assert torch.equal(kept, kept.sort(-1).values)
        got = mask.to_dense(B, H, Lq, Lk, num_kv_heads=H)
        assert torch.equal(got, want), (chunk, got.int(), want.int())


def test_topk_mask_half_precision_and_integer_scores():
    s = _scores(1, 1, 6, 10, seed=5)
    got = M.topk(s.half(), 4, causal=True).to_dense(1, 1, 6, 10)
    assert torch.equal(got, _brute(s.half().float(), 4, True))
    ints = torch.randperm(60, generator=torch.Generator().manual_seed(1)).view(1, 1, 6, 10)
    assert torch.equal(M.topk(ints, 4, causal=True).to_dense(1, 1, 6, 10),
                       _brute(ints.float(), 4, True))


def test_topk_mask_unsorted_is_descending_score_order():
    s = _scores(1, 2, 5, 8, seed=9)
    idx = M.topk(s, 3, sort=False).indices
    for h in range(2):
        for i in range(5):
            row = [j for j in idx[0, h, i].tolist() if j >= 0]
            vals = [float(s[0, h, i, j]) for j in row]
            assert vals == sorted(vals, reverse=True)
            assert set(row) == set(_brute(s, 3, False)[0, h, i].nonzero().flatten().tolist())


def test_topk_mask_from_a_callable_builds_no_full_scores():
    B, H, Lq, Lk = 1, 2, 10, 12
    s = _scores(B, H, Lq, Lk, seed=3)
    calls = []

    def rows(r0, r1):
        calls.append((r0, r1))
        return s[..., r0:r1, :]

    mask = M.topk(rows, 5, causal=True, chunk_rows=4, num_queries=Lq)
    assert calls == [(0, 4), (4, 8), (8, 10)]
    assert torch.equal(mask.to_dense(B, H, Lq, Lk, num_kv_heads=H), _brute(s, 5, True))
    with pytest.raises(ValueError, match="num_queries"):
        M.topk(rows, 5)


def test_topk_mask_degenerate():
    s = torch.randn((1, 1, 3, 4))
    assert torch.equal(M.topk(s, 0).indices, torch.zeros((1, 1, 3, 0), dtype=torch.int32))
    # Lq > Lk, causal: the first Lq - Lk rows see no key at all
    s = torch.randn((1, 1, 6, 2))
    idx = M.topk(s, 2, causal=True).indices
    assert (idx[0, 0, :4] == -1).all() and (idx[0, 0, 4:, 0] == 0).all()
    assert torch.equal(topk_indices(torch.full((1, 1, 2, 3), -math.inf), 2),
                       torch.full((1, 1, 2, 2), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="k"):
        M.topk(s, -1)


def test_topk_mask_attention_matches_dense_mask():
    B, Hq, Hkv, Lq, Lk, D = 1, 4, 2, 9, 11, 8
    g = torch.Generator().manual_seed(7)
    q = torch.randn((B, Hq, Lq, D), generator=g, dtype=torch.float64)
    k = torch.randn((B, Hkv, Lk, D), generator=g, dtype=torch.float64)
    v = torch.randn((B, Hkv, Lk, D), generator=g, dtype=torch.float64)
    s = _scores(B, Hkv, Lq, Lk, seed=11).double()
    dense = _brute(s, 4, True).repeat_interleave(Hq // Hkv, 1)
    got = flexsparse.attention(q, k, v, M.topk(s, 4, causal=True), backend="reference")
    want = flexsparse.attention(q, k, v, dense, backend="reference")
    torch.testing.assert_close(got, want)


def test_topk_bench_table_format():
    from benchmarks import topk_bench as tb
    ces = (1 << 22, 1 << 26)
    r = dict(L=32768, k=64, torch_ms=10.0, torch_unsorted_ms=9.0, ours_ms=11.0, chunk_rows=64,
             causal_ms=6.0, torch_mb=640.0, ours_mb=100.0, syncs=0, same=True,
             **{f"chunk_{ce}_ms": 12.0 for ce in ces})
    for c in ((), ces):
        head = tb.header(c).splitlines()
        line = tb.format_row(r, c)
        assert head[0].count("|") == head[1].count("|") == line.count("|")
    assert "| 32K | 64 | 10.00 | 9.00 | 11.00 (64) | 1.10 | 6.00 (0.60) | 640 / 100 | 0 | yes" in line


def _select_first_ties(s, k, causal, row0, num_queries):
    """topk_rows' contract by a Python loop: per row the k largest allowed scores, ties to
    the lower position, positions ascending, then -1."""
    rows, Lk = s.shape[-2], s.shape[-1]
    flat = s.reshape(-1, rows, Lk)
    out = torch.full((flat.shape[0], rows, k), -1, dtype=torch.int32)
    for a in range(flat.shape[0]):
        for r in range(rows):
            see = Lk if not causal else max(0, min(Lk, row0 + r + Lk - num_queries + 1))
            keys = [j for j in range(see) if not math.isnan(flat[a, r, j]) and flat[a, r, j] != -math.inf]
            keys.sort(key=lambda j: (-float(flat[a, r, j]), j))
            kept = sorted(keys[:k])
            out[a, r, :len(kept)] = torch.tensor(kept, dtype=torch.int32)
    return out.reshape(s.shape[:-1] + (k,))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k", [1, 4, 9])
def test_segmented_topk_equals_the_whole_row(causal, k):
    # Rows longer than csrc/topk.cu's shared memory go through it in segments
    # (topk._segmented_topk): the same positions as one select over the whole row, ties
    # (scores rounded to few values) to the lower position, -inf / NaN never kept, causal
    # rows of a chunk that starts at row0 with Lq != Lk.
    from flexsparse.topk import _segmented_topk
    g = torch.Generator().manual_seed(k * 7 + causal)
    Lq, Lk, seg = 40, 53, 16
    s = (torch.randn((2, Lq, Lk), generator=g) * 2).round()
    s[:, 3, 5:] = -math.inf
    s[:, 4, ::3] = float("nan")
    s[:, 5, :] = -math.inf
    for r0, rows in ((0, 6), (17, 9), (34, 6)):
        chunk = s[:, r0:r0 + rows]
        want = _select_first_ties(chunk, k, causal, r0, Lq)
        got = _segmented_topk(chunk, k, causal, r0, Lq, _select_first_ties, seg)
        assert torch.equal(got, want), (r0, got, want)
        # in row chunks of 1, 2 and 4 rows (candidates per row: 2 lead x 4 segments x k)
        for per in (1, 2, 4):
            got = _segmented_topk(chunk, k, causal, r0, Lq, _select_first_ties, seg,
                                  max_candidates=per * 2 * 4 * k)
            assert torch.equal(got, want), (r0, per)
