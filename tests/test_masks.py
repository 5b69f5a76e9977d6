"""Masks: each kind against its spec (tests/naive.py), descriptors sound and block-size independent."""
import itertools

import pytest
import numpy as np
import torch
from hypothesis import given, settings, strategies as st

import flexsparse
from flexsparse import masks as M
from flexsparse.descriptor import FULL, SKIP

import naive

BLOCKS = [(16, 16), (8, 32), (32, 8), (4, 4)]


def check_descriptor(mask, B, Hq, Hkv, Lq, Lk, expected):
    """to_dense equals `expected` for every block size, and block states are sound."""
    for block in BLOCKS:
        desc = mask.compile(B, Hq, Hkv, Lq, Lk, block_size=block)
        got = desc.to_dense()
        exp = expected
        if got.shape[1] not in (1, exp.shape[1]) and exp.shape[1] == Hq:
            got = got.repeat_interleave(Hq // Hkv, 1)
        got, exp = torch.broadcast_tensors(got, exp)
        assert torch.equal(got, exp), f"{mask!r} block={block}\n{got.int()}\n{exp.int()}"
        if desc.is_index_mask:
            continue
        state = desc.block_state()
        bq, bk = block
        dense = desc.to_dense()
        for idx in itertools.product(*[range(n) for n in state.shape]):
            b, h, qb, kb = idx
            tile = dense[min(b, dense.shape[0] - 1), min(h, dense.shape[1] - 1),
                         qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
            if state[idx] == FULL:
                assert bool(tile.all()), f"{mask!r}: FULL block {idx} has hidden entries"
            if state[idx] == SKIP:
                assert not bool(tile.any()), f"{mask!r}: SKIP block {idx} has visible entries"


@pytest.mark.parametrize("Lq,Lk", [(37, 37), (20, 45), (45, 20), (1, 17)])
def test_causal_and_sliding(Lq, Lk):
    check_descriptor(M.causal(), 1, 1, 1, Lq, Lk, naive.predicate_dense(naive.causal(Lq, Lk), 1, 1, Lq, Lk))
    for left, right in [(3, 0), (0, 0), (5, 2), (None, 4), (7, None)]:
        exp = naive.predicate_dense(naive.sliding(Lq, Lk, left, right), 1, 1, Lq, Lk)
        check_descriptor(M.sliding_window(left, right), 1, 1, 1, Lq, Lk, exp)


@pytest.mark.parametrize("causal", [True, False])
def test_document(causal):
    lengths = [5, 11, 1, 20]
    exp = naive.predicate_dense(naive.document(lengths, causal), 1, 1, 37, 37)
    check_descriptor(M.document(lengths, causal=causal), 1, 1, 1, 37, 37, exp)
    batched = [[10, 27, 0, 0], [1, 2, 3, 31]]
    exp = naive.predicate_dense(naive.document(batched, causal), 2, 1, 37, 37)
    check_descriptor(M.document(torch.tensor(batched), causal=causal), 2, 1, 1, 37, 37, exp)


def test_prefix_lm_and_shared_question():
    exp = naive.predicate_dense(naive.prefix_lm(30, 30, 9), 1, 1, 30, 30)
    check_descriptor(M.prefix_lm(9), 1, 1, 1, 30, 30, exp)
    exp = naive.predicate_dense(naive.prefix_lm(30, 30, [3, 17]), 2, 1, 30, 30)
    check_descriptor(M.prefix_lm(torch.tensor([3, 17])), 2, 1, 1, 30, 30, exp)
    exp = naive.predicate_dense(naive.shared_question(8, [7, 9, 6]), 1, 1, 30, 30)
    check_descriptor(M.shared_question(8, [7, 9, 6]), 1, 1, 1, 30, 30, exp)


@pytest.mark.parametrize("causal,C", [(True, 1), (True, 2), (False, 2), (False, 4), (True, 4)])
def test_column_ranges(causal, C):
    g = torch.Generator().manual_seed(C + 10 * causal)
    Lq = Lk = 29
    t = torch.randint(0, Lq + 1, (2, 2, Lk, C), generator=g, dtype=torch.int32)
    exp = naive.predicate_dense(naive.flashmask(t, causal, Lq, Lk), 2, 2, Lq, Lk)
    check_descriptor(M.column_ranges(t, causal), 2, 4, 2, Lq, Lk, exp.repeat_interleave(2, 1))


def test_dense_and_block_sparse():
    g = torch.Generator().manual_seed(0)
    dm = torch.rand(2, 1, 23, 31, generator=g) > 0.5
    check_descriptor(M.dense(dm), 2, 2, 2, 23, 31, dm)
    kp = torch.rand(2, 1, 1, 31, generator=g) > 0.3        # key padding, broadcast over rows
    check_descriptor(M.dense(kp), 2, 2, 2, 23, 31, kp.expand(2, 1, 23, 31))
    layout = torch.rand(1, 2, 3, 4, generator=g) > 0.5
    exp = naive.predicate_dense(naive.block_layout(layout, 8, 8), 1, 2, 23, 31)
    check_descriptor(M.block_sparse(layout, (8, 8)), 1, 2, 2, 23, 31, exp)


def test_indices():
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(-1, 17, (1, 2, 13, 5), generator=g)
    for causal in (False, True):
        def pred(b, h, i, j):
            return j in idx[0, h, i].tolist() and (not causal or j <= i + 4)
        exp = naive.predicate_dense(pred, 1, 2, 13, 17)
        check_descriptor(M.indices(idx, causal=causal), 1, 2, 2, 13, 17, exp)


def test_combinations():
    Lq = Lk = 33
    causal = naive.predicate_dense(naive.causal(Lq, Lk), 1, 1, Lq, Lk)
    win = naive.predicate_dense(naive.sliding(Lq, Lk, 4, 0), 1, 1, Lq, Lk)
    doc = naive.predicate_dense(naive.document([10, 23], False), 1, 1, Lq, Lk)
    g = torch.Generator().manual_seed(2)
    dm = torch.rand(1, 1, Lq, Lk, generator=g) > 0.4
    layout = torch.rand(1, 1, 5, 5, generator=glob_gen()) > 0.4
    blk = naive.predicate_dense(naive.block_layout(layout, 7, 7), 1, 1, Lq, Lk)
    glob = torch.zeros(1, 1, Lq, Lk, dtype=torch.bool)
    glob[..., :3] = True
    glob[..., :3, :] = True
    cases = [
        (M.and_(M.causal(), M.document([10, 23], False)), causal & doc),
        (M.or_(M.sliding_window(4), M.document([10, 23], False)), win | doc),
        (M.and_(M.causal(), M.dense(dm)), causal & dm),
        (M.or_(M.causal(), M.dense(dm)), causal | dm),
        (M.and_(M.block_sparse(layout, 7), M.sliding_window(4)), blk & win),
        (M.or_(M.block_sparse(layout, 7), M.sliding_window(4)), blk | win),
        (M.or_(M.sliding_window(4), M.dense(glob)), win | glob),
        (M.causal() & M.sliding_window(4) & M.dense(dm), win & dm),
        (M.or_(M.and_(M.causal(), M.dense(dm)), M.sliding_window(2)),
         (causal & dm) | naive.predicate_dense(naive.sliding(Lq, Lk, 2, 0), 1, 1, Lq, Lk)),
    ]
    for mask, exp in cases:
        check_descriptor(mask, 1, 1, 1, Lq, Lk, exp)


def glob_gen():
    return torch.Generator().manual_seed(3)


def test_index_combinations():
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(-1, 20, (1, 1, 20, 6), generator=g)
    def pred(b, h, i, j):
        return j in idx[0, 0, i].tolist() and i - 3 <= j <= i
    exp = naive.predicate_dense(pred, 1, 1, 20, 20)
    check_descriptor(M.and_(M.indices(idx), M.sliding_window(3)), 1, 1, 1, 20, 20, exp)
    win = naive.predicate_dense(naive.sliding(20, 20, 3, 0), 1, 1, 20, 20)
    inlist = naive.predicate_dense(lambda b, h, i, j: j in idx[0, 0, i].tolist(), 1, 1, 20, 20)
    check_descriptor(M.or_(M.indices(idx), M.causal() & M.sliding_window(3)), 1, 1, 1, 20, 20,
                     inlist | win)


# ---------------------------------------------------------------- random masks

def _mask_strategy(L):
    leaf = st.one_of(
        st.just(M.causal()),
        st.builds(M.sliding_window, st.integers(0, L), st.one_of(st.none(), st.integers(0, L))),
        st.builds(M.prefix_lm, st.integers(0, L)),
        st.lists(st.integers(0, L), min_size=1, max_size=4).map(
            lambda xs: M.document(xs + [L - sum(xs)] if sum(xs) <= L else [L], causal=bool(len(xs) % 2))),
        st.integers(0, 2 ** 31 - 1).map(
            lambda s: M.dense(torch.rand(1, 1, L, L, generator=torch.Generator().manual_seed(s)) > 0.5)),
        st.integers(0, 2 ** 31 - 1).map(
            lambda s: M.column_ranges(torch.randint(0, L + 1, (1, 1, L, 4), dtype=torch.int32,
                                                    generator=torch.Generator().manual_seed(s)), False)),
    )
    return st.recursive(leaf, lambda kids: st.one_of(
        st.lists(kids, min_size=2, max_size=3).map(lambda ms: M.and_(*ms)),
        st.lists(kids, min_size=2, max_size=3).map(lambda ms: M.or_(*ms))), max_leaves=4)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_masks_block_size_independent(data):
    L = data.draw(st.integers(1, 40))
    mask = data.draw(_mask_strategy(L))
    expected = mask.compile(1, 1, 1, L, L, block_size=(1, 1)).to_dense()   # one element per block
    check_descriptor(mask, 1, 1, 1, L, L, expected)


def test_block_size_one_matches_spec():
    """Block size (1, 1) has no partial blocks: the state alone is the mask."""
    d = M.sliding_window(2, 1).compile(1, 1, 1, 9, 9, block_size=(1, 1))
    exp = naive.predicate_dense(naive.sliding(9, 9, 2, 1), 1, 1, 9, 9)
    assert torch.equal(d.block_state() == FULL, exp)


# ---------------------------------------------------------------- descriptor cache

def test_value_masks_share_compiled_descriptors():
    M.clear_cache()
    a = M.causal().compile(1, 2, 2, 300, 300)
    assert M.causal().compile(1, 2, 2, 300, 300) is a          # another causal() object, same value
    assert M.causal().compile(1, 2, 2, 301, 301) is not a      # other sizes
    assert M.causal().compile(1, 2, 2, 300, 300, block_size=(64, 64)) is not a
    combo = M.and_(M.sliding_window(5), M.prefix_lm(3))
    assert combo.compile(1, 1, 1, 40, 40) is M.and_(M.sliding_window(5), M.prefix_lm(3)).compile(1, 1, 1, 40, 40)
    for n in range(M.CACHE_SIZE + 2):                          # bounded
        M.sliding_window(n).compile(1, 1, 1, 40, 40)
    assert len(M._CACHE) <= M.CACHE_SIZE


def test_masks_with_user_tensors_are_not_cached_and_value_masks_copy():
    M.clear_cache()
    lengths = torch.tensor([10, 30])
    doc = M.document(lengths)
    before = doc.to_dense(1, 1, 40, 40)
    lengths[0], lengths[1] = 20, 20                            # the mask keeps its own copy
    assert torch.equal(doc.to_dense(1, 1, 40, 40), before)
    # one copy also when it casts (int32) or when the values come from an array
    for src in (torch.tensor([10, 30], dtype=torch.int32), np.array([10, 30])):
        doc = M.document(src)
        src[0], src[1] = 20, 20
        assert torch.equal(doc.to_dense(1, 1, 40, 40), before)
    prefix = torch.tensor([3, 5], dtype=torch.int32)
    pm = M.prefix_lm(prefix)
    want = pm.to_dense(2, 1, 9, 9)
    prefix.fill_(0)
    assert torch.equal(pm.to_dense(2, 1, 9, 9), want) and bool(want[1, 0, 0, 4])
    dm = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    d = M.dense(dm)
    first = d.compile(1, 1, 1, 8, 8)
    dm[..., 3] = False                                          # in-place change is seen
    second = d.compile(1, 1, 1, 8, 8)
    assert second is not first and not bool(second.to_dense()[..., 3].any())
    cr = M.column_ranges(torch.zeros(1, 1, 8, 2, dtype=torch.int32), causal=False)
    assert cr.compile(1, 1, 1, 8, 8) is not cr.compile(1, 1, 1, 8, 8)
    assert M.and_(M.causal(), d).compile(1, 1, 1, 8, 8) is not M.and_(M.causal(), d).compile(1, 1, 1, 8, 8)


def test_masks_owning_their_tensors_keep_their_descriptors():
    """Documents and prefix-LM made from tensors hold their own copies, so each mask object
    keeps what it built, per sizes: a model that passes one mask to all its layers builds
    it once. (CPU masks of values also share the value cache; `cacheable = False` here
    takes the path of GPU tensors, which are not in it.) Masks holding the caller's tensors
    build on every call."""
    M.clear_cache()
    kept = []
    for mask in (M.document(torch.tensor([[10, 30], [25, 15]])), M.prefix_lm(torch.tensor([3, 7]))):
        assert mask.owns_tensors
        mask.cacheable = False
        first = mask.compile(2, 4, 2, 40, 40)
        assert mask.compile(2, 4, 2, 40, 40) is first                    # the same sizes
        other = mask.compile(2, 4, 1, 40, 40)                            # other sizes
        assert other is not first and mask.compile(2, 4, 1, 40, 40) is other
        assert torch.equal(first.to_dense(), other.to_dense())
        kept.append(first)
    twin = M.document(torch.tensor([[10, 30], [25, 15]]))              # another object: its own
    twin.cacheable = False
    again = twin.compile(2, 4, 2, 40, 40)
    assert again is not kept[0] and torch.equal(again.to_dense(), kept[0].to_dense())
    both = M.and_(M.document(torch.tensor([10, 30])), M.sliding_window(5))   # owned + a value
    both.cacheable = False
    assert both.owns_tensors and both.compile(1, 2, 2, 40, 40) is both.compile(1, 2, 2, 40, 40)
    user = M.column_ranges(torch.zeros(1, 1, 40, 2, dtype=torch.int32), causal=False)
    assert not M.and_(M.document(torch.tensor([10, 30])), user).owns_tensors
    layout = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    users = M.block_sparse(layout, 16)
    assert not users.owns_tensors
    assert users.compile(1, 1, 1, 48, 48) is not users.compile(1, 1, 1, 48, 48)


def test_full_mask_lists_are_one_row_for_all():
    """The full mask's block state is one value: its kv lists (one per query block) and q
    lists (one per key block) are one row expanded (stride 0), which the CUDA kernels read
    as "every row the same" (the forward's 192-row tiles at hd64, the backward's 80-row
    steps at hd128). A key-padding mask's kv lists are one row, its q lists are not."""
    d = M.full().compile(2, 4, 2, 1000, 700)
    for name in ("kv_count", "kv_index", "kv_full_count", "kv_full_index",
                 "q_count", "q_index", "q_full_count", "q_full_index"):
        t = getattr(d, name)
        assert t.shape[2] > 1 and t.stride(2) == 0, name
    assert bool((d.block_state() == FULL).all()) and bool(d.to_dense().all())
    keys = torch.arange(700) < 650
    pad = M.dense(keys.view(1, 1, 1, 700)).compile(2, 4, 2, 1000, 700)
    assert pad.kv_full_count.stride(2) == 0 and pad.q_full_count.stride(2) != 0
    assert torch.equal(pad.to_dense(), keys.view(1, 1, 1, 700).expand_as(pad.to_dense()))
