"""The mask-build ops (issue 16; flexsparse/build_op.py, csrc/build_ops.h): their CPU
kernel against the torch builds of the same masks. FlashMask column ranges: the static
build's tensors exactly (padded lists). Documents from a lengths tensor (causal and not)
and prefix-LM from per-sample prefixes: the same column ranges as the static and the
compact build (exactly), the same block counts, the same blocks in every list (the op
writes maximal ranges; the compact build may split a run in two), the same block grid,
mask and attention. Output shapes equal the fake kernel's. Bad values raise the eager
build's ValueError with the same text. Inside torch.compile(fullgraph=True, dynamic=True)
the op is one node of the graph, with no recompile across lengths.

Without flexsparse._C (CPU-only torch, as in CI) the same C++ (csrc/build_ops.h without
CUDA) is compiled here and loaded (tests/cpu_build_ops.py; needs a C++ compiler and
ninja), or the library FLEXSPARSE_TEST_BUILD_LIB names; skipped, with the reason, only
when neither works.
"""
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import flexsparse
from flexsparse import build_op
from flexsparse import masks as M
from flexsparse.descriptor import Sizes, building_static
from torch._subclasses.fake_tensor import FakeTensorMode

from build_checks import LISTS, check_range_rows, grids, state_masks

from cpu_build_ops import load as load_cpu_build_ops

# flexsparse._C's CPU kernels, or (CPU-only torch, as in CI) the same C++ built here
# (tests/cpu_build_ops.py), or the library FLEXSPARSE_TEST_BUILD_LIB names
_WHY_NOT = load_cpu_build_ops()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))


def _same_attention(got, want, B, Hq, Hkv, Lq, Lk, seed):
    """float64 attention through two descriptors of one mask: exactly equal outputs."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, 8, dtype=torch.float64, generator=g)
    k = torch.randn(B, Hkv, Lk, 8, dtype=torch.float64, generator=g)
    v = torch.randn(B, Hkv, Lk, 8, dtype=torch.float64, generator=g)
    torch.testing.assert_close(flexsparse.attention(q, k, v, got),
                               flexsparse.attention(q, k, v, want), rtol=0, atol=0)


def _sizes(B, Hq, Hkv, Lq, Lk, block):
    return Sizes(B, Hq, Hkv, Lq, Lk, *block, torch.device("cpu"))


def _compare(mask, B, Hq, Hkv, Lq, Lk, block, attention=False):
    compact = mask.compile(B, Hq, Hkv, Lq, Lk, block_size=block)
    with building_static():
        static = mask._descriptor(_sizes(B, Hq, Hkv, Lq, Lk, block))
    M.clear_cache()          # masks of CPU tensors are cached by value
    with build_op.use(True):
        got = mask.compile(B, Hq, Hkv, Lq, Lk, block_size=block)
    M.clear_cache()
    assert compact.kv_index.dim() == 5, "the compact build gave lists: not a range-form mask"
    check_range_rows(got)
    assert got.col_ranges.dtype == torch.int32 and got.col_ranges.is_contiguous()
    assert torch.equal(got.col_ranges, static.col_ranges)
    assert torch.equal(got.col_ranges, compact.col_ranges)
    want, want_static, have = grids(compact), grids(static), grids(got)
    for name in LISTS:
        assert have[name][0].dtype == torch.int32
        assert torch.equal(have[name][0], want[name][0]), name
        assert torch.equal(have[name][0], want_static[name][0]), name
        assert torch.equal(have[name][1], want[name][1]), name
        assert torch.equal(have[name][1], want_static[name][1]), name
    assert torch.equal(got.block_state(), static.block_state())
    assert torch.equal(got.to_dense(), static.to_dense())
    for field in ("seq_lengths", "block_size", "num_heads"):
        assert getattr(got, field) == getattr(static, field)
    _check_fake_shapes(mask, got, Lq, Lk, block)
    if attention:
        _same_attention(got, static, B, Hq, Hkv, Lq, Lk, Lq)
    return got


def _check_fake_shapes(mask, got, Lq, Lk, block):
    """The fake kernel's outputs have the real outputs' shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    names = ("col_ranges",) + tuple(f"{n}_{w}" for n in LISTS for w in ("count", "index"))
    real = [getattr(got, n) for n in names]
    with FakeTensorMode() as mode:
        if got.col_ranges.shape[-1] == 4:
            lens = mode.from_tensor(torch.zeros(got.col_ranges.shape[0], 3, dtype=torch.int64))
            fake = torch.ops.flexsparse.build_document(lens, Lk, *block, True)
        else:
            pre = mode.from_tensor(torch.zeros(got.col_ranges.shape[0], dtype=torch.int64))
            fake = torch.ops.flexsparse.build_prefix_lm(pre, Lq, Lk, *block)
    for n, r, f in zip(names, real, fake):
        assert tuple(f.shape) == tuple(r.shape) and f.dtype == r.dtype, n


