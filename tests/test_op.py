"""The custom op as PyTorch sees it: opcheck, torch.compile without graph breaks, bad inputs."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.library import opcheck

import flexsparse
from flexsparse import masks as M
from flexsparse.ops import MASK_TENSOR_NAMES


def _op_args(mask, requires_grad, dtype=torch.float32, bias_shape=(1, 4, 9, 11), seed=0):
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 9, 11, 8
    q = torch.randn(B, Hq, Lq, D, generator=g, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype, requires_grad=requires_grad)
    bias = torch.randn(*bias_shape, generator=g, dtype=dtype, requires_grad=requires_grad) \
        if bias_shape else None
    desc = mask.compile(B, Hq, Hkv, Lq, Lk, block_size=(4, 4))
    return (q, k, v, bias, *desc.mask_tensors(), 4, 4, 0.3, 0.0, "reference", False)


def _masks():
    g = torch.Generator().manual_seed(1)
    return {
        "full": M.full(),
        "causal": M.causal(),
        "dense": M.dense(torch.rand(2, 1, 9, 11, generator=g) > 0.5),
        "bits": M.or_(M.causal(), M.dense(torch.rand(1, 1, 9, 11, generator=g) > 0.7)),
        "indices": M.indices(torch.randint(-1, 11, (1, 2, 9, 3), generator=g)),
    }


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("name", list(_masks()))
def test_opcheck_attention(name, requires_grad):
    opcheck(torch.ops.flexsparse.attention.default, _op_args(_masks()[name], requires_grad))


@pytest.mark.parametrize("bias_requires_grad", [False, True])
@pytest.mark.parametrize("name", ["causal", "indices"])
def test_opcheck_attention_backward(name, bias_requires_grad):
    args = _op_args(_masks()[name], False)
    q, k, v, bias = args[:4]
    out, lse = torch.ops.flexsparse.attention(*args)
    g = torch.Generator().manual_seed(2)
    go = torch.randn(out.shape, generator=g)
    gl = torch.randn(lse.shape, generator=g)
    opcheck(torch.ops.flexsparse.attention_backward.default,
            (go, gl, q, k, v, out, lse, bias, *args[4:], bias_requires_grad))
    opcheck(torch.ops.flexsparse.attention_backward.default,
            (go, None, q, k, v, out, lse, None, *args[4:], False))


class TinyAttention(torch.nn.Module):
    def __init__(self, D=16, H=4, Hkv=2):
        super().__init__()
        self.H, self.Hkv, self.D = H, Hkv, D
        self.qkv = torch.nn.Linear(D * 2, (H + 2 * Hkv) * D)

    def forward(self, x, bias):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, -1, self.D).transpose(1, 2).split(
            [self.H, self.Hkv, self.Hkv], dim=1)
        mask = M.and_(M.causal(), M.sliding_window(5))
        return flexsparse.attention(q, k, v, mask, bias=bias, block_size=(16, 16)).sum()


def test_compile_one_frame_no_recompiles():
    torch._dynamo.reset()
    model = TinyAttention()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for L in (24, 40, 57):
        x = torch.randn(2, L, 32)
        bias = torch.randn(1, 4, L, L, requires_grad=True)
        loss = compiled(x, bias)
        loss.backward()
        ref_bias = bias.detach().clone().requires_grad_()
        ref = model(x, ref_bias)
        ref.backward()
        torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(bias.grad, ref_bias.grad, atol=1e-4, rtol=1e-4)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_compile_inductor_with_precompiled_descriptor():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(q, k, v, desc):
        return flexsparse.attention(q, k, v, desc) * 2

    for L in (20, 33, 48):
        q = torch.randn(1, 2, L, 8)
        desc = M.document([L // 2, L - L // 2]).compile(1, 2, 2, L, L, block_size=(8, 8))
        torch.testing.assert_close(f(q, q, q, desc), flexsparse.attention(q, q, q, desc) * 2)
    assert counter.frame_count == 1


# ---------------------------------------------------------------- bad inputs

def _qkv(B=1, Hq=2, Hkv=2, Lq=5, Lk=6, D=4, dtype=torch.float32):
    return (torch.randn(B, Hq, Lq, D, dtype=dtype), torch.randn(B, Hkv, Lk, D, dtype=dtype),
            torch.randn(B, Hkv, Lk, D, dtype=dtype))


@pytest.mark.parametrize("make,exc,needle", [
    (lambda q, k, v: (q[0], k, v, {}), ValueError, "query"),
    (lambda q, k, v: (q, k.half(), v, {}), TypeError, "key"),
    (lambda q, k, v: (q.int(), k, v, {}), TypeError, "query"),
    (lambda q, k, v: (q, k[:, :, :, :3], v, {}), ValueError, "head dim"),
    (lambda q, k, v: (q, k, v[:, :, :4], {}), ValueError, "value"),
    (lambda q, k, v: (q, torch.cat([k] * 2, 0), torch.cat([v] * 2, 0), {}), ValueError, "batch"),
    (lambda q, k, v: (q, torch.cat([k] * 3, 1)[:, :3], torch.cat([v] * 3, 1)[:, :3], {}), ValueError, "multiple"),
    (lambda q, k, v: (q, k, v, {"bias": torch.randn(1, 2, 5, 4)}), ValueError, "bias"),
    (lambda q, k, v: (q, k, v, {"bias": torch.randn(3, 5, 6)}), ValueError, "bias"),
    (lambda q, k, v: (q, k, v, {"bias": torch.ones(1, 1, 5, 6, dtype=torch.int64)}), TypeError, "bias"),
    (lambda q, k, v: (q, k, v, {"mask": torch.ones(1, 1, 5, 7, dtype=torch.bool)}), ValueError, "mask"),
    (lambda q, k, v: (q, k, v, {"mask": torch.ones(1, 1, 5, 6)}), TypeError, "mask"),
    (lambda q, k, v: (q, k, v, {"mask": torch.ones(1, 3, 5, 6, dtype=torch.bool)}), ValueError, "head dim"),
    (lambda q, k, v: (q, k, v, {"mask": "causal"}), TypeError, "mask"),
    (lambda q, k, v: (q, k, v, {"mask": M.indices(torch.full((1, 2, 5, 2), 6))}), ValueError, "attn_indices"),
    (lambda q, k, v: (q, k, v, {"mask": M.indices(torch.full((1, 2, 5, 2), -2))}), ValueError, "attn_indices"),
    (lambda q, k, v: (q, k, v, {"mask": M.indices(torch.zeros(1, 2, 4, 2, dtype=torch.int64))}), ValueError, "attn_indices"),
    (lambda q, k, v: (q, k, v, {"mask": M.column_ranges(torch.zeros(1, 1, 5, 2, dtype=torch.int32), True)}),
     ValueError, "startend_row_indices"),
    (lambda q, k, v: (q, k, v, {"mask": M.block_sparse(torch.ones(1, 1, 3, 2, dtype=torch.bool), 4)}),
     ValueError, "layout"),
    (lambda q, k, v: (q, k, v, {"softcap": -1.0}), ValueError, "softcap"),
    (lambda q, k, v: (q, k, v, {"backend": "magic"}), ValueError, "backend"),
    (lambda q, k, v: (q, k, v, {"mask": M.document([2, 2])}), ValueError, "lengths"),
])
def test_bad_inputs(make, exc, needle):
    q, k, v, kwargs = make(*_qkv())
    with pytest.raises(exc, match=needle):
        flexsparse.attention(q, k, v, **kwargs)


def test_bad_mask_arguments():
    with pytest.raises(ValueError, match="startend_row_indices"):
        M.column_ranges(torch.zeros(1, 1, 6, 1, dtype=torch.int32), causal=False)
    with pytest.raises(TypeError, match="startend_row_indices"):
        M.column_ranges(torch.zeros(1, 1, 6, 2), causal=False)
    with pytest.raises(ValueError, match="left"):
        M.sliding_window(-1)
    with pytest.raises(TypeError, match="attn_indices"):
        M.indices(torch.zeros(1, 1, 5, 2))
    with pytest.raises(TypeError, match="and_"):
        M.and_(M.causal(), "window")
    q, k, v = _qkv()
    desc = M.causal().compile(1, 2, 2, 5, 7)
    with pytest.raises(ValueError, match="descriptor"):
        flexsparse.attention(q, k, v, desc)


@pytest.mark.parametrize("use", ["out", "lse", "both"])
def test_eager_autograd_matches_registered(use):
    """flexsparse.attention's eager autograd.Function and the op's registered autograd
    (what torch.compile and direct torch.ops callers use) give the same gradients,
    also when only one of the two outputs reaches the loss."""
    g = torch.Generator().manual_seed(7)
    B, H, L, D = 1, 2, 40, 16
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, H, L, L, generator=g, dtype=torch.float64)
    desc = M.sliding_window(9).compile(B, H, H, L, L, device="cpu", block_size=(16, 16))
    w_out = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    w_lse = torch.randn(B, H, L, generator=g, dtype=torch.float64)

    def grads(call):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out, lse = call(*leaves)
        loss = {"out": (out * w_out).sum(), "lse": (lse * w_lse).sum(),
                "both": (out * w_out).sum() + (lse * w_lse).sum()}[use]
        return torch.autograd.grad(loss, leaves)

    eager = grads(lambda q, k, v, b: flexsparse.attention(q, k, v, desc, bias=b,
                                                          return_lse=True, scale=0.3))
    registered = grads(lambda q, k, v, b: torch.ops.flexsparse.attention(
        q, k, v, b, *desc.mask_tensors(), 16, 16, 0.3, 0.0, "reference", False))
    for a, r in zip(eager, registered):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-12)


def test_eager_calls_visible_to_dispatch_modes():
    """Eager calls skip the dispatcher only when nothing observes it: under a
    TorchDispatchMode both ops still show up, forward and backward, and give the same
    results as without the mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 24, 8, generator=g, dtype=torch.float64) for _ in range(3))
    desc = M.causal().compile(1, 2, 2, 24, 24, device="cpu", block_size=(8, 8))

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flexsparse.attention(*leaves, desc)
        return [out.detach()] + list(torch.autograd.grad(out.sum(), leaves))

    plain = run()
    with Record() as rec:
        watched = run()
    assert any("flexsparse.attention.default" in s for s in rec.seen)
    assert any("flexsparse.attention_backward.default" in s for s in rec.seen)
    for a, b in zip(plain, watched):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_eager_backward_skips_dispatcher_when_unobserved(monkeypatch):
    """With nothing observing the dispatcher, the eager forward and backward call the ops'
    Python kernels directly (also when grad_lse is None, the usual case)."""
    from flexsparse.ops import schema
    called = []
    for op, kernel in list(schema.EAGER_KERNELS.items()):
        def spy(*args, _kernel=kernel, _op=op):
            called.append(str(_op))
            return _kernel(*args)
        monkeypatch.setitem(schema.EAGER_KERNELS, op, spy)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out = flexsparse.attention(q, k, v, M.causal())
    torch.autograd.grad(out.sum(), (q, k, v))
    assert called == ["flexsparse.attention", "flexsparse.attention_backward"]


