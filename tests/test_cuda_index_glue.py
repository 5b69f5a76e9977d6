"""The CUDA backend's Python side for index masks, on CPU: the C++ forward kernel
(csrc/index_fwd.cu) is stood in for by the reference forward, registered for the test as
the CPU kernel of flexsparse::cuda_attention, so that everything around it runs: the
support checks of backend="cuda", the CUDA op's autograd for index masks (through
attention_backward with backend "cuda") and cuda_backend.backward on the Triton index
kernels (interpreter). The kernel itself is tested on the GPU
(tests/gpu/test_cuda_index_gpu.py)."""
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: TRITON_INTERPRET is not 1", allow_module_level=True)

import flexsparse  # noqa: E402
from flexsparse import masks as M  # noqa: E402
from flexsparse.ops import MASK_TENSOR_NAMES, MaskTensors, backends, cuda_backend  # noqa: E402
from flexsparse.ops import reference, triton_indices  # noqa: E402

_N_MASK = len(MASK_TENSOR_NAMES)


@pytest.fixture
def calls(monkeypatch):
    """The CUDA backend registered with the reference forward as its CPU kernel; returns
    the names of the CUDA backend's steps as they run."""
    seen = []

    def forward_kernel(query, key, value, bias, *rest):
        seen.append("cuda_attention")
        block_q, block_k, scale, softcap, deterministic = rest[_N_MASK:]
        # as the C++ op: the bias read in the query's dtype
        bias = None if bias is None else bias.to(query.dtype)
        return reference.forward(query, key, value, bias, MaskTensors(*rest[:_N_MASK]), block_q,
                                 block_k, scale, softcap, deterministic)

    backward, index_backward = cuda_backend.backward, triton_indices.backward

    def backward_spy(*args, **kw):
        seen.append("cuda_backend.backward")
        return backward(*args, **kw)

    def index_backward_spy(grad_out, grad_lse, query, key, value, out, lse, bias, *rest):
        seen.append(f"triton_indices.backward(bias {None if bias is None else bias.dtype})")
        return index_backward(grad_out, grad_lse, query, key, value, out, lse, bias, *rest)

    lib = torch.library.Library("flexsparse", "IMPL")
    lib.impl("cuda_attention", forward_kernel, "CPU")
    monkeypatch.setitem(backends._REGISTRY, "cuda", cuda_backend)
    monkeypatch.setattr(cuda_backend, "not_supported_reasons", lambda *args: [])
    monkeypatch.setattr(cuda_backend, "backward", backward_spy)
    monkeypatch.setattr(triton_indices, "backward", index_backward_spy)
    yield seen
    lib._destroy()


def _inputs():
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, L, D, W = 2, 4, 2, 11, 16, 6
    q = torch.randn(B, Hq, L, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g)
    v = torch.randn(B, Hkv, L, D, generator=g)
    # float64: the CUDA op reads it rounded to the query's dtype, and so must the backward
    bias = torch.randn(1, Hkv, L, L, generator=g, dtype=torch.float64)
    idx = torch.randint(0, L, (B, Hkv, L, W), generator=g, dtype=torch.int32)
    idx[..., 1] = idx[..., 0]                   # a key listed twice counts twice
    idx[..., -1] = -1
    idx[:, :, 4] = -1                           # fully padded rows
    return q, k, v, bias, idx


@pytest.mark.parametrize("path", ["api", "op"])
def test_index_gradients_through_the_cuda_backend(calls, path):
    """Forward on the CUDA op, gradients from cuda_backend.backward (Triton index kernels),
    matching the reference backend: through flexsparse.attention(backend="cuda") and
    through the generic op with backend "cuda"."""
    q, k, v, bias, idx = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    if path == "api":
        out = flexsparse.attention(*leaves[:3], M.indices(idx), bias=leaves[3], backend="cuda")
    else:
        out = torch.ops.flexsparse.attention(
            *leaves[:3], leaves[3], *MaskTensors(attn_indices=idx), 128, 128,
            q.shape[-1] ** -0.5, 0.0, "cuda", False)[0]
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, do)
    assert calls == ["cuda_attention", "cuda_backend.backward",
                     "triton_indices.backward(bias torch.float32)"]

    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, bias.float())]
    ref = flexsparse.attention(*ref_leaves[:3], M.indices(idx), bias=ref_leaves[3],
                               backend="reference")
    ref_grads = torch.autograd.grad(ref, ref_leaves, do)
    torch.testing.assert_close(out, ref)
    assert torch.all(out[:, :, 4] == 0)
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert got.dtype == leaves["qkvb".index(name[1])].dtype, name
        torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4, msg=name)


def test_index_backward_needs_the_triton_index_kernels(calls, monkeypatch):
    """With gradients wanted, backend="cuda" reports what keeps the Triton index backward
    from running, before the forward runs; without gradients the forward alone runs."""
    monkeypatch.setattr(triton_indices, "not_supported_reasons",
                        lambda *args: ["triton_indices: stand-in refusal"])
    q, k, v, bias, idx = _inputs()
    qg = q.clone().requires_grad_()
    with pytest.raises(ValueError, match="backend: 'cuda' cannot run.*stand-in refusal"):
        flexsparse.attention(qg, k, v, M.indices(idx), backend="cuda")
    assert calls == []
    with torch.no_grad():
        flexsparse.attention(qg, k, v, M.indices(idx), backend="cuda")
    assert calls == ["cuda_attention"]


# ---- the switch to the CUDA index backward (csrc/index_bwd.cu; tested on the GPU in
# tests/gpu/test_cuda_index_bwd_gpu.py): which kernel cuda_backend.backward calls.