def _random_lengths(draw, L, rows):
    out = []
    for _ in range(rows):
        cuts = sorted(draw(st.lists(st.integers(0, L), min_size=0, max_size=12)))
        lens = [b - a for a, b in zip([0] + cuts, cuts + [L])]
        out.append(lens)
    n = max(len(r) for r in out)
    return torch.tensor([r + [0] * (n - len(r)) for r in out], dtype=torch.int64)


BLOCKS = st.sampled_from([(16, 16), (32, 32), (16, 32), (32, 16), (24, 40), (7, 5), (64, 64)])


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data(), st.integers(1, 300), BLOCKS, st.integers(1, 3), st.booleans(),
       st.booleans())
def test_document_random_lengths(data, L, block, B, per_row, causal):
    lens = _random_lengths(data.draw, L, B if per_row else 1)
    if not per_row and data.draw(st.booleans()):
        lens = lens[0]                                   # 1-D lengths
    _compare(M.document(lens, causal=causal), B, 2, 2, L, L, block)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(1, 300), st.integers(0, 80), BLOCKS, st.integers(1, 3), st.booleans(),
       st.lists(st.integers(0, 320), min_size=3, max_size=3))
def test_prefix_lm_random(Lq, extra, block, B, per_row, prefixes):
    Lk = Lq + extra                                      # Lk >= Lq: bottom-right aligned
    p = torch.tensor(prefixes[:B] if per_row else prefixes[:1])
    _compare(M.prefix_lm(p), B, 2, 2, Lq, Lk, block)


@pytest.mark.parametrize("Lq,Lk", [(100, 60), (1, 1), (5, 300)])
def test_prefix_lm_other_shapes(Lq, Lk):
    """Lq > Lk too (rows above the shifted diagonal see only the prefix)."""
    _compare(M.prefix_lm(torch.tensor([0, 3, 50])), 3, 1, 1, Lq, Lk, (16, 16))


@pytest.mark.parametrize("name,lens,L,block", [
    ("one document", [257], 257, (32, 32)),
    ("odd L, partial last block", [100, 0, 1, 98], 199, (64, 64)),
    ("L smaller than a block", [3, 4], 7, (128, 128)),
    ("many tiny documents", [1] * 301, 301, (16, 16)),
    ("documents of one block each", [32] * 8, 256, (32, 32)),
    ("zero-length documents everywhere", [0, 10, 0, 0, 90, 0], 100, (16, 32)),
])
@pytest.mark.parametrize("causal", [True, False])
def test_document_cases(name, lens, L, block, causal):
    _compare(M.document(torch.tensor(lens), causal=causal), 1, 1, 1, L, L, block)


@pytest.mark.parametrize("mask", [
    M.document(torch.tensor([[50, 90, 60], [120, 0, 80]])),
    M.document(torch.tensor([[50, 90, 60], [120, 0, 80]]), causal=False),
    M.document(torch.tensor([100, 100])),
    M.prefix_lm(torch.tensor([30, 77])),
    M.prefix_lm(torch.tensor([5])),
], ids=["doc-rows", "doc-rows-noncausal", "doc-shared", "prefix-rows", "prefix-shared"])
def test_attention_batch_and_gqa(mask):
    """B = 2, Hq = 4 query heads on Hkv = 2: the same attention as the static build."""
    _compare(mask, 2, 4, 2, 200, 200, (32, 32), attention=True)