# ---------------------------------------------------------------- bad input, named (issue 19)

@pytest.mark.parametrize("kw,exc,words", [
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale=float("inf")), ValueError, "scale"),
    (dict(scale=-0.5), ValueError, "scale"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(return_lse="yes"), TypeError, "return_lse"),
    (dict(deterministic="no"), TypeError, "deterministic"),
])
def test_bad_scalars_are_named(kw, exc, words):
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(exc, match=words):
        flexsparse.attention(q, q, q, M.causal(), **kw)


def test_zero_head_dim_is_named():
    q = torch.randn(1, 2, 5, 0)
    with pytest.raises(ValueError, match="head dim"):
        flexsparse.attention(q, q, q)


@pytest.mark.parametrize("arg,exc", [(-3, ValueError), (2.7, TypeError), (True, TypeError)])
def test_prefix_lm_argument_checked(arg, exc):
    with pytest.raises(exc, match="prefix_len"):
        M.prefix_lm(arg)


@pytest.mark.parametrize("B_used", [1, 3])
def test_descriptor_batch_must_match(B_used):
    """A descriptor compiled with per-batch documents for B=2 is refused at B=1 and B=3
    (B=3 used to crash the Triton kernels; B=1 silently used batch 0)."""
    lengths = torch.tensor([[3, 5], [4, 4]])
    desc = M.document(lengths).compile(2, 2, 2, 8, 8)
    q = torch.randn(B_used, 2, 8, 4)
    with pytest.raises(ValueError, match="batch"):
        flexsparse.attention(q, q, q, desc)


