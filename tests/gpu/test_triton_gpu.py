"""Triton block-descriptor kernels on a GPU, with the FlashAttention error rule.

For every output X (out, lse, dq, dk, dv, dbias):
    |X_triton - X_fp64|_max  <=  2 * |X_lowp - X_fp64|_max + floor
where X_fp64 is dense float64 attention (autograd) on the same inputs and X_lowp the same
dense computation in the input dtype (scores and probabilities rounded to it, as the
FlashAttention tests do). Fresh random inputs every case. Skipped without CUDA.

    FLEXSPARSE_GPU_TESTS=1 python -m pytest -x -q --import-mode=importlib tests/gpu/test_triton_gpu.py
"""
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

import flexsparse  # noqa: E402
from flexsparse import masks as M  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())  # masks compare devices exactly
FLOOR = 1e-5


def dense_attention(q, k, v, vis, bias, scale, softcap, lowp):
    """Dense attention with autograd. vis: bool broadcastable to (B, Hq, Lq, Lk).
    lowp: keep scores/probabilities in the input dtype (softmax itself in float32)."""
    B, Hq, Lq, D = q.shape
    G = Hq // k.shape[1]
    k = k.repeat_interleave(G, 1)
    v = v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        b = bias if bias.shape[1] in (1, Hq) else bias.repeat_interleave(G, 1)
        s = s + b
    vis = vis if vis.shape[1] in (1, Hq) else vis.repeat_interleave(G, 1)
    vis = vis.expand(B, Hq, Lq, k.shape[2])
    s = s.masked_fill(~vis, -math.inf)
    row_any = (s > -math.inf).any(-1, keepdim=True)
    s = torch.where(row_any, s, torch.zeros_like(s))
    lse = torch.logsumexp(s.float(), -1)
    p = torch.softmax(s.float() if lowp else s, -1) * row_any
    p = p.to(q.dtype)
    lse = torch.where(row_any.squeeze(-1), lse, torch.full_like(lse, -math.inf))
    return p @ v, lse


def grads(fn, q, k, v, bias, dtype, dout, dlse, backward=True):
    leaves = [t.detach().to(dtype).requires_grad_(backward) for t in (q, k, v)]
    b = None
    if bias is not None:
        b = bias.detach().to(dtype).requires_grad_(backward)
        leaves.append(b)
    out, lse = fn(*leaves[:3], b)
    if not backward:
        return out, lse
    lse_f = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    loss = (out.double() * dout).sum() + (lse_f.double() * dlse).sum()
    return (out, lse) + torch.autograd.grad(loss, leaves)


def check(B, Hq, Hkv, Lq, Lk, D, mask, dtype, *, bias_shape=None, softcap=None,
          deterministic=False, desc=None, backend="triton", backward=True, bias=None,
          inputs=None):
    """bias: a given bias (float32) in place of a random one of bias_shape; inputs: given
    (q, k, v) (float32) in place of random ones."""
    if inputs is None:
        inputs = (torch.randn(B, Hq, Lq, D, device=DEV), torch.randn(B, Hkv, Lk, D, device=DEV),
                  torch.randn(B, Hkv, Lk, D, device=DEV))
    q, k, v = inputs
    if bias is None and bias_shape is not None:
        bias = torch.randn(bias_shape, device=DEV)
    scale = 1.0 / math.sqrt(D)
    if desc is None:
        desc = (mask if mask is not None else M.full()).compile(B, Hq, Hkv, Lq, Lk, device=DEV)
    vis = desc.to_dense()
    dout = torch.randn(B, Hq, Lq, D, device=DEV, dtype=torch.float64)
    dlse = torch.randn(B, Hq, Lq, device=DEV, dtype=torch.float64)

    def ours(q, k, v, b):
        return flexsparse.attention(q, k, v, desc, bias=b, softcap=softcap, return_lse=True,
                                    backend=backend, deterministic=deterministic)

    def dense(lowp):
        return lambda q, k, v, b: dense_attention(q, k, v, vis, b, scale, softcap or 0.0, lowp)

    got = grads(ours, q, k, v, bias, dtype, dout, dlse, backward)
    ref = grads(dense(False), q, k, v, bias, torch.float64, dout, dlse, backward)
    low = grads(dense(True), q, k, v, bias, dtype, dout, dlse, backward)
    names = ("out", "lse", "dq", "dk", "dv", "dbias")
    report = []
    for name, a, r, lo in zip(names, got, ref, low):
        assert a.shape == r.shape and a.dtype == lo.dtype, name
        assert not torch.isnan(a).any(), f"{name}: NaN"
        a, lo = a.double(), lo.double()
        if name == "lse":
            fin = torch.isfinite(r)
            assert torch.equal(torch.isfinite(a), fin), "lse: -inf pattern differs"
            a, r, lo = a[fin], r[fin], lo[fin]
        err = (a - r).abs().max().item() if a.numel() else 0.0
        err_lo = (lo - r).abs().max().item() if a.numel() else 0.0
        report.append(f"{name} {err:.2e} (lowp {err_lo:.2e})")
        assert err <= 2 * err_lo + FLOOR, f"{name}: error {err:.3e} > 2 x {err_lo:.3e} + {FLOOR}"
    print(" | ".join(report))
    return got


