"""The raw op `torch.ops.flexsparse.attention` (and `attention_backward`) as an entry point
of its own (issue 19; contract in docs/design.md, "The raw op's contract"): its mask tensors
are checked before any kernel runs, in eager and in compiled graphs, and every
descriptor the library builds passes those checks and gives what flexsparse.attention
gives."""
import re

import pytest
import torch
from torch.library import opcheck

import flexsparse
import naive
from flexsparse import masks as M
from flexsparse.ops import mask_checks
from flexsparse.ops.schema import MASK_TENSOR_NAMES, MaskTensors

B, HQ, HKV, L, D = 1, 4, 2, 64, 16
BQ = BK = 16                      # nQB = nKB = 4
SCALE = 0.25


def _qkv(B=B, Hq=HQ, Hkv=HKV, Lq=L, Lk=L, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def _raw(q, k, v, mt, bias=None, block=(BQ, BK), backend="reference"):
    return torch.ops.flexsparse.attention(q, k, v, bias, *mt, block[0], block[1], SCALE, 0.0,
                                          backend, False)


def _i32(*shape):
    return torch.zeros(shape, dtype=torch.int32)


def _lists(count_rows=4, index_shape=None, bd=1, hd=1):
    """A consistent set of the eight lists (nQB = nKB = 4): every block full."""
    idx = torch.arange(4, dtype=torch.int32).expand(bd, hd, count_rows, 4).contiguous()
    full = torch.full((bd, hd, count_rows), 4, dtype=torch.int32)
    part = torch.zeros((bd, hd, count_rows), dtype=torch.int32)
    return dict(kv_count=part, kv_index=idx if index_shape is None else _i32(*index_shape),
                kv_full_count=full, kv_full_index=idx, q_count=part, q_index=idx,
                q_full_count=full, q_full_index=idx)


def _bits(rows=BQ, words=1, P=2):
    return dict(partial_bits_index=torch.full((1, 1, 4, 4), -1, dtype=torch.int32),
                partial_bits=_i32(P, rows, words))


# (id, mask tensors, block size, exception, message pattern): each must be refused, naming
# the argument and what it got.
BAD = [
    ("count_without_index", dict(kv_count=_i32(1, 1, 7)), (128, 128), ValueError,
     r"kv_count: given without kv_index"),
    ("index_without_count", dict(q_full_index=_i32(1, 1, 4, 4)), (BQ, BK), ValueError,
     r"q_full_index: given without q_full_count"),
    ("count_rows_not_query_blocks", dict(kv_count=_i32(1, 1, 7), kv_index=_i32(1, 1, 7, 1),
                                         kv_full_count=_i32(1, 1, 7),
                                         kv_full_index=_i32(1, 1, 7, 1)),
     (128, 128), ValueError, r"kv_count: shape \(1, 1, 7\), expected .*nQB=ceil\(Lq/block_q\)=1"),
    ("q_list_rows_not_key_blocks", {**_lists(), "q_count": _i32(1, 1, 3),
                                    "q_index": _i32(1, 1, 3, 4)},
     (BQ, BK), ValueError, r"q_count: shape \(1, 1, 3\), expected .*nKB=ceil\(Lk/block_k\)=4"),
    ("partial_lists_without_full", {k: v for k, v in _lists().items() if "full" not in k},
     (BQ, BK), ValueError, r"kv_count: given without kv_full_count"),
    ("q_lists_without_kv_lists", {k: v for k, v in _lists().items() if k.startswith("q")},
     (BQ, BK), ValueError, r"q_count: the transposed \(q\) lists were given without the kv"),
    ("list_head_dim", _lists(hd=3), (BQ, BK), ValueError,
     r"kv_count: shape \(1, 3, 4\): head dim 3 must be 1, Hkv or Hq \(B=1, Hkv=2, Hq=4\)"),
    ("list_batch_dim", _lists(bd=2), (BQ, BK), ValueError,
     r"kv_count: shape \(2, 1, 4\): batch dim 2 must be 1 or B=1"),
    ("index_dims_differ_from_count", _lists(index_shape=(1, 2, 4, 4)), (BQ, BK), ValueError,
     r"kv_index: shape \(1, 2, 4, 4\), expected"),
    ("index_too_many_ranges", _lists(index_shape=(1, 1, 4, 5, 2)), (BQ, BK), ValueError,
     r"kv_index: shape \(1, 1, 4, 5, 2\), expected .*1 <= R <= 4"),
    ("list_dtype", {**_lists(), "kv_index": torch.zeros(1, 1, 4, 4)}, (BQ, BK), TypeError,
     r"kv_index: must be an int32 or int64 tensor, got torch.float32"),
    ("dense_mask_not_broadcastable", dict(dense_mask=torch.ones(1, 1, 5, 5, dtype=torch.bool)),
     (128, 128), ValueError, r"dense_mask: shape \(1, 1, 5, 5\) is not broadcastable to "
                             r"\(B, Hq, Lq, Lk\).*Lq=64, Lk=64"),
    ("dense_mask_3d", dict(dense_mask=torch.ones(1, 64, 64, dtype=torch.bool)), (BQ, BK),
     ValueError, r"dense_mask: shape \(1, 64, 64\)"),
    ("dense_mask_head_dim", dict(dense_mask=torch.ones(1, 3, 64, 64, dtype=torch.bool)),
     (BQ, BK), ValueError, r"dense_mask: shape \(1, 3, 64, 64\): head dim 3"),
    ("dense_mask_dtype", dict(dense_mask=torch.ones(1, 1, 64, 64, dtype=torch.uint8)),
     (BQ, BK), TypeError, r"dense_mask: must be a bool tensor, got torch.uint8"),
    ("col_ranges_wrong_length", dict(col_ranges=_i32(1, 1, 63, 2)), (BQ, BK), ValueError,
     r"col_ranges: shape \(1, 1, 63, 2\), expected \(B\|1, H\|1, Lk, 2m\) with Lk=64"),
    ("col_ranges_odd", dict(col_ranges=_i32(1, 1, 64, 3)), (BQ, BK), ValueError,
     r"col_ranges: shape \(1, 1, 64, 3\)"),
    ("bits_index_without_bits", {"partial_bits_index": _bits()["partial_bits_index"]},
     (BQ, BK), ValueError, r"partial_bits_index: given without partial_bits"),
    ("bits_rows_not_block_q", _bits(rows=8), (BQ, BK), ValueError,
     r"partial_bits: shape \(2, 8, 1\), expected \(P, block_q, ceil\(block_k/32\)\) = "
     r"\(P, 16, 1\)"),
    ("bits_index_grid", {**_bits(), "partial_bits_index": _i32(1, 1, 4, 3)}, (BQ, BK),
     ValueError, r"partial_bits_index: shape \(1, 1, 4, 3\), expected \(B\|1, H\|1, nQB, nKB\)"),
    ("indices_with_other_mask_tensors",
     dict(attn_indices=_i32(1, 1, 64, 3), dense_mask=torch.ones(1, 1, 64, 64, dtype=torch.bool)),
     (BQ, BK), ValueError, r"attn_indices: an index mask takes no other mask tensors, got "
                           r"\['dense_mask'\]"),
    ("indices_rows", dict(attn_indices=_i32(1, 1, 60, 3)), (BQ, BK), ValueError,
     r"attn_indices: shape \(1, 1, 60, 3\), expected \(B\|1, Hkv\|1, Lq, W\) with Lq=64"),
    ("indices_query_heads", dict(attn_indices=_i32(1, 4, 64, 3)), (BQ, BK), ValueError,
     r"attn_indices: shape \(1, 4, 64, 3\): head dim 4 must be 1 or Hkv"),
    ("indices_dtype", dict(attn_indices=torch.zeros(1, 1, 64, 3, dtype=torch.int16)), (BQ, BK),
     TypeError, r"attn_indices: must be an int32 or int64 tensor, got torch.int16"),
    ("block_size", {}, (0, 16), ValueError, r"block_q, block_k: must be positive"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_mask_tensors_refused_eager(case):
    _, tensors, block, exc, pattern = case
    q, k, v = _qkv()
    with pytest.raises(exc, match=pattern):
        _raw(q, k, v, MaskTensors(**tensors), block=block)


def _compiled_raises(fn, exc, pattern, *args):
    """Under torch.compile the fake kernel leaves a refusal to the op's kernel, which runs
    the same checks when the graph runs: the compiled call raises the check's own
    exception and message, as the eager call does (not Dynamo's TorchRuntimeError)."""
    with pytest.raises(exc, match=pattern):
        fn(*args)


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_mask_tensors_refused_compiled(case):
    _, tensors, block, exc, pattern = case
    q, k, v = _qkv()
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=True)
    def f(q, k, v, mt):
        return _raw(q, k, v, mt, block=block)

    _compiled_raises(f, exc, pattern, q, k, v, MaskTensors(**tensors))


def test_bad_descriptor_after_a_good_compiled_call():
    """A compiled graph that ran with a good descriptor refuses a bad one (the guards on the
    mask tensors' shapes fail; the retraced graph refuses when it runs), and the good one
    still runs."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=True)
    def f(q, k, v, mt):
        return _raw(q, k, v, mt)[0]

    q, k, v = _qkv()
    desc = M.causal().compile(B, HQ, HKV, L, L, block_size=(BQ, BK))
    torch.testing.assert_close(f(q, k, v, desc.mask_tensors()),
                               flexsparse.attention(q, k, v, desc, scale=SCALE,
                                                    block_size=(BQ, BK)))
    bad = desc.mask_tensors()._replace(kv_count=_i32(1, 1, 3))
    _compiled_raises(f, ValueError, r"kv_count: shape \(1, 1, 3\)", q, k, v, bad)
    torch.testing.assert_close(f(q, k, v, desc.mask_tensors()),
                               flexsparse.attention(q, k, v, desc, scale=SCALE,
                                                    block_size=(BQ, BK)))


def test_bias_and_backward_tensors_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"bias: shape \(1, 3, 64, 64\)"):
        _raw(q, k, v, MaskTensors(), bias=torch.zeros(1, 3, L, L))
    with pytest.raises(ValueError, match=r"key: query heads Hq=4 must be a multiple of .*Hkv=3"):
        _raw(q, torch.zeros(B, 3, L, D), torch.zeros(B, 3, L, D), MaskTensors())
    out, lse = _raw(q, k, v, MaskTensors())
    tail = (BQ, BK, SCALE, 0.0, "reference", False, False)
    bad = MaskTensors(dense_mask=torch.ones(1, 1, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"dense_mask: shape \(1, 1, 5, 5\)"):
        torch.ops.flexsparse.attention_backward(out, None, q, k, v, out, lse, None, *bad, *tail)
    with pytest.raises(ValueError, match=r"lse: shape \(1, 4\), expected \(1, 4, 64\)"):
        torch.ops.flexsparse.attention_backward(out, None, q, k, v, out, lse[..., 0], None,
                                                *MaskTensors(), *tail)
    with pytest.raises(ValueError, match=r"grad_out: shape \(1, 4, 64, 8\)"):
        torch.ops.flexsparse.attention_backward(out[..., :8], None, q, k, v, out, lse, None,
                                                *MaskTensors(), *tail)


def test_mask_tensor_on_another_device_refused():
    q, k, v = _qkv()
    dm = torch.ones(1, 1, L, L, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"dense_mask: is on meta but query is on cpu"):
        _raw(q, k, v, MaskTensors(dense_mask=dm))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("index_mask", [False, True])
def test_triton_on_cpu_without_interpreter(monkeypatch, compiled, index_mask):
    """backend="triton" with CPU tensors and no TRITON_INTERPRET: a ValueError saying why,
    not torch's "Torch not compiled with CUDA enabled" from inside the launcher."""
    # Triton decides interpreted vs compiled when a kernel is defined: load the lazily
    # imported index kernels under the interpreter first, as every other test sees them.
    from flexsparse.ops import triton_indices  # noqa: F401
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv()
    mt = MaskTensors(attn_indices=_i32(1, 1, L, 2)) if index_mask else MaskTensors()
    pattern = r"backend: 'triton' cannot run these inputs: .*CPU"
    if not compiled:
        with pytest.raises(ValueError, match=pattern):
            _raw(q, k, v, mt, backend="triton")
        return
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=True)
    def f(q, k, v, mt):
        return _raw(q, k, v, mt, backend="triton")

    _compiled_raises(f, ValueError, pattern, q, k, v, mt)


@pytest.mark.parametrize("scale,softcap,pattern", [
    (float("nan"), 0.0, r"scale: must be a finite positive float, got nan"),
    (float("inf"), 0.0, r"scale: must be a finite positive float, got inf"),
    (-0.5, 0.0, r"scale: must be a finite positive float, got -0.5"),
    (0.0, 0.0, r"scale: must be a finite positive float, got 0.0"),
    (SCALE, float("nan"), r"softcap: must be a finite float >= 0 .*, got nan"),
    (SCALE, float("inf"), r"softcap: must be a finite float >= 0 .*, got inf"),
    (SCALE, -1.0, r"softcap: must be a finite float >= 0 .*, got -1.0"),
])
def test_bad_scalars_refused_eager_and_compiled(scale, softcap, pattern):
    """scale and softcap of the raw op (scale used to be taken as given: NaN outputs; a
    negative softcap was read as none). Compiled, the floats are graph inputs (symbolic):
    the op's kernel refuses them when the graph runs, after a good call compiled it."""
    q, k, v = _qkv()

    def call(q, k, v, scale, softcap):
        return torch.ops.flexsparse.attention(q, k, v, None, *MaskTensors(), BQ, BK, scale,
                                              softcap, "reference", False)[0]
    with pytest.raises(ValueError, match=pattern):
        call(q, k, v, scale, softcap)
    torch._dynamo.reset()
    f = torch.compile(call, fullgraph=True, dynamic=True, backend="aot_eager")
    torch.testing.assert_close(f(q, k, v, SCALE, 5.0), call(q, k, v, SCALE, 5.0))
    _compiled_raises(f, ValueError, pattern, q, k, v, scale, softcap)


def test_meta_tensors_still_refused():
    """Outside tracing the fake kernel is the op's only kernel for meta tensors: it
    refuses there instead of leaving the refusal to a kernel that never runs."""
    q, k, v = (t.to("meta") for t in _qkv())
    with pytest.raises(ValueError, match=r"kv_count: given without kv_index"):
        _raw(q, k, v, MaskTensors(kv_count=torch.zeros(1, 1, 4, dtype=torch.int32,
                                                        device="meta")))
    with pytest.raises(ValueError, match=r"scale: must be a finite positive float"):
        torch.ops.flexsparse.attention(q, k, v, None, *MaskTensors(), BQ, BK, float("nan"),
                                       0.0, "reference", False)


def test_unknown_backend_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"backend: unknown or unavailable backend 'fast'"):
        _raw(q, k, v, MaskTensors(), backend="fast")


