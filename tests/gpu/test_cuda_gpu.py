"""The CUDA backend (csrc/, flexsparse._C) on a Hopper GPU, with the FlashAttention error
rule of test_triton_gpu.check: every mask kind, dtype and head dim against float64.
Skipped without CUDA or without the built extension."""
import math
import os
import re
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import flexsparse  # noqa: E402
from flexsparse import masks as M  # noqa: E402
from flexsparse.ops import backends  # noqa: E402

if "cuda" not in backends.available():
    pytest.skip("flexsparse._C (csrc/) is not built", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
import test_triton_gpu as T  # noqa: E402

from flexsparse.ops import cuda_backend  # noqa: E402

# Forward and backward against float64, where this build has the backward kernels.
BACKWARD = cuda_backend.has_backward()


def check(*args, backward=BACKWARD, **kw):
    return T.check(*args, backend="cuda", backward=backward, **kw)


def needs_backward():
    """Tests about the backward kernels skip, rather than pass on the forward alone, on a
    build without them (check() compares only out and lse there)."""
    if not BACKWARD:
        pytest.skip("this flexsparse._C has no CUDA backward kernels")


def fa_rule(got, q, k, v, vis, bias, scale):
    """got (low precision) against float64 dense attention, within 2x the error of the same
    dense attention run in got's dtype, plus test_triton_gpu's floor (the FlashAttention
    rule)."""
    f64 = [t.double() for t in (q, k, v)]
    ref = T.dense_attention(*f64, vis, None if bias is None else bias.double(), scale, 0.0, False)[0]
    low = T.dense_attention(q, k, v, vis, bias, scale, 0.0, True)[0]
    err = (got.double() - ref).abs().max().item()
    err_lo = (low.double() - ref).abs().max().item()
    assert err <= 2 * err_lo + T.FLOOR, f"error {err:.3e} > 2 x {err_lo:.3e} + {T.FLOOR}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", T.KINDS)
def test_mask_kinds(kind, dtype):
    B, Hq, Hkv, L = 2, 4, 2, 1000
    torch.manual_seed(hash(kind) % 1000)
    check(B, Hq, Hkv, L, L, 128, T.mask_kinds(B, Hkv, L)[kind], dtype)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_row_max_moving_over_tiles(D, dtype):
    """The forward subtracts a row's old max until a tile's max exceeds it by more than 8
    (log2 units; lazy rescaling): keys whose scores grow along the sequence (a ramp, and a
    jump at key 1500 that every row sees) move the max on later tiles, by less and by more
    than that margin, and keys of large scores first (key 0..99) keep it from moving. Full
    and causal, against float64."""
    torch.manual_seed(D)
    B, Hq, Hkv, L = 1, 4, 2, 2000
    q = torch.randn(B, Hq, L, D, device=T.DEV)
    k = torch.randn(B, Hkv, L, D, device=T.DEV)
    ramp = torch.linspace(0.5, 3.0, L, device=T.DEV)
    ramp[1500:] *= 4.0
    ramp[:100] = 6.0
    k = k * ramp[:, None]
    v = torch.randn(B, Hkv, L, D, device=T.DEV)
    for mask in (None, M.causal()):
        check(B, Hq, Hkv, L, L, D, mask, dtype, inputs=(q, k, v))


def test_block_size_below_tile_is_refused():
    """A descriptor of 64-token blocks is finer than the kernel's 128-row query tile."""
    q = torch.randn(1, 2, 256, 128, device=T.DEV, dtype=torch.float16)
    with pytest.raises(ValueError, match="block size"):
        flexsparse.attention(q, q, q, M.causal(), backend="cuda", block_size=(64, 64))


def test_error_inside_the_op_reaches_python():
    """A check inside the C++ op raises RuntimeError (the dispatcher path, no Python check)."""
    q = torch.randn(1, 2, 256, 128, device=T.DEV, dtype=torch.float16)
    desc = M.causal().compile(1, 2, 2, 256, 256, device=T.DEV, block_size=(64, 64))
    with pytest.raises(RuntimeError, match="block size"):
        torch.ops.flexsparse.cuda_attention(q, q, q, None, *desc.mask_tensors(), 64, 64, 0.1, 0.0,
                                            False)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_head_dims(D):
    torch.manual_seed(D)
    check(1, 4, 2, 700, 700, D, M.causal(), torch.bfloat16)
    check(1, 2, 2, 389, 389, D, M.document([100, 200, 89]), torch.float16)


@pytest.mark.parametrize("kind", T.KINDS)
def test_mask_kinds_hd256(kind):
    """Head dim 256 has its own backward layout (64-key CTAs, P^T and dS^T through shared
    memory): every mask kind, with GQA and a length that is no multiple of the tiles."""
    needs_backward()
    B, Hq, Hkv, L = 1, 4, 2, 700
    torch.manual_seed(hash(kind) % 1000 + 256)
    check(B, Hq, Hkv, L, L, 256, T.mask_kinds(B, Hkv, L)[kind], torch.bfloat16)


def test_hd256_bias_softcap_and_64_key_blocks():
    """Head dim 256 through the general backward kernel (trainable bias, softcap), and a
    descriptor of 64-key blocks, which the hd256 kernels take (64 keys per CTA)."""
    needs_backward()
    torch.manual_seed(2560)
    check(1, 2, 2, 500, 500, 256, M.document([200, 300]), torch.float16, softcap=20.0,
          bias_shape=(1, 2, 500, 500))
    desc = M.sliding_window(150).compile(1, 2, 1, 600, 600, device=T.DEV, block_size=(128, 64))
    check(1, 2, 1, 600, 600, 256, None, torch.bfloat16, desc=desc)


@pytest.mark.skipif(not BACKWARD, reason="no CUDA backward kernels in this build")
def test_unsupported_backward_refused_before_running():
    """With grad wanted, what the CUDA backward cannot do (here 64-key blocks at head dim
    128) is a ValueError naming the backend before the forward runs, not a failure in
    backward()."""
    q = torch.randn(1, 2, 256, 128, device=T.DEV, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="backend: 'cuda'"):
        flexsparse.attention(q, q, q, M.causal(), backend="cuda", block_size=(128, 64))


@pytest.mark.skipif(not BACKWARD, reason="no CUDA backward kernels in this build")
@pytest.mark.parametrize("kind", ["causal", "document", "block_sparse", "causal_hd256",
                                  "causal_hd64"])