def test_attention_forward_backward_against_the_torch_build():
    """Gradients too, at the default backend (reference on CPU)."""
    mask = M.document(torch.tensor([[70, 130], [10, 190]]))
    q, k, v = (torch.randn(2, 4, 200, 8, dtype=torch.float64, requires_grad=True,
                           generator=torch.Generator().manual_seed(i)) for i in range(3))
    k2, v2 = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()
    outs = []
    for mode in (True, False):
        with build_op.use(mode):
            out = flexsparse.attention(q, k2, v2, mask, block_size=(32, 32))
        outs.append((out, torch.autograd.grad(out.sum(), (q, k2, v2))))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_not_used_on_cpu_by_default():
    lens = torch.tensor([100, 100])
    calls = []
    real = build_op.document
    try:
        build_op.document = lambda *a: calls.append(a) or real(*a)
        M.clear_cache()
        M.document(lens).compile(1, 1, 1, 200, 200)
        assert not calls
        M.clear_cache()
        with build_op.use(True):
            M.document(lens).compile(1, 1, 1, 200, 200)
        assert len(calls) == 1
        M.clear_cache()
        with build_op.use(True), build_op.use(False):
            M.document(lens).compile(1, 1, 1, 200, 200)
        assert len(calls) == 1
    finally:
        build_op.document = real
        M.clear_cache()
    with pytest.raises(TypeError, match="mode"):
        with build_op.use("yes"):
            pass


# ------------------------------------------------------------------ FlashMask column ranges

def _compare_static(t, causal, B, Hq, Hkv, Lq, Lk, block, attention=False):
    """Column ranges: the op gives the static build's tensors exactly (padded lists)."""
    mask = M.column_ranges(t, causal=causal)
    with building_static():
        static = mask._descriptor(_sizes(B, Hq, Hkv, Lq, Lk, block))
    with build_op.use(True):
        got = mask.compile(B, Hq, Hkv, Lq, Lk, block_size=block)
    for name, a, b in zip(got.mask_tensors()._fields, got.mask_tensors(), static.mask_tensors()):
        assert (a is None) == (b is None), name
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), name
    with FakeTensorMode() as mode:
        fake = torch.ops.flexsparse.build_column_ranges(
            mode.from_tensor(t), Lq, Lk, *block, causal)
    real = [got.col_ranges] + list(got.mask_tensors())[:8]
    for f, r in zip(fake, real):
        assert tuple(f.shape) == tuple(r.shape) and f.dtype == r.dtype
    if attention:
        compact = mask.compile(B, Hq, Hkv, Lq, Lk, block_size=block)
        _same_attention(got, compact, B, Hq, Hkv, Lq, Lk, Lq)
    return got


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(1, 200), st.integers(0, 50), BLOCKS, st.sampled_from([1, 2, 4]),
       st.booleans(), st.sampled_from([(1, 1), (2, 1), (2, 2), (1, 2)]), st.integers(0, 2**31))
def test_column_ranges_random(Lq, extra, block, C, causal, bh, seed):
    """Random (unsorted, out-of-range) row indices, every C, head dim 1 or Hkv."""
    if C == 1 and not causal:
        C = 2
    Lk = Lq + extra
    Bc, Hc = bh
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-5, Lq + 6, (Bc, Hc, Lk, C), generator=g)
    _compare_static(t, causal, 2, 4, 2, Lq, Lk, block)


@pytest.mark.parametrize("C,causal", [(1, True), (2, True), (4, True), (2, False), (4, False)])
def test_column_ranges_attention(C, causal):
    g = torch.Generator().manual_seed(C)
    t = torch.randint(0, 200, (2, 2, 200, C), generator=g, dtype=torch.int32)
    _compare_static(t, causal, 2, 4, 2, 200, 200, (32, 32), attention=True)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(1, 300), st.integers(1, 300), BLOCKS,
       st.sampled_from([(1, 1), (2, 1), (2, 2), (1, 2), (1, 4), (2, 4)]),
       st.floats(0.0, 1.0), st.integers(0, 2**31))