def test_api_messages_unchanged():
    """The Python API keeps its own checks (and messages), which run before the op's."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"bias: shape \(1, 3, 64, 64\) is not broadcastable"):
        flexsparse.attention(q, k, v, bias=torch.zeros(1, 3, L, L))
    with pytest.raises(ValueError, match=r"mask: descriptor was compiled for \(Lq, Lk\)"):
        flexsparse.attention(q, k, v, M.causal().compile(B, HQ, HKV, 32, 32))


# ---------------------------------------------------------------- valid descriptors

def _valid_masks():
    g = torch.Generator().manual_seed(3)
    layout = torch.rand(1, HQ, 4, 4, generator=g) < 0.6
    layout[..., 0] = True
    dense = torch.rand(B, 1, L, L, generator=g) < 0.5
    dense[..., 0] = True
    cr = torch.randint(0, L + 1, (B, HKV, L, 2), generator=g).sort(-1).values
    idx = torch.randint(-1, L, (B, HKV, L, 5), generator=g)
    win = torch.arange(L)[:, None] - torch.arange(6)[None, :]          # local windows
    win = torch.where(win >= 0, win, -1).expand(B, 1, L, 6).contiguous()
    return {
        "causal": M.causal(),
        "document": M.document([10, 30, 24]),
        "document_per_batch": M.document(torch.tensor([[40, 24]]), causal=False),
        "block_sparse": M.block_sparse(layout, (BQ, BK)),
        "dense": M.dense(dense),
        "column_ranges": M.column_ranges(cr, causal=False),
        "indices": M.indices(idx),
        "indices_blocks": M.indices(win, layout="blocks"),
        "sliding_or_global": M.sliding_window(8) | M.global_tokens(4),
        "causal_and_dense": M.causal() & M.dense(dense),
        "full": M.full(),
    }


@pytest.mark.parametrize("name", list(_valid_masks()))
def test_library_descriptors_pass_and_match_the_api(name):
    mask = _valid_masks()[name]
    q, k, v = _qkv(dtype=torch.float64, requires_grad=True)
    desc = mask.compile(B, HQ, HKV, L, L, block_size=(BQ, BK))
    mt = desc.mask_tensors()
    out, lse = _raw(q, k, v, mt)
    ref_out, ref_lse = flexsparse.attention(q, k, v, mask, scale=SCALE, return_lse=True,
                                            block_size=(BQ, BK), backend="reference")
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    # and an independent check of what the op computed: dense float64 attention
    vis = desc.to_dense()
    if desc.is_index_mask:
        counts = naive.index_counts(desc.attn_indices, B, HKV, HQ // HKV, L, L)
        want, want_lse = naive.attention(q, k, v, scale=SCALE, counts=counts.double())
    else:
        want, want_lse = naive.attention(q, k, v, vis, scale=SCALE)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    g_raw = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref_out.sum(), (q, k, v))
    for a, b in zip(g_raw, g_ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["causal", "document", "indices"])
def test_library_descriptors_on_triton(name):
    """The same descriptors through backend="triton" (interpreter on CPU)."""
    mask = _valid_masks()[name]
    q, k, v = _qkv()
    desc = mask.compile(B, HQ, HKV, L, L, block_size=(BQ, BK))
    out, lse = _raw(q, k, v, desc.mask_tensors(), backend="triton")
    ref_out, ref_lse = flexsparse.attention(q, k, v, mask, scale=SCALE, return_lse=True,
                                            block_size=(BQ, BK), backend="reference")
    torch.testing.assert_close(out, ref_out, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=3e-5, rtol=1e-4)


def test_gqa_batch_and_head_broadcasts_pass():
    """Descriptors with batch dim B and head dims Hkv or Hq pass the checks (the layouts
    masks build for per-batch documents, per-kv-head column ranges, per-query-head layouts)."""
    Bb = 2
    q, k, v = _qkv(B=Bb)
    g = torch.Generator().manual_seed(4)
    masks = [M.document(torch.tensor([[40, 24], [8, 56]])),
             M.column_ranges(torch.randint(0, L + 1, (Bb, HKV, L, 1), generator=g), causal=True),
             M.block_sparse(torch.rand(Bb, HQ, 4, 4, generator=g) < 0.5, (BQ, BK)),
             M.dense(torch.rand(Bb, HQ, 1, L, generator=g) < 0.5),
             M.indices(torch.randint(-1, L, (Bb, HKV, L, 3), generator=g))]
    for mask in masks:
        desc = mask.compile(Bb, HQ, HKV, L, L, block_size=(BQ, BK))
        mt = desc.mask_tensors()
        heads = {t.shape[1] for n, t in zip(MASK_TENSOR_NAMES, mt)
                 if t is not None and n != "partial_bits"}
        assert heads <= {1, HKV, HQ}
        out = _raw(q, k, v, mt)[0]
        torch.testing.assert_close(out, flexsparse.attention(q, k, v, mask, scale=SCALE,
                                                             block_size=(BQ, BK)))


def test_valid_raw_call_compiled_dynamic():
    """A raw call with a descriptor inside torch.compile(fullgraph=True, dynamic=True), two
    lengths, forward and backward: the fakes' checks pass and outputs match eager."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=True)
    def f(q, k, v, mt):
        out, lse = _raw(q, k, v, mt)
        return out.sum() + lse.sum()

    for Lx in (64, 96):
        q, k, v = _qkv(Lq=Lx, Lk=Lx, requires_grad=True)
        mt = M.document([Lx // 2, Lx - Lx // 2]).compile(B, HQ, HKV, Lx, Lx,
                                                         block_size=(BQ, BK)).mask_tensors()
        got = f(q, k, v, mt)
        g_got = torch.autograd.grad(got, (q, k, v))
        out, lse = _raw(q, k, v, mt)
        want = out.sum() + lse.sum()
        g_want = torch.autograd.grad(want, (q, k, v))
        torch.testing.assert_close(got, want)
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["column_ranges", "indices_blocks"])
def test_opcheck_valid_raw_call(name):
    q, k, v = _qkv(requires_grad=True)
    bias = torch.randn(1, HKV, L, L, requires_grad=True)
    mt = _valid_masks()[name].compile(B, HQ, HKV, L, L, block_size=(BQ, BK)).mask_tensors()
    args = (q, k, v, bias, *mt, BQ, BK, SCALE, 0.0, "reference", False)
    opcheck(torch.ops.flexsparse.attention.default, args)
    out, lse = torch.ops.flexsparse.attention(*args)
    opcheck(torch.ops.flexsparse.attention_backward.default,
            (torch.ones_like(out), None, q.detach(), k.detach(), v.detach(), out.detach(),
             lse.detach(), bias.detach(), *mt, BQ, BK, SCALE, 0.0, "reference", False, True))


def test_passed_checks_are_remembered_by_identity_and_version():
    """The eager check cache: a descriptor edited in place to a bad shape (its version
    changes) is checked again and refused."""
    q, k, v = _qkv()
    desc = M.causal().compile(B, HQ, HKV, L, L, block_size=(BQ, BK))
    mt = desc.with_lists().mask_tensors()
    _raw(q, k, v, mt)
    mask_checks.check_inputs(q, k, v, None, mt, BQ, BK)            # a hit: no error
    mt.kv_count.resize_(1, 1, 3)
    with pytest.raises(ValueError, match=r"kv_count: shape \(1, 1, 3\)"):
        _raw(q, k, v, mt)