@pytest.mark.parametrize("dims", [2, 3])
def test_low_rank_bias_and_mask_broadcast_like_sdpa(dims):
    g = torch.Generator().manual_seed(dims)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    shape = (6, 7)[:0] + ((3,) if dims == 3 else ()) + (6, 6)
    bias = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    vis = torch.rand(*shape, generator=g) < 0.7
    vis[..., 0] = True
    out = flexsparse.attention(q, k, v, vis, bias=bias)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=bias.masked_fill(~vis, float("-inf")))
    torch.testing.assert_close(out, ref)
    (g1,) = torch.autograd.grad(out.sum(), bias)
    (g2,) = torch.autograd.grad(ref.sum(), bias)
    assert g1.shape == bias.shape
    torch.testing.assert_close(g1, g2)


def test_raw_op_contract_default_backend_and_missing_lists():
    """The raw op: backend="auto" works, and mask tensors may be left out (no mask tensors
    = full attention; a dense mask alone = that mask), forward and backward (issue 19)."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    none = (None,) * len(MASK_TENSOR_NAMES)
    out, lse = torch.ops.flexsparse.attention(q, k, v, None, *none, 4, 4, 0.5, 0.0, "auto", False)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5)
    torch.testing.assert_close(out, ref)
    dm = torch.rand(1, 1, 9, 9, generator=g) < 0.6
    dm[..., 0] = True
    mt = [None] * len(MASK_TENSOR_NAMES)
    mt[8] = dm
    out, _ = torch.ops.flexsparse.attention(q, k, v, None, *mt, 4, 4, 0.5, 0.0, "reference", False)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dm, scale=0.5)
    torch.testing.assert_close(out, ref)
    g1 = torch.autograd.grad(out.sum(), (q, k, v))
    g2 = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_raw_op_mask_tensor_dtypes_named():
    q = torch.randn(1, 2, 8, 4)
    mt = [None] * len(MASK_TENSOR_NAMES)
    mt[12] = torch.zeros(1, 2, 8, 2, dtype=torch.int16)
    with pytest.raises(TypeError, match="attn_indices"):
        torch.ops.flexsparse.attention(q, q, q, None, *mt, 4, 4, 0.5, 0.0, "reference", False)


def test_int16_index_lists_refused():
    with pytest.raises(TypeError, match="int32 or int64"):
        M.indices(torch.zeros(1, 1, 4, 2, dtype=torch.int16))


@pytest.mark.parametrize("make,exc,pattern", [
    (lambda: M.document([]), ValueError, r"lengths: must not be empty"),
    (lambda: M.document([[3, 4], [7]]), TypeError,
     r"lengths: must be a list or tensor of integers"),
    (lambda: M.document("ab"), TypeError, r"lengths: must be a list or tensor of integers"),
    (lambda: M.document([3, -4]), ValueError, r"lengths: must be non-negative, got \[3, -4\]"),
    (lambda: M.document([3.5, 4]), TypeError, r"lengths: must be integers, got torch.float32"),
    (lambda: M.document([3, 4], causal="yes"), TypeError, r"causal: must be a bool, got 'yes'"),
    (lambda: M.shared_question(2, [3, -1]), ValueError, r"answer_lengths: must be non-negative"),
    (lambda: M.shared_question(2.5, [3]), TypeError,
     r"question_len: must be a non-negative int, got 2.5"),
    (lambda: M.shared_question(True, [3]), TypeError, r"question_len: .* got True"),
    (lambda: M.sliding_window(2.5), TypeError,
     r"left: must be a non-negative int or None, got 2.5"),
    (lambda: M.sliding_window(True), TypeError, r"left: .* got True"),
    (lambda: M.sliding_window(3, -2), ValueError,
     r"right: must be a non-negative int or None, got -2"),
    (lambda: M.global_tokens(True), TypeError, r"n: must be a non-negative int, got True"),
    (lambda: M.column_ranges(torch.zeros(1, 1, 6, 1, dtype=torch.int32), causal="x"), TypeError,
     r"causal: must be a bool, got 'x'"),
    (lambda: M.indices(torch.zeros(1, 1, 6, 2, dtype=torch.int64), causal=1), TypeError,
     r"causal: must be a bool, got 1"),
    (lambda: M.indices(torch.zeros(1, 1, 6, 2, dtype=torch.int16)), TypeError,
     r"attn_indices: must be int32 or int64, got torch.int16"),
    (lambda: M.block_sparse(torch.ones(1, 1, 2, 2, dtype=torch.bool), 2.5), TypeError,
     r"block_size: must be an int or a \(block_q, block_k\) pair of ints, got 2.5"),
    (lambda: M.causal().compile(1, 1, 1, 8, 8, block_size=(16,)), TypeError,
     r"block_size: .* got \(16,\)"),
    (lambda: M.causal().compile(1, 1, 1, 8, 8, block_size=(0, 16)), ValueError,
     r"block_size: must be positive, got \(0, 16\)"),
])
def test_mask_constructor_arguments_named(make, exc, pattern):
    """Each mask constructor argument: a TypeError (wrong type: float, bool, str, ragged
    lists) or ValueError (range) naming it and showing the value, never torch's own
    error from inside (document([[3, 4], [7]]) used to give "expected sequence of length
    2 at dim 1") nor a silent acceptance (document(causal="yes"), sliding_window(True))."""
    with pytest.raises(exc, match=pattern):
        make()


@pytest.mark.parametrize("block_size,exc,pattern", [
    ((16,), TypeError, r"block_size: must be an int or a \(block_q, block_k\) pair of ints"),
    ((16.5, 16), TypeError, r"block_size: .* got \(16.5, 16\)"),
    ((0, 16), ValueError, r"block_size: must be positive, got \(0, 16\)"),
    ("16", TypeError, r"block_size: .* got '16'"),
])
def test_attention_block_size_named(block_size, exc, pattern):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(exc, match=pattern):
        flexsparse.attention(q, q, q, M.causal(), block_size=block_size)
    # also with a descriptor (whose own block size is used): the argument is still checked
    desc = M.causal().compile(1, 2, 2, 8, 8, block_size=(4, 4))
    with pytest.raises(exc, match=pattern):
        flexsparse.attention(q, q, q, desc, block_size=block_size)


def test_attention_block_size_int_is_square():
    q = torch.randn(1, 2, 40, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(flexsparse.attention(q, q, q, M.causal(), block_size=16),
                               flexsparse.attention(q, q, q, M.causal(), block_size=(16, 16)))


@pytest.mark.parametrize("block_size", [(8, 8), (24, 24), (16, 8)])
def test_triton_block_size_refused_by_name(block_size):
    """Descriptor blocks the Triton block kernels cannot tile (not multiples of 16): a
    ValueError naming the backend and the block size before any launch (it was the
    launcher's NotImplementedError), from the API and from the raw op; index masks have
    no blocks and run."""
    pytest.importorskip("triton")
    q = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(0))
    pattern = (r"backend: 'triton' cannot run these inputs: triton: descriptor block size "
               r"\(\d+, \d+\): the block kernels need multiples of 16")
    with pytest.raises(ValueError, match=pattern):
        flexsparse.attention(q, q, q, M.causal(), block_size=block_size, backend="triton")
    mt = M.causal().compile(1, 2, 2, 40, 40, block_size=block_size).mask_tensors()
    with pytest.raises(ValueError, match=pattern):
        torch.ops.flexsparse.attention(q, q, q, None, *mt, *block_size, 0.25, 0.0, "triton",
                                       False)
    idx = torch.randint(-1, 40, (1, 2, 40, 3), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        flexsparse.attention(q, q, q, M.indices(idx), block_size=block_size, backend="triton"),
        flexsparse.attention(q, q, q, M.indices(idx), block_size=block_size), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("shape", [(24, 24), (2, 24, 24), (1, 24)], ids=["2d", "3d", "row"])
def test_low_rank_bias_on_every_backend_and_compiled(shape, backend, compiled):
    """2-D and 3-D biases with a bool mask of the same rank, as SDPA broadcasts them, on
    the Triton kernels too and inside torch.compile(fullgraph=True, dynamic=True): out
    and the bias gradient (in the bias's own shape) equal SDPA's in float64. (L = 24:
    two 16-blocks each way, the second partial.)"""
    if backend == "triton":
        pytest.importorskip("triton")
    L = 24
    g = torch.Generator().manual_seed(len(shape))
    q, k, v = (torch.randn(2, 2, L, 16, generator=g) for _ in range(3))
    bias = torch.randn(*shape, generator=g, requires_grad=True)
    vis = (torch.rand(*shape[:-2], L, L, generator=g) < 0.7) if shape[-2] == L else None

    def fn(q, k, v, b):
        return flexsparse.attention(q, k, v, vis, bias=b, backend=backend, block_size=16)
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    out = fn(q, k, v, bias)
    (g_bias,) = torch.autograd.grad(out.sum(), bias)
    b64 = bias.detach().double().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(),
        attn_mask=b64 if vis is None else b64.masked_fill(~vis, float("-inf")))
    (g_ref,) = torch.autograd.grad(ref.sum(), b64)
    assert g_bias.shape == bias.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g_bias.double(), g_ref, atol=1e-4, rtol=1e-4)


def test_mask_tensors_in_schema_order():
    """BlockDescriptor.mask_tensors() (written out field by field for host time) holds each
    field named by MASK_TENSOR_NAMES, in that order."""
    from flexsparse.descriptor import BlockDescriptor
    values = {name: object() for name in MASK_TENSOR_NAMES}
    desc = BlockDescriptor((1, 1), (1, 1), (1, 1), **values)
    mt = desc.mask_tensors()
    assert mt._fields == MASK_TENSOR_NAMES
    assert all(got is values[name] for name, got in zip(MASK_TENSOR_NAMES, mt))
