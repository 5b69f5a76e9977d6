"""The eager autograd of the CUDA backend's op (ops/schema.py, _EagerCudaAttention), wired
as register_autograd wires the op itself: on CPU, with the reference kernels registered as
the CPU kernels of flexsparse::cuda_attention and cuda_attention_backward for the length
of each test, both paths give the same outputs and gradients (q, k, v, bias), with and
without the lse used, with fully masked rows, and the eager path leaves grad_lse None
when lse is unused (the backward then converts no zero tensor)."""
import pytest
import torch

import flexsparse
from flexsparse import masks as M
from flexsparse.ops import reference
from flexsparse.ops.schema import MaskTensors, cuda_attention_with_grad

N_MASK = len(MaskTensors._fields)


@pytest.fixture
def cpu_kernels():
    seen = {}
    lib = torch.library.Library("flexsparse", "IMPL")

    def fwd(q, k, v, bias, *rest):
        mask, tail = MaskTensors(*rest[:N_MASK]), rest[N_MASK:]
        return reference.forward(q, k, v, bias, mask, *tail)

    def bwd(grad_out, grad_lse, q, k, v, out, lse, bias, *rest):
        seen.setdefault("grad_lse", []).append(grad_lse)
        mask, tail = MaskTensors(*rest[:N_MASK]), rest[N_MASK:]
        return tuple(reference.backward(grad_out, grad_lse, q, k, v, out, lse, bias, mask, *tail))

    lib.impl("cuda_attention", fwd, "CPU")
    lib.impl("cuda_attention_backward", bwd, "CPU")
    try:
        yield seen
    finally:
        lib._destroy()


