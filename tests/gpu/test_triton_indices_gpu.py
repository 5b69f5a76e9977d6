"""Index-mode Triton kernels on CUDA (skipped without CUDA).

Accuracy rule (FlashAttention's): for every output, the kernel's max error vs a float64
reference must be <= 2x the max error of the same naive computation run in the input
dtype (matmuls in fp16/bf16, softmax in fp32, autograd for the gradients) plus a small
floor of 2 ulps of the dtype at the scale of the tensor group (out / lse / gradients).

Runs under pytest (FLEXSPARSE_GPU_TESTS=1), or directly: python tests/gpu/test_triton_indices_gpu.py
"""
import math
import os
import sys

os.environ.setdefault("FLEXSPARSE_GPU_TESTS", "1")

import torch

try:
    import pytest
except ImportError:  # the direct runner below needs no pytest
    pytest = None

HAVE_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def _param(name, values):
    def deco(fn):
        # remembered for the direct runner, and a pytest mark when pytest is there
        params = getattr(fn, "_params", []) + [(name, values)]
        if pytest is not None:
            fn = pytest.mark.parametrize(name, values)(fn)
        fn._params = params
        return fn
    return deco


if pytest is not None:
    pytestmark = pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA (and no TRITON_INTERPRET)")

if HAVE_CUDA:
    import flexsparse
    from flexsparse.ops import MaskTensors
    from flexsparse.ops import triton_indices as ti
    from flexsparse.topk import topk_indices

DEV = "cuda"
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


# ------------------------------------------------------------------ naive reference