def _doc_lengths(L, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(L - 1, generator=g)[:n - 1].add(1).sort().values.tolist()
    bounds = [0] + cuts + [L]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def mask_kinds(B, Hkv, L):
    nb = -(-L // 128)
    layout = (torch.rand(1, Hkv, nb, nb, device=DEV) < 0.3) | torch.eye(nb, dtype=torch.bool,
                                                                          device=DEV)
    cr = torch.randint(0, L + 1, (B, Hkv, L, 2), device=DEV).sort(-1).values
    dm = torch.rand(B, 1, L, L, device=DEV) < 0.7
    lay64 = torch.rand(1, 1, -(-L // 64), -(-L // 64), device=DEV) < 0.4
    return {
        "full": None,
        "causal": M.causal(),
        "sliding": M.sliding_window(200),
        "document": M.document(_doc_lengths(L, 5)),
        "prefix_lm": M.prefix_lm(L // 4),
        "shared_question": M.shared_question(L // 4, _doc_lengths(L - L // 4, 4, 1)),
        "column_ranges": M.column_ranges(cr, causal=True),
        "dense": M.dense(dm),
        "block_sparse": M.block_sparse(layout, 128),
        "bits": M.block_sparse(lay64, 64),
        "and_dense_causal": M.and_(M.dense(dm), M.causal()),
    }


KINDS = list(mask_kinds(1, 1, 256))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_mask_kinds(kind, dtype):
    B, Hq, Hkv, L = 2, 4, 2, 1000
    torch.manual_seed(hash(kind) % 1000)
    check(B, Hq, Hkv, L, L, 128, mask_kinds(B, Hkv, L)[kind], dtype)


@pytest.mark.parametrize("D", [32, 64, 96, 192, 256])
def test_head_dims(D):
    torch.manual_seed(D)
    check(1, 4, 2, 700, 700, D, M.causal(), torch.bfloat16)
    check(1, 2, 2, 389, 389, D, M.document([100, 200, 89]), torch.float16)


@pytest.mark.parametrize("Lq,Lk", [(300, 1000), (1000, 300), (1, 513), (777, 777)])
def test_odd_lengths(Lq, Lk):
    torch.manual_seed(Lq * 7 + Lk)
    check(1, 2, 1, Lq, Lk, 64, M.causal(), torch.bfloat16)
    check(1, 2, 1, Lq, Lk, 128, None, torch.float16)


@pytest.mark.parametrize("L", [64, 192, 320])
@pytest.mark.parametrize("D", [64, 128])
def test_lengths_that_divide_the_tile_not_the_block(L, D):
    """L a multiple of the kernel tiles (64-row dK/dV tiles at hd128) but not of the 128
    descriptor block: the last block's tiles past L must be masked."""
    torch.manual_seed(L + D)
    check(1, 2, 1, L, L, D, M.causal(), torch.bfloat16)
    check(1, 2, 1, L, L, D, None, torch.float16)


@pytest.mark.parametrize("Hq,Hkv", [(8, 1), (6, 2)])
def test_gqa(Hq, Hkv):
    torch.manual_seed(Hq)
    check(2, Hq, Hkv, 600, 600, 128, M.sliding_window(150), torch.bfloat16)


BIAS = {"full": (2, 4, 600, 600), "batch1": (1, 4, 600, 600), "hkv": (2, 2, 600, 600),
        "row": (2, 4, 1, 600), "col": (1, 2, 600, 1), "shared": (1, 1, 600, 600)}


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("shape", list(BIAS))
def test_bias(shape, deterministic):
    torch.manual_seed(len(shape))
    check(2, 4, 2, 600, 600, 64, M.causal(), torch.bfloat16, bias_shape=BIAS[shape],
          deterministic=deterministic)


@pytest.mark.parametrize("mask", ["causal", "document"])
def test_full_bias_hd128(mask):
    """hd128 with a full-shape dbias: the tiles of _BIAS_CONFIGS (dK/dV stores dS, the dQ
    pass reads it back), at a length no tile divides."""
    torch.manual_seed(6)
    m = M.causal() if mask == "causal" else M.document([250, 350, 77])
    check(2, 4, 2, 677, 677, 128, m, torch.bfloat16, bias_shape=(2, 4, 677, 677))


def test_softcap():
    torch.manual_seed(3)
    check(1, 4, 2, 500, 500, 128, M.document([200, 300]), torch.bfloat16, softcap=20.0,
          bias_shape=(1, 4, 500, 500))


def test_fully_masked_rows():
    torch.manual_seed(4)
    B, H, L = 1, 2, 400
    dm = torch.rand(B, H, L, L, device=DEV) < 0.5
    dm[:, :, 100:250] = False
    out, lse, dq = check(B, H, H, L, L, 64, M.dense(dm), torch.float16,
                         bias_shape=(B, H, L, L))[:3]
    assert torch.all(out[:, :, 100:250] == 0) and torch.all(lse[:, :, 100:250] == -math.inf)
    assert torch.all(dq[:, :, 100:250] == 0)


def test_deterministic_bitwise():
    torch.manual_seed(5)
    B, Hq, Hkv, L, D = 2, 4, 2, 700, 128
    q = torch.randn(B, Hq, L, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, L, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, L, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(1, Hkv, L, L, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, Hq, L, D, device=DEV, dtype=torch.bfloat16)
    results = []
    for _ in range(2):
        out = flexsparse.attention(q, k, v, M.causal(), bias=bias, backend="triton",
                                   deterministic=True)
        results.append([out] + list(torch.autograd.grad(out, (q, k, v, bias), do)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


REPLAY = {   # name -> (B, Hq, Hkv, L, D, mask, dtype, bias shape, softcap, deterministic)
    "causal gqa odd": (2, 4, 2, 677, 128, M.causal(), torch.bfloat16, None, None, False),
    "document hd64": (1, 4, 4, 500, 64, M.document([200, 250, 50]), torch.float16, None, None,
                      False),
    "full bias, dS": (2, 4, 2, 600, 128, M.causal(), torch.bfloat16, (2, 4, 600, 600), None,
                      False),
    "shared bias, atomics": (2, 4, 2, 600, 64, M.causal(), torch.bfloat16, (1, 1, 600, 600),
                             None, False),
    "hkv bias, deterministic": (2, 4, 2, 600, 64, M.causal(), torch.bfloat16, (1, 2, 600, 600),
                                None, True),
    "row bias, softcap": (1, 4, 2, 500, 128, M.sliding_window(100), torch.bfloat16,
                          (1, 4, 1, 500), 20.0, False),
}


@pytest.mark.parametrize("name", list(REPLAY))
def test_recorded_calls_replay(name):
    """Repeat calls with one descriptor replay the recorded launches (ops/triton_block.py
    _Call) with each call's own tensors: fresh inputs every call, each checked."""
    from flexsparse.ops import triton_launch
    B, Hq, Hkv, L, D, mask, dtype, bias_shape, softcap, det = REPLAY[name]
    torch.manual_seed(len(name))
    desc = mask.compile(B, Hq, Hkv, L, L, device=DEV)
    hits = triton_launch.FAST_HITS
    for _ in range(3):
        check(B, Hq, Hkv, L, L, D, None, dtype, bias_shape=bias_shape, softcap=softcap,
              deterministic=det, desc=desc)
    assert triton_launch.FAST_HITS >= hits + 2 * 3      # the later calls: fwd + bwd launches


def test_recorded_calls_see_in_place_mask_changes():
    """A mask tensor written in place after a call: the next call must use the new mask
    (the recorded call is keyed by the tensors' versions)."""
    torch.manual_seed(9)
    B, H, L = 1, 2, 300
    dm = torch.rand(B, H, L, L, device=DEV) < 0.5
    desc = M.dense(dm).compile(B, H, H, L, L, device=DEV)
    check(B, H, H, L, L, 64, None, torch.float16, desc=desc)
    desc.dense_mask.logical_not_()
    check(B, H, H, L, L, 64, None, torch.float16, desc=desc)


def test_fast_launch_matches_triton_launch():
    """ops/triton_launch.py: repeated launches skip Triton's binder and give bitwise the
    results of Triton's own launch path; a 16-byte-misaligned input (a different
    specialization) is not served by the kernel cached for aligned inputs."""
    from flexsparse.ops import triton_launch
    torch.manual_seed(6)
    B, Hq, Hkv, L, D = 1, 4, 2, 300, 64
    base = torch.randn(B * Hq * L * D + 1, device=DEV, dtype=torch.float16)
    mk = lambda *s: torch.randn(*s, device=DEV, dtype=torch.float16)  # noqa: E731
    k, v = mk(B, Hkv, L, D), mk(B, Hkv, L, D)
    do = mk(B, Hq, L, D)
    q_aligned = base[:-1].view(B, Hq, L, D).clone()
    q_odd = base[1:].view(B, Hq, L, D)        # data pointer 2 bytes past a 16-byte boundary
    q_odd.copy_(q_aligned)
    assert q_odd.data_ptr() % 16 != 0

    def run(q):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = flexsparse.attention(qq, kk, vv, M.causal(), backend="triton", deterministic=True)
        return [out] + list(torch.autograd.grad(out, (qq, kk, vv), do))

    old = triton_launch.FAST_LAUNCH
    try:
        triton_launch.FAST_LAUNCH = False
        want = run(q_aligned)
        triton_launch.FAST_LAUNCH = True
        run(q_aligned)                              # first launches: Triton's path, cached
        hits = triton_launch.FAST_HITS
        got = run(q_aligned)
        assert triton_launch.FAST_HITS >= hits + 3  # forward, preprocess, backward kernel(s)
        got_odd = run(q_odd)
    finally:
        triton_launch.FAST_LAUNCH = old
    for a, b, c in zip(want, got, got_odd):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, a)    # its own kernel (alignment): not bitwise promised