def _inputs(with_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, L, D = 2, 4, 2, 200, 16
    q = torch.randn(B, Hq, L, D, dtype=torch.float64, generator=g)
    k = torch.randn(B, Hkv, L, D, dtype=torch.float64, generator=g)
    v = torch.randn(B, Hkv, L, D, dtype=torch.float64, generator=g)
    bias = torch.randn(B, Hq, L, L, dtype=torch.float64, generator=g) if with_bias else None
    # a random block layout whose second query block sees nothing (fully masked rows
    # 32..63: out 0, lse -inf, zero gradients)
    layout = torch.rand(B, Hkv, 7, 7, generator=g) < 0.5
    layout[:, :, 1] = False
    layout[:, :, 0, 0] = True
    desc = M.block_sparse(layout, 32).compile(B, Hq, Hkv, L, L, block_size=(32, 32))
    tensors = [t.requires_grad_() for t in (q, k, v)] + (
        [bias.requires_grad_()] if with_bias else [])
    return tensors, desc


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("use_lse", [False, True])
def test_eager_function_equals_registered_autograd(cpu_kernels, with_bias, use_lse):
    tensors, desc = _inputs(with_bias)
    q, k, v = tensors[:3]
    bias = tensors[3] if with_bias else None
    args = (q, k, v, bias, *desc.mask_tensors(), *desc.block_size, 0.25, 0.0, False)
    g = torch.Generator().manual_seed(7)
    w_out = torch.randn(q.shape, dtype=torch.float64, generator=g)
    w_lse = torch.randn(q.shape[:3], dtype=torch.float64, generator=g)

    def loss(out, lse):
        total = (out * w_out).sum()
        if use_lse:
            total = total + (torch.where(torch.isfinite(lse), lse, 0) * w_lse).sum()
        return total

    results = []
    for fn in (cuda_attention_with_grad, torch.ops.flexsparse.cuda_attention):
        out, lse = fn(*args)
        grads = torch.autograd.grad(loss(out, lse), tensors)
        results.append((out.detach(), lse.detach(), grads))
    (o1, l1, g1), (o2, l2, g2) = results
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert all(torch.isfinite(t).all() for t in g1)
    assert torch.all(l1[:, :, 32:64] == float("-inf")) and torch.all(o1[:, :, 32:64] == 0)
    assert torch.all(g1[0][:, :, 32:64] == 0)
    # the eager path: grad_lse None unless lse was used; the registered path materializes it
    first = cpu_kernels["grad_lse"][0]
    assert (first is None) == (not use_lse)
    assert cpu_kernels["grad_lse"][1] is not None


def test_eager_function_without_grad_mode_takes_the_op(cpu_kernels):
    tensors, desc = _inputs(False)
    args = (*tensors[:3], None, *desc.mask_tensors(), *desc.block_size, 0.25, 0.0, False)
    with torch.no_grad():
        out, lse = cuda_attention_with_grad(*args)
    assert not out.requires_grad
    want, _ = flexsparse.attention(*[t.detach() for t in tensors[:3]], desc, scale=0.25,
                                   return_lse=True, backend="reference")
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("op_name", ["cuda", "generic"])
def test_grad_mode_without_inputs_needing_grad_skips_autograd(cpu_kernels, monkeypatch, op_name):
    """An inference call with grad mode on (no input requires grad) takes the op below
    autograd, not the eager Function (its ~15-60 µs of host time per call, perf-notes
    C124): no graph node, the same values; with one input needing grad, the Function."""
    from flexsparse.ops import schema
    tensors, desc = _inputs(True)
    plain = [t.detach() for t in tensors]
    applied = []
    for name in ("_EagerCudaAttention", "_EagerAttention"):
        fn = getattr(schema, name)
        monkeypatch.setattr(fn, "apply", (lambda real: lambda *a: applied.append(1) or real(*a))(fn.apply))
    if op_name == "cuda":
        call = cuda_attention_with_grad
        tail = (False,)
    else:
        call = schema.attention_with_grad
        tail = ("reference", False)
    args = (*plain, *desc.mask_tensors(), *desc.block_size, 0.25, 0.0, *tail)
    assert torch.is_grad_enabled()
    out, lse = call(*args)
    assert out.grad_fn is None and not out.requires_grad and applied == []
    want, want_lse = flexsparse.attention(*plain[:3], desc, bias=plain[3], scale=0.25,
                                          return_lse=True, backend="reference")
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    # the bias alone needing grad: the Function, a graph node, its gradient
    bias = plain[3].clone().requires_grad_()
    out, _ = call(*plain[:3], bias, *args[4:])
    assert applied == [1] and out.grad_fn is not None
    (g,) = torch.autograd.grad(out.sum(), bias)
    assert g.shape == bias.shape and torch.isfinite(g).all()


def test_cuda_backward_kernel_check_keeps_a_cuda_true(monkeypatch):
    """_has_cuda_backward_kernel: the CPU key asked every time (tests register and remove
    CPU kernels); the CUDA key asked until it answers True once (flexsparse._C registers it
    at import and never removes it), then no more: the dispatcher's answer costs ~8 µs of
    host time per backward (perf-notes C124)."""
    from flexsparse.ops import schema
    assert schema._has_cuda_backward_kernel("CPU") is False
    lib = torch.library.Library("flexsparse", "IMPL")
    lib.impl("cuda_attention_backward", lambda *a: None, "CPU")
    try:
        assert schema._has_cuda_backward_kernel("CPU") is True
    finally:
        lib._destroy()
    assert schema._has_cuda_backward_kernel("CPU") is False
    asked = []
    answers = iter([False, True])

    def dispatcher(op, key):
        asked.append((op, key))
        return next(answers)
    monkeypatch.setattr(schema, "_CUDA_BACKWARD_REGISTERED", [])
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", dispatcher)
    assert [schema._has_cuda_backward_kernel("CUDA") for _ in range(4)] == [False, True, True, True]
    assert asked == [("flexsparse::cuda_attention_backward", "CUDA")] * 2


def test_forward_ad_dual_inputs_refused_not_dropped(cpu_kernels):
    """Under forward-mode AD a dual input (no requires_grad) still takes the eager Function,
    which refuses it for want of a jvp, as before C124: below autograd the CUDA and Triton
    kernels would return the output without its tangent."""
    import torch.autograd.forward_ad as fwAD
    tensors, desc = _inputs(False)
    q, k, v = (t.detach() for t in tensors[:3])
    args = (None, *desc.mask_tensors(), *desc.block_size, 0.25, 0.0, False)
    with fwAD.dual_level():
        qd = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="jvp"):
            cuda_attention_with_grad(qd, k, v, *args)
    out, _ = cuda_attention_with_grad(q, k, v, *args)   # outside the level: below autograd
    assert out.grad_fn is None
