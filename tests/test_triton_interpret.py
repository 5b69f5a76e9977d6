"""Triton block-descriptor kernels under TRITON_INTERPRET=1 (CPU), against the reference backend.

Tiny shapes, float32 (tight tolerance: the interpreter's float32 dot is exact float32) and a
few float16 cases (bfloat16 tl.dot is not meaningful in the interpreter). Every output the
kernels allocate is poisoned with NaN first, so an element a kernel forgets to write fails.
"""
import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton interpreter tests need TRITON_INTERPRET=1 (tests/conftest.py sets it)",
                allow_module_level=True)
triton = pytest.importorskip("triton")

import flexsparse  # noqa: E402
from flexsparse import masks as M  # noqa: E402
from flexsparse.ops import triton_block  # noqa: E402
from flexsparse.ops import triton_block_bwd, triton_block_fwd  # noqa: E402
from flexsparse.ops.triton_block_common import call_args  # noqa: E402
from flexsparse.ops.triton_block_mask import EMPTY_LIST, ListRanges, _all_lists  # noqa: E402
from flexsparse.ops.schema import MaskTensors  # noqa: E402
from flexsparse.descriptor import Sizes, building_static  # noqa: E402

DEV = "cpu"


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    def nan_empty(*shape, dtype=None, device=None, **kw):
        t = torch.empty(*shape, dtype=dtype, device=device, **kw)
        return t.fill_(math.nan) if t.dtype.is_floating_point else t.fill_(-12345)
    monkeypatch.setattr(triton_block, "_empty", nan_empty)


def rand(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype)


def run(backend, q, k, v, mask, bias=None, *, softcap=None, block=(32, 32), deterministic=False,
        bias_grad=True, dtype=None, seed=0, kernel_options=None):
    """out, lse and grads of a loss that uses both out and lse."""
    dtype = dtype or q.dtype
    q, k, v = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    b = None
    if bias is not None:
        b = bias.detach().to(dtype if dtype != torch.float64 else torch.float64)
        b.requires_grad_(bias_grad)
    out, lse = flexsparse.attention(q, k, v, mask, bias=b, softcap=softcap, return_lse=True,
                                    backend=backend, block_size=block,
                                    deterministic=deterministic, kernel_options=kernel_options)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    dlse = torch.randn(lse.shape, generator=g).to(lse.dtype)
    lse_f = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    loss = (out * dout).sum() + (lse_f * dlse).sum()
    leaves = [q, k, v] + ([b] if (b is not None and bias_grad) else [])
    grads = torch.autograd.grad(loss, leaves)
    return (out, lse) + tuple(grads)


NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")


