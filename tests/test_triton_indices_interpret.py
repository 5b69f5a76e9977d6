"""Index-mode Triton kernels (ops/triton_indices.py) vs the reference backend, on CPU under
TRITON_INTERPRET=1 (tests/conftest.py turns it on). fp16/fp32 only: bf16 tl.dot is not
meaningful in the interpreter. Also tests flexsparse.topk.topk_indices.
"""
import math
import os

import pytest
import torch

if os.environ.get("FLEXSPARSE_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: TRITON_INTERPRET is not 1", allow_module_level=True)

import flexsparse  # noqa: E402
from flexsparse.ops import MaskTensors  # noqa: E402
from flexsparse.ops import triton_indices as ti  # noqa: E402
from flexsparse.topk import topk_indices  # noqa: E402


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every buffer a kernel must fill starts as NaN, so an entry it forgets shows up."""
    def poisoned(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.fill_(math.nan) if t.dtype.is_floating_point else t
    monkeypatch.setattr(ti, "_empty", poisoned)


# ------------------------------------------------------------------ helpers

def _ref_fwd(q, k, v, bias, idx, scale, softcap):
    return torch.ops.flexsparse.attention(
        q, k, v, bias, *MaskTensors(attn_indices=idx), 128, 128, scale, softcap, "reference", False)


def _ref_bwd(do, dlse, q, k, v, o, lse, bias, idx, scale, softcap, want_dbias):
    return torch.ops.flexsparse.attention_backward(
        do, dlse, q, k, v, o, lse, bias, *MaskTensors(attn_indices=idx), 128, 128, scale,
        softcap, "reference", False, want_dbias)


def _padded(shape, dtype, gen, pad=3):
    """A view of length shape[2] inside a NaN-filled tensor: reading outside it gives NaN."""
    B, H, L, D = shape
    big = torch.full((B, H, L + 2 * pad, D), math.nan, dtype=dtype)
    big[:, :, pad:pad + L] = torch.randn(shape, generator=gen).to(dtype)
    return big[:, :, pad:pad + L]


def _make(B, Hq, Hkv, Lq, Lk, D, Dv, W, dtype, seed=0, idx_heads=None, idx_batch=None,
          idx_dtype=torch.int32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((B, Hq, Lq, D), generator=gen).to(dtype)
    k = _padded((B, Hkv, Lk, D), dtype, gen)
    v = _padded((B, Hkv, Lk, Dv), dtype, gen)
    Bi = B if idx_batch is None else idx_batch
    Hi = Hkv if idx_heads is None else idx_heads
    idx = torch.randint(0, Lk, (Bi, Hi, Lq, W), generator=gen)
    drop = torch.rand((Bi, Hi, Lq, W), generator=gen) < 0.2
    idx = torch.where(drop, torch.full_like(idx, -1), idx)
    if W >= 2:
        idx[..., 1] = idx[..., 0]              # duplicates: count twice
    if Lq >= 2:
        idx[0, 0, 1, :] = -1                   # a row with nothing visible
    if Lq >= 3 and W >= 3:
        # out of range entries (the API would reject them; kernels must ignore them)
        idx[0, -1, 2, -1] = Lk
        idx[-1, 0, Lq - 1, W // 2] = Lk + 2
        idx[0, 0, 0, -1] = -4
    return q, k, v, idx.to(idx_dtype)


def _close(name, got, want, tol):
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
    got = got.double()
    want = want.double()
    assert not torch.isnan(got).any(), f"{name}: NaN in kernel output"
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin), f"{name}: inf pattern differs"
    assert torch.equal(got[~fin], want[~fin]), f"{name}: infinite entries differ"
    err = (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    scale = max(1.0, want[fin].abs().max().item()) if fin.any() else 1.0
    assert err <= tol * scale, f"{name}: max abs err {err:.3e} > {tol:.1e} * {scale:.3g}"


TOL = {torch.float32: 2e-5, torch.float16: 2e-2}


def _check(q, k, v, idx, bias=None, scale=None, softcap=0.0, dlse=True, deterministic=False,
           want_dbias=None):
    dtype = q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    want_dbias = bias is not None if want_dbias is None else want_dbias
    mask = MaskTensors(attn_indices=idx)
    assert ti.not_supported_reasons(q, k, v, bias, mask) == []
    out, lse = ti.forward(q, k, v, bias, mask, scale, softcap)
    # float64 reference on the same (rounded) inputs
    d = lambda t: None if t is None else t.double()
    ro, rl = _ref_fwd(d(q), d(k), d(v), d(bias), idx, scale, softcap)
    tol = TOL[dtype]
    _close("out", out, ro.to(dtype), tol)
    _close("lse", lse, rl.float(), tol)

    gen = torch.Generator().manual_seed(123)
    do = torch.randn(out.shape, generator=gen).to(dtype)
    gl = torch.randn(lse.shape, generator=gen) if dlse else None
    dq, dk, dv, db = ti.backward(do, gl, q, k, v, out, lse, bias, mask, scale, softcap,
                                 deterministic, want_dbias)
    rdq, rdk, rdv, rdb = _ref_bwd(d(do), d(gl), d(q), d(k), d(v), ro, rl, d(bias), idx, scale,
                                  softcap, want_dbias)
    _close("dq", dq, rdq.to(dtype), 2 * tol)
    _close("dk", dk, rdk.to(dtype), 2 * tol)
    _close("dv", dv, rdv.to(dtype), 2 * tol)
    if want_dbias:
        _close("dbias", db, rdb.to(bias.dtype), 2 * tol)
    else:
        assert db.shape == (0,)
    return (out, lse), (dq, dk, dv, db)


# ------------------------------------------------------------------ forward + backward

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (4, 1)])
def test_gqa_duplicates_oob(dtype, Hq, Hkv):
    # W = 37 is not a power of two and spans several BLOCK_W chunks in the backward.
    q, k, v, idx = _make(2, Hq, Hkv, 4, 11, 16, 16, 37, dtype, seed=Hq * 10 + Hkv)
    _check(q, k, v, idx)


@pytest.mark.parametrize("deterministic", [False, True])
def test_wide_w_odd_head_dims(deterministic):
    # W = 70 > the forward's BLOCK_W (64); D = 24 and Dv = 40 are padded in-kernel.
    q, k, v, idx = _make(1, 4, 2, 3, 13, 24, 40, 70, torch.float32, seed=5)
    _check(q, k, v, idx, deterministic=deterministic)


@pytest.mark.parametrize("W", [1, 5])
def test_small_w(W):
    q, k, v, idx = _make(1, 2, 1, 5, 6, 16, 16, W, torch.float16, seed=W)
    _check(q, k, v, idx, dlse=False)


@pytest.mark.parametrize("bias_shape", [
    "B,Hq,Lq,Lk", "1,Hkv,Lq,Lk", "1,1,1,Lk", "B,1,Lq,1", "1,Hq,1,Lk", "B,Hkv,1,1"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bias_broadcast_and_dbias(bias_shape, deterministic):
    B, Hq, Hkv, Lq, Lk = 2, 4, 2, 3, 9
    q, k, v, idx = _make(B, Hq, Hkv, Lq, Lk, 16, 16, 6, torch.float32, seed=7)
    env = dict(B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk)
    shape = tuple(env[s] if s in env else int(s) for s in bias_shape.split(","))
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    _check(q, k, v, idx, bias=bias, deterministic=deterministic)


@pytest.mark.parametrize("idx_batch,idx_heads", [(1, 1), (1, 2), (2, 1)])
def test_index_broadcast_int64_with_bias(idx_batch, idx_heads):
    q, k, v, idx = _make(2, 4, 2, 3, 9, 16, 16, 7, torch.float32, seed=11,
                         idx_batch=idx_batch, idx_heads=idx_heads, idx_dtype=torch.int64)
    bias = torch.randn((1, 4, 3, 9), generator=torch.Generator().manual_seed(4))
    for det in (False, True):
        _check(q, k, v, idx, bias=bias, deterministic=det)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softcap_with_bias(dtype):
    q, k, v, idx = _make(1, 4, 2, 4, 10, 16, 16, 9, dtype, seed=13)
    q = (q.float() * 4).to(dtype)  # push scores into tanh's curved part
    bias = torch.randn((1, 1, 4, 10), generator=torch.Generator().manual_seed(6)).to(dtype)
    for det in (False, True):
        _check(q, k, v, idx, bias=bias, softcap=2.5, deterministic=det)


def test_bias_without_grad_and_grad_lse_none():
    q, k, v, idx = _make(1, 2, 2, 3, 8, 16, 16, 5, torch.float32, seed=17)
    bias = torch.randn((1, 2, 3, 8), generator=torch.Generator().manual_seed(8))
    _check(q, k, v, idx, bias=bias, dlse=False, want_dbias=False)


def test_empty_rows_and_masked_bias_rows():
    q, k, v, idx = _make(1, 2, 1, 4, 8, 16, 16, 6, torch.float32, seed=19)
    idx[0, 0, 2] = -1
    bias = torch.randn((1, 1, 4, 8), generator=torch.Generator().manual_seed(9))
    bias[0, 0, 3] = -math.inf  # row 3: everything masked by the bias
    (out, lse), (dq, dk, dv, db) = _check(q, k, v, idx, bias=bias)
    for r in (1, 2, 3):  # row 1 is all -1 from _make
        assert torch.equal(out[:, :, r], torch.zeros_like(out[:, :, r]))
        assert torch.isneginf(lse[:, :, r]).all()
        assert torch.equal(dq[:, :, r], torch.zeros_like(dq[:, :, r]))
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()


def test_all_inactive():
    q, k, v, idx = _make(1, 2, 1, 3, 5, 16, 16, 4, torch.float16, seed=23)
    idx.fill_(-1)
    (out, lse), (dq, dk, dv, _) = _check(q, k, v, idx)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    for t in (dq, dk, dv):
        assert torch.equal(t, torch.zeros_like(t))


def test_deterministic_bitwise_and_matches_fast():
    q, k, v, idx = _make(2, 4, 2, 5, 7, 16, 16, 12, torch.float32, seed=29)
    bias = torch.randn((2, 4, 5, 7), generator=torch.Generator().manual_seed(10))
    mask = MaskTensors(attn_indices=idx)
    out, lse = ti.forward(q, k, v, bias, mask, 0.25, 0.0)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    runs = [ti.backward(do, None, q, k, v, out, lse, bias, mask, 0.25, 0.0, True, True)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    fast = ti.backward(do, None, q, k, v, out, lse, bias, mask, 0.25, 0.0, False, True)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), runs[0], fast):
        _close(name, a, b, 1e-5)


def test_transposed_csr():
    idx = torch.tensor([[[[3, 1, -1], [1, 1, 7], [0, -2, 3]]]], dtype=torch.int32)
    rowptr, qidx = ti.transposed_csr(idx, 5)
    assert rowptr.tolist() == [[[0, 1, 4, 4, 6, 6]]]
    # key 0: query 2; key 1: queries 0, 1, 1; key 3: queries 0, 2; 7 and -2 dropped
    assert qidx[0, 0, :6].tolist() == [2, 0, 1, 1, 0, 2]


def test_not_supported_reasons():
    q, k, v, idx = _make(1, 2, 1, 3, 5, 16, 16, 4, torch.float32)
    assert ti.not_supported_reasons(q, k, v, None, MaskTensors()) != []
    assert ti.not_supported_reasons(q.double(), k.double(), v.double(), None,
                                    MaskTensors(attn_indices=idx)) != []
    assert ti.not_supported_reasons(q, k, v, None,
                                    MaskTensors(attn_indices=idx.to(torch.int16))) != []
    assert ti.not_supported_reasons(q, k, v, None, MaskTensors(attn_indices=idx)) == []


def test_public_api_triton_backend():
    from flexsparse.ops import backends
    if "triton" not in backends.available():
        pytest.skip("the triton backend module is not registered yet")
    q, k, v, idx = _make(1, 4, 2, 3, 8, 16, 16, 5, torch.float32, seed=31)
    idx = idx.clamp(-1, 7)
    q, k, v = (t.contiguous().requires_grad_() for t in (q, k, v))
    bias = torch.randn((1, 4, 3, 8), requires_grad=True)
    mask = flexsparse.masks.indices(idx)
    got = flexsparse.attention(q, k, v, mask, bias=bias, backend="triton")
    want = flexsparse.attention(q, k, v, mask, bias=bias, backend="reference")
    _close("out", got, want, 2e-5)
    g_got = torch.autograd.grad(got.sum(), (q, k, v, bias))
    g_want = torch.autograd.grad(want.sum(), (q, k, v, bias))
    for name, a, b in zip("qkvb", g_got, g_want):
        _close("d" + name, a, b, 4e-5)


# ------------------------------------------------------------------ topk

def _dense_topk(s, k, causal):
    Lq, Lk = s.shape[-2:]
    if causal:
        i = torch.arange(Lq)[:, None]
        j = torch.arange(Lk)[None, :]
        s = s.masked_fill(j > i + (Lk - Lq), -math.inf)
    kk = min(k, Lk)
    vals, ind = torch.topk(s, kk, dim=-1)
    ind = torch.where(torch.isneginf(vals), Lk, ind).sort(-1).values
    ind = torch.where(ind >= Lk, -1, ind)
    if kk < k:
        ind = torch.cat([ind, ind.new_full(ind.shape[:-1] + (k - kk,), -1)], -1)
    return ind.to(torch.int32)


def test_kernel_options_set_the_index_configs(monkeypatch):
    """kernel_options' index_*_config reach the index kernels through flexsparse.attention
    (per call, no module state), and the results stay right with them."""
    seen = {}
    for name in ("_fwd_config", "_bwd_config", "_bwd_kv_config"):
        real = getattr(ti, name)

        def spy(*args, _real=real, _name=name):
            seen[_name] = _real(*args)
            return seen[_name]
        monkeypatch.setattr(ti, name, spy)
    q, k, v, idx = _make(1, 4, 2, 24, 40, 16, 16, 20, torch.float32, seed=9)
    idx = idx.clamp(-1, 39)                     # in range, as the API requires
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    options = {"index_fwd_config": (16, 2, 1), "index_bwd_config": (16, 1, 1),
               "index_bwd_kv_config": (32, 2)}
    mask = flexsparse.masks.indices(idx)
    out = flexsparse.attention(*leaves, mask, backend="triton", deterministic=True,
                               kernel_options=options)
    grads = torch.autograd.grad(out.sum(), leaves)
    assert seen["_fwd_config"] == (16, 2, 1)
    assert seen["_bwd_config"] == (16, 1, 1)
    assert seen["_bwd_kv_config"] == (32 // 2, 2)       # rows per G_P2 (G = 2), warps
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = flexsparse.attention(*ref_leaves, mask, backend="reference")
    ref_grads = torch.autograd.grad(ref.sum(), ref_leaves)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        _close(name, got, want.float(), TOL[torch.float32])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k", [1, 4, 12])
@pytest.mark.parametrize("Lq,Lk", [(9, 9), (5, 9), (9, 10)])
def test_topk_matches_dense(causal, k, Lq, Lk):
    s = torch.randn((2, 3, Lq, Lk), generator=torch.Generator().manual_seed(Lq * 7 + k))
    want = _dense_topk(s, k, causal)
    for chunk in (None, 1, 4):
        got = topk_indices(s, k, causal=causal, chunk_rows=chunk)
        assert got.dtype == torch.int32 and got.shape == (2, 3, Lq, k)
        assert torch.equal(got, want), (chunk, got, want)
    calls = []

    def fn(r0, r1):
        calls.append((r0, r1))
        return s[..., r0:r1, :]

    got = topk_indices(fn, k, causal=causal, chunk_rows=2, num_queries=Lq)
    assert torch.equal(got, want)
    assert all(r1 - r0 <= 2 for r0, r1 in calls) and calls[-1][1] == Lq


def test_topk_causal_rows_and_neg_inf():
    s = torch.randn((1, 1, 4, 4), generator=torch.Generator().manual_seed(0))
    s[0, 0, 3, 2] = -math.inf
    got = topk_indices(s, 3, causal=True)
    assert got[0, 0, 0].tolist() == [0, -1, -1]
    assert sorted(got[0, 0, 1].tolist()) == [-1, 0, 1]
    assert -1 not in got[0, 0, 2].tolist()
    assert 2 not in got[0, 0, 3].tolist()
    # unsorted: descending score order
    got_u = topk_indices(s, 2, sort=False)
    want_u = torch.topk(s.masked_fill(torch.isneginf(s), -math.inf), 2).indices.to(torch.int32)
    assert torch.equal(got_u, want_u)


def test_topk_feeds_kernel():
    # top-k of the bias itself (Flash-DMA's dynamic mask), then the index kernel.
    B, Hq, Hkv, Lq, Lk = 1, 4, 2, 5, 12
    gen = torch.Generator().manual_seed(41)
    q = torch.randn((B, Hq, Lq, 16), generator=gen)
    k = torch.randn((B, Hkv, Lk, 16), generator=gen)
    v = torch.randn((B, Hkv, Lk, 16), generator=gen)
    bias = torch.randn((B, Hkv, Lq, Lk), generator=gen)
    idx = topk_indices(bias, 4, causal=True)
    assert idx.shape == (B, Hkv, Lq, 4)
    _check(q, k, v, idx, bias=bias)


def test_degenerate_sizes():
    # W = 0: nothing visible anywhere; Lq = 0: empty outputs. No kernel launch needed.
    q, k, v, idx = _make(1, 2, 1, 3, 5, 16, 16, 4, torch.float32)
    bias = torch.randn((1, 2, 3, 5))
    for ix, qq in ((idx[..., :0], q), (idx[:, :, :0], q[:, :, :0])):
        mask = MaskTensors(attn_indices=ix)
        out, lse = ti.forward(qq, k, v, bias if qq.shape[2] == 3 else None, mask, 0.25, 0.0)
        assert out.shape == qq.shape and lse.shape == qq.shape[:3]
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
        do = torch.randn_like(out)
        b = bias if qq.shape[2] == 3 else None
        dq, dk, dv, db = ti.backward(do, None, qq, k, v, out, lse, b, mask, 0.25, 0.0, False,
                                     b is not None)
        for t, ref in ((dq, qq), (dk, k), (dv, v)):
            assert t.shape == ref.shape and torch.equal(t, torch.zeros_like(t))
        if b is not None:
            assert db.shape == b.shape and torch.equal(db, torch.zeros_like(db))