def test_block_layout_random(Lq, Lk, block, bh, density, seed):
    """masks.block_sparse(layout) at the call's block size: the op's eight padded lists
    equal the static build's exactly (Bd, Hd of 1, B, Hkv or Hq), with the fake kernel's
    shapes, and the attention through them equals the torch build's (float64)."""
    B, Hq, Hkv = 2, 4, 2
    nq, nk = -(-Lq // block[0]), -(-Lk // block[1])
    g = torch.Generator().manual_seed(seed)
    layout = torch.rand(*bh, nq, nk, generator=g) < density
    mask = M.block_sparse(layout, block)
    with building_static():
        static = mask._descriptor(_sizes(B, Hq, Hkv, Lq, Lk, block))
    with build_op.use(True), mock.patch.object(build_op, "_BLOCK_LISTS",
                                               wraps=build_op._BLOCK_LISTS) as op:
        got = mask.compile(B, Hq, Hkv, Lq, Lk, block_size=block)
    assert op.call_count == 1                 # built by the op, not the torch build
    for name, a, b in zip(got.mask_tensors()._fields, got.mask_tensors(), static.mask_tensors()):
        assert (a is None) == (b is None), name
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), name
    with FakeTensorMode() as mode:
        fake = torch.ops.flexsparse.build_block_lists(mode.from_tensor(layout))
    for f, r in zip(fake, list(got.mask_tensors())[:8]):
        assert tuple(f.shape) == tuple(r.shape) and f.dtype == r.dtype
        assert f.stride() == r.stride(), (f.stride(), r.stride())
    # a layout has no partial blocks: its partial lists are one stored row per (b, h),
    # expanded over the list rows (half of the bytes the build writes)
    for t in (got.kv_count, got.kv_index, got.q_count, got.q_index):
        assert t.shape[2] < 2 or t.stride(2) == 0, t.stride()
    q = torch.randn(B, Hq, Lq, 8, dtype=torch.float64, generator=g)
    k = torch.randn(B, Hkv, Lk, 8, dtype=torch.float64, generator=g)
    v = torch.randn(B, Hkv, Lk, 8, dtype=torch.float64, generator=g)
    with build_op.use(False):
        torch_build = mask.compile(B, Hq, Hkv, Lq, Lk, block_size=block)
    torch.testing.assert_close(flexsparse.attention(q, k, v, got),
                               flexsparse.attention(q, k, v, torch_build), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(state_masks(8)))
@pytest.mark.parametrize("L,block", [(100, (16, 16)), (77, (32, 16)), (64, (64, 64))])
def test_block_states_to_lists_in_one_op_call(name, L, block):
    """Static builds of masks that reach the descriptor through block states
    (DescriptorParts.state): with the op, the eight lists come from one build_block_lists
    call on the int32 states; every tensor equals the torch build's, and the attention
    through it the torch build's (float64)."""
    mask = state_masks(L)[name]
    B, Hq, Hkv = 2, 4, 2
    M.clear_cache()
    with building_static(), build_op.use(False):
        want = mask._descriptor(_sizes(B, Hq, Hkv, L, L, block))
    with building_static(), build_op.use(True), mock.patch.object(
            build_op, "_BLOCK_LISTS", wraps=build_op._BLOCK_LISTS) as op:
        got = mask._descriptor(_sizes(B, Hq, Hkv, L, L, block))
    assert op.call_count == 1
    assert op.call_args.args[0].dtype == torch.int32
    for n, a, b in zip(got.mask_tensors()._fields, got.mask_tensors(), want.mask_tensors()):
        assert (a is None) == (b is None), n
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), n
    _same_attention(got, want, B, Hq, Hkv, L, L, L)