def test_deterministic_backward_bitwise(kind):
    """deterministic=True: dQ is added in key-tile order, so two runs agree bit for bit
    (GQA: several query heads per CTA; block 256 keys: two key tiles per block; hd64: the
    128-row steps, whose warpgroups split dQ by rows); and the gradients pass the float64
    check."""
    torch.manual_seed(5)
    B, Hq, Hkv, L = 2, 4, 2, 1500
    D = 256 if kind.endswith("hd256") else 64 if kind.endswith("hd64") else 128
    mask = T.mask_kinds(B, Hkv, L)[kind.split("_hd")[0]]
    check(B, Hq, Hkv, L, L, D, mask, torch.bfloat16, deterministic=True)
    desc = mask.compile(B, Hq, Hkv, L, L, device=T.DEV, block_size=(128, 256)) \
        if kind != "block_sparse" else mask.compile(B, Hq, Hkv, L, L, device=T.DEV)
    q = torch.randn(B, Hq, L, D, device=T.DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device=T.DEV, dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    runs = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flexsparse.attention(*leaves, desc, backend="cuda", deterministic=True)
        runs.append(torch.autograd.grad(out, leaves, do))
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    for a, b in zip(runs[0], runs[2]):
        assert torch.equal(a, b)


@pytest.mark.skipif(not BACKWARD, reason="no CUDA backward kernels in this build")
def test_backward_matches_triton_on_random_descriptors():
    """Random block layouts with random partial bitmaps and column ranges: CUDA gradients
    agree with Triton's (both against float64 in check())."""
    g = torch.Generator(device="cpu").manual_seed(11)
    for trial in range(6):
        L = int(torch.randint(200, 900, (1,), generator=g))
        nb = -(-L // 128)
        layout = torch.rand(1, 2, nb, nb, generator=g) < 0.5
        layout |= torch.eye(nb, dtype=torch.bool)
        cr = torch.randint(0, L + 1, (1, 2, L, 2), generator=g).sort(-1).values
        mask = M.and_(M.block_sparse(layout.to(T.DEV), 128),
                      M.column_ranges(cr.to(T.DEV), causal=bool(trial % 2)))
        torch.manual_seed(trial)
        check(1, 4, 2, L, L, (128, 128, 64, 64, 256, 256)[trial], mask,
              torch.bfloat16 if trial % 2 else torch.float16)


@pytest.mark.skipif(not BACKWARD, reason="no CUDA backward kernels in this build")
def test_opcheck_backward():
    torch.manual_seed(9)
    B, H, L, D = 1, 2, 300, 64
    q, k, v, do = (torch.randn(B, H, L, D, device=T.DEV, dtype=torch.bfloat16) for _ in range(4))
    bias = torch.randn(1, H, L, L, device=T.DEV, dtype=torch.bfloat16)
    desc = M.causal().compile(B, H, H, L, L, device=T.DEV)
    tail = (*desc.block_size, 0.125, 0.0, False)
    out, lse = torch.ops.flexsparse.cuda_attention(q, k, v, bias, *desc.mask_tensors(), *tail)
    args = (do, None, q, k, v, out, lse, bias, *desc.mask_tensors(), *tail, True)
    torch.library.opcheck(torch.ops.flexsparse.cuda_attention_backward.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(not BACKWARD, reason="no CUDA backward kernels in this build")
def test_compiled_training_step_one_frame():
    """A compiled forward + backward with backend='cuda' over three lengths: one frame,
    gradients as Triton's."""
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def loss(q, k, v, desc):
        return flexsparse.attention(q, k, v, desc, backend="cuda").float().square().sum()

    def grads(backend, dtype, desc, base):
        xs = [t.detach().to(dtype).clone().requires_grad_() for t in base]
        fn = loss if backend == "cuda" else (
            lambda q, k, v, d: flexsparse.attention(q, k, v, d, backend=backend).float().square().sum())
        fn(*xs, desc).backward()
        return [x.grad.double() for x in xs]

    for L in (300, 517, 1024):
        torch.manual_seed(L)
        base = [torch.randn(1, 4, L, 128, device=T.DEV, dtype=torch.bfloat16) for _ in range(3)]
        desc = M.causal().compile(1, 4, 4, L, L, device=T.DEV)
        got = grads("cuda", torch.bfloat16, desc, base)
        lowp = grads("triton", torch.bfloat16, desc, base)
        exact = grads("reference", torch.float64, desc, base)
        # The FlashAttention rule: within 2x (plus a floor) of a bf16 kernel's own error.
        for name, g, w, e in zip("qkv", got, lowp, exact):
            err, ref_err = (g - e).abs().max().item(), (w - e).abs().max().item()
            assert err <= 2 * ref_err + 1e-2, f"d{name} at L={L}: {err} vs triton {ref_err}"
    assert counter.frame_count == 1


@pytest.mark.parametrize("Lq,Lk", [(300, 1000), (1000, 300), (1, 513), (777, 777), (128, 128)])
def test_odd_lengths(Lq, Lk):
    torch.manual_seed(Lq * 7 + Lk)
    check(1, 2, 1, Lq, Lk, 64, M.causal(), torch.bfloat16)
    check(1, 2, 1, Lq, Lk, 128, None, torch.float16)


@pytest.mark.parametrize("Hq,Hkv", [(8, 1), (6, 2)])
def test_gqa(Hq, Hkv):
    torch.manual_seed(Hq)
    check(2, Hq, Hkv, 600, 600, 128, M.sliding_window(150), torch.bfloat16)


@pytest.mark.parametrize("shape", list(T.BIAS))
def test_bias(shape):
    torch.manual_seed(len(shape))
    check(2, 4, 2, 600, 600, 64, M.causal(), torch.bfloat16, bias_shape=T.BIAS[shape])


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("mask", ["causal", "document", "sliding"])
def test_bias_tiles(mask, D):
    """The backward that moves bias and dbias tiles by TMA (BwdTraits::kBiasTiles: keys
    contiguous, 16-byte rows, so L % 8 == 0) and zeroes dbias where the descriptor lists no
    block: GQA, a length no tile divides, key blocks of 256 (two CTAs per block)."""
    needs_backward()
    torch.manual_seed(D + len(mask))
    B, Hq, Hkv, L = 2, 4, 2, 904
    m = {"causal": M.causal(), "document": M.document([300, 411, 193]),
         "sliding": M.sliding_window(170)}[mask]
    desc = m.compile(B, Hq, Hkv, L, L, device=T.DEV, block_size=(128, 256))
    check(B, Hq, Hkv, L, L, D, m, torch.bfloat16, bias_shape=(B, Hq, L, L), desc=desc)
    check(B, Hq, Hkv, L, L, D, m, torch.float16, bias_shape=(1, Hkv, L, L))


@pytest.mark.parametrize("D", [64, 128])
def test_forward_bias_tiles(D, monkeypatch):
    """The forward's bias tiles (FwdTraits::kBiasTiles: TMA into shared memory, ldmatrix into
    the score fragments), which biased calls take where the bias rows allow TMA: masks with
    partial tiles, GQA with an Hkv-head bias, a length no tile divides (L % 8 == 0 for TMA),
    fully masked rows. Small enough that the bias sits in L2, where the buffer's reuse
    raced once (docs/perf-notes.md C49). The default is the overlapped schedule (C51); the
    serial one (FLEXSPARSE_CUDA_DEBUG bit 32) and the per-score-load kernel (bit 65536) on
    the same inputs too. L = 904 leaves the last query tile's second half past Lq (its
    bias half is not loaded)."""
    torch.manual_seed(D + 1)
    B, Hq, Hkv, L = 2, 4, 2, 904
    for m in (M.causal(), M.document([300, 411, 193]), M.sliding_window(170)):
        check(B, Hq, Hkv, L, L, D, m, torch.bfloat16, bias_shape=(B, Hq, L, L))
    # (the default above is the plain build of the tensor-core bias kernel; bit 1024: the
    # general build)
    for bits in ("32", "65536", "1024"):
        with monkeypatch.context() as mp:
            mp.setenv("FLEXSPARSE_CUDA_DEBUG", bits)
            check(B, Hq, Hkv, L, L, D, M.document([300, 411, 193]), torch.bfloat16,
                  bias_shape=(B, Hq, L, L))
            if bits == "1024":
                check(B, Hq, Hkv, L, L, D, M.causal(), torch.float16, bias_shape=(1, Hkv, L, L))
    check(1, Hq, Hkv, L, L, D, M.causal(), torch.float16, bias_shape=(1, Hkv, L, L))
    dm = torch.rand(1, 2, 400, 400, device=T.DEV) < 0.5
    dm[:, :, 100:250] = False
    out, lse = check(1, 2, 2, 400, 400, D, M.dense(dm), torch.float16, bias_shape=(1, 2, 400, 400))[:2]
    assert torch.all(out[:, :, 100:250] == 0) and torch.all(lse[:, :, 100:250] == -float("inf"))


@pytest.mark.parametrize("D", [64, 128])
def test_forward_bias_infinities(D, monkeypatch):
    """A bias with -inf entries (a mask passed as a bias). The overlapped forward adds the
    bias on the tensor cores (FwdTraits::kBiasMma), where an infinite entry times the
    identity's zeros is NaN: the work tiles where a NaN score shows are queued and run
    again by the serial kernel (docs/perf-notes.md C52). Scattered -inf entries (most work
    tiles), rows that the bias hides wholly (0 / -inf), a head without any (not redone),
    and the redo pass switched off (FLEXSPARSE_CUDA_DEBUG bit 131072) must differ."""
    torch.manual_seed(D + 7)
    B, Hq, Hkv, L = 1, 4, 2, 904
    bias = torch.randn(B, Hq, L, L, device=T.DEV)
    bias[:, :3][torch.rand(B, 3, L, L, device=T.DEV) < 0.01] = -float("inf")
    bias[:, 1, 300:420] = -float("inf")
    out, lse = check(B, Hq, Hkv, L, L, D, M.causal(), torch.bfloat16, bias=bias)[:2]
    assert torch.all(out[:, 1, 300:420] == 0) and torch.all(lse[:, 1, 300:420] == -float("inf"))
    # Without the redo pass the tiles with infinities keep NaN: the queue is what fixes them.
    q, k, v = (torch.randn(B, h, L, D, device=T.DEV, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "131072")
    raw = flexsparse.attention(q, k, v, M.causal(), bias=bias.bfloat16(), backend="cuda")
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG")
    fixed = flexsparse.attention(q, k, v, M.causal(), bias=bias.bfloat16(), backend="cuda")
    assert torch.isnan(raw[:, :3]).any() and not torch.isnan(fixed).any()
    torch.testing.assert_close(raw[:, 3], fixed[:, 3], atol=0, rtol=0)


@pytest.mark.parametrize("scale", [0.1, 0.07])
def test_forward_bias_scales(scale):
    """The overlapped bias forward multiplies the bias by a 16-bit 1 / scale on the tensor
    cores (FwdTraits::kBiasMma): 1 / 0.1 = 10 is exact there, 1 / 0.07 is not within 2^-12
    of a bf16 value and takes the serial kernel (fwd_bias_mma_ok). Both against Triton and
    against float64 (the FlashAttention rule)."""
    torch.manual_seed(int(scale * 100))
    B, H, L, D = 1, 2, 520, 128
    q, k, v = (torch.randn(B, H, L, D, device=T.DEV, dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(B, H, L, L, device=T.DEV, dtype=torch.bfloat16)
    got = flexsparse.attention(q, k, v, M.causal(), bias=bias, scale=scale, backend="cuda")
    want = flexsparse.attention(q, k, v, M.causal(), bias=bias, scale=scale, backend="triton")
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    causal = torch.ones(L, L, dtype=torch.bool, device=T.DEV).tril()[None, None]
    fa_rule(got, q, k, v, causal, bias, scale)


def _hand_nan_blocks(shape):
    """Leave NaN-filled bf16 blocks of `shape` in the caching allocator, for the next
    allocations of that size (dbias): an entry the kernel does not write stays NaN."""
    poison = [torch.full(shape, float("nan"), device=T.DEV, dtype=torch.bfloat16)
              for _ in range(4)]
    del poison


def _bias_grads(q, k, v, bias, desc, dout, backend):
    q, k, v, bias = (t.detach().requires_grad_() for t in (q, k, v, bias))
    out = flexsparse.attention(q, k, v, desc, bias=bias, backend=backend)
    return torch.autograd.grad(out, (q, k, v, bias), dout)


def test_bias_tiles_write_every_dbias_entry(monkeypatch):
    """dbias is allocated uninitialised: the bias-tile kernel must write every entry, zeros
    in the blocks the descriptor skips. The caching allocator is handed NaN-filled blocks of
    dbias's size first; the result must equal the general kernel's (FLEXSPARSE_CUDA_DEBUG
    bit 512, after its memset) and be exactly 0 wherever the mask hides a score."""
    torch.manual_seed(11)
    B, H, L, D = 1, 2, 1024, 128
    q, k, v = (torch.randn(B, H, L, D, device=T.DEV, dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(B, H, L, L, device=T.DEV, dtype=torch.bfloat16)
    dout = torch.randn(B, H, L, D, device=T.DEV, dtype=torch.bfloat16)
    desc = M.document([300, 500, 224]).compile(B, H, H, L, L, device=T.DEV)
    _hand_nan_blocks((B, H, L, L))
    got = _bias_grads(q, k, v, bias, desc, dout, "cuda")
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "512")
    general = _bias_grads(q, k, v, bias, desc, dout, "cuda")
    dbias = got[3]
    assert torch.isfinite(dbias).all()
    assert torch.all(dbias[~desc.to_dense().expand(B, H, L, L)] == 0)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, general):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("D", [64, 128])
def test_bias_tiles_store_hints_write_what_copy_writes(D, monkeypatch):
    """The bias-tile backward stores dbias tiles through tma_store (sm90_utils.cuh: a
    hand-written TMA store with an L2 hint, box by box) unless FLEXSPARSE_CUDA_DEBUG bit
    2097152 sends them through CuTe's copy; its zeros are plain streaming stores either way.
    The hint changes no value: dbias, dk and dv are bitwise equal (dq's reductions are not
    ordered, so it is compared loosely). GQA, a length no tile divides, key blocks of 256
    (two boxes per dbias tile at hd128), and NaN-filled memory handed to dbias, so that a
    missed zero shows."""
    torch.manual_seed(D + 5)
    B, Hq, Hkv, L = 1, 4, 2, 904
    q = torch.randn(B, Hq, L, D, device=T.DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device=T.DEV, dtype=torch.bfloat16) for _ in range(2))
    bias = torch.randn(B, Hq, L, L, device=T.DEV, dtype=torch.bfloat16)
    dout = torch.randn(B, Hq, L, D, device=T.DEV, dtype=torch.bfloat16)
    desc = M.document([300, 411, 193]).compile(B, Hq, Hkv, L, L, device=T.DEV, block_size=(128, 256))

    def grads():
        _hand_nan_blocks((B, Hq, L, L))
        return _bias_grads(q, k, v, bias, desc, dout, "cuda")

    hinted = grads()
    assert torch.all(hinted[3][~desc.to_dense().expand(B, Hq, L, L)] == 0)
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "2097152")
    plain = grads()
    for name, a, b in zip(("dk", "dv", "dbias"), hinted[1:], plain[1:]):
        assert torch.equal(a, b), name
    torch.testing.assert_close(hinted[0], plain[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_backward_preprocess_variants_agree(D, monkeypatch):
    """The backward's preprocess (delta, lse in log2 units, dq_accum zeroed) has a wide
    version (16-byte pieces, kHeadDim / 8 threads per row; the default), the older
    one-warp-per-row one (FLEXSPARSE_CUDA_DEBUG bit 33554432) and the wide one with
    dq_accum zeroed by cudaMemsetAsync (bit 67108864). The workspace is handed NaN-filled
    memory first, so a row the zeroing misses shows. A length no tile divides, GQA, and a
    gradient through lse as well (delta subtracts it): dk and dv equal bitwise, dq (whose
    reductions are unordered) closely for the memset variant, which runs the same wide
    kernel; the old kernel sums delta in another order, so its gradients agree to rounding;
    all of them agree with float64."""
    torch.manual_seed(D + 17)
    B, Hq, Hkv, L = 2, 4, 2, 777
    q = torch.randn(B, Hq, L, D, device=T.DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device=T.DEV, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn(B, Hq, L, D, device=T.DEV, dtype=torch.bfloat16)
    dlse = torch.randn(B, Hq, L, device=T.DEV, dtype=torch.float32)
    desc = M.document([300, 280, 197]).compile(B, Hq, Hkv, L, L, device=T.DEV)

    def grads(inputs, backend="cuda"):
        qq, kk, vv = (t.detach().requires_grad_() for t in inputs)
        out, lse = flexsparse.attention(qq, kk, vv, desc, backend=backend, return_lse=True)
        return torch.autograd.grad((out, lse), (qq, kk, vv), (dout.to(out.dtype), dlse.to(lse.dtype)))

    results = {}
    for bits in ("0", "33554432", "67108864"):
        monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", bits)
        torch.empty(2 * B * Hq * 896 * (D + 2), device=T.DEV).fill_(float("nan"))   # freed: reused
        results[bits] = grads((q, k, v))
    for name, a, b in zip(("dk", "dv"), results["0"][1:], results["67108864"][1:]):
        assert torch.equal(a, b), name
    for bits in ("33554432", "67108864"):
        for name, a, b in zip(("dq", "dk", "dv"), results["0"], results[bits]):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=f"{bits} {name}")
    ref = grads((q.double(), k.double(), v.double()), backend="reference")
    for name, a, r in zip(("dq", "dk", "dv"), results["0"], ref):
        assert torch.isfinite(a).all(), name
        err = (a.double() - r).norm() / r.norm()
        assert err < 2e-2, (name, err.item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind,Lq,Lk", [("full", 1000, 1000), ("full", 193, 700), ("full", 1, 300),
                                        ("full", 2000, 517), ("causal", 1000, 1000),
                                        ("document", 777, 777), ("sliding", 900, 900),
                                        ("column_ranges", 1000, 1000)])
def test_three_warpgroup_forward(kind, Lq, Lk, dtype, monkeypatch):
    """Head dim 64's plain forward takes 192-row work tiles (three consumer warpgroups)
    where the descriptor's query blocks hold whole ones (block_q a multiple of 192): the
    full mask and masks with partial tiles (staged column ranges, by key and by slot),
    compiled at 384-row query blocks. Against float64 with GQA and lengths no tile
    divides, and against the two-warpgroup kernel (FLEXSPARSE_CUDA_DEBUG bit 134217728)."""
    torch.manual_seed(hash((kind, Lq, Lk)) % 1000)
    B, Hq, Hkv, D = 2, 4, 2, 64
    mask = M.full() if kind == "full" else T.mask_kinds(B, Hkv, Lq)[kind]
    desc = mask.compile(B, Hq, Hkv, Lq, Lk, device=T.DEV, block_size=(384, 128))
    q = torch.randn(B, Hq, Lq, D, device=T.DEV)
    k, v = (torch.randn(B, Hkv, Lk, D, device=T.DEV) for _ in range(2))
    three = check(B, Hq, Hkv, Lq, Lk, D, None, dtype, desc=desc, inputs=(q, k, v), backward=False)
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "134217728")
    two = flexsparse.attention(q.to(dtype), k.to(dtype), v.to(dtype), desc, backend="cuda",
                               return_lse=True)
    torch.testing.assert_close(three[0], two[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(three[1], two[1], atol=1e-4, rtol=1e-4)


def _consumer_warpgroups(fn):
    """The consumer warpgroup counts of the CUDA forward kernels that fn() launches, read
    from their names (FwdTraits' last template argument)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "fwd_kernel<" in e.name]
    # FwdTraits<Element, kHeadDim, kBlockN, kStages, kOverlap, kConsumerRegs, kTmaStore,
    # kPlain, kBiasTiles, kConsumerWarpgroups, kQBuffers>: the tenth argument
    return {int(re.search(r"FwdTraits<([^<>]*)>", n).group(1).split(",")[9]) for n in names}


@pytest.mark.parametrize("Lq,Lk", [(1000, 1000), (193, 700), (2000, 517), (129, 64)])
def test_full_mask_takes_three_warpgroups_at_default_blocks(Lq, Lk, monkeypatch):
    """The full mask's kv lists are one row expanded (stride 0), which the host reads as
    "every query row reads the same lists": head dim 64's forward then takes 192-row work
    tiles over the default 128-row descriptor blocks. The kernel names say which ran; the
    results match float64 and the two-warpgroup kernel. A causal descriptor (rows differ)
    keeps two warpgroups."""
    torch.manual_seed(Lq + Lk)
    B, Hq, Hkv, D = 2, 4, 2, 64
    desc = M.full().compile(B, Hq, Hkv, Lq, Lk, device=T.DEV)
    assert desc.block_size == (128, 128) and desc.kv_full_count.stride(2) == 0
    q = torch.randn(B, Hq, Lq, D, device=T.DEV)
    k, v = (torch.randn(B, Hkv, Lk, D, device=T.DEV) for _ in range(2))
    qh, kh, vh = (t.to(torch.bfloat16) for t in (q, k, v))
    call = lambda d: flexsparse.attention(qh, kh, vh, d, backend="cuda", return_lse=True)  # noqa: E731
    assert _consumer_warpgroups(lambda: call(desc)) == {3}
    three = check(B, Hq, Hkv, Lq, Lk, D, None, torch.bfloat16, desc=desc, inputs=(q, k, v),
                  backward=False)
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "134217728")
    assert _consumer_warpgroups(lambda: call(desc)) == {2}
    two = call(desc)
    torch.testing.assert_close(three[0], two[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(three[1], two[1], atol=1e-4, rtol=1e-4)
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG")
    causal = M.causal().compile(B, Hq, Hkv, Lq, Lk, device=T.DEV)
    assert _consumer_warpgroups(lambda: call(causal)) == {2}


# Under compute-sanitizer (tests/gpu.sh sets this) the profiler records no kernels: the
# sanitizer holds CUPTI. The tests that read kernel names then check the numbers only; the
# suite's unsanitized run checks the names.
UNDER_SANITIZER = os.environ.get("FLEXSPARSE_UNDER_SANITIZER") == "1"


def _kernel_names(fn, kernel):
    """fn()'s result and the names of the CUDA kernels `kernel<...>` it launched."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, [e.name for e in prof.events() if kernel + "<" in e.name]


def _bwd_kernel_names(fn):
    return _kernel_names(fn, "bwd_kernel")


def _fwd_kernel_names(fn):
    return _kernel_names(fn, "fwd_kernel")


def _bwd_step_rows(fn):
    """The query-step sizes of the CUDA backward kernels that fn() launches, read from
    their names (BwdTraits' fourth template argument)."""
    _, names = _bwd_kernel_names(fn)
    return {int(re.search(r"BwdTraits<[^,]+, \d+, \d+, (\d+)", n).group(1)) for n in names}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("Lq,Lk", [(1000, 1000), (200, 700), (2000, 517), (300, 129), (1280, 256)])
def test_full_mask_backward_80_row_steps(Lq, Lk, dtype, monkeypatch):
    """The full mask's kv and q lists are one row expanded (stride 0), which the host reads
    as "the block state is one value": head dim 128's backward then walks every query row
    in 80-row steps (dQ transposed; perf-notes C109), and with FLEXSPARSE_CUDA_DEBUG bit
    268435456 in the 64-row steps of the other masks. The kernel names say which ran; the
    gradients match float64 and the 64-row kernel's, at lengths that no step divides, with
    GQA. Causal and deterministic calls take 64-row steps."""
    torch.manual_seed(Lq * 7 + Lk)
    B, Hq, Hkv, D = 2, 4, 2, 128
    desc = M.full().compile(B, Hq, Hkv, Lq, Lk, device=T.DEV)
    assert desc.q_full_count.stride(2) == 0 and desc.kv_full_count.stride(2) == 0
    q = torch.randn(B, Hq, Lq, D, device=T.DEV)
    k, v = (torch.randn(B, Hkv, Lk, D, device=T.DEV) for _ in range(2))
    dout = torch.randn(B, Hq, Lq, D, device=T.DEV, dtype=dtype)

    def grads(d, deterministic=False):
        qh, kh, vh = (t.to(dtype).requires_grad_() for t in (q, k, v))
        out = flexsparse.attention(qh, kh, vh, d, backend="cuda", deterministic=deterministic)
        out.backward(dout)
        return qh.grad, kh.grad, vh.grad

    assert _bwd_step_rows(lambda: grads(desc)) == {80}
    check(B, Hq, Hkv, Lq, Lk, D, None, dtype, desc=desc, inputs=(q, k, v))
    eighty = grads(desc)
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "268435456")
    assert _bwd_step_rows(lambda: grads(desc)) == {64}
    sixty_four = grads(desc)
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG")
    for name, a, b in zip(("dq", "dk", "dv"), eighty, sixty_four):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=name)
    assert _bwd_step_rows(lambda: grads(desc, deterministic=True)) == {64}
    causal = M.causal().compile(B, Hq, Hkv, Lq, Lk, device=T.DEV)
    assert _bwd_step_rows(lambda: grads(causal)) == {64}


def test_softcap():
    torch.manual_seed(3)
    check(1, 4, 2, 500, 500, 128, M.document([200, 300]), torch.bfloat16, softcap=20.0,
          bias_shape=(1, 4, 500, 500))


def test_fully_masked_rows():
    torch.manual_seed(4)
    B, H, L = 1, 2, 400
    dm = torch.rand(B, H, L, L, device=T.DEV) < 0.5
    dm[:, :, 100:250] = False
    out, lse = check(B, H, H, L, L, 64, M.dense(dm), torch.float16, bias_shape=(B, H, L, L))[:2]
    assert torch.all(out[:, :, 100:250] == 0) and torch.all(lse[:, :, 100:250] == -float("inf"))


def test_matches_triton_on_noncontiguous_inputs():
    """Strided q/k/v (a transposed (B, L, H, D) layout) give what Triton gives, and pass the
    float64 rule."""
    torch.manual_seed(7)
    B, H, L, D = 2, 4, 333, 128
    q, k, v = (torch.randn(B, L, H, D, device=T.DEV, dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    a = flexsparse.attention(q, k, v, M.causal(), backend="cuda")
    b = flexsparse.attention(q, k, v, M.causal(), backend="triton")
    torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    causal = torch.ones(L, L, dtype=torch.bool, device=T.DEV).tril()[None, None]
    fa_rule(a, q, k, v, causal, None, 1.0 / math.sqrt(D))


def test_poisoned_output_fully_written():
    """Every output element is written: the same call twice over differently filled
    allocator memory gives bitwise the same result."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(1, 2, 517, 64, device=T.DEV, dtype=torch.float16) for _ in range(3))
    outs = []
    for fill in (float("nan"), 0.0):
        junk = torch.full((1 << 22,), fill, device=T.DEV)
        del junk
        outs.append(flexsparse.attention(q, k, v, M.sliding_window(100), backend="cuda",
                                         return_lse=True))
    for a, b in zip(*outs):
        assert not torch.isnan(a).any()
        assert torch.equal(a, b)


def test_opcheck_forward():
    q, k, v = (torch.randn(1, 2, 300, 64, device=T.DEV, dtype=torch.bfloat16) for _ in range(3))
    desc = M.causal().compile(1, 2, 2, 300, 300, device=T.DEV)
    args = (q, k, v, None, *desc.mask_tensors(), *desc.block_size, 0.125, 0.0, False)
    torch.library.opcheck(torch.ops.flexsparse.cuda_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_auto_picks_cuda_where_measured_faster():
    """backend="auto": cuda for block masks at hd 64, 128 and 256 (measured faster forward and
    backward, partial-heavy documents included), with grad too when the backward kernels
    are built and the call is not deterministic; with a bias, cuda at hd128 and hd64 where
    the bias-tile kernels run (AUTO_BIAS_HEAD_DIMS), triton otherwise."""
    from flexsparse.ops import backends as B
    L = 4096
    q = torch.randn(1, 2, L, 128, device=T.DEV, dtype=torch.bfloat16)
    causal = M.causal().compile(1, 2, 2, L, L, device=T.DEV)
    doc = M.document([100] * 40 + [96]).compile(1, 2, 2, L, L, device=T.DEV)
    mt, bs = causal.mask_tensors(), causal.block_size
    assert B.choose(q, q, q, None, mt, False, bs) == "cuda"
    assert B.choose(q, q, q, None, mt, True, bs) == ("cuda" if BACKWARD else "triton")
    # deterministic training: Triton (the CUDA deterministic backward measured slower)
    assert B.choose(q, q, q, None, mt, True, bs, deterministic=True) == "triton"
    assert B.choose(q, q, q, None, doc.mask_tensors(), False, doc.block_size) == "cuda"
    q64 = q[..., :64].contiguous()
    assert B.choose(q64, q64, q64, None, mt, False, bs) == "cuda"
    q256 = torch.randn(1, 2, L, 256, device=T.DEV, dtype=torch.bfloat16)
    assert B.choose(q256, q256, q256, None, mt, True, bs) == ("cuda" if BACKWARD else "triton")
    # a bias (AUTO_BIAS_HEAD_DIMS): hd128 and hd64 on the bias-tile kernels, else Triton
    bias = torch.zeros(1, 2, L, L, device=T.DEV, dtype=torch.bfloat16)
    assert B.choose(q, q, q, bias, mt, False, bs) == "cuda"
    assert B.choose(q, q, q, bias, mt, True, bs) == ("cuda" if BACKWARD else "triton")
    assert B.choose(q, q, q, bias, mt, True, bs, softcap=True) == "triton"
    assert B.choose(q64, q64, q64, bias, mt, False, bs) == "cuda"
    with torch.no_grad():
        a = flexsparse.attention(q, q, q, causal)
    torch.testing.assert_close(a, flexsparse.attention(q, q, q, causal, backend="triton"),
                               atol=2e-2, rtol=2e-2)
    # index masks: cuda at 1, 2, 4, 8, 16 query heads per kv head (AUTO_INDEX_GROUPS), no
    # bias or softcap;
    # gradients then come from the Triton index backward (or, deterministic, the CUDA one)
    q8 = torch.randn(1, 8, L, 128, device=T.DEV, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(1, 2, L, 128, device=T.DEV, dtype=torch.bfloat16, requires_grad=True)
    lists = torch.randint(-1, L, (1, 2, L, 32), device=T.DEV, dtype=torch.int32)
    imt = M.indices(lists).compile(1, 8, 2, L, L, device=T.DEV).mask_tensors()
    assert B.choose(q8, kv, kv, None, imt, False) == "cuda"
    assert B.choose(q8, kv, kv, None, imt, True) == "cuda"
    assert B.choose(q8, kv, kv, None, imt, True, softcap=True) == "triton"
    assert B.choose(q, q, q, None, M.indices(lists).compile(1, 2, 2, L, L, device=T.DEV)
                    .mask_tensors(), False) == "cuda"                 # one head per kv head
    q6 = torch.randn(1, 6, L, 128, device=T.DEV, dtype=torch.bfloat16)
    imt6 = M.indices(lists).compile(1, 6, 2, L, L, device=T.DEV).mask_tensors()
    assert B.choose(q6, kv, kv, None, imt6, False) == "triton"        # 3, not measured
    got = flexsparse.attention(q8, kv, kv, M.indices(lists))
    want = flexsparse.attention(q8, kv, kv, M.indices(lists), backend="triton")
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    g_got = torch.autograd.grad(got.float().square().sum(), (q8, kv))
    g_want = torch.autograd.grad(want.float().square().sum(), (q8, kv))
    for x, y in zip(g_got, g_want):   # same backward kernel, over two forwards' out and lse
        torch.testing.assert_close(x, y, atol=2e-2 * y.abs().max().item(), rtol=5e-2)


def test_compiled_graph_calls_the_cuda_op_one_frame():
    """torch.compile(fullgraph=True, dynamic=True) over three lengths: one frame, and the
    graph holds flexsparse.cuda_attention itself (its C++ kernel, no Python in between)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    targets = set()

    def backend(gm, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    counter = CompileCounterWithBackend(backend)

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(q, k, v, desc):
        return flexsparse.attention(q, k, v, desc, backend="cuda") * 2

    for L in (300, 517, 1024):
        q, k, v = (torch.randn(1, 4, L, 128, device=T.DEV, dtype=torch.bfloat16) for _ in range(3))
        desc = M.causal().compile(1, 4, 4, L, L, device=T.DEV)
        torch.testing.assert_close(f(q, k, v, desc),
                                   flexsparse.attention(q, k, v, desc, backend="triton") * 2,
                                   atol=3e-2, rtol=3e-2)
    assert counter.frame_count == 1
    assert any("cuda_attention" in t for t in targets), targets


@pytest.mark.skipif(BACKWARD, reason="the backward kernels are built")
def test_backward_without_kernels_says_so():
    q = torch.randn(1, 2, 256, 128, device=T.DEV, dtype=torch.bfloat16, requires_grad=True)
    out = flexsparse.attention(q, q, q, M.causal(), backend="cuda")
    with pytest.raises(NotImplementedError, match="forward kernels only"):
        out.sum().backward()


# FLEXSPARSE_CUDA_DEBUG bits of the backward's older stores (csrc/bwd_sm90.cuh): 2^40 the
# dS^T stores through CuTe's partition (before C86), 2^41 dQ staged in 8-byte pieces
# (before C87); 2^46 the other place of the dS^T stores than the kernel's default (before
# or after the dV product is issued, C106), 2^47 the other order of the exponentials and
# dS (interleaved after an early dP^T wait or not, C107).
CUTE_DS_STORE, DQ_PAIRS = 1 << 40, 1 << 41
DS_FIRST, DS_INTERLEAVED = 1 << 46, 1 << 47
# the other of 0 and 1 lse / delta pairs read before the waits than the kernel's default
# (1 in the 80-row kernel, else 0; C110, head dim 128)
STATS_EARLY = 1 << 49


def _order_defaults(D, step_rows):
    """BwdTraits' kDsFirst and kDsInterleaved of a bf16 kernel with the order variants."""
    return True, D == 128 and step_rows == 64


@pytest.mark.skipif(not BACKWARD, reason="no CUDA backward kernels in this build")
@pytest.mark.parametrize("case", ["causal_hd128_gqa", "document_hd128_bias", "causal_hd64_softcap",
                                  "full_hd64", "causal_hd256"])
def test_backward_store_variants_bitwise(case, monkeypatch):
    """The backward's dS^T stores at hand-computed addresses (C86: hd128 and hd64 at 64-row
    steps) and its dQ staged in 16-byte pieces (C87: every kernel, with the postprocess
    reading that order) move the same values to the same places as the stores before them
    (bits 2^40 and 2^41); the bf16 variants that only reorder independent work (C106: dS^T
    stored before or after the dV product is issued; C107: the exponentials interleaved
    with dS or not; bits 2^46 and 2^47 take the order other than the kernel's default, in
    the kernels with P^T and dS^T in registers and no bias tiles, whose names say which
    order ran; C110: at head dim 128 bit 2^49 reads one lse and one delta pair before the
    waits) compute each value by the same operations:
    with deterministic=True every gradient equals bit for bit under each bit and
    combination. Cases: the general hd128 kernel (GQA, a length no tile divides), the
    bias-tiles kernel (dbias too), hd64's 64-row general kernel (a softcap makes the call
    not plain) and its 128-row plain one, hd256; and against float64 (check())."""
    kind, hd = case.split("_")[:2]
    D = int(hd[2:])
    torch.manual_seed(D + len(case))
    B, Hq, Hkv, L = 2, 4, 2 if case.endswith("gqa") else 4, 1000
    mask = T.mask_kinds(B, Hkv, L)[kind] or M.full()
    softcap = 20.0 if case.endswith("softcap") else None
    desc = mask.compile(B, Hq, Hkv, L, L, device=T.DEV)
    q = torch.randn(B, Hq, L, D, device=T.DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device=T.DEV, dtype=torch.bfloat16) for _ in range(2))
    bias = torch.randn(B, Hq, L, L, device=T.DEV, dtype=torch.bfloat16) if case.endswith("bias") else None
    dout = torch.randn_like(q)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        b = bias.clone().requires_grad_() if bias is not None else None
        out = flexsparse.attention(*leaves, desc, bias=b, softcap=softcap, backend="cuda", deterministic=True)
        return torch.autograd.grad(out, leaves + ([b] if b is not None else []), dout)

    takes_order_bits = bias is None and D != 256
    results = {}
    for bits in (0, CUTE_DS_STORE, DQ_PAIRS, CUTE_DS_STORE | DQ_PAIRS,
                 DS_FIRST, DS_INTERLEAVED, DS_FIRST | DS_INTERLEAVED, STATS_EARLY):
        monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", str(bits))
        torch.empty(4 * B * Hq * 1024 * (D + 2), device=T.DEV).fill_(float("nan"))   # freed: reused
        results[bits], kernels = _bwd_kernel_names(grads)
        if takes_order_bits and not bits & (CUTE_DS_STORE | DQ_PAIRS):
            first, interleaved = _order_defaults(D, 128 if case == "full_hd64" else 64)
            early = int(bits == STATS_EARLY and D == 128)
            persistent = D == 128 and bits == 0   # C118: the bf16 hd128 64-row kernel's default
            args = ">, false, false, {}, {}, {}, {}>".format(str(first != bool(bits & DS_FIRST)).lower(),
                                                     str(interleaved != bool(bits & DS_INTERLEAVED)).lower(),
                                                     early, str(persistent).lower())
            assert UNDER_SANITIZER or kernels and all(args in n for n in kernels), (args, kernels)
    names = ("dq", "dk", "dv", "dbias")
    for bits, got in results.items():
        for name, a, b in zip(names, results[0], got):
            assert torch.isfinite(a).all(), (bits, name)
            assert torch.equal(a, b), (bits, name)
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG")
    check(B, Hq, Hkv, L, L, D, mask, torch.bfloat16, desc=desc, deterministic=True, softcap=softcap,
          bias_shape=(B, Hq, L, L) if bias is not None else None)


@pytest.mark.skipif(not BACKWARD, reason="no CUDA backward kernels in this build")
def test_backward_80_row_steps_store_variants(monkeypatch):
    """The 80-row backward (head dim 128, full mask, not deterministic) and its store
    variants: dS^T at hand-computed addresses (C105: ds_store_offset_keys_contiguous,
    stmatrix.trans at one 32-bit base plus 2 KB per store) against CuTe's (bit 2^40), dS^T
    stored after the dV product is issued (bit 2^46; before it is the default, C106), the
    exponentials interleaved with dS (bit 2^47, C107), and dQ^T staged in C87's 16-byte
    pieces against 8-byte ones (bit 2^41): the kernel names say which ran; dk and dv equal
    bit for bit (they read neither the stored dS nor the staged dQ), dq to the rounding of
    its unordered reductions, and all match float64, with GQA and a length no step
    divides. The kernel reads one pair of lse and of delta before the waits (C110); bit
    2^49 none."""
    torch.manual_seed(105)
    B, Hq, Hkv, L, D = 2, 4, 2, 1000, 128
    q = torch.randn(B, Hq, L, D, device=T.DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device=T.DEV, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    desc = M.full().compile(B, Hq, Hkv, L, L, device=T.DEV)

    def grads(inputs, backend="cuda"):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = flexsparse.attention(*leaves, desc, backend=backend)
        return torch.autograd.grad(out, leaves, dout.to(out.dtype))

    results = {}
    expected = {0: "false, false, true, false, 1", CUTE_DS_STORE: "true, false, true, false, 1",
                DS_FIRST: "false, false, false, false, 1", DS_INTERLEAVED: "false, false, true, true, 1",
                DQ_PAIRS: "false, true, true, false, 1", STATS_EARLY: "false, false, true, false, 0"}
    for bits, args in expected.items():
        monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", str(bits))
        torch.empty(4 * B * Hq * 1024 * (D + 2), device=T.DEV).fill_(float("nan"))   # freed: reused
        results[bits], names = _bwd_kernel_names(lambda: grads((q, k, v)))
        assert UNDER_SANITIZER or names and all(
            re.search(r"BwdTraits<[^,]+, 128, 2, 80, true, false>, " + args + ", false>", n) for n in names), names
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG")
    ref = grads((q.double(), k.double(), v.double()), backend="reference")
    by_hand = results[0]
    for bits, got in results.items():
        for name, a, b, r in zip(("dq", "dk", "dv"), by_hand, got, ref):
            assert torch.isfinite(b).all(), (bits, name)
            if name == "dq":
                torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)
            else:
                assert torch.equal(a, b), (bits, name)
            err = (b.double() - r).norm() / r.norm()
            assert err < 2e-2, (bits, name, err.item())


TWO_Q_BUFFERS = 1 << 44    # FLEXSPARSE_CUDA_DEBUG: the forward's two query buffers (kQBuffers)
ONE_Q_BUFFER = 1 << 48      # hd64: the one-buffer kernel (two buffers are hd64's default)
TWO_Q_REGISTER_STORE = 1 << 50   # hd64, bf16: two query buffers storing O from registers (before C111)


STAGED_RANGES = 1 << 52   # FLEXSPARSE_CUDA_DEBUG: windows on the staged column ranges, not the band (both passes)


@pytest.mark.parametrize("case", ["sliding256_64_4096_4096", "sliding64_64_3001_3001",
                                  "sliding1000_128_4601_4601", "sliding64_128_1000_1000",
                                  "lookahead_64_1500_2000", "lookahead_128_2000_1500",
                                  "wide_64_777_777"])
def test_forward_band_kernels_bitwise(case, monkeypatch):
    """C113: sliding-window descriptors carry their window (BlockDescriptor.window), and the
    bf16 forward at hd64 / hd128 then takes the band kernels (kBandMasks: a partial tile's
    scores hidden by two bounds per row, i - b < j <= i - a, as a bit mask of the thread's
    columns; no column ranges staged). They hide exactly what the staged ranges hide: out
    and lse bit for bit against the staged kernel (STAGED_RANGES), for windows, a window
    that also looks ahead with Lq != Lk (the offset Lk - Lq), one wider than the sequence,
    odd lengths, GQA; the kernels' names checked; and against float64 (check())."""
    kind, D, Lq, Lk = case.split("_")
    D, Lq, Lk = int(D), int(Lq), int(Lk)
    torch.manual_seed(D + Lq + Lk)
    B, Hq, Hkv = 2, 8, 2
    left, right = {"sliding256": (256, 0), "sliding64": (63, 0), "sliding1000": (1000, 0),
                   "lookahead": (200, 30), "wide": (5000, 0)}[kind]
    mask = M.sliding_window(left, right)
    desc = mask.compile(B, Hq, Hkv, Lq, Lk, device=T.DEV)
    assert desc.window is not None and desc.window.tolist() == [left, right]
    q = torch.randn(B, Hq, Lq, D, device=T.DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Lk, D, device=T.DEV, dtype=torch.bfloat16) for _ in range(2))
    results = {}
    for bits in (STAGED_RANGES, 0):
        monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", str(bits))
        torch.empty(2 * B * Hq * Lq * (D + 1), device=T.DEV).fill_(float("nan"))   # freed: reused
        results[bits], names = _fwd_kernel_names(
            lambda: flexsparse.attention(q, k, v, desc, backend="cuda", return_lse=True))
        band_kernel = all(re.search(rf"FwdTraits<[^,]+, {D}, .*, true>", n) for n in names)
        assert UNDER_SANITIZER or names and band_kernel == (bits == 0), (bits, names)
    out0, lse0 = results[STAGED_RANGES]
    out1, lse1 = results[0]
    assert torch.isfinite(out1).all() and not torch.isnan(lse1).any()
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)
    if case in ("sliding64_128_1000_1000", "lookahead_64_1500_2000"):
        monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "0")
        check(1, 4, Hkv, Lq, Lk, D, mask, torch.bfloat16, backward=False)


def _seeded_case(case):
    """A case named kind_D_dtype_Lq_Lk as (kind, D, torch dtype, Lq, Lk), torch seeded by it."""
    kind, D, dt, Lq, Lk = case.split("_")
    D, Lq, Lk = int(D), int(Lq), int(Lk)
    torch.manual_seed(D + Lq + Lk)
    return kind, D, {"bf16": torch.bfloat16, "fp16": torch.float16}[dt], Lq, Lk


@pytest.mark.parametrize("case", ["sliding256_64_bf16_4096_4096", "sliding64_128_bf16_3001_3001",
                                  "sliding1000_128_fp16_4601_4601", "lookahead_128_bf16_1500_2000",
                                  "lookahead_64_fp16_2000_1500", "wide_128_bf16_777_777",
                                  "sliding300_256_bf16_1001_1001"])
def test_backward_band_bitwise(case, monkeypatch):
    """C114: the backward of a sliding-window descriptor (its window, BlockDescriptor.window)
    takes each key's visible rows from the window (band_rows) instead of staging the column
    ranges in shared memory: dq, dk and dv bit for bit against the staged ranges
    (STAGED_RANGES; deterministic, so that dq's accumulation order is fixed too), in every
    kernel that stages ranges (hd64's 128-row plain kernel, hd128's general one, hd256's;
    bf16 and fp16), for windows, one looking ahead with Lq != Lk both ways, one wider than
    the sequence, odd lengths, GQA; and against float64 (check())."""
    needs_backward()
    kind, D, dtype, Lq, Lk = _seeded_case(case)
    B, Hq, Hkv = 2, 8, 2
    left, right = {"sliding256": (256, 0), "sliding64": (63, 0), "sliding1000": (1000, 0),
                   "sliding300": (300, 0), "lookahead": (200, 30), "wide": (5000, 0)}[kind]
    mask = M.sliding_window(left, right)
    desc = mask.compile(B, Hq, Hkv, Lq, Lk, device=T.DEV)
    assert desc.window is not None
    q = torch.randn(B, Hq, Lq, D, device=T.DEV, dtype=dtype)
    k, v = (torch.randn(B, Hkv, Lk, D, device=T.DEV, dtype=dtype) for _ in range(2))
    do = torch.randn(B, Hq, Lq, D, device=T.DEV, dtype=dtype)
    grads = {}
    for bits in (STAGED_RANGES, 0):
        monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", str(bits))
        torch.empty(4 * B * Hq * max(Lq, Lk) * (D + 1), device=T.DEV).fill_(float("nan"))   # freed: reused
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = flexsparse.attention(qq, kk, vv, desc, backend="cuda", deterministic=True)
        grads[bits] = torch.autograd.grad(out, (qq, kk, vv), do)
    for g0, g1, name in zip(grads[STAGED_RANGES], grads[0], ("dq", "dk", "dv")):
        assert torch.isfinite(g1).all(), name
        assert torch.equal(g0, g1), name
    if case in ("sliding64_128_bf16_3001_3001", "lookahead_64_fp16_2000_1500"):
        monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "0")
        check(1, 4, Hkv, Lq, Lk, D, mask, dtype)


@pytest.mark.parametrize("case", ["causal_64_bf16_1000_1000", "causal_128_bf16_1000_1000",
                                  "full_128_bf16_1000_1000", "document_128_fp16_777_777",
                                  "causal_256_bf16_333_333", "bias_128_bf16_512_512", "bias_64_bf16_512_512",
                                  "bias_128_bf16_500_500", "full_256_fp16_1000_1000",
                                  "lookahead_128_bf16_300_1000", "lookahead_64_bf16_300_1000"])
def test_backward_tma_store_epilogue(case):
    """The backward writes dK and dV through the key and value buffers and one TMA store
    each (C116; bit for bit what C28's 16-byte store loop wrote, checked on the H200 before
    that loop went): every row of dk and dv written (poisoned memory underneath) and
    within the FlashAttention rule of float64, in every backward kernel (hd64's 128-row
    plain one, hd128's general, 80-row (full) and bias-tile ones (a bias whose rows TMA can
    read: L = 512), hd256's split one; bf16 and fp16; a bias at L = 500 takes the general
    kernel's per-score loads), with GQA and lengths no key tile divides (the last tile's
    rows past Lk clipped by the tensor map), and where key tiles have no query step at all
    ("lookahead": a window of 100 keys behind the bottom-right diagonal, Lq = 300 < Lk =
    1000, so keys 0-599 see no query: their CTAs write zeros, once K and V have landed in
    the buffers the epilogue writes over)."""
    needs_backward()
    kind, D, dtype, Lq, Lk = _seeded_case(case)
    B, Hq, Hkv = 2, 4, 2
    mask = {"causal": M.causal(), "full": M.full(), "bias": M.causal(),
            "document": M.document([300, 1, 476]), "lookahead": M.sliding_window(100, 0)}[kind]
    desc = mask.compile(B, Hq, Hkv, Lq, Lk, device=T.DEV)
    q = torch.randn(B, Hq, Lq, D, device=T.DEV, dtype=dtype)
    k, v = (torch.randn(B, Hkv, Lk, D, device=T.DEV, dtype=dtype) for _ in range(2))
    bias = torch.randn(B, Hq, Lq, Lk, device=T.DEV, dtype=dtype) if kind == "bias" else None
    dout = torch.randn_like(q)

    def grads(inputs):
        leaves = [t.detach().clone().requires_grad_() for t in inputs if t is not None]
        qq, kk, vv = leaves[:3]
        bb = leaves[3] if len(leaves) > 3 else None
        out = flexsparse.attention(qq, kk, vv, desc, bias=bb, backend="cuda")
        return torch.autograd.grad(out, leaves, dout.to(out.dtype))

    torch.empty(4 * B * Hq * 1024 * (D + 2), device=T.DEV).fill_(float("nan"))   # freed: reused
    got = grads((q, k, v, bias))
    for name, g in zip(("dq", "dk", "dv", "dbias"), got):
        assert torch.isfinite(g).all(), name
    # against float64 within the FlashAttention rule (dense attention in the inputs' dtype)
    check(B, Hq, Hkv, Lq, Lk, D, mask, dtype, desc=desc, deterministic=True,
          bias_shape=(B, Hq, Lq, Lk) if bias is not None else None)
    if kind == "lookahead":
        assert got[1][:, :, :600].abs().max().item() == 0.0   # the keys no query sees


PER_TILE_BWD = 1 << 53   # FLEXSPARSE_CUDA_DEBUG: one CTA per key tile, not the persistent backward (C118)


@pytest.mark.parametrize("case", ["causal_1000_gqa", "causal_4096", "sliding_4096", "document_3001",
                                  "prefix_4096", "lookahead_300_1000", "lookahead_300_1000_gqa",
                                  "causal_4096_nondet"])
def test_backward_persistent(case, monkeypatch):
    """C118 (the default; bit 2^53 takes one CTA per key tile): the bf16 hd128 64-row
    backward as one CTA per SM drawing key tiles (a tile ring in shared memory, K / V of
    the next tile during the epilogue's stores) computes what one CTA per tile does: with
    deterministic=True dq, dk and dv equal bit for bit (dk and dv too without it; dq there
    to its unordered reductions' rounding), and the kernel that ran is the persistent
    instantiation. Cases: GQA at a length no
    tile divides; 4096 (B=2, 4 kv heads: 256 key tiles, so each CTA takes about two); a
    window (the band path), documents, prefix-LM; key tiles no query sees (lookahead,
    Lq < Lk: tiles with no step, whose CTAs still wait for K and V and write zeros; with
    GQA, four heads' end stages and no step before K and V, which the producer must load
    before the pipeline's stages run out)."""
    needs_backward()
    parts = case.split("_")
    kind = parts[0]
    Lq = int(parts[1])
    Lk = int(parts[2]) if kind == "lookahead" else Lq
    deterministic = not case.endswith("nondet")
    torch.manual_seed(Lq + Lk + len(case))
    B, Hq, Hkv, D = 2, 8 if case.endswith("gqa") else 4, 2 if case.endswith("gqa") else 4, 128
    mask = {"causal": M.causal(), "sliding": M.sliding_window(256, 0),
            "document": M.document([1000, 1, 2000]), "prefix": M.prefix_lm(1000),
            "lookahead": M.sliding_window(100, 0)}[kind]
    desc = mask.compile(B, Hq, Hkv, Lq, Lk, device=T.DEV)
    q = torch.randn(B, Hq, Lq, D, device=T.DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Lk, D, device=T.DEV, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flexsparse.attention(*leaves, desc, backend="cuda", deterministic=deterministic)
        return torch.autograd.grad(out, leaves, dout)

    results, kernels = {}, {}
    for bits in (PER_TILE_BWD, 0):
        monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", str(bits))
        torch.empty(4 * B * Hq * 4096 * (D + 2), device=T.DEV).fill_(float("nan"))   # freed: reused
        results[bits], kernels[bits] = _bwd_kernel_names(grads)
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG")
    if not UNDER_SANITIZER:
        assert kernels[PER_TILE_BWD] and all(
            n.split("(")[0].endswith(", false>") for n in kernels[PER_TILE_BWD]), kernels[PER_TILE_BWD]
        assert kernels[0] and all(
            "BwdTraits<cutlass::bfloat16_t, 128, 2, 64, false, false>" in n and n.split("(")[0].endswith(", true>")
            for n in kernels[0]), kernels[0]
    for name, a, b in zip(("dq", "dk", "dv"), results[PER_TILE_BWD], results[0]):
        assert torch.isfinite(b).all(), name
        if deterministic or name != "dq":
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)
    if kind == "lookahead":
        assert results[0][1][:, :, :600].abs().max().item() == 0.0
    check(B, Hq, Hkv, Lq, Lk, D, mask, torch.bfloat16, desc=desc, deterministic=deterministic)


@pytest.mark.parametrize("case", ["causal_128_4096", "sliding_128_4096", "document_128_3001",
                                  "causal_64_4096", "layout_128_2000", "layout_64_1000"])
def test_forward_two_query_buffers_bitwise(case, monkeypatch):
    """The forward with two query buffers (kQBuffers = 2: the next work tile's queries load
    while this one runs) computes what the one-buffer kernel does: out and lse bit for bit,
    over many work tiles per CTA (both buffers, each several phases), odd lengths, GQA, and
    block layouts with empty query-block rows (work tiles with nothing listed); and against
    float64 (check()). Its epilogue: at hd64 the TMA store through the O staging buffer
    (C111), or with bit 2^50 16-byte stores from registers after a transpose within each
    quad, hd128's (the kernels' names checked). The reference is the one-buffer kernel
    (ONE_Q_BUFFER: at hd64 two buffers are the default, at hd128 TWO_Q_BUFFERS asks).
    Both kernels hand the producer's started list cursors to the consumers through shared
    memory (SharedStorage::cursor), one slot per work tile for two (one buffer) or four
    (two buffers) work tiles: the many work tiles per CTA here reuse every slot."""
    kind, D, L = case.split("_")
    D, L = int(D), int(L)
    torch.manual_seed(D + L)
    B, Hq, Hkv = 2, 16, 4
    if kind == "layout":
        nb = -(-L // 128)
        lay = torch.rand(1, Hkv, nb, nb, generator=torch.Generator().manual_seed(L)) < 0.4
        lay[..., 1, :] = False                     # a query block with nothing listed
        mask = M.block_sparse(lay.to(T.DEV), 128)
    else:
        mask = {"causal": M.causal(), "sliding": M.sliding_window(700),
                "document": M.document([1000, 1, 1500, 500])}[kind]
    desc = mask.compile(B, Hq, Hkv, L, L, device=T.DEV)
    q = torch.randn(B, Hq, L, D, device=T.DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device=T.DEV, dtype=torch.bfloat16) for _ in range(2))
    results = {}
    variants = (0, TWO_Q_BUFFERS, TWO_Q_REGISTER_STORE)
    for bits in (ONE_Q_BUFFER, *variants):
        monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", str(bits))
        torch.empty(2 * B * Hq * L * (D + 1), device=T.DEV).fill_(float("nan"))   # freed: reused
        results[bits], names = _fwd_kernel_names(
            lambda: flexsparse.attention(q, k, v, desc, backend="cuda", return_lse=True))
        if D == 64 and bits in (0, TWO_Q_REGISTER_STORE):
            # FwdTraits<bf16, 64, 128, 3, overlap, regs, kTmaStore, kPlain, kBiasTiles, 2, kQBuffers,
            # kBandMasks>
            tma_store = "false" if bits else "true"
            assert UNDER_SANITIZER or names and all(
                re.search(rf"FwdTraits<[^,]+, 64, 128, 3, true, \d+, {tma_store}, true, false, 2, 2(, false)?>", n)
                for n in names), (bits, names)
    out0, lse0 = results[ONE_Q_BUFFER]
    assert torch.isfinite(out0).all() and not torch.isnan(lse0).any()
    for bits in variants:
        out1, lse1 = results[bits]
        assert torch.equal(out0, out1) and torch.equal(lse0, lse1), bits
    if case in ("document_128_3001", "layout_64_1000"):
        for bits in (ONE_Q_BUFFER, TWO_Q_BUFFERS):
            monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", str(bits))
            check(1, 8, Hkv, L, L, D, mask, torch.bfloat16)