def test_index_backward_kernel_choice(monkeypatch):
    """Triton by default, CUDA for deterministic calls and at hd256 with 4 query heads per
    kv head; FLEXSPARSE_CUDA_INDEX_BWD=1 picks the CUDA kernel, =0 the Triton one; CUDA
    only where it can run (fp16/bf16, head dims 64/128/256, no dbias wanted)."""
    monkeypatch.setattr(cuda_backend, "has_backward", lambda: True)
    monkeypatch.delenv("FLEXSPARSE_CUDA_INDEX_BWD", raising=False)
    q = torch.empty(1, 2, 3, 64, dtype=torch.float16)
    bias = torch.empty(1, 1, 3, 5, dtype=torch.float16)
    pick = cuda_backend.index_backward_kernel
    assert pick(q, None, False) == "triton"
    assert pick(q, None, False, deterministic=True) == "cuda"
    assert pick(q, bias, True, deterministic=True) == "triton"
    assert pick(q.float(), None, False, deterministic=True) == "triton"
    for value in ("1", "cuda"):
        monkeypatch.setenv("FLEXSPARSE_CUDA_INDEX_BWD", value)
        assert pick(q, None, False) == "cuda"
        assert pick(q, bias, False) == "cuda"            # a bias read, no gradient
        assert pick(q, bias, True) == "triton"           # dbias: Triton only
        assert pick(q.float(), None, False) == "triton"
        assert pick(torch.empty(1, 2, 3, 32, dtype=torch.bfloat16), None, False) == "triton"
    for value in ("0", "triton", ""):
        monkeypatch.setenv("FLEXSPARSE_CUDA_INDEX_BWD", value)
        assert pick(q, None, False) == "triton"
        assert pick(q, None, False, deterministic=True) == ("cuda" if value == "" else "triton")
    # where the CUDA backward measured faster than Triton's atomic one (hd256, 4 query heads
    # per kv head): CUDA without deterministic=True too, unless the variable says Triton
    q256 = torch.empty(1, 8, 3, 256, dtype=torch.bfloat16)
    k256 = torch.empty(1, 2, 5, 256, dtype=torch.bfloat16)
    for value, want in (("", "cuda"), ("0", "triton"), ("triton", "triton"), ("1", "cuda")):
        monkeypatch.setenv("FLEXSPARSE_CUDA_INDEX_BWD", value)
        assert pick(q256, None, False, key=k256) == want, value
    monkeypatch.setenv("FLEXSPARSE_CUDA_INDEX_BWD", "")
    assert pick(q256, None, False) == "triton"                        # no key given
    assert pick(q256, None, False, key=k256[:, :1]) == "triton"       # 8 per kv head
    assert pick(q256, bias, True, key=k256) == "triton"               # dbias: Triton only
    assert pick(q256.float(), None, False, key=k256.float()) == "triton"
    assert pick(q, None, False, key=torch.empty(1, 1, 5, 64)) == "triton"   # hd64: Triton
    monkeypatch.setenv("FLEXSPARSE_CUDA_INDEX_BWD", "1")
    monkeypatch.setattr(cuda_backend, "has_backward", lambda: False)
    assert pick(q, None, False) == "triton"


@pytest.mark.parametrize("bias_grad", [False, True])
def test_index_gradients_through_the_cuda_index_backward(calls, monkeypatch, bias_grad):
    """FLEXSPARSE_CUDA_INDEX_BWD=1: cuda_backend.backward calls the CUDA backward op
    (stood in for on CPU by the Triton index backward) with the call's arguments; a call
    that wants dbias stays on the Triton backward."""
    monkeypatch.setattr(cuda_backend, "has_backward", lambda: True)
    monkeypatch.setattr(cuda_backend, "_INDEX_BWD_DTYPES", (torch.float32,))
    monkeypatch.setattr(cuda_backend, "_INDEX_BWD_HEAD_DIMS", (16,))
    monkeypatch.setenv("FLEXSPARSE_CUDA_INDEX_BWD", "1")

    def backward_kernel(grad_out, grad_lse, query, key, value, out, lse, bias, *rest):
        calls.append("cuda_attention_backward")
        mask = MaskTensors(*rest[:_N_MASK])
        block_q, block_k, scale, softcap, deterministic, bias_requires_grad = rest[_N_MASK:]
        assert not bias_requires_grad
        dq, dk, dv, _ = triton_indices.backward(
            grad_out, grad_lse, query, key, value, out, lse,
            None if bias is None else bias.to(query.dtype), mask, scale, softcap,
            deterministic, False)
        return dq, dk, dv, query.new_empty((0,))

    lib = torch.library.Library("flexsparse", "IMPL")
    lib.impl("cuda_attention_backward", backward_kernel, "CPU")
    try:
        q, k, v, bias, idx = _inputs()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        b = bias.clone().requires_grad_(bias_grad)
        out = flexsparse.attention(*leaves, M.indices(idx), bias=b, backend="cuda")
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves + ([b] if bias_grad else []), do)
        # (the stand-in runs the Triton index backward itself: its spy entry follows)
        want = (["cuda_attention", "cuda_backend.backward"]
                + ([] if bias_grad else ["cuda_attention_backward"])
                + ["triton_indices.backward(bias torch.float32)"])
        assert calls == want
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = flexsparse.attention(*ref_leaves, M.indices(idx), bias=bias.float(),
                                   backend="reference")
        ref_grads = torch.autograd.grad(ref, ref_leaves, do)
        for name, got, want_g in zip(("dq", "dk", "dv"), grads, ref_grads):
            torch.testing.assert_close(got, want_g, atol=1e-4, rtol=1e-4, msg=name)
    finally:
        lib._destroy()