def test_block_states_inside_torch_compile_one_graph_over_lengths():
    """A mask built through block states (and_(dense, causal)) inside a compiled function:
    its lists from one build_block_lists node, no recompile over three lengths, the torch
    static build's tensors."""
    counter, seen = _recording_counter()

    def build(dmask, q):
        B, H, L, _ = q.shape
        mask = M.and_(M.dense(dmask), M.causal())
        return mask.compile(B, H, H, L, L, block_size=(16, 16)).mask_tensors()

    f = torch.compile(build, backend=counter, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(3)
    with build_op.use(True):
        for L in (80, 96, 130):
            dmask = torch.rand(1, 1, L, L, generator=g) < 0.5
            q = torch.zeros(2, 2, L, 8)
            with building_static(), build_op.use(False):
                want = M.and_(M.dense(dmask), M.causal())._descriptor(
                    _sizes(2, 2, 2, L, L, (16, 16))).mask_tensors()
            _assert_same_tensors(f(dmask, q), want)
    assert counter.frame_count == 1
    assert _flexsparse_ops(seen) == ["flexsparse.build_block_lists"], seen


def test_block_layout_other_block_size_keeps_the_torch_build():
    """A layout at another block size than the call's is evaluated per element (bitmaps):
    not the op's job; the descriptor equals the torch build's."""
    layout = torch.rand(1, 2, 4, 4, generator=torch.Generator().manual_seed(1)) < 0.5
    mask = M.block_sparse(layout, 64)
    with build_op.use(True):
        got = mask.compile(1, 2, 2, 256, 256, block_size=(128, 128))
    with build_op.use(False):
        want = mask.compile(1, 2, 2, 256, 256, block_size=(128, 128))
    assert torch.equal(got.to_dense(), want.to_dense())
    for a, b in zip(got.mask_tensors(), want.mask_tensors()):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


def test_block_layout_bad_shapes_raise_before_the_op():
    layout = torch.ones(1, 2, 3, 3, dtype=torch.bool)
    with build_op.use(True), pytest.raises(ValueError, match=r"layout: shape \(1, 2, 3, 3\)"):
        M.block_sparse(layout, 128).compile(1, 2, 2, 256, 256)
    with pytest.raises(ValueError, match="layout must be a 4-D bool or int32 tensor"):
        with FakeTensorMode() as mode:
            torch.ops.flexsparse.build_block_lists(mode.from_tensor(torch.ones(2, 2, dtype=torch.bool)))


def test_column_ranges_past_static_max_blocks_keep_the_compact_build(monkeypatch):
    """Past STATIC_MAX_BLOCKS the padded lists would be too large: eager builds keep the
    compact build (as without the op)."""
    monkeypatch.setattr(M, "STATIC_MAX_BLOCKS", 4)
    t = torch.randint(0, 64, (1, 1, 64, 2))
    with build_op.use(True):
        desc = M.column_ranges(t, causal=True).compile(1, 1, 1, 64, 64, block_size=(16, 16))
    compact = M.column_ranges(t, causal=True).compile(1, 1, 1, 64, 64, block_size=(16, 16))
    for a, b in zip(desc.mask_tensors(), compact.mask_tensors()):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b)


# ------------------------------------------------------------------ errors

def _error(make, *args):
    try:
        make().compile(*args)
    except Exception as err:        # noqa: BLE001 - the test compares the exceptions
        return type(err), str(err)
    return None


@pytest.mark.parametrize("make,args", [
    (lambda: M.document(torch.tensor([10, 20])), (1, 1, 1, 64, 64)),
    (lambda: M.document(torch.tensor([[32, 32], [10, 20]])), (2, 1, 1, 64, 64)),
    (lambda: M.document(torch.tensor([[80, -16], [32, 32]])), (2, 1, 1, 64, 64)),
    (lambda: M.document(torch.tensor([[32, 32], [-1, 65]]), causal=False), (2, 1, 1, 64, 64)),
    (lambda: M.document(torch.tensor([[32, 32]] * 3)), (2, 1, 1, 64, 64)),
    (lambda: M.document(torch.tensor([32, 32])), (1, 1, 1, 64, 48)),
    (lambda: M.prefix_lm(torch.tensor([3, -2])), (2, 1, 1, 64, 64)),
    (lambda: M.prefix_lm(torch.tensor([3, 2, 1])), (2, 1, 1, 64, 64)),
], ids=["sum", "row-sum", "negative", "negative-noncausal", "batch", "lq-lk",
        "prefix-negative", "prefix-batch"])
def test_bad_values_raise_the_eager_error(make, args):
    """The op's CPU kernel raises what the torch build raises eagerly (type and text)."""
    want = _error(make, *args)
    assert want is not None and want[0] is ValueError
    with build_op.use(True):
        assert _error(make, *args) == want


def test_raw_op_refuses_bad_arguments():
    lens = torch.tensor([[8, 8]])
    with pytest.raises(ValueError, match="block sizes must be positive"):
        torch.ops.flexsparse.build_document(lens, 16, 0, 16, True)
    with pytest.raises(TypeError, match="integer tensor"):
        torch.ops.flexsparse.build_document(lens.float(), 16, 16, 16, True)
    with pytest.raises(ValueError, match=r"\(n,\) or \(B, n\)"):
        torch.ops.flexsparse.build_document(lens[None], 16, 16, 16, True)
    one_d = torch.ops.flexsparse.build_document(lens[0], 16, 16, 16, True)
    for a, b in zip(one_d, torch.ops.flexsparse.build_document(lens, 16, 16, 16, True)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        torch.ops.flexsparse.build_prefix_lm(lens, 16, 16, 16, 16)
    out = torch.ops.flexsparse.build_document(lens.to(torch.int32), 16, 16, 16, True)
    assert torch.equal(out[0], torch.ops.flexsparse.build_document(lens, 16, 16, 16, True)[0])


# ------------------------------------------------------------------ torch.compile

def _assert_same_tensors(got, want):
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b)