def naive(q, k, v, idx, bias, scale, softcap, dtype):
    """Gather attention in `dtype` (float64 for the truth); returns out, lse (autograd-able)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = Hq // Hkv
    W = idx.shape[-1]
    ix = idx.to(torch.int64).expand(B, Hkv, Lq, W)
    valid = (ix >= 0) & (ix < Lk)
    ixs = torch.where(valid, ix, torch.zeros_like(ix))
    base = (torch.arange(B * Hkv, device=q.device) * Lk).view(B, Hkv, 1, 1)
    flat = (ixs + base).reshape(-1)
    ks = k.reshape(B * Hkv * Lk, D).index_select(0, flat).view(B, Hkv, Lq, W, D)
    vs = v.reshape(B * Hkv * Lk, Dv).index_select(0, flat).view(B, Hkv, Lq, W, Dv)
    q5 = q.unflatten(1, (Hkv, G))
    s = torch.einsum("bhgrd,bhrwd->bhgrw", q5, ks) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    sf = s.float() if dtype != torch.float64 else s
    if bias is not None:
        b = bias.to(dtype)
        b5 = b.unflatten(1, (Hkv, G)) if (b.shape[1] == Hq and G > 1) else b.unsqueeze(2)
        b5 = b5.expand(B, Hkv, G, Lq, Lk)
        gathered = torch.gather(b5, -1, ixs.unsqueeze(2).expand(B, Hkv, G, Lq, W))
        sf = sf + gathered.to(sf.dtype)
    v5 = valid.unsqueeze(2)
    has = v5.any(-1, keepdim=True)
    sm = sf.masked_fill(~v5, -math.inf)
    sm = torch.where(has, sm, torch.zeros_like(sm))
    lse = torch.logsumexp(sm, -1, keepdim=True)
    p = torch.exp(sm - lse) * v5
    out = torch.einsum("bhgrw,bhrwd->bhgrd", p.to(dtype), vs)
    lse = torch.where(has, lse, torch.full_like(lse, -math.inf)).squeeze(-1)
    return out.flatten(1, 2), lse.flatten(1, 2)


def _grads(q, k, v, idx, bias, scale, softcap, dtype, do, dlse):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    b = bias.detach().clone().requires_grad_() if bias is not None else None
    out, lse = naive(*leaves, idx, b, scale, softcap, dtype)
    loss = (out.double() * do.double()).sum()
    if dlse is not None:
        fin = torch.isfinite(lse)
        loss = loss + (torch.where(fin, lse, torch.zeros_like(lse)).double() * dlse.double()).sum()
    wrt = leaves + ([b] if b is not None else [])
    gs = torch.autograd.grad(loss, wrt)
    return out.detach(), lse.detach(), gs


def _max_err(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin), "inf/nan pattern differs"
    return (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0


def _rule(group, dtype):
    """group: list of (name, kernel, ref64, ref_lowp)."""
    scale = max(max(r[~r.isinf()].abs().max().item() if (~r.isinf()).any() else 0.0
                    for _, _, r, _ in group), 1e-3)
    floor = 2 * EPS[dtype] * scale
    msgs = []
    for name, got, ref, low in group:
        assert not torch.isnan(got).any(), f"{name}: NaN"
        e_k = _max_err(got, ref)
        e_l = _max_err(low, ref)
        ok = e_k <= 2 * e_l + floor
        msgs.append(f"{name}: kernel {e_k:.2e} lowp {e_l:.2e} floor {floor:.1e} {'ok' if ok else 'FAIL'}")
        assert ok, "; ".join(msgs)
    return msgs


def _padded(shape, dtype, pad=5):
    B, H, L, D = shape
    big = torch.full((B, H, L + 2 * pad, D), math.nan, dtype=dtype, device=DEV)
    big[:, :, pad:pad + L] = torch.randn(shape, device=DEV).to(dtype)
    return big[:, :, pad:pad + L]


def _make(B, Hq, Hkv, Lq, Lk, D, Dv, W, dtype, seed=0, oob=True):
    torch.manual_seed(seed)
    q = torch.randn((B, Hq, Lq, D), device=DEV).to(dtype)
    k = _padded((B, Hkv, Lk, D), dtype)
    v = _padded((B, Hkv, Lk, Dv), dtype)
    idx = torch.randint(0, Lk, (B, Hkv, Lq, W), device=DEV)
    idx = torch.where(torch.rand(idx.shape, device=DEV) < 0.1, -1, idx)
    if W >= 2:
        idx[..., 1] = idx[..., 0]
    if Lq >= 2:
        idx[0, 0, 1] = -1
    if oob and W >= 3 and Lq >= 3:
        idx[0, -1, 2, -1] = Lk
        idx[-1, 0, 0, W // 2] = Lk + 3
        idx[0, 0, Lq - 1, -2] = -3
    return q, k, v, idx.to(torch.int32)


def _run(q, k, v, idx, bias=None, scale=None, softcap=0.0, deterministic=False, dlse=True,
         want_dbias=None):
    dtype = q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    want_dbias = bias is not None if want_dbias is None else want_dbias
    mt = MaskTensors(attn_indices=idx)
    assert ti.not_supported_reasons(q, k, v, bias, mt) == []
    out, lse = ti.forward(q, k, v, bias, mt, scale, softcap)
    torch.manual_seed(99)
    do = torch.randn(out.shape, device=DEV).to(dtype)
    gl = torch.randn(lse.shape, device=DEV) if dlse else None
    dq, dk, dv, db = ti.backward(do, gl, q, k, v, out, lse, bias, mt, scale, softcap,
                                 deterministic, want_dbias)
    b_ref = bias if want_dbias else (bias.detach() if bias is not None else None)
    o64, l64, g64 = _grads(q, k, v, idx, b_ref, scale, softcap, torch.float64, do, gl)
    olp, llp, glp = _grads(q, k, v, idx, b_ref, scale, softcap, dtype, do, gl)
    msgs = _rule([("out", out, o64, olp)], dtype)
    msgs += _rule([("lse", lse, l64, llp)], dtype)
    names = ["dq", "dk", "dv"] + (["dbias"] if want_dbias else [])
    got = [dq, dk, dv] + ([db] if want_dbias else [])
    msgs += _rule(list(zip(names, got, g64[:len(names)], glp[:len(names)])), dtype)
    if not want_dbias:
        assert db.shape == (0,)
    for t, ref in zip(got, (q, k, v, bias)):
        assert t.shape == ref.shape and t.dtype == ref.dtype
    return (out, lse), (dq, dk, dv, db), msgs


# ------------------------------------------------------------------ tests

@_param("dtype", [torch.float16, torch.bfloat16])
@_param("D", [64, 128, 256])
@_param("W", [1, 64, 100, 1024])
def test_fwd_bwd(dtype, D, W):
    q, k, v, idx = _make(2, 8, 2, 37, 517, D, D, W, dtype, seed=D + W)
    _run(q, k, v, idx)


@_param("G", [1, 2, 4, 8, 16])
def test_gqa(G):
    q, k, v, idx = _make(1, 2 * G, 2, 45, 301, 128, 128, 100, torch.bfloat16, seed=G)
    _run(q, k, v, idx, dlse=False)


@_param("deterministic", [False, True])
@_param("bias_shape", [(2, 8, 33, 257), (1, 2, 33, 257), (2, 1, 1, 257), (1, 8, 33, 1)])
def test_bias_softcap_dbias(deterministic, bias_shape):
    q, k, v, idx = _make(2, 8, 2, 33, 257, 64, 64, 100, torch.float16, seed=3)
    q = (q.float() * 3).half()
    bias = torch.randn(bias_shape, device=DEV).half()
    _run(q, k, v, idx, bias=bias, softcap=5.0, deterministic=deterministic)


def test_deterministic_bitwise():
    q, k, v, idx = _make(1, 8, 2, 513, 300, 128, 128, 256, torch.bfloat16, seed=7)
    bias = torch.randn((1, 2, 513, 300), device=DEV).to(torch.bfloat16)
    mt = MaskTensors(attn_indices=idx)
    out, lse = ti.forward(q, k, v, bias, mt, 0.1, 0.0)
    do = torch.randn_like(out)
    runs = [ti.backward(do, None, q, k, v, out, lse, bias, mt, 0.1, 0.0, True, True)
            for _ in range(3)]
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b)
    fast = ti.backward(do, None, q, k, v, out, lse, bias, mt, 0.1, 0.0, False, True)
    for a, b in zip(runs[0], fast):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 2e-2 * max(1.0, b.float().abs().max().item()), err
    # and the deterministic result obeys the accuracy rule
    _run(q, k, v, idx, bias=bias, scale=0.1, deterministic=True, dlse=False)


def test_noncontiguous_int64():
    torch.manual_seed(5)
    B, L, Hq, Hkv, D = 2, 129, 8, 4, 128
    q = torch.randn((B, L, Hq, D), device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn((B, L, Hkv, D), device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn((B, L, Hkv, D), device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    idx = torch.randint(-1, L, (1, 1, L, 64), device=DEV)  # int64, broadcast over B and heads
    _run(q, k, v, idx)
    _run(q, k, v, idx, deterministic=True)


def test_public_api():
    q, k, v, idx = _make(1, 8, 2, 65, 200, 64, 64, 48, torch.bfloat16, seed=9, oob=False)
    q, k, v = (t.contiguous().requires_grad_() for t in (q, k, v))
    bias = torch.randn((1, 8, 65, 200), device=DEV, dtype=torch.bfloat16, requires_grad=True)
    mask = flexsparse.masks.indices(idx)
    out = flexsparse.attention(q, k, v, mask, bias=bias, backend="triton")
    mt = MaskTensors(attn_indices=idx)
    scale = 1.0 / math.sqrt(64)
    ref_out, ref_lse = ti.forward(q.detach(), k.detach(), v.detach(), bias.detach(), mt, scale, 0.0)
    assert torch.equal(out.detach(), ref_out)
    do = torch.randn_like(out)
    gs = torch.autograd.grad(out, (q, k, v, bias), do)
    want = ti.backward(do, None, q.detach(), k.detach(), v.detach(), ref_out, ref_lse,
                       bias.detach(), mt, scale, 0.0, False, True)
    for a, b in zip(gs, want):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 1e-2 * max(1.0, b.float().abs().max().item()), err  # atomics order


def test_topk_cuda():
    torch.manual_seed(0)
    s = torch.randn((2, 4, 300, 257), device=DEV)
    for causal in (False, True):
        got = topk_indices(s, 32, causal=causal, chunk_rows=64)
        want = topk_indices(s.cpu(), 32, causal=causal)
        assert got.is_cuda and torch.equal(got.cpu(), want)



def test_topk_cuda_no_host_sync():
    # chunked, causal, NaN / -inf scores: no host sync anywhere in the build (issue 17)
    from flexsparse import masks
    torch.manual_seed(1)
    s = torch.randn((1, 2, 200, 190), device=DEV)
    s[..., 3, ::2] = float("nan")
    s[..., 5, 1::3] = -math.inf
    for causal in (False, True):
        want = topk_indices(s.cpu(), 16, causal=causal)
        topk_indices(s, 16, causal=causal, chunk_rows=48)      # warm-up (lazy CUDA init)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = topk_indices(s, 16, causal=causal, chunk_rows=48)
            mask = masks.topk(s, 16, causal=causal, chunk_rows=48)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got.cpu(), want) and torch.equal(mask.indices.cpu(), want)


def test_topk_cuda_long_rows_every_dtype():
    # The Triton select (flexsparse/triton_topk.py): rows held in registers (the path
    # topk_indices takes) and rows longer than its block; bf16 / fp16 / fp32, ties, NaN,
    # -inf: the kept scores are torch.topk's, row by row.
    torch.manual_seed(2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        s = torch.randn((2, 3, 40, 5000), device=DEV).to(dtype)
        s[..., 1, :] = (s[..., 1, :].float() * 4).round().to(dtype)      # ties
        s[..., 2, ::3] = float("nan")
        s[..., 3, 7:] = -math.inf
        for k, causal in ((64, False), (256, True), (1, False)):
            got = topk_indices(s, k, causal=causal)
            assert got.is_cuda and got.shape == (2, 3, 40, k)
            allowed = s.float().nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
            if causal:
                i = torch.arange(40, device=DEV)[:, None]
                allowed = allowed.masked_fill(torch.arange(5000, device=DEV) > i + 5000 - 40, -math.inf)
            want = allowed.topk(k, dim=-1).values
            kept = torch.gather(s.float(), -1, got.clamp_min(0).long()).masked_fill(got < 0, -math.inf)
            assert torch.equal(kept.sort(-1, descending=True).values, want), (dtype, k, causal)
            parked = got.masked_fill(got < 0, 1 << 20)
            assert torch.equal(parked, parked.sort(-1).values)
            unsorted = topk_indices(s, k, causal=causal, sort=False)
            v = torch.gather(s.float(), -1, unsorted.clamp_min(0).long())
            assert torch.equal(v.masked_fill(unsorted < 0, -math.inf), want)
            # rows longer than the kernel's block (read once per step), histogram bytes first
            from flexsparse.triton_topk import topk_rows
            for hist_digits in (0, 2):
                got = topk_rows(s, k, causal=causal, num_queries=40, block=1024, num_warps=4,
                                hist_digits=hist_digits)
                kept = torch.gather(s.float(), -1, got.clamp_min(0).long()).masked_fill(got < 0, -math.inf)
                assert torch.equal(kept.sort(-1, descending=True).values, want), (dtype, hist_digits)

def _skip_without_topk_op():
    if not torch._C._dispatch_has_kernel_for_dispatch_key("flexsparse::topk_rows", "CUDA"):
        if pytest is None:
            raise RuntimeError("flexsparse._C is not built (tests/gpu.sh builds it)")
        pytest.skip("flexsparse._C without the topk kernel")


def _assert_topk_of(s, got, k, causal, row0, num_queries, note):
    """got holds, per row of s, positions whose scores are torch.topk's k largest allowed
    (NaN and -inf never, causal as topk_rows defines it), ascending, then -1."""
    Lq, L = s.shape[-2], s.shape[-1]
    allowed = s.float().nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    if causal:
        i = torch.arange(row0, row0 + Lq, device=s.device)[:, None]
        allowed = allowed.masked_fill(torch.arange(L, device=s.device) > i + L - num_queries, -math.inf)
    want = allowed.topk(k, dim=-1).values
    kept = torch.gather(s.float(), -1, got.clamp_min(0).long()).masked_fill(got < 0, -math.inf)
    assert torch.equal(kept.sort(-1, descending=True).values, want), note
    parked = got.masked_fill(got < 0, 1 << 30)
    assert torch.equal(parked, parked.sort(-1).values), note


def test_topk_cuda_op():
    # csrc/topk.cu (flexsparse::topk_rows): one warp per row, keys in shared memory. Kept
    # scores equal torch.topk's row by row; positions ascending, -1 last; causal; strided;
    # degenerate sizes; opcheck.
    _skip_without_topk_op()
    from flexsparse import topk as T
    torch.manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for L, Lq, k in ((300, 37, 5), (5000, 40, 64), (40000, 8, 256)):
            s = torch.randn((2, 3, Lq, L), device=DEV).to(dtype)
            s[..., 1, :] = (s[..., 1, :].float() * 4).round().to(dtype)      # ties
            s[..., 2, ::3] = float("nan")
            s[..., 3, 7:] = -math.inf
            s[..., 4, :9] = math.inf
            for causal in (False, True):
                got = torch.ops.flexsparse.topk_rows(s, k, causal, 0, Lq)
                _assert_topk_of(s, got, k, causal, 0, Lq, (dtype, L, k, causal))
                assert T._cuda_op_takes(s, k)
                assert torch.equal(got, topk_indices(s, k, causal=causal)), (dtype, L, causal)
                for warps in (1, 4, 8, 16):   # one warp per row, or a CTA of warps per row
                    assert torch.equal(torch.ops.flexsparse.topk_rows(s, k, causal, 0, Lq, warps), got), \
                        (dtype, L, k, causal, warps)
        for strided in (s[..., ::2], s.transpose(0, 1)[..., ::3]):   # column stride; a copy
            want = torch.ops.flexsparse.topk_rows(strided.contiguous(), 16, False, 0, Lq)
            assert torch.equal(torch.ops.flexsparse.topk_rows(strided, 16, False, 0, Lq), want)
    assert torch.ops.flexsparse.topk_rows(s[..., :0], 4, False, 0, Lq).eq(-1).all()
    assert torch.ops.flexsparse.topk_rows(s[..., :0], 4, False, 0, Lq, 8).eq(-1).all()
    # (bad arguments: tests/gpu/test_op_errors_gpu.py)
    assert torch.ops.flexsparse.topk_rows(s, 0, False, 0, Lq).shape == s.shape[:-1] + (0,)
    torch.library.opcheck(torch.ops.flexsparse.topk_rows.default,
                          (torch.randn(2, 5, 300, device=DEV, dtype=torch.bfloat16), 7, True, 0, 5))


def test_topk_cuda_op_fp32_bottom_halves():
    # fp32 rows (csrc/topk.cu kWide): shared memory holds the keys' top 16 bits; keys that
    # tie there are told apart by their bottom halves, from a candidate list (up to 1024 per
    # row) or, past it, by reading the row again. Rows: many values sharing their top half
    # (fewer and more than 1024), exact ties in both halves, one value everywhere, NaN /
    # inf; every warps_per_row; kept scores equal torch.topk's, positions ascending.
    _skip_without_topk_op()
    torch.manual_seed(5)
    Lq = 6
    for L, k in ((3000, 100), (20000, 700), (65536, 2000)):
        s = torch.randn((1, 2, Lq, L), device=DEV)
        j = torch.arange(L, device=DEV, dtype=torch.float32)
        s[..., 0, :] = 1.0 + (j % 4096) * 2.0 ** -23          # one top half, 4096 bottoms
        s[..., 1, :] = -s[..., 1, :].abs()                    # 500 on top, sharing a top half
        s[..., 1, :500] = 1.0 + torch.randint(0, 64, (500,), device=DEV) * 2.0 ** -23
        s[..., 2, :] = 0.25                                   # one value everywhere
        s[..., 3, ::2] = float("nan")
        s[..., 3, 1::4] = math.inf
        s[..., 4, :] = (s[..., 4, :] * 8).round() / 8 + (j % 3) * 2.0 ** -20   # ties in both halves
        for causal in (False, True):
            got = torch.ops.flexsparse.topk_rows(s, k, causal, 0, Lq)
            _assert_topk_of(s, got, k, causal, 0, Lq, (L, k, causal))
            for warps in (1, 4, 8, 16):
                assert torch.equal(torch.ops.flexsparse.topk_rows(s, k, causal, 0, Lq, warps), got), \
                    (L, k, causal, warps)


def test_topk_cuda_rows_longer_than_shared_memory():
    # 16-bit rows above 64K keys: csrc/topk.cu per 64K-key segment, then over the
    # candidates (topk._segmented_topk). Kept scores equal torch.topk's row by row,
    # positions ascending, causal rows of a chunk (row0 > 0, Lq != Lk).
    _skip_without_topk_op()
    from flexsparse import topk as T
    torch.manual_seed(4)
    Lq, L = 6, 140_000
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        s = torch.randn((1, 3, Lq, L), device=DEV).to(dtype)
        s[..., 1, :] = (s[..., 1, :].float() * 2).round().to(dtype)      # ties across segments
        s[..., 2, ::5] = float("nan")
        s[..., 3, 70_000:] = -math.inf
        for k, causal, r0, nq in ((64, False, 0, Lq), (300, True, 0, Lq), (17, True, 30_000, 100_000)):
            assert T._cuda_op_takes(s, k)
            got = T.topk_indices(s, k, causal=causal) if r0 == 0 else \
                T._topk_chunk(s, k, causal, r0, nq, True)
            _assert_topk_of(s, got, k, causal, r0, nq, (dtype, k, causal, r0))


# ------------------------------------------------------------------ direct runner

def run_direct(namespace) -> int:
    """Run the test_* functions of a module namespace over their _param grids, without
    pytest (used by this file and test_index_blocks_gpu.py). Returns the exit status."""
    if not HAVE_CUDA:
        print("SKIPPED: needs CUDA")
        return 0
    import itertools
    import time
    fails = 0
    n = 0
    for name, fn in sorted(namespace.items()):
        if not (name.startswith("test_") and callable(fn)):
            continue
        params = getattr(fn, "_params", [])
        keys = [p[0] for p in params]
        for combo in itertools.product(*[p[1] for p in params]):
            kw = dict(zip(keys, combo))
            t0 = time.time()
            n += 1
            try:
                fn(**kw)
                print(f"PASS {name} {kw} ({time.time() - t0:.1f}s)", flush=True)
            except Exception as err:
                fails += 1
                print(f"FAIL {name} {kw}: {type(err).__name__}: {str(err)[:500]}", flush=True)
    print(f"{n - fails} passed, {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(run_direct(globals()))
