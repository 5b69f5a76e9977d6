"""The CUDA index forward (csrc/index_fwd.cu) on a Hopper GPU, and the CUDA backend's
index path (that forward, gradients from the Triton index backward).

Accuracy: the FlashAttention rule of test_triton_indices_gpu (error vs float64 within 2x
the same naive computation in the input dtype, plus a floor of 2 ulps at the tensors'
scale). K and V are views inside NaN-filled tensors and outputs land in allocator memory
filled with NaN first, so a read out of bounds or an element never written shows up.
Skipped without CUDA or without the built extension.

    FLEXSPARSE_GPU_TESTS=1 python -m pytest -q tests/gpu/test_cuda_index_gpu.py
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
from flexsparse.ops import MaskTensors, backends  # noqa: E402

if "cuda" not in backends.available():
    pytest.skip("flexsparse._C (csrc/) is not built", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
import test_triton_indices_gpu as TI  # noqa: E402

DEV = TI.DEV


def poison_allocator(*specs):
    """Hand freed blocks of NaN to the caching allocator, one per (shape, dtype), so that
    the next allocations of those sizes (the op's out and lse) likely start as NaN."""
    junk = [torch.full(shape, math.nan, dtype=dtype, device=DEV) for shape, dtype in specs]
    del junk


def cuda_forward(q, k, v, idx, bias=None, scale=None, softcap=0.0):
    """out, lse of the CUDA op itself (no Python checks in between), over poisoned memory."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    poison_allocator((q.shape, q.dtype), (q.shape[:3], torch.float32))
    return torch.ops.flexsparse.cuda_attention(q, k, v, bias, *MaskTensors(attn_indices=idx),
                                               128, 128, scale, softcap, False)


def check_forward(q, k, v, idx, bias=None, scale=None, softcap=0.0):
    """The CUDA forward against float64 (the FlashAttention rule); returns out, lse."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = cuda_forward(q, k, v, idx, bias, scale, softcap)
    o64, l64 = TI.naive(q, k, v, idx, bias, scale, softcap, torch.float64)
    olp, llp = TI.naive(q, k, v, idx, bias, scale, softcap, q.dtype)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    TI._rule([("out", out, o64, olp)], q.dtype)
    TI._rule([("lse", lse, l64, llp)], q.dtype)
    return out, lse


DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("W", [1, 7, 64, 1000])
def test_forward(W, D, dtype):
    """Random lists with -1 padding, a repeated key per row, entries Lk, Lk+3 and -3 (read
    nothing); odd lengths; G = 4."""
    q, k, v, idx = TI._make(2, 8, 2, 37, 517, D, D, W, dtype, seed=D + W)
    check_forward(q, k, v, idx)


@pytest.mark.parametrize("G", [1, 4, 8, 16, 17, 20, 33])
def test_gqa(G):
    """Query heads per kv head on both sides of the kernel's 16-head groups."""
    q, k, v, idx = TI._make(1, 2 * G, 2, 45, 301, 128, 128, 100, torch.bfloat16, seed=G)
    check_forward(q, k, v, idx)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("W", [0, 5, 16, 100])
def test_half_rows_and_the_kernel_before(D, W, monkeypatch):
    """G <= 8 takes the kernel that skips the tile's zero rows 8-15 and rescales O lazily;
    FLEXSPARSE_CUDA_DEBUG bit 536870912 the kernel before (all 16 rows, a rescale every
    chunk); bit 1073741824 adds 32-bit row addressing to either. All under the float64
    rule, with padding, out-of-range entries and a fully padded row; G = 3."""
    q, k, v, idx = TI._make(2, 6, 2, 41, 403, D, D, W, torch.bfloat16, seed=D + W)
    check = check_forward if W else cuda_forward       # (W = 0: every row fully masked)
    if W:
        idx[1, 0, 7] = -1
    rows = (slice(None), slice(None), slice(None)) if W == 0 else (1, slice(0, 3), 7)
    for bits in (None, "536870912", "1073741824", "1610612736"):
        if bits:
            monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", bits)
        out, lse = check(q, k, v, idx)
        assert torch.all(out[rows] == 0) and torch.all(lse[rows] == -math.inf)


@pytest.mark.parametrize("D", [64, 256])
def test_fully_padded_rows(D):
    """Rows whose entries are all -1 or out of range: out exactly 0, lse -inf; W = 0 too."""
    q, k, v, idx = TI._make(1, 4, 2, 50, 300, D, D, 40, torch.float16, seed=1)
    idx[:, :, 10:20] = -1
    idx[:, 0, 30] = 300                                 # only positions past Lk
    idx[:, 1, 31] = torch.arange(-40, 0, device=DEV, dtype=idx.dtype)
    out, lse = check_forward(q, k, v, idx)
    # (query heads, rows): kv head 0 serves query heads 0-1, kv head 1 heads 2-3
    for heads, rows in ((slice(None), slice(10, 20)), (slice(0, 2), 30), (slice(2, 4), 31)):
        assert torch.all(out[:, heads, rows] == 0)
        assert torch.all(lse[:, heads, rows] == -math.inf)
    out, lse = cuda_forward(q, k, v, idx[..., :0])
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_duplicates_count_per_occurrence():
    """Lists drawn from 5 keys (most entries repeat), and one row listing key 3 twice and
    key 4 once: weights 2:1."""
    q, k, v, _ = TI._make(1, 4, 1, 33, 64, 128, 128, 1, torch.bfloat16, seed=2)
    idx = torch.randint(0, 5, (1, 1, 33, 96), device=DEV, dtype=torch.int32)
    idx[0, 0, 0, :3] = torch.tensor([3, 4, 3], device=DEV)
    idx[0, 0, 0, 3:] = -1
    check_forward(q, k, v, idx)
    # row 0 on its own: weights e^{s3}·2 : e^{s4}
    out, _ = cuda_forward(q, k, v, idx)
    s = (q[0, :, 0].double() @ k[0, 0, [3, 4]].double().T) * 128 ** -0.5
    w = torch.softmax(s + torch.tensor([math.log(2), 0.0], device=DEV, dtype=torch.float64), -1)
    want = w @ v[0, 0, [3, 4]].double()
    torch.testing.assert_close(out[0, :, 0].double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_out_of_range_entries_read_nothing(idx_dtype):
    """Entries < 0 or >= Lk of any size (int64 past 2^31 too) give bitwise the result of -1
    there; the rows around K and V are NaN, so a read past them would show."""
    q, k, v, idx = TI._make(2, 4, 2, 40, 200, 64, 64, 50, torch.float16, seed=3, oob=False)
    idx = idx.to(idx_dtype)
    big = [200, 201, 2**31 - 1, -2, -2**31] + ([2**31, 2**40, -2**40] if idx_dtype == torch.int64
                                               else [])
    picks = torch.rand(idx.shape, device=DEV) < 0.3
    fill = torch.tensor(big, device=DEV, dtype=idx_dtype)[
        torch.randint(0, len(big), idx.shape, device=DEV)]
    bad = torch.where(picks, fill, idx)
    clean = torch.where(picks, torch.full_like(idx, -1), idx)
    a, la = cuda_forward(q, k, v, bad)
    b, lb = cuda_forward(q, k, v, clean)
    assert torch.equal(a, b) and torch.equal(la, lb)
    check_forward(q, k, v, bad)


def test_index_layouts_int64_strided_broadcast():
    """int64 lists, a strided view (every other slot), and lists broadcast over batch and
    kv heads (stride 0) give bitwise what the same lists give as contiguous int32."""
    q, k, v, _ = TI._make(2, 8, 4, 70, 129, 128, 128, 1, torch.bfloat16, seed=4)
    wide = torch.randint(-1, 129, (1, 1, 70, 2 * 48), device=DEV)
    strided = wide[..., ::2]                               # int64, stride 2 along W
    base = strided.to(torch.int32).contiguous()
    a, la = cuda_forward(q, k, v, strided)
    b, lb = cuda_forward(q, k, v, base.expand(2, 4, 70, 48).contiguous())
    assert torch.equal(a, b) and torch.equal(la, lb)
    check_forward(q, k, v, strided)


def test_strided_and_misaligned_inputs():
    """q/k/v in (B, L, H, D) layout (strided, read as they are) and misaligned views (not
    16-byte aligned: copied by the op) give bitwise the contiguous result."""
    torch.manual_seed(5)
    B, L, Hq, Hkv, D = 2, 97, 8, 2, 128
    q, k, v = (torch.randn(B, L, H, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
               for H in (Hq, Hkv, Hkv))
    idx = torch.randint(-1, L, (B, Hkv, L, 33), device=DEV, dtype=torch.int32)
    want = cuda_forward(q.contiguous(), k.contiguous(), v.contiguous(), idx)
    for got in (cuda_forward(q, k, v, idx),
                cuda_forward(*(torch.cat([t.flatten(), t.new_zeros(1)])[1:].view_as(t)
                               .copy_(t) for t in (q, k, v)), idx)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def strided_qkv(B, L, Hkv, G, D):
    """bf16 q, k, v (G query heads per kv head) as (B, H, L, D) views of (B, L, H, D)
    tensors: strided, as a model's projections give them."""
    return (torch.randn(B, L, H, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
            for H in (Hkv * G, Hkv, Hkv))


@pytest.mark.parametrize("G", [4, 12])
def test_narrow_addressing_is_bitwise_the_same(G, monkeypatch):
    """32-bit row addressing (the default; ignore-src copies for inactive slots) and the
    64-bit addressing of FLEXSPARSE_CUDA_DEBUG bit 1073741824 fetch rows differently with
    the same arithmetic: bitwise the same result, on strided (B, L, H, D) inputs with -1
    and out-of-range entries (both tile kinds: G = 4 half rows, G = 12 all 16)."""
    torch.manual_seed(6)
    B, L, Hkv, D = 2, 97, 2, 128
    q, k, v = strided_qkv(B, L, Hkv, G, D)
    idx = torch.randint(-1, L + 3, (B, Hkv, L, 40), device=DEV, dtype=torch.int32)
    want = cuda_forward(q, k, v, idx)
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "1073741824")
    got = cuda_forward(q, k, v, idx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("G", [3, 12])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_one_stage_and_pipelined_kernels(D, G, monkeypatch):
    """The default one-stage kernel (the query tile read from shared memory, twice the
    warps per SM) and the pipelined kernel of FLEXSPARSE_CUDA_DEBUG bit 2147483648 do the
    same arithmetic in the same order: bitwise the same results, with either addressing
    (bit 1073741824: 64-bit), and each against the kernel before C70 (bit 536870912) in
    the same kernel; on strided inputs with -1, out-of-range entries and a fully padded
    row, W below, at and above one chunk of 16 keys; and the float64 rule holds."""
    torch.manual_seed(8 + D + G)
    B, L, Hkv = 2, 75, 2
    q, k, v = strided_qkv(B, L, Hkv, G, D)
    for W in (1, 7, 16, 17, 100):
        idx = torch.randint(-1, L + 3, (B, Hkv, L, W), device=DEV, dtype=torch.int32)
        idx[1, 0, 7] = -1
        results = {}
        for bits in (0, 2147483648, 1073741824, 3221225472, 536870912, 2684354560):
            monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", str(bits))
            results[bits] = cuda_forward(q, k, v, idx)
        for bits, base in ((2147483648, 0), (1073741824, 0), (3221225472, 0),
                           (2684354560, 536870912)):
            got, want = results[bits], results[base]
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (W, bits)
        want = results[0]
        assert torch.all(want[0][1, :G, 7] == 0) and torch.all(want[1][1, :G, 7] == -math.inf)
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
    check_forward(q, k, v, idx[..., :16].contiguous())


ONE_ROW = "4294967296"   # one query row per warp, the default before C79


def assert_nan_key_stays_in_its_row(q, k, v, row):
    """Key 3's K and V rows NaN, listed by query row `row` only (9 keys per row from 4 up):
    that row's output is not finite, every other row's is (the rows a warp shares never
    sum each other's keys)."""
    B, Hkv, L = k.shape[:3]
    k, v = k.clone(), v.clone()
    k[:, :, 3] = math.nan
    v[:, :, 3] = math.nan
    idx = torch.randint(4, L, (B, Hkv, L, 9), device=DEV, dtype=torch.int32)
    idx[:, :, row, 0] = 3
    out, _ = cuda_forward(q, k, v, idx)
    assert (~torch.isfinite(out[:, :, row])).all()
    assert torch.isfinite(out[:, :, :row]).all() and torch.isfinite(out[:, :, row + 1:]).all()


@pytest.mark.parametrize("G", [1, 3, 8])
@pytest.mark.parametrize("D", [64, 128])
def test_two_rows_per_warp_is_bitwise_the_same(D, G, monkeypatch):
    """Two query rows per warp (the default at G <= 8, C79), each with its own keys, every
    output element computed as the one-row kernel (bit 4294967296) does: bitwise the
    same out and lse, on strided inputs with -1, out-of-range entries, a fully padded row
    next to a full one, an odd Lq (the last pair has no row B), W below, at and above one
    chunk; with a bias and softcap too; and the float64 rule holds. A NaN in K and V at a
    key only the neighbouring row lists stays in that row."""
    torch.manual_seed(11 + D + G)
    B, L, Hkv = 2, 75, 2
    q, k, v = strided_qkv(B, L, Hkv, G, D)
    for W in (1, 7, 16, 17, 100):
        idx = torch.randint(-1, L + 3, (B, Hkv, L, W), device=DEV, dtype=torch.int32)
        idx[1, 0, 7] = -1                                   # row 7 (a pair's row B) empty
        monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", ONE_ROW)
        want = cuda_forward(q, k, v, idx)
        monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
        got = cuda_forward(q, k, v, idx)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), W
        assert torch.all(got[0][1, :G, 7] == 0) and torch.all(got[1][1, :G, 7] == -math.inf)
    bias = torch.randn(B, Hkv * G, L, L, device=DEV, dtype=torch.bfloat16)
    for softcap in (0.0, 5.0):
        monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", ONE_ROW)
        want = cuda_forward(q, k, v, idx, bias, softcap=softcap)
        monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
        got = cuda_forward(q, k, v, idx, bias, softcap=softcap)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), softcap
    check_forward(q, k, v, idx[..., :16].contiguous())
    assert_nan_key_stays_in_its_row(q, k, v, 11)   # rows 10 and 11 share a warp


BIAS_SHAPES = {"full": (2, 8, 33, 257), "hkv_batch1": (1, 2, 33, 257), "keys": (2, 1, 1, 257),
               "rows_per_head": (1, 8, 33, 1)}


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("shape", list(BIAS_SHAPES))
def test_bias_softcap(shape, softcap):
    q, k, v, idx = TI._make(2, 8, 2, 33, 257, 64, 64, 100, torch.float16, seed=6)
    q = (q.float() * 3).half()
    bias = torch.randn(BIAS_SHAPES[shape], device=DEV).half()
    check_forward(q, k, v, idx, bias=bias, softcap=softcap)


def test_nan_in_unlisted_rows_reaches_no_output():
    """-1 padding reads nothing (issue 17): NaN in K, V and the bias at key 0, which no list
    names; the CUDA, Triton and reference backends agree."""
    torch.manual_seed(7)
    B, H, L, D, W = 1, 4, 65, 64, 9
    q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(B, H, L, L, device=DEV, dtype=torch.bfloat16)
    k[:, :, 0] = math.nan
    v[:, :, 0] = math.nan
    bias[..., 0] = math.nan
    idx = torch.randint(1, L, (B, H, L, W), device=DEV, dtype=torch.int32)
    idx[..., -2:] = -1
    idx[:, :, 5] = -1
    outs = {name: flexsparse.attention(q, k, v, M.indices(idx), bias=bias, backend=name)
            for name in ("cuda", "triton", "reference")}
    assert torch.isfinite(outs["cuda"]).all()
    assert torch.all(outs["cuda"][:, :, 5] == 0)
    for name in ("triton", "reference"):
        torch.testing.assert_close(outs["cuda"], outs[name], atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("D", [64, 128])
def test_public_api_forward_backward(D):
    """flexsparse.attention(backend="cuda") with gradients: the CUDA forward, the Triton
    index backward; out, lse, dq, dk, dv and dbias against float64."""
    q, k, v, idx = TI._make(1, 8, 2, 65, 200, D, D, 48, torch.bfloat16, seed=8 + D, oob=False)
    bias = torch.randn((1, 8, 65, 200), device=DEV, dtype=torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    out, lse = flexsparse.attention(*leaves[:3], M.indices(idx), bias=leaves[3], backend="cuda",
                                    return_lse=True)
    torch.manual_seed(9)
    do = torch.randn_like(out)
    dlse = torch.randn_like(lse)
    finite = torch.isfinite(lse)
    loss = (out.double() * do.double()).sum() + (torch.where(finite, lse, 0).double() * dlse).sum()
    grads = torch.autograd.grad(loss, leaves)
    bias_ref = bias.detach().clone().requires_grad_()
    scale = D ** -0.5
    o64, l64, g64 = TI._grads(q, k, v, idx, bias_ref, scale, 0.0, torch.float64, do, dlse)
    olp, llp, glp = TI._grads(q, k, v, idx, bias_ref, scale, 0.0, torch.bfloat16, do, dlse)
    TI._rule([("out", out, o64, olp)], torch.bfloat16)
    TI._rule([("lse", lse, l64, llp)], torch.bfloat16)
    TI._rule(list(zip(("dq", "dk", "dv", "dbias"), grads, g64, glp)), torch.bfloat16)


@pytest.mark.parametrize("index_bwd", ["default", "1"])
def test_compiled_forward_backward_one_frame(index_bwd, monkeypatch):
    """torch.compile(fullgraph=True) over backend="cuda" with an index mask, forward and
    backward: one frame, the gradients of the eager call; with the default backward and
    with the CUDA index backward forced (FLEXSPARSE_CUDA_INDEX_BWD=1, csrc/index_bwd.cu)."""
    if index_bwd == "1":
        monkeypatch.setenv("FLEXSPARSE_CUDA_INDEX_BWD", "1")
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("inductor")

    def loss(q, k, v, desc):
        return flexsparse.attention(q, k, v, desc, backend="cuda").float().square().sum()
    compiled = torch.compile(loss, backend=counter, fullgraph=True)

    q, k, v, idx = TI._make(1, 8, 2, 64, 256, 128, 128, 32, torch.bfloat16, seed=10, oob=False)
    desc = M.indices(idx).compile(1, 8, 2, 64, 256, device=DEV)
    grads = []
    for fn in (compiled, loss):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves, desc).backward()
        grads.append([t.grad for t in leaves])
    assert counter.frame_count == 1
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


def test_opcheck_forward():
    q, k, v, idx = TI._make(1, 4, 2, 40, 100, 64, 64, 20, torch.bfloat16, seed=11)
    k, v = k.contiguous(), v.contiguous()
    args = (q, k, v, None, *MaskTensors(attn_indices=idx), 128, 128, 0.125, 0.0, False)
    torch.library.opcheck(torch.ops.flexsparse.cuda_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("what", ["float32", "head_dim_96", "dv_differs"])
def test_unsupported_inputs_are_refused(what):
    """What the kernel does not run is a ValueError naming the backend (before any
    kernel); Triton runs the same inputs."""
    dtype = torch.float32 if what == "float32" else torch.bfloat16
    D = 96 if what == "head_dim_96" else 64
    q = torch.randn(1, 2, 16, D, device=DEV, dtype=dtype)
    v = torch.randn(1, 2, 16, 128 if what == "dv_differs" else D, device=DEV, dtype=dtype)
    idx = torch.randint(0, 16, (1, 2, 16, 4), device=DEV, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend: 'cuda' cannot run"):
        flexsparse.attention(q, q, v, M.indices(idx), backend="cuda")
    flexsparse.attention(q, q, v, M.indices(idx), backend="triton")