def _flexsparse_ops(seen):
    """The flexsparse ops of the recorded graphs, overload names dropped."""
    return [t.replace(".default", "") for graph in seen for t in graph if "flexsparse" in t]


def _recording_counter():
    """A compile counter whose backend records each graph's call_function targets."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    return CompileCounterWithBackend(backend), seen


def test_inside_torch_compile_one_graph_over_lengths():
    """fullgraph=True, dynamic=True: the mask built inside the compiled function is one op
    node, the descriptor equals the eager one, and a second length does not recompile."""
    counter, seen = _recording_counter()

    def build(lens, prefix, q):
        B, H, L, _ = q.shape
        d = M.document(lens).compile(B, H, H, L, L, block_size=(16, 16))
        p = M.prefix_lm(prefix).compile(B, H, H, L, L, block_size=(16, 16))
        return d.mask_tensors(), p.mask_tensors()

    f = torch.compile(build, backend=counter, fullgraph=True, dynamic=True)
    with build_op.use(True):
        for L in (64, 96, 130):
            lens = torch.tensor([[L // 2, L - L // 2], [L, 0]])
            prefix = torch.tensor([L // 3, 5])
            q = torch.zeros(2, 2, L, 4)
            got = f(lens, prefix, q)
            want = build(lens, prefix, q)
            for g, w in zip(got, want):
                for a, b in zip(g, w):
                    assert (a is None) == (b is None)
                    assert a is None or torch.equal(a, b)
    assert counter.frame_count == 1
    ops = [t.replace(".default", "") for graph in seen for t in graph if "flexsparse" in t]
    assert sorted(ops) == ["flexsparse.build_document", "flexsparse.build_prefix_lm"], seen


def test_block_layout_inside_torch_compile_one_graph_over_lengths():
    """block_sparse(layout) built inside a compiled function: one build_block_lists node,
    no recompile over three lengths (the layout's grid follows L), the eager tensors."""
    counter, seen = _recording_counter()

    def build(layout, q):
        B, H, L, _ = q.shape
        return M.block_sparse(layout, 16).compile(B, H, H, L, L, block_size=(16, 16)).mask_tensors()

    f = torch.compile(build, backend=counter, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    with build_op.use(True):
        for L in (80, 96, 130):   # (n = 5, 6, 9: no size equal to another dim's)
            n = -(-L // 16)
            layout = torch.rand(2, 1, n, n, generator=g) < 0.4
            q = torch.zeros(2, 2, L, 8)
            _assert_same_tensors(f(layout, q), build(layout, q))
    assert counter.frame_count == 1
    assert _flexsparse_ops(seen) == ["flexsparse.build_block_lists"], seen


def test_compiled_first_use_does_not_query_the_dispatcher():
    """A process whose first build is inside torch.compile: availability is read from the
    cache (Dynamo cannot trace the dispatcher query); with the cache empty the torch build
    runs, and an eager call fills it again."""
    torch._dynamo.reset()
    saved = dict(build_op._HAVE)

    def build(lens, q):
        L = q.shape[2]
        return M.document(lens).compile(1, 1, 1, L, L, block_size=(16, 16)).kv_count

    f = torch.compile(build, backend="aot_eager", fullgraph=True, dynamic=True)
    try:
        build_op._HAVE.clear()
        with build_op.use(True):
            assert f(torch.tensor([32, 32]), torch.zeros(1, 1, 64, 4)).shape == (1, 1, 4)
        assert build_op.available("cpu")
    finally:
        build_op._HAVE.update(saved)
        torch._dynamo.reset()


def test_compiled_bad_lengths_raise_when_the_graph_runs():
    """Inside a compiled graph the CPU op raises its ValueError when the graph runs (the
    torch build raises RuntimeError from torch._assert_async there)."""
    torch._dynamo.reset()

    def build(lens, q):
        L = q.shape[2]
        return M.document(lens).compile(1, 1, 1, L, L, block_size=(16, 16)).kv_count

    f = torch.compile(build, backend="aot_eager", fullgraph=True, dynamic=True)
    with build_op.use(True):
        f(torch.tensor([32, 32]), torch.zeros(1, 1, 64, 4))
        with pytest.raises(ValueError, match="lengths must sum to L=64, got \\[63\\]"):
            f(torch.tensor([31, 32]), torch.zeros(1, 1, 64, 4))


def test_compiled_build_flag_uses_the_op():
    """mask.compile(compiled_build=True) traces the op too and gives the eager op's tensors."""
    torch._dynamo.reset()
    lens = torch.tensor([[50, 150], [200, 0]])
    with build_op.use(True):
        got = M.document(lens).compile(2, 2, 2, 200, 200, block_size=(32, 32),
                                       compiled_build=True)
        want = M.document(lens).compile(2, 2, 2, 200, 200, block_size=(32, 32))
    for a, b in zip(got.mask_tensors(), want.mask_tensors()):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b)


def _build_op_cases():
    g = torch.Generator().manual_seed(3)
    layout = torch.rand(2, 3, 5, 7, generator=g) < 0.5
    states = torch.randint(0, 3, (1, 2, 6, 4), generator=g, dtype=torch.int32)
    startend = torch.randint(0, 100, (2, 1, 100, 2), generator=g, dtype=torch.int64)
    return {
        "block_lists_layout": (torch.ops.flexsparse.build_block_lists.default, (layout,)),
        "block_lists_states": (torch.ops.flexsparse.build_block_lists.default, (states,)),
        "document": (torch.ops.flexsparse.build_document.default,
                     (torch.tensor([[30, 50, 20], [100, 0, 0]]), 100, 16, 16, True)),
        "prefix_lm": (torch.ops.flexsparse.build_prefix_lm.default,
                      (torch.tensor([10, 70]), 100, 90, 32, 16)),
        "column_ranges": (torch.ops.flexsparse.build_column_ranges.default,
                          (startend, 100, 100, 16, 32, True)),
    }


@pytest.mark.parametrize("name", list(_build_op_cases()))
def test_build_ops_opcheck(name):
    """torch.library.opcheck on each build op: schema, fake kernel (shapes, dtypes and
    strides, including a layout's row-expanded partial lists), no autograd registration
    needed, AOT dispatch with dynamic shapes."""
    op, args = _build_op_cases()[name]
    torch.library.opcheck(op, args)


def test_block_layout_lists_convert_to_a_block_mask():
    """A layout's descriptor from the op (its partial lists one stored row, expanded)
    converts to a FlexAttention BlockMask with the static build's blocks and dense mask."""
    from flexsparse import flex
    lay = torch.rand(2, 2, 4, 4, generator=torch.Generator().manual_seed(0)) < 0.5
    lay[0, 1, 2] = False                           # a query block with nothing listed
    with build_op.use(True):
        got = M.block_sparse(lay, 128).compile(2, 2, 2, 512, 512)
    assert got.kv_index.stride(2) == 0 and got.q_index.stride(2) == 0
    M.clear_cache()
    with build_op.use(False), building_static():
        want = M.block_sparse(lay, 128).compile(2, 2, 2, 512, 512)
    bm, bm_want = flex.to_block_mask(got), flex.to_block_mask(want)
    assert torch.equal(bm.to_dense(), bm_want.to_dense())
    assert torch.equal(bm.to_dense(), lay)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(bm, name), getattr(bm_want, name)), name


def test_block_layout_build_and_attention_through_inductor():
    """A layout built inside a function compiled by Inductor (fullgraph, dynamic) and used
    at once: the op's row-expanded partial lists (their strides from the fake kernel) reach
    the attention op, which gives the eager result exactly at three lengths, one frame."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def f(layout, q):
        B, H, L, _ = q.shape
        desc = M.block_sparse(layout, 16).compile(B, H, H, L, L, block_size=(16, 16))
        return flexsparse.attention(q, q, q, desc)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    cf = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    with build_op.use(True):
        for L in (80, 96, 130):
            n = -(-L // 16)
            layout = torch.rand(2, 1, n, n, generator=g) < 0.4
            q = torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64)
            torch.testing.assert_close(cf(layout, q), f(layout, q), rtol=0, atol=0)
    assert counter.frame_count == 1
