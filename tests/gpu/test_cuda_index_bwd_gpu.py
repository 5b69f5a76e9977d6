"""The CUDA index backward (csrc/index_bwd.cu, issue 17) on a Hopper GPU: dq, dk, dv of
index masks against float64 (the FlashAttention rule of test_triton_indices_gpu: error
within 2x the same naive computation in the input dtype, plus a floor of 2 ulps at the
tensors' scale), bitwise determinism, and the switch that routes gradients to it
(FLEXSPARSE_CUDA_INDEX_BWD=1; the default stays the Triton index backward).

K and V are views inside NaN-filled tensors, and dq, dk, dv land in allocator memory
filled with NaN first, so a read out of bounds or an element never written shows up.
Skipped without CUDA or without the built extension.

    FLEXSPARSE_GPU_TESTS=1 python -m pytest -q tests/gpu/test_cuda_index_bwd_gpu.py
"""
import math
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs a CUDA device (and no TRITON_INTERPRET)", allow_module_level=True)

import flexsparse  # noqa: E402
from flexsparse import masks as M  # noqa: E402
from flexsparse.ops import MaskTensors, backends, cuda_backend  # noqa: E402
from flexsparse.ops import triton_indices as ti  # noqa: E402

if "cuda" not in backends.available() or not cuda_backend.has_backward():
    pytest.skip("flexsparse._C (csrc/) is not built with its backward", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
import test_triton_indices_gpu as TI  # noqa: E402

DEV = TI.DEV
DTYPES = [torch.float16, torch.bfloat16]


def poison_allocator(*specs):
    """Freed blocks of NaN for the caching allocator, one per (shape, dtype), so that the
    next allocations of those sizes (dq, dk, dv) likely start as NaN."""
    junk = [torch.full(shape, math.nan, dtype=dtype, device=DEV) for shape, dtype in specs]
    del junk


def cuda_forward(q, k, v, idx, bias=None, scale=None, softcap=0.0):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.flexsparse.cuda_attention(q, k, v, bias, *MaskTensors(attn_indices=idx),
                                               128, 128, scale, softcap, False)


def cuda_backward(do, dlse, q, k, v, out, lse, idx, bias=None, scale=None, softcap=0.0):
    """dq, dk, dv of the C++ op itself (csrc/index_bwd.cu), over poisoned memory."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    poison_allocator((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype))
    dq, dk, dv, db = torch.ops.flexsparse.cuda_attention_backward(
        do, dlse, q, k, v, out, lse, bias, *MaskTensors(attn_indices=idx), 128, 128, scale,
        softcap, False, False)
    assert db.shape == (0,)
    for g, t in zip((dq, dk, dv), (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype
    return dq, dk, dv


def run(q, k, v, idx, bias=None, softcap=0.0, dlse=True, seed=99):
    """Forward (CUDA), then the CUDA backward with random dO (and dlse)."""
    out, lse = cuda_forward(q, k, v, idx, bias, None, softcap)
    g = torch.Generator(device=DEV).manual_seed(seed)
    do = torch.randn(out.shape, device=DEV, generator=g).to(q.dtype)
    gl = torch.randn(lse.shape, device=DEV, generator=g) if dlse else None
    return (out, lse, do, gl), cuda_backward(do, gl, q, k, v, out, lse, idx, bias, None, softcap)


def check(q, k, v, idx, bias=None, softcap=0.0, dlse=True):
    """The CUDA backward against float64 (dq, dk, dv; the bias is read, not differentiated)."""
    (out, lse, do, gl), grads = run(q, k, v, idx, bias, softcap, dlse)
    scale = q.shape[-1] ** -0.5
    _, _, g64 = TI._grads(q, k, v, idx, bias, scale, softcap, torch.float64, do, gl)
    _, _, glp = TI._grads(q, k, v, idx, bias, scale, softcap, q.dtype, do, gl)
    TI._rule(list(zip(("dq", "dk", "dv"), grads, g64[:3], glp[:3])), q.dtype)
    return grads


# ------------------------------------------------------------------ accuracy

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("W", [1, 7, 64, 1000])
def test_backward(W, D, dtype):
    """Random lists with -1 padding, a repeated key per row, entries Lk, Lk+3 and -3 (read
    nothing); odd lengths (Lq 37, Lk 517); G = 4; with grad_lse."""
    q, k, v, idx = TI._make(2, 8, 2, 37, 517, D, D, W, dtype, seed=D + W)
    check(q, k, v, idx)


@pytest.mark.parametrize("G", [1, 4, 8, 17])
def test_gqa(G):
    """Query heads per kv head: 1, 4, 8 and 17 (two 16-head groups in the dQ pass)."""
    q, k, v, idx = TI._make(1, 2 * G, 2, 45, 301, 128, 128, 100, torch.bfloat16, seed=G)
    check(q, k, v, idx)


@pytest.mark.parametrize("D", [64, 128])
def test_fully_padded_rows_and_unlisted_keys(D):
    """Rows whose entries are all -1 or out of range: dq exactly 0 (with grad_lse too);
    keys no list names: dk = dv = 0 exactly; W = 0: all gradients 0."""
    q, k, v, idx = TI._make(1, 4, 2, 50, 300, D, D, 40, torch.float16, seed=1)
    idx[:, :, 10:20] = -1
    idx[:, 0, 30] = 300
    idx[:, 1, 31] = torch.arange(-40, 0, device=DEV, dtype=idx.dtype)
    idx = torch.where(idx >= 250, -1, idx)             # keys 250-299 listed by nobody
    dq, dk, dv = check(q, k, v, idx)
    for heads, rows in ((slice(None), slice(10, 20)), (slice(0, 2), 30), (slice(2, 4), 31)):
        assert torch.all(dq[:, heads, rows] == 0)
    assert torch.all(dk[:, :, 250:] == 0) and torch.all(dv[:, :, 250:] == 0)
    _, (dq, dk, dv) = run(q, k, v, idx[..., :0])
    assert all(torch.all(t == 0) for t in (dq, dk, dv))


def test_duplicates_count_per_occurrence():
    """Lists drawn from 5 keys (long segments of repeats in the transposed lists)."""
    q, k, v, _ = TI._make(1, 4, 1, 33, 64, 128, 128, 1, torch.bfloat16, seed=2)
    idx = torch.randint(0, 5, (1, 1, 33, 96), device=DEV, dtype=torch.int32)
    idx[0, 0, 0, :3] = torch.tensor([3, 4, 3], device=DEV)
    idx[0, 0, 0, 3:] = -1
    check(q, k, v, idx)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("shape", [(2, 8, 33, 257), (1, 2, 33, 257), (2, 1, 1, 257),
                                   (1, 8, 33, 1)], ids=["full", "hkv_b1", "keys", "rows"])
def test_bias_read_softcap(shape, softcap):
    """A bias (read by the backward, no dbias) and softcap."""
    q, k, v, idx = TI._make(2, 8, 2, 33, 257, 64, 64, 100, torch.float16, seed=6)
    q = (q.float() * 3).half()
    bias = torch.randn(shape, device=DEV).half()
    check(q, k, v, idx, bias=bias, softcap=softcap)


def test_no_grad_lse():
    q, k, v, idx = TI._make(2, 4, 2, 40, 200, 64, 64, 30, torch.bfloat16, seed=12)
    check(q, k, v, idx, dlse=False)


def test_nan_in_unlisted_rows_reaches_no_gradient():
    """NaN in K and V at key 0, which no list names: every gradient finite, dk = dv = 0
    there."""
    torch.manual_seed(7)
    B, H, L, D, W = 1, 4, 65, 64, 9
    q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    k[:, :, 0] = math.nan
    v[:, :, 0] = math.nan
    idx = torch.randint(1, L, (B, H, L, W), device=DEV, dtype=torch.int32)
    idx[..., -2:] = -1
    _, (dq, dk, dv) = run(q, k, v, idx)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert torch.all(dk[:, :, 0] == 0) and torch.all(dv[:, :, 0] == 0)


# ------------------------------------------------------------------ determinism, layouts

@pytest.mark.parametrize("D", [64, 128])
def test_bitwise_deterministic(D):
    """Two runs (and a run after other work on the GPU) give bitwise the same dq, dk, dv:
    heavy key reuse (each key in ~500 lists, duplicates), G = 8."""
    q, k, v, _ = TI._make(2, 16, 2, 1024, 256, D, D, 1, torch.bfloat16, seed=13)
    idx = torch.randint(-1, 256, (2, 2, 1024, 128), device=DEV, dtype=torch.int32)
    first = run(q, k, v, idx)[1]
    torch.randn(1 << 24, device=DEV).sum()               # other work in between
    second = run(q, k, v, idx)[1]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_variant_kernels_are_bitwise_the_same(D, monkeypatch):
    """FLEXSPARSE_CUDA_DEBUG bit 34359738368 (the pipelined dQ pass the one-stage default
    replaced, kept for A/Bs). The arithmetic and its order are the default's: bitwise the
    same dq, dk, dv, with padding, out-of-range entries, duplicates, keys no list names
    and segments of every length mod the step (G = 1, 3, 8, 17; W below, at and above one
    16-key chunk); and the float64 rule holds."""
    for G, W, seed in ((1, 7, 1), (3, 40, 2), (8, 100, 3), (17, 16, 4)):
        q, k, v, idx = TI._make(2, 2 * G, 2, 61, 203, D, D, W, torch.bfloat16, seed=seed + D)
        idx[0, 1, 5] = -1
        idx[1, 0, 3, : min(W, 3)] = 7                     # duplicates of key 7
        idx = torch.where(idx >= 190, -1, idx)           # keys 190-202 listed by nobody
        monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
        fwd, want = run(q, k, v, idx)
        for bits in (34359738368,):
            monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", str(bits))
            got = cuda_backward(fwd[2], fwd[3], q, k, v, fwd[0], fwd[1], idx)
            for name, a, b in zip(("dq", "dk", "dv"), got, want):
                assert torch.equal(a, b), (name, G, W, bits)
    check(q, k, v, idx)


FMA_DKDV = "17179869184"   # the dK/dV pass on the CUDA cores, the default before C78


def dkdv_cases(D, dtype):
    """The dK/dV passes' test inputs: (G, W, q, k, v, idx) for G = 1, 3, 8, 17, 4 and W below,
    at and above a 16-pair step (segments of every length mod 16) and 1000 (Lq = 9), with
    padding, a fully padded row, out-of-range entries, duplicates of key 7 and keys
    190-202 listed by nobody."""
    for G, W, seed in ((1, 7, 1), (3, 40, 2), (8, 100, 3), (17, 16, 4), (4, 1000, 5)):
        Lq = 61 if W < 1000 else 9
        q, k, v, idx = TI._make(2, 2 * G, 2, Lq, 203, D, D, W, dtype, seed=seed + D)
        idx[0, 1, 5 % Lq] = -1
        idx[1, 0, 3, : min(W, 3)] = 7                     # duplicates of key 7
        idx = torch.where(idx >= 190, -1, idx)           # keys 190-202 listed by nobody
        yield G, W, q, k, v, idx


def check_default_beside(bits, G, W, q, k, v, idx, monkeypatch):
    """The default backward (the float64 rule, dk = dv = 0 at keys 190-202 that no list
    names, two runs bitwise equal) beside a run under FLEXSPARSE_CUDA_DEBUG `bits`, which
    shares its dQ pass (dq bitwise); returns the default's (dq, dk, dv) and the bit's."""
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", bits)
    fwd, want = run(q, k, v, idx)
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
    dq, dk, dv = check(q, k, v, idx)
    assert torch.equal(dq, want[0]), (G, W)
    assert torch.all(dk[:, :, 190:] == 0) and torch.all(dv[:, :, 190:] == 0)
    first = cuda_backward(fwd[2], fwd[3], q, k, v, fwd[0], fwd[1], idx)
    second = cuda_backward(fwd[2], fwd[3], q, k, v, fwd[0], fwd[1], idx)
    for a, b in zip(first, second):
        assert torch.equal(a, b), (G, W)
    return (dq, dk, dv), want


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_tensor_core_dkdv_pass(D, dtype, monkeypatch):
    """The dK/dV pass on the tensor cores (the default, C78): the float64 rule over G = 1,
    3, 8, 17 and W below, at and above a 16-pair step (segments of every length mod 16),
    padding, out-of-range entries, duplicates and keys no list names (dk = dv = 0 there);
    dq is the FMA kernel's (bit 17179869184) bit for bit (the same dQ pass), and two runs
    agree bitwise."""
    for G, W, q, k, v, idx in dkdv_cases(D, dtype):
        check_default_beside(FMA_DKDV, G, W, q, k, v, idx, monkeypatch)
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", FMA_DKDV)   # the FMA kernel, kept for A/Bs
    check(q, k, v, idx)


ONE_CHAIN = "68719476736"   # the tensor-core dK/dV pass with one [s dp] chain (before C80)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_short_chains_dkdv_pass(D, dtype, monkeypatch):
    """The default tensor-core dK/dV pass (C80: [s dp] in four accumulators, the gather's
    pointers read first) against the one-chain kernel of bit 68719476736. The float64 rule
    over the configurations of test_tensor_core_dkdv_pass and a bias with softcap, both
    kernels; dq bitwise the one-chain run's (the same dQ pass), dk and dv within bf16/fp16
    rounding of its (the [s dp] sums are added in another order), keys no list names zero,
    two runs bitwise equal."""
    for G, W, q, k, v, idx in dkdv_cases(D, dtype):
        (_, dk, dv), want = check_default_beside(ONE_CHAIN, G, W, q, k, v, idx, monkeypatch)
        for got, ref in ((dk, want[1]), (dv, want[2])):   # 2% of the tensor's scale
            err = (got.float() - ref.float()).abs().max().item()
            assert err <= 2e-2 * ref.float().abs().max().item() + 1e-3, (G, W, err)
    q, k, v, idx = TI._make(2, 8, 2, 33, 257, D, D, 100, dtype, seed=6)
    bias = torch.randn(2, 8, 33, 257, device=DEV).to(dtype)
    check(q, k, v, idx, bias=bias, softcap=5.0)
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", ONE_CHAIN)   # kept for A/Bs
    check(q, k, v, idx, bias=bias, softcap=5.0)


SCALAR_PREP = "137438953472"   # the preprocess with 2-byte loads (before C81)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_vector_prep(D, monkeypatch):
    """The default preprocess (C81): delta and lse2 from 16-byte loads, 256 / D rows per
    warp. The float64 rule (G = 1, 3, 17; an odd number of rows, so a warp's last row group
    is cut short; dlse given and not), and two runs bitwise equal. With an output that
    starts off 16-byte alignment (a contiguous view at element 1) the op takes the
    warp-per-row kernel: bitwise bit 137438953472's gradients (that kernel always), which
    also meet the float64 rule."""
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
    for G, W, seed, dlse in ((1, 7, 1, True), (3, 40, 2, False), (17, 16, 4, True)):
        q, k, v, idx = TI._make(1, 2 * G, 2, 61, 203, D, D, W, torch.bfloat16, seed=seed + D)
        check(q, k, v, idx, dlse=dlse)
        fwd, first = run(q, k, v, idx)
        second = cuda_backward(fwd[2], fwd[3], q, k, v, fwd[0], fwd[1], idx)
        for a, b in zip(first, second):
            assert torch.equal(a, b), (G, W)
    out, lse, do, gl = fwd
    shifted = torch.empty(out.numel() + 1, device=DEV, dtype=out.dtype)[1:].view(out.shape)
    shifted.copy_(out)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 != 0
    got = cuda_backward(do, gl, q, k, v, shifted, lse, idx)
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", SCALAR_PREP)
    want = cuda_backward(do, gl, q, k, v, out, lse, idx)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    check(q, k, v, idx, dlse=True)


ONE_STREAM = "549755813888"   # the transposed lists on the caller's stream (before C83)


def test_side_stream_lists(monkeypatch):
    """The default (C83): the transposed lists built on a second
    stream beside the preprocess and the dQ pass, joined before the dK/dV pass. The same
    kernels on the same data: bitwise bit 549755813888's gradients (one stream), on the
    default stream and on a side stream of the caller's; and a CUDA graph that captured the
    backward replays it with the lists (and dO) changed in place, equal to an eager run on
    the new values."""
    q, k, v, idx = TI._make(2, 8, 2, 61, 203, 128, 128, 40, torch.bfloat16, seed=3)
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", ONE_STREAM)
    fwd, want = run(q, k, v, idx)
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
    got = cuda_backward(fwd[2], fwd[3], q, k, v, fwd[0], fwd[1], idx)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(caller):
        got = cuda_backward(fwd[2], fwd[3], q, k, v, fwd[0], fwd[1], idx)
    torch.cuda.current_stream().wait_stream(caller)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    # captured: the lists, dO, out and lse as static inputs, changed in place (out and lse
    # to the new lists' forward) before the replay
    lists, do, out, lse = idx.clone(), fwd[2].clone(), fwd[0].clone(), fwd[1].clone()
    gl = fwd[3]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up outside the capture
        cuda_backward(do, gl, q, k, v, out, lse, lists)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.flexsparse.cuda_attention_backward(
            do, gl, q, k, v, out, lse, None, *MaskTensors(attn_indices=lists), 128, 128,
            q.shape[-1] ** -0.5, 0.0, False, False)
    new_lists = torch.randint(-1, 203, lists.shape, device=DEV, dtype=lists.dtype)
    new_out, new_lse = cuda_forward(q, k, v, new_lists)
    lists.copy_(new_lists)
    out.copy_(new_out)
    lse.copy_(new_lse)
    do.copy_(torch.randn_like(do))
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", ONE_STREAM)
    eager = cuda_backward(do, gl, q, k, v, new_out, new_lse, new_lists)
    for name, a, b in zip(("dq", "dk", "dv"), captured[:3], eager):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_tensor_core_dkdv_pass_bias_softcap_nan(softcap, monkeypatch):
    """The tensor-core dK/dV pass: a bias (read) and softcap; NaN in K and V at a key no
    list names reaches no gradient; all-padded lists give zero gradients."""
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
    q, k, v, idx = TI._make(2, 8, 2, 33, 257, 64, 64, 100, torch.float16, seed=6)
    q = (q.float() * 3).half()
    check(q, k, v, idx, bias=torch.randn(2, 8, 33, 257, device=DEV).half(), softcap=softcap)
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, 4, 65, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    k[:, :, 0] = math.nan
    v[:, :, 0] = math.nan
    idx = torch.randint(1, 65, (1, 4, 65, 9), device=DEV, dtype=torch.int32)
    idx[..., -2:] = -1
    _, (dq, dk, dv) = run(q, k, v, idx, softcap=softcap)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert torch.all(dk[:, :, 0] == 0) and torch.all(dv[:, :, 0] == 0)
    _, (dq, dk, dv) = run(q, k, v, torch.full_like(idx, -1))
    assert all(torch.all(t == 0) for t in (dq, dk, dv))


def test_index_layouts_int64_strided_broadcast():
    """int64 lists, a strided view and lists broadcast over batch and kv heads give bitwise
    the gradients of the same lists as contiguous int32 (one sorted list per (b, h))."""
    q, k, v, _ = TI._make(2, 8, 4, 70, 129, 128, 128, 1, torch.bfloat16, seed=4)
    wide = torch.randint(-1, 129, (1, 1, 70, 2 * 48), device=DEV)
    strided = wide[..., ::2]
    base = strided.to(torch.int32).expand(2, 4, 70, 48).contiguous()
    a = run(q, k, v, strided)[1]
    b = run(q, k, v, base)[1]
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    check(q, k, v, strided)


def test_strided_inputs():
    """q/k/v and dO in (B, L, H, D) layout (strided views) give bitwise the contiguous
    gradients."""
    torch.manual_seed(5)
    B, L, Hq, Hkv, D = 2, 97, 8, 2, 128
    q, k, v = (torch.randn(B, L, H, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
               for H in (Hq, Hkv, Hkv))
    idx = torch.randint(-1, L, (B, Hkv, L, 33), device=DEV, dtype=torch.int32)
    out, lse = cuda_forward(q, k, v, idx)
    do = torch.randn(B, L, Hq, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    got = cuda_backward(do, None, q, k, v, out, lse, idx)
    want = cuda_backward(do.contiguous(), None, q.contiguous(), k.contiguous(), v.contiguous(),
                         out, lse, idx)
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def test_matches_triton_backward():
    """The CUDA and Triton index backwards agree closely (both fp32 accumulation)."""
    q, k, v, idx = TI._make(2, 8, 2, 300, 1000, 128, 128, 64, torch.bfloat16, seed=14)
    (out, lse, do, gl), got = run(q, k, v, idx)
    want = ti.backward(do, gl, q, k, v, out, lse, None, MaskTensors(attn_indices=idx),
                       128 ** -0.5, 0.0, True, False)[:3]
    for name, x, y in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(x.float(), y.float(), atol=2e-2, rtol=2e-2, msg=name)


# ------------------------------------------------------------------ the switch

def spy_on_triton_backward(monkeypatch):
    """A list that gets "triton" each time the Triton index backward runs."""
    seen = []
    real = ti.backward

    def spy(*args, **kw):
        seen.append("triton")
        return real(*args, **kw)
    monkeypatch.setattr(ti, "backward", spy)
    return seen


def test_switch_routes_public_api(monkeypatch):
    """flexsparse.attention(backend="cuda"): Triton gradients by default,
    FLEXSPARSE_CUDA_INDEX_BWD=1 the CUDA ones (bitwise those of the op called directly);
    both against float64."""
    q, k, v, idx = TI._make(1, 8, 2, 65, 200, 128, 128, 48, torch.bfloat16, seed=8, oob=False)
    torch.manual_seed(9)
    do = torch.randn(1, 8, 65, 128, device=DEV, dtype=torch.bfloat16)
    seen = spy_on_triton_backward(monkeypatch)
    grads = {}
    for env in ("0", "1"):
        monkeypatch.setenv("FLEXSPARSE_CUDA_INDEX_BWD", env)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flexsparse.attention(*leaves, M.indices(idx), backend="cuda")
        grads[env] = torch.autograd.grad(out, leaves, do)
    assert seen == ["triton"]
    out, lse = cuda_forward(q, k, v, idx)
    direct = cuda_backward(do, None, q, k, v, out, lse, idx)
    for x, y in zip(grads["1"], direct):
        assert torch.equal(x, y)
    _, _, g64 = TI._grads(q, k, v, idx, None, 128 ** -0.5, 0.0, torch.float64, do, None)
    _, _, glp = TI._grads(q, k, v, idx, None, 128 ** -0.5, 0.0, torch.bfloat16, do, None)
    for env in ("0", "1"):
        TI._rule(list(zip(("dq", "dk", "dv"), grads[env], g64, glp)), torch.bfloat16)


def test_switch_keeps_dbias_on_triton(monkeypatch):
    """A bias that wants a gradient: the Triton backward even with the switch on."""
    monkeypatch.setenv("FLEXSPARSE_CUDA_INDEX_BWD", "1")
    q, k, v, idx = TI._make(1, 4, 2, 40, 100, 64, 64, 16, torch.float16, seed=15, oob=False)
    bias = torch.randn(1, 4, 40, 100, device=DEV, dtype=torch.float16, requires_grad=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flexsparse.attention(*leaves, M.indices(idx), bias=bias, backend="cuda")
    grads = torch.autograd.grad(out.float().sum(), leaves + [bias])
    assert all(torch.isfinite(g).all() for g in grads)
    do = torch.ones_like(out)              # (the loss above: out's sum)
    _, _, g64 = TI._grads(q, k, v, idx, bias, 64 ** -0.5, 0.0, torch.float64, do, None)
    _, _, glp = TI._grads(q, k, v, idx, bias, 64 ** -0.5, 0.0, torch.float16, do, None)
    TI._rule(list(zip(("dq", "dk", "dv", "dbias"), grads, g64, glp)), torch.float16)
    with pytest.raises(RuntimeError, match="no bias gradient"):
        torch.ops.flexsparse.cuda_attention_backward(
            torch.ones_like(out), None, q, k, v, out.detach(), torch.zeros(1, 4, 40, device=DEV),
            bias.detach(), *MaskTensors(attn_indices=idx), 128, 128, 0.125, 0.0, False, True)


def test_no_host_sync():
    """The backward (CSR build included) runs with no device-to-host sync."""
    q, k, v, idx = TI._make(1, 8, 2, 128, 512, 128, 128, 64, torch.bfloat16, seed=16)
    out, lse = cuda_forward(q, k, v, idx)
    do = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cuda_backward(do, None, q, k, v, out, lse, idx)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_deterministic_calls_take_the_cuda_backward(monkeypatch):
    """deterministic=True with backend="cuda" and no switch set: the CUDA index backward
    (the Triton one is never called), bitwise the same over two runs, within the
    FlashAttention rule of float64."""
    monkeypatch.delenv("FLEXSPARSE_CUDA_INDEX_BWD", raising=False)
    q, k, v, idx = TI._make(1, 8, 2, 97, 300, 128, 128, 40, torch.bfloat16, seed=21, oob=False)
    torch.manual_seed(22)
    do = torch.randn(1, 8, 97, 128, device=DEV, dtype=torch.bfloat16)
    seen = spy_on_triton_backward(monkeypatch)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flexsparse.attention(*leaves, M.indices(idx), backend="cuda", deterministic=True)
        runs.append(torch.autograd.grad(out, leaves, do))
    assert seen == []
    for x, y in zip(*runs):
        assert torch.equal(x, y)
    _, _, g64 = TI._grads(q, k, v, idx, None, 128 ** -0.5, 0.0, torch.float64, do, None)
    _, _, glp = TI._grads(q, k, v, idx, None, 128 ** -0.5, 0.0, torch.bfloat16, do, None)
    TI._rule(list(zip(("dq", "dk", "dv"), runs[0], g64, glp)), torch.bfloat16)


def test_hd256_group4_takes_the_cuda_backward(monkeypatch):
    """Head dim 256 with 4 query heads per kv head, no switch, not deterministic: the CUDA
    index backward (faster than Triton's atomic one on every row measured there,
    cuda_backend.INDEX_BWD_OVER_ATOMIC); the Triton one is never called; within the
    FlashAttention rule of float64. At 8 per kv head the Triton one still runs."""
    monkeypatch.delenv("FLEXSPARSE_CUDA_INDEX_BWD", raising=False)
    q, k, v, idx = TI._make(1, 8, 2, 97, 300, 256, 256, 40, torch.bfloat16, seed=23, oob=False)
    torch.manual_seed(24)
    do = torch.randn(1, 8, 97, 256, device=DEV, dtype=torch.bfloat16)
    seen = spy_on_triton_backward(monkeypatch)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flexsparse.attention(*leaves, M.indices(idx), backend="cuda")
    grads = torch.autograd.grad(out, leaves, do)
    assert seen == []
    _, _, g64 = TI._grads(q, k, v, idx, None, 256 ** -0.5, 0.0, torch.float64, do, None)
    _, _, glp = TI._grads(q, k, v, idx, None, 256 ** -0.5, 0.0, torch.bfloat16, do, None)
    TI._rule(list(zip(("dq", "dk", "dv"), grads, g64, glp)), torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k[:, :1], v[:, :1])]
    out = flexsparse.attention(*leaves, M.indices(idx[:, :1]), backend="cuda")
    torch.autograd.grad(out, leaves, do)
    assert seen == ["triton"]
