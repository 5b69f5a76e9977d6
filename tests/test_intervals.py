"""Interval specs (flexsparse/intervals.py) and their one-launch kernel (flexsparse/triton_intervals.py).

The oracle is the torch builder of each mask (`masks._stack_slots(mask.slots(sz), sz)`):
the kernel, run under TRITON_INTERPRET=1 here, must give the same int32 column ranges bit
for bit, for every named column-range mask, and_ of them and or_ of two; and the masks
must show what their docstrings say (checked on a dense grid for small sizes).
"""
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from flexsparse import intervals
from flexsparse import masks as M
from flexsparse.masks import Sizes, _stack_slots

SETTINGS = dict(deadline=None, derandomize=True, max_examples=60,
                suppress_health_check=[HealthCheck.too_slow])


def kernel_ranges(mask, sz):
    spec = mask.spec(sz)
    assert intervals.fits(spec, sz.Lq, sz.Lk)
    return intervals.column_ranges(spec, sz.B, sz.Lq, sz.Lk, "cpu")


def torch_ranges(mask, sz):
    slots = mask.slots(sz)
    return _stack_slots(slots, sz) if slots else None


def assert_same(mask, sz):
    ref = torch_ranges(mask, sz)
    got = kernel_ranges(mask, sz)
    if ref is None:
        assert got.shape[-1] == 0, repr(mask)
    else:
        assert got.shape == ref.shape, (repr(mask), got.shape, ref.shape)
        assert torch.equal(got, ref), repr(mask)


def split(L, n, draw):
    cuts = sorted(draw(st.lists(st.integers(0, L), min_size=n - 1, max_size=n - 1)))
    edges = [0, *cuts, L]
    return [b - a for a, b in zip(edges, edges[1:])]


@st.composite
def single_masks(draw, B, Lq, Lk):
    kind = draw(st.sampled_from(["causal", "sliding", "document", "prefix", "prefix_b",
                                 "shared_question", "global"]))
    window = st.one_of(st.none(), st.integers(0, Lk + 3))
    if kind == "causal":
        return M.causal()
    if kind == "sliding":
        return M.sliding_window(draw(window), draw(window))
    if kind == "prefix":
        return M.prefix_lm(draw(st.integers(0, Lk + 5)))
    if kind == "prefix_b":
        return M.prefix_lm(torch.tensor(draw(st.lists(st.integers(0, Lk), min_size=B,
                                                      max_size=B))))
    if kind == "global":
        return M.global_tokens(draw(st.integers(0, Lk + 2)))
    if Lq != Lk:          # documents need Lq == Lk
        return M.causal()
    if kind == "document":
        if draw(st.booleans()):
            lens = torch.tensor([split(Lk, 4, draw) for _ in range(B)])
        else:
            lens = split(Lk, draw(st.integers(1, 6)), draw)
        return M.document(lens, causal=draw(st.booleans()))
    q = draw(st.integers(0, Lk))
    return M.shared_question(q, split(Lk - q, draw(st.integers(1, 4)), draw))


@st.composite
def cases(draw):
    B = draw(st.integers(1, 3))
    Lq = draw(st.integers(1, 200))
    Lk = Lq if draw(st.booleans()) else draw(st.integers(1, 200))
    a = draw(single_masks(B, Lq, Lk))
    how = draw(st.sampled_from(["one", "and", "or"]))
    if how == "one":
        m = a
    else:
        b = draw(single_masks(B, Lq, Lk))
        m = M.and_(a, b) if how == "and" else M.or_(a, b)
    return m, Sizes(B, 4, 2, Lq, Lk, 32, 16, torch.device("cpu"))


@given(cases())
@settings(**SETTINGS)
def test_kernel_matches_torch_builder(case):
    m, sz = case
    # and_ of two document masks has no single doc table: not an example of this test
    assume(m.spec(sz) is not None)
    assert_same(m, sz)


@pytest.mark.parametrize("Lq,Lk", [(300, 300), (250, 300), (300, 250), (1, 1)])
def test_named_masks(Lq, Lk):
    named = [M.causal(), M.sliding_window(40), M.sliding_window(40, 7), M.sliding_window(None, 5),
             M.sliding_window(None, None), M.prefix_lm(70), M.prefix_lm(torch.tensor([10, 250])),
             M.global_tokens(33), M.or_(M.sliding_window(50), M.global_tokens(20)),
             M.or_(M.prefix_lm(50), M.sliding_window(20, 3))]
    if Lq == Lk:
        docs = [Lk // 3, 0, Lk - 2 * (Lk // 3), Lk // 3]
        named += [M.document(docs), M.document(docs, causal=False),
                  M.document(torch.tensor([docs, [Lk, 0, 0, 0]])),
                  M.shared_question(Lk // 5, [Lk // 2, Lk - Lk // 5 - Lk // 2]),
                  M.and_(M.document(docs), M.sliding_window(30))]
    for m in named:
        assert_same(m, Sizes(2, 4, 2, Lq, Lk, 64, 32, torch.device("cpu")))


def test_global_tokens_semantics():
    n, L = 3, 10
    dense = M.global_tokens(n).to_dense(1, 1, L, L)[0, 0]
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    assert torch.equal(dense, (i < n) | (j < n))
    g_s = M.or_(M.sliding_window(2), M.global_tokens(n)).to_dense(1, 1, L, L)[0, 0]
    assert torch.equal(g_s, (i < n) | (j < n) | ((j <= i) & (i - j <= 2)))


def test_spec_limits():
    # or_ of three intervals, and_ of two document masks: no spec, the torch path builds them
    sz = Sizes(1, 1, 1, 64, 64, 16, 16, torch.device("cpu"))
    three = M.or_(M.causal(), M.global_tokens(2), M.prefix_lm(3))
    assert three.spec is None or three.spec(sz) is None
    two_docs = M.and_(M.document([32, 32]), M.document([16, 48]))
    assert two_docs.spec(sz) is None
    assert not intervals.fits(None, 64, 64)
    with pytest.raises(ValueError, match="n: must be a non-negative int"):
        M.global_tokens(-1)
    with pytest.raises(ValueError, match="lengths must sum"):
        M.document([10, 10]).spec(sz)