def check(q, k, v, mask, bias=None, *, dtype=torch.float32, atol=None, rtol=None, **kw):
    got = run("triton", q, k, v, mask, bias, dtype=dtype, **kw)
    ref = run("reference", q.double(), k.double(), v.double(), mask,
              None if bias is None else bias.double(), dtype=torch.float64, **kw)
    if atol is None:
        atol, rtol = (3e-4, 1e-3) if dtype == torch.float32 else (2e-2, 2e-2)
    for name, a, r in zip(NAMES, got, ref):
        assert a.shape == r.shape, f"{name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        assert not torch.isnan(a).any(), f"{name}: NaN (unwritten element or bad math)"
        a = a.double()
        if name == "lse":
            fin = torch.isfinite(r)
            assert torch.equal(torch.isfinite(a), fin), "lse: -inf pattern differs"
            a, r = a[fin], r[fin]
        torch.testing.assert_close(a, r, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    return got


def qkv(B, Hq, Hkv, Lq, Lk, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return rand(B, Hq, Lq, D, gen=g), rand(B, Hkv, Lk, D, gen=g), rand(B, Hkv, Lk, D, gen=g)


# ----------------------------------------------------------------------------- mask kinds

def _masks(B, Hkv, L):
    """The mask kinds at length L; the document and question lengths are written for
    L = 97 and scaled to L (windows and the prefix are not: they are about the tiles)."""
    def s(n):
        return n * L // 97
    g = torch.Generator().manual_seed(7)
    cr = torch.randint(0, L + 1, (B, Hkv, L, 2), generator=g).sort(-1).values
    dense = torch.rand(B, 1, L, L, generator=g) < 0.6
    nb = -(-L // 32)
    layout = torch.rand(1, Hkv, nb, nb, generator=g) < 0.5
    layout |= torch.eye(nb, dtype=torch.bool)
    layout16 = torch.rand(1, 1, -(-L // 16), -(-L // 16), generator=g) < 0.4
    return {
        "full": None,
        "causal": M.causal(),
        "sliding": M.sliding_window(20),
        "sliding_lr": M.sliding_window(9, 13),
        "document": M.document([s(30), s(45), 0, L - s(30) - s(45)]),
        "document_noncausal": M.document([s(50), L - s(50)], causal=False),
        "prefix_lm": M.prefix_lm(40),
        "shared_question": M.shared_question(25, [s(30), s(20), L - 25 - s(30) - s(20)]),
        "column_ranges": M.column_ranges(cr, causal=True),
        "dense": M.dense(dense),
        "block_sparse": M.block_sparse(layout, 32),
        "bits (block_sparse 16 on 32 blocks)": M.block_sparse(layout16, 16),
        "bits (or_ causal|dense)": M.or_(M.sliding_window(5), M.dense(dense)),
        "and_ dense & causal": M.and_(M.dense(dense), M.causal()),
        "and_ bits & dense & window": M.and_(M.or_(M.causal(), M.dense(~dense)),
                                             M.dense(dense), M.sliding_window(40)),
    }


MASK_NAMES = list(_masks(2, 2, 97))


@pytest.mark.parametrize("name", MASK_NAMES)
def test_mask_kinds(name):
    # L = 65: three 32-row tiles each way, the last holding one row (as 97 did with four:
    # interpreter time grows with the tile count)
    B, Hq, Hkv, L, D = 2, 4, 2, 65, 32
    mask = _masks(B, Hkv, L)[name]
    check(*qkv(B, Hq, Hkv, L, L, D), mask)


@pytest.mark.parametrize("name", ["causal", "document", "bits (or_ causal|dense)", "dense"])
def test_sub_tiles(name):
    """Kernel tiles smaller than the descriptor blocks (sub-tile loops), rectangular blocks."""
    options = {"fwd_config": (16, 32, 4, 1), "dkdv_config": (16, 16, 4, 1),
               "dq_config": (32, 16, 4, 1)}
    B, Hq, Hkv, L, D = 1, 2, 1, 97, 32
    mask = _masks(B, Hkv, L)[name]
    check(*qkv(B, Hq, Hkv, L, L, D, seed=3), mask, block=(32, 64), kernel_options=options)


@pytest.mark.parametrize("Lq,Lk", [(45, 83), (83, 45), (1, 70), (70, 1), (64, 64)])
@pytest.mark.parametrize("kind", ["full", "causal"])
def test_odd_lengths(Lq, Lk, kind):
    mask = None if kind == "full" else M.causal()
    check(*qkv(1, 2, 2, Lq, Lk, 32, seed=Lq + Lk), mask)


@pytest.mark.parametrize("Lq,Lk", [(32, 32), (64, 96), (96, 32)])
@pytest.mark.parametrize("kind", ["full", "causal"])
def test_lengths_that_divide_the_tile_not_the_block(Lq, Lk, kind):
    """Lengths that are multiples of the kernel tile (32 here) but not of the descriptor
    block (64): the last block's second tile lies past the length and must be masked."""
    mask = None if kind == "full" else M.causal()
    check(*qkv(1, 2, 1, Lq, Lk, 32, seed=Lq * Lk), mask, block=(64, 64))


@pytest.mark.parametrize("D", [16, 40, 64])
def test_head_dims(D):
    check(*qkv(1, 2, 1, 50, 50, D, seed=D), M.causal())


# B = 1 for the six heads (was 2: 20 s of interpreter time): the batch of 2 with
# head-dependent masks is checked by the other two cases.
@pytest.mark.parametrize("Hq,Hkv,B", [(4, 1, 2), (6, 2, 1), (3, 3, 2)])
def test_gqa(Hq, Hkv, B):
    g = torch.Generator().manual_seed(Hq)
    # head-dependent masks: column ranges per kv head, dense mask per query head
    cr = torch.randint(0, 61, (1, Hkv, 60, 2), generator=g).sort(-1).values
    check(*qkv(B, Hq, Hkv, 60, 60, 32, seed=Hq), M.column_ranges(cr, causal=False))
    dm = torch.rand(B, Hq, 60, 60, generator=g) < 0.5
    check(*qkv(B, Hq, Hkv, 60, 60, 32, seed=Hq + 1), M.dense(dm))


def test_batch_dependent_descriptor():
    lens = torch.tensor([[20, 30, 20], [70, 0, 0]])
    check(*qkv(2, 2, 1, 70, 70, 32, seed=11), M.document(lens))


def test_noncontiguous_inputs():
    g = torch.Generator().manual_seed(5)
    q = rand(2, 60, 4, 32, gen=g).transpose(1, 2)
    k = rand(2, 60, 2, 32, gen=g).transpose(1, 2)
    v = rand(2, 2, 32, 60, gen=g).transpose(2, 3)
    check(q, k, v, M.sliding_window(15))


# ----------------------------------------------------------------------------- bias

# Lq, Lk = 40, 45: two 32-wide tiles each way, the second partial (as 70 x 75 had three:
# interpreter time grows with the tile count)
BIAS_SHAPES = {
    "full": (2, 4, 40, 45), "batch1": (1, 4, 40, 45), "hkv": (2, 2, 40, 45),
    "shared": (1, 1, 40, 45), "row": (2, 4, 1, 45), "col": (2, 1, 40, 1),
    "scalar": (1, 1, 1, 1), "col_hkv": (1, 2, 40, 1), "row_b1": (1, 2, 1, 45),
}


# The deterministic mode changes how dbias is summed over blocks, not how the broadcast
# dimensions are reduced afterwards: it runs on one shape per kind of broadcast (full,
# over batch and heads, over rows) rather than on all nine (saves ~1.5 min of CI).
DETERMINISTIC_BIAS_SHAPES = ("full", "shared", "col_hkv")


@pytest.mark.parametrize("shape,deterministic",
                         [(s, False) for s in BIAS_SHAPES] + [(s, True) for s in DETERMINISTIC_BIAS_SHAPES])
def test_bias_broadcast(shape, deterministic):
    B, Hq, Hkv, Lq, Lk = 2, 4, 2, 40, 45
    g = torch.Generator().manual_seed(len(shape))
    bias = rand(*BIAS_SHAPES[shape], gen=g)
    check(*qkv(B, Hq, Hkv, Lq, Lk, 32, seed=2), M.causal(), bias, deterministic=deterministic)


def test_bias_no_grad_and_softcap():
    g = torch.Generator().manual_seed(9)
    bias = rand(1, 4, 60, 60, gen=g)
    got = check(*qkv(1, 4, 2, 60, 60, 32), M.causal(), bias, bias_grad=False, softcap=2.0)
    assert len(got) == 5


@pytest.mark.parametrize("name", ["full", "document", "bits (or_ causal|dense)"])
def test_softcap(name):
    L = 65
    mask = _masks(1, 1, L)[name]
    g = torch.Generator().manual_seed(4)
    q, k, v = qkv(1, 2, 1, L, L, 32, seed=4)
    check(q * 3, k, v, mask, rand(1, 2, L, L, gen=g), softcap=5.0)


def test_deterministic_bitwise():
    B, Hq, Hkv, L = 2, 4, 2, 50      # two tiles each way: dQ, dK/dV, dbias sum several parts
    g = torch.Generator().manual_seed(1)
    bias = rand(1, 2, L, L, gen=g)
    inputs = qkv(B, Hq, Hkv, L, L, 32)
    a = run("triton", *inputs, M.causal(), bias, deterministic=True)
    b = run("triton", *inputs, M.causal(), bias, deterministic=True)
    for name, x, y in zip(NAMES, a, b):
        assert torch.equal(x, y), f"{name} differs between two deterministic runs"


# ----------------------------------------------------------------------------- edge cases

def test_fully_masked_rows():
    B, Hq, Hkv, L = 1, 2, 1, 70
    dm = torch.rand(B, Hq, L, L, generator=torch.Generator().manual_seed(2)) < 0.5
    dm[:, :, 10:40] = False            # whole query block 0..31 partly, rows 10..39 empty
    dm[:, 1, :, :] = False             # head 1 sees nothing at all
    got = check(*qkv(B, Hq, Hkv, L, L, 32), M.dense(dm), rand(B, Hq, L, L))
    out, lse, dq = got[:3]
    assert torch.all(out[:, :, 10:40] == 0) and torch.all(out[:, 1] == 0)
    assert torch.all(lse[:, :, 10:40] == -math.inf) and torch.all(lse[:, 1] == -math.inf)
    assert torch.all(dq[:, :, 10:40] == 0)
    assert torch.all(got[5][:, 1] == 0)  # dbias of the fully masked head


def test_minus_inf_bias_rows():
    """A row whose visible scores are all -inf (through the bias) is fully masked too."""
    bias = torch.zeros(1, 1, 40, 1)
    bias[:, :, 5:9] = -math.inf
    q, k, v = qkv(1, 2, 1, 40, 40, 32)
    out, lse, dq, dk, dv, db = run("triton", q, k, v, M.causal(), bias)
    assert torch.all(out[:, :, 5:9] == 0) and torch.all(lse[:, :, 5:9] == -math.inf)
    for t in (out, dq, dk, dv, db):
        assert not torch.isnan(t).any()


def test_skipped_blocks_only():
    """A mask with nothing visible at all: zero outputs, -inf lse, zero grads."""
    dm = torch.zeros(1, 1, 50, 50, dtype=torch.bool)
    out, lse, dq, dk, dv = run("triton", *qkv(1, 2, 1, 50, 50, 32), M.dense(dm))
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    assert all(torch.all(t == 0) for t in (dq, dk, dv))


def test_missing_transposed_lists():
    """Straight through the op: no q lists (and no descriptor at all) still works."""
    B, H, L, D = 1, 2, 50, 32
    q, k, v = qkv(B, H, H, L, L, D)
    desc = M.causal().compile(B, H, H, L, L, device=DEV, block_size=(32, 32))
    mt = desc.mask_tensors()
    ref = torch.ops.flexsparse.attention(q, k, v, None, *mt, 32, 32, 0.2, 0.0, "reference", False)
    part = mt._replace(q_count=None, q_index=None, q_full_count=None, q_full_index=None)
    got = torch.ops.flexsparse.attention(q, k, v, None, *part, 32, 32, 0.2, 0.0, "triton", False)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, atol=3e-5, rtol=1e-4)
    full = MaskTensors()
    got = torch.ops.flexsparse.attention(q, k, v, None, *full, 32, 32, 0.2, 0.0, "triton", False)
    dfull = M.full().compile(B, H, H, L, L, device=DEV, block_size=(32, 32)).mask_tensors()
    ref = torch.ops.flexsparse.attention(q, k, v, None, *dfull, 32, 32, 0.2, 0.0, "reference",
                                         False)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, atol=3e-5, rtol=1e-4)


def test_list_trimming_and_argument_cache():
    """Full mask: partial lists compiled out (EMPTY_LIST), one range slot of four; the
    cached kernel arguments follow an in-place edit of the descriptor (tensor version)."""
    B, H, L, D = 1, 2, 64, 32
    q, k, v = qkv(B, H, H, L, L, D, seed=5)
    mt = M.full().compile(B, H, H, L, L, device=DEV, block_size=(32, 32)).mask_tensors()
    # (The full mask's kv lists are one row expanded, stride 0: copies to edit in place.)
    assert mt.kv_full_index.stride(2) == 0
    mt = mt._replace(kv_full_index=mt.kv_full_index.clone(), kv_full_count=mt.kv_full_count.clone())
    c = call_args(q, k, v, None, mt, 32, 32, 0.2, 0.0)
    assert c.mask.ranges == ListRanges(kv_partial=EMPTY_LIST, kv_full=1, q_partial=EMPTY_LIST,
                                       q_full=1)
    ref = torch.ops.flexsparse.attention(q, k, v, None, *mt, 32, 32, 0.2, 0.0, "reference", False)
    got = torch.ops.flexsparse.attention(q, k, v, None, *mt, 32, 32, 0.2, 0.0, "triton", False)
    torch.testing.assert_close(got[0], ref[0], atol=3e-5, rtol=1e-4)
    # Edit in place: key blocks [1, 2) only (range form (lo, hi)); every query sees 32 keys.
    mt.kv_full_index[..., 0, :] = torch.tensor([1, 2])
    mt.kv_full_count.fill_(1)
    c = call_args(q, k, v, None, mt, 32, 32, 0.2, 0.0)
    assert c.mask.ranges.kv_full == 1 and c.mask.ranges.kv_partial == EMPTY_LIST
    out, lse = torch.ops.flexsparse.attention(q, k, v, None, *mt, 32, 32, 0.2, 0.0, "triton",
                                              False)
    s = (q @ k[:, :, 32:].transpose(-1, -2)) * 0.2
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v[:, :, 32:], atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=3e-5, rtol=1e-4)


def test_one_row_lists_are_read_as_one_row():
    """Lists whose rows are one row expanded (stride 0: the full mask's; a block layout's
    partial lists from the build op) reach the kernels as that one row with row stride 0,
    not copied out to every row; the results equal the reference's, also with list
    trimming off (the layout's empty partial lists then run their zero-length loops) and
    with GQA (lists per kv head)."""
    B, Hq, Hkv, L, D = 2, 4, 2, 96, 32
    q, k, v = qkv(B, Hq, Hkv, L, L, D, seed=7)
    full = M.full().compile(B, Hq, Hkv, L, L, device=DEV, block_size=(32, 32)).mask_tensors()
    c = call_args(q, k, v, None, full, 32, 32, 0.2, 0.0)
    assert c.mask.kv_full.row_stride == 0 and c.mask.kv_full.index.shape[2] == 1
    assert c.mask.kv_full.count.shape[2] == 1
    # the layout's partial lists as the build op returns them: one row per (b, h), expanded
    lay = torch.rand(B, Hkv, 3, 3, generator=torch.Generator().manual_seed(2)) < 0.5
    lay[0, 0, 1] = False                               # a query block with nothing listed
    with building_static():                            # padded lists, as the op gives
        mt = M.block_sparse(lay, 32)._descriptor(
            Sizes(B, Hq, Hkv, L, L, 32, 32, torch.device(DEV))).mask_tensors()
    one = dict(kv_count=mt.kv_count[:, :, :1].expand(B, Hkv, 3),
               kv_index=mt.kv_index[:, :, :1].expand(B, Hkv, 3, 3),
               q_count=mt.q_count[:, :, :1].expand(B, Hkv, 3),
               q_index=mt.q_index[:, :, :1].expand(B, Hkv, 3, 3))
    assert all(torch.equal(t, getattr(mt, n)) for n, t in one.items())   # (all empty)
    mt = mt._replace(**one)
    def attend(backend, tensors):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out, lse = torch.ops.flexsparse.attention(qq, kk, vv, None, *tensors, 32, 32, 0.2, 0.0,
                                                  backend, False)
        grads = torch.autograd.grad((out * out).sum() + lse.sum(), (qq, kk, vv))
        return (out, lse) + grads

    for tensors in (full, mt):
        want = attend("reference", tensors)
        for backend in ("triton", "triton;trim_lists=0"):
            for a, b in zip(attend(backend, tensors), want):
                torch.testing.assert_close(a, b, atol=3e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- float16

@pytest.mark.parametrize("name", ["causal", "document", "dense", "bits (or_ causal|dense)"])
def test_float16(name):
    B, Hq, Hkv, L = 1, 4, 2, 65
    mask = _masks(B, Hkv, L)[name]
    g = torch.Generator().manual_seed(8)
    check(*qkv(B, Hq, Hkv, L, L, 64, seed=8), mask, rand(1, Hkv, L, L, gen=g),
          dtype=torch.float16)


def test_not_supported_reasons():
    q = torch.randn(1, 2, 8, 32)
    k = torch.randn(1, 2, 8, 32)
    reasons = triton_block.not_supported_reasons(q, k, torch.randn(1, 2, 8, 16), None,
                                                 MaskTensors())
    assert any("Dv" in r for r in reasons)
    reasons = triton_block.not_supported_reasons(q.double(), k.double(), k.double(), None,
                                                 MaskTensors())
    assert any("dtype" in r for r in reasons)
    assert triton_block.not_supported_reasons(q, k, k, None, MaskTensors()) == []


@pytest.mark.parametrize("n_ranges", [3, 4, 6])
def test_many_column_ranges(n_ranges):
    """col_ranges with n intervals per column; <= 4 are prefetched/hoisted, more are loaded
    in the loop. Every block partial (lists built from the predicates alone)."""
    B, H, L, D = 1, 2, 70, 32
    g = torch.Generator().manual_seed(n_ranges)
    cr = torch.randint(0, L + 1, (B, H, L, 2 * n_ranges), generator=g)
    cr = cr.view(B, H, L, n_ranges, 2).sort(-1).values.flatten(-2).to(torch.int32)
    mt = MaskTensors(col_ranges=cr)
    lists = _all_lists(mt, L, L, 32, 32, DEV)
    mt = MaskTensors(*lists, col_ranges=cr)
    q, k, v = qkv(B, H, H, L, L, D, seed=n_ranges)
    args = (32, 32, 0.3, 0.0)
    ref = torch.ops.flexsparse.attention(q.double(), k.double(), v.double(), None, *mt, *args,
                                         "reference", False)
    got = torch.ops.flexsparse.attention(q, k, v, None, *mt, *args, "triton", False)
    for a, r in zip(got, ref):
        fin = torch.isfinite(r)
        torch.testing.assert_close(a.double()[fin], r[fin], atol=3e-4, rtol=1e-3)
    do = torch.randn(B, H, L, D, generator=g)
    gref = torch.ops.flexsparse.attention_backward(
        do.double(), None, q.double(), k.double(), v.double(), ref[0], ref[1], None, *mt, *args,
        "reference", False, False)
    ggot = torch.ops.flexsparse.attention_backward(
        do, None, q, k, v, got[0], got[1], None, *mt, *args, "triton", False, False)
    for a, r in zip(ggot[:3], gref[:3]):
        torch.testing.assert_close(a.double(), r, atol=3e-4, rtol=1e-3)


# ----------------------------------------------------------------------------- backward modes

def _spy_backward_launches(monkeypatch):
    """Record (kernel, constexpr kwargs) of every backward launch through _launch, but the
    preprocess kernel's (every mode launches it)."""
    seen = []
    launch = triton_block._launch

    def spy(kernel, grid, args, kwargs, warps, stages):
        if kernel not in (triton_block_fwd._attn_fwd, triton_block_bwd._bwd_preprocess):
            seen.append((kernel, kwargs))
        return launch(kernel, grid, args, kwargs, warps, stages)
    monkeypatch.setattr(triton_block, "_launch", spy)
    return seen


def _doc_cr(B, Hkv, L, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, L + 1, (B, Hkv, L, 2), generator=g).sort(-1).values


# name -> (B, Hq, Hkv, Lq, Lk, D, mask, bias shape or None, softcap)
BWD_MODE_CASES = {
    "causal": (1, 2, 1, 64, 64, 32, lambda: M.causal(), None, None),
    "document": (1, 2, 1, 70, 70, 32, lambda: M.document([30, 17, 23]), None, None),
    "column_ranges": (1, 2, 2, 64, 64, 32,
                      lambda: M.column_ranges(_doc_cr(1, 2, 64, 3), causal=True), None, None),
    # non-causal C=2 masks rows >= LTS and rows < UTE: LTS >= UTE leaves the band [UTE, LTS)
    "gqa": (2, 4, 2, 60, 60, 32,
            lambda: M.column_ranges(_doc_cr(1, 2, 60, 4).flip(-1), causal=False), None, None),
    "odd 45": (1, 2, 2, 45, 45, 32, lambda: M.causal(), None, None),
    "odd 45x83, D=40": (1, 2, 1, 45, 83, 40, lambda: M.sliding_window(30), None, None),
    # full-shape bias: dbias stored by the dK/dV pass (softcap keeps dQ recomputed)
    "softcap + full bias": (1, 2, 1, 70, 70, 32, lambda: M.document([30, 40]), (1, 2, 70, 70),
                            4.0),
    "bias (1, Hkv) atomics": (2, 4, 2, 50, 50, 32, lambda: M.causal(), (1, 2, 50, 50), None),
    "bias row (dbias summed over queries)": (1, 2, 1, 50, 50, 32, lambda: M.causal(),
                                             (1, 2, 1, 50), None),
}


@pytest.mark.parametrize("case", list(BWD_MODE_CASES))
@pytest.mark.parametrize("mode", ["one_launch", "atomic_dq"])
def test_bwd_modes(mode, case, monkeypatch):
    seen = _spy_backward_launches(monkeypatch)
    B, Hq, Hkv, Lq, Lk, D, mask, bshape, softcap = BWD_MODE_CASES[case]
    bias = None if bshape is None else rand(*bshape, gen=torch.Generator().manual_seed(Lq))
    check(*qkv(B, Hq, Hkv, Lq, Lk, D, seed=Lq + Lk), mask(), bias, softcap=softcap,
          kernel_options={"bwd_mode": mode})
    if mode == "one_launch":
        assert [k for k, _ in seen] == [triton_block_bwd._attn_bwd_one_launch]
    else:
        assert [(k, kw["DQ_ATOMIC"]) for k, kw in seen] == [(triton_block_bwd._attn_bwd_dkdv, True)]


@pytest.mark.parametrize("mode", ["one_launch", "atomic_dq"])
def test_bwd_modes_sub_tiles(mode):
    """Tiles smaller than the descriptor blocks, different in the dK/dV and dQ halves."""
    options = {"bwd_mode": mode, "fwd_config": (16, 32, 4, 1), "dkdv_config": (16, 32, 4, 1),
               "dq_config": (32, 16, 4, 1)}
    mask = _masks(1, 1, 97)["bits (or_ causal|dense)"]
    check(*qkv(1, 2, 1, 97, 97, 32, seed=3), mask, block=(32, 64), kernel_options=options)


@pytest.mark.parametrize("mode", ["one_launch", "atomic_dq"])
def test_bwd_modes_fully_masked_rows(mode):
    B, Hq, Hkv, L = 1, 2, 1, 70
    dm = torch.rand(B, Hq, L, L, generator=torch.Generator().manual_seed(2)) < 0.5
    dm[:, :, 10:40] = False
    dm[:, 1, :, :] = False
    got = check(*qkv(B, Hq, Hkv, L, L, 32), M.dense(dm), rand(1, 1, L, L),
                kernel_options={"bwd_mode": mode})
    dq, dk, dv, db = got[2:]
    assert torch.all(dq[:, :, 10:40] == 0) and torch.all(dq[:, 1] == 0)
    assert torch.all(db[:, :, 10:40] == 0)


@pytest.mark.parametrize("mode", ["one_launch", "atomic_dq"])
def test_bwd_modes_float16(mode):
    B, Hq, Hkv, L = 1, 4, 2, 97
    g = torch.Generator().manual_seed(8)
    check(*qkv(B, Hq, Hkv, L, L, 64, seed=8), _masks(B, Hkv, L)["document"],
          rand(1, Hkv, L, L, gen=g), dtype=torch.float16, kernel_options={"bwd_mode": mode})


# (mode, bias shape, softcap, deterministic): cases that must run the two-pass kernels
BWD_MODE_FALLBACKS = [
    ("atomic_dq", None, None, True),              # atomics are not deterministic
    ("atomic_dq", (1, 2, 50, 1), None, False),    # dbias summed over keys in the dQ pass
    ("atomic_dq", (1, 2, 50, 50), None, False),   # dQ from the stored dS
    ("one_launch", (1, 2, 50, 50), None, False),  # dQ from the stored dS
]


@pytest.mark.parametrize("mode,bshape,softcap,deterministic", BWD_MODE_FALLBACKS)
def test_bwd_mode_fallbacks(mode, bshape, softcap, deterministic, monkeypatch):
    seen = _spy_backward_launches(monkeypatch)
    bias = None if bshape is None else rand(*bshape, gen=torch.Generator().manual_seed(5))
    check(*qkv(1, 2, 1, 50, 50, 32), M.causal(), bias, softcap=softcap,
          deterministic=deterministic, kernel_options={"bwd_mode": mode})
    assert [(k, kw.get("DQ_ATOMIC")) for k, kw in seen] == [
        (triton_block_bwd._attn_bwd_dkdv, False), (triton_block_bwd._attn_bwd_dq, None)]


@pytest.mark.parametrize("name, mask, reversed_", [
    ("causal", M.causal(), 1),
    ("prefix_lm", M.prefix_lm(40), 1),
    ("sliding_window", M.sliding_window(24), 0),
    ("document", M.document(torch.tensor([50, 78])), 0),
    ("shared_question", M.shared_question(32, [24, 24, 24, 24]), 0),
    ("full", M.full(), 0),
])
def test_query_tile_order(name, mask, reversed_):
    # Heavy query tiles first only where work grows with the query index (_tile_order).
    L = 128
    mt = mask.compile(1, 2, 2, L, L, device=torch.device(DEV)).mask_tensors()
    q = rand(1, 2, L, 16)
    c = call_args(q, q, q, None, mt, 128, 128, 0.25, 0.0)
    assert c.mask.reverse_query_tiles == reversed_, (name, c.mask.flags)
