"""On a GPU: the public API with backend="auto" inside torch.compile (inductor), against the reference."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flexsparse
from flexsparse import masks as M
from flexsparse.ops import backends

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_auto_picks_a_gpu_kernel():
    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    desc = M.causal().compile(1, 2, 2, 256, 256, device="cuda")
    assert backends.choose(q, q, q, None, desc.mask_tensors()) != "reference"


def test_compiled_model_matches_reference_no_recompiles():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def layer(q, k, v, bias):
        mask = M.and_(M.causal(), M.sliding_window(300))
        return flexsparse.attention(q, k, v, mask, bias=bias)

    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for L in (512, 777, 1024):
        q = torch.randn(2, 8, L, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(2, 2, L, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(2, 2, L, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        bias = torch.randn(1, 8, L, L, device="cuda", dtype=torch.bfloat16, generator=g)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = compiled(*leaves)
        go = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
        grads = torch.autograd.grad(out, leaves, go)
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v, bias)]
        mask = M.and_(M.causal(), M.sliding_window(300))
        ref = flexsparse.attention(*ref_leaves[:3], mask, bias=ref_leaves[3], backend="reference")
        ref_grads = torch.autograd.grad(ref, ref_leaves, go.double())
        for name, a, b in zip(["out", "dq", "dk", "dv", "dbias"], (out,) + grads, (ref,) + ref_grads):
            rel = ((a.double() - b).norm() / b.norm()).item()
            assert rel < 2e-2, f"L={L} {name}: relative error {rel:.2e}"
    assert counter.frame_count == 1


def test_block_mask_made_inside_a_compiled_function():
    """A FlexAttention BlockMask created inside torch.compile (document mask_mod over a
    tensor), converted by the traced path: one frame over three lengths, against the
    float64 reference of the same mask (FlashAttention rule on the output)."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def layer(q, k, v, doc):
        L = q.shape[2]

        def document_causal(b, h, qi, kv):
            return (doc[qi] == doc[kv]) & (qi >= kv)
        bm = create_block_mask(document_causal, None, None, L, L, device="cuda")
        return flexsparse.attention(q, k, v, bm)

    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for L in (640, 1000, 1536):
        q, k, v = (torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        doc = (torch.arange(L, device="cuda") >= L // 3).long() + (torch.arange(L, device="cuda") >= L // 2)
        out = compiled(q, k, v, doc)

        def document_causal(b, h, qi, kv):
            return (doc[qi] == doc[kv]) & (qi >= kv)
        vis = create_mask(document_causal, None, None, L, L, device="cuda")
        ref = flexsparse.attention(q.double(), k.double(), v.double(), M.dense(vis),
                                   backend="reference")
        low = flexsparse.attention(q, k, v, M.dense(vis), backend="reference")
        err, err_low = (out.double() - ref).abs().max().item(), (low.double() - ref).abs().max().item()
        assert err <= 2 * err_low + 1e-3, (L, err, err_low)
    assert counter.frame_count == 1


def test_block_mask_conversion_kept_but_not_while_capturing(monkeypatch):
    """A CUDA BlockMask is converted once (flex.converted returns the same mask again),
    except while a CUDA graph is being captured, when it converts anew and keeps nothing.
    (A real conversion cannot run during capture: it reads list lengths on the host; a
    stand-in conversion shows which branch ran.)"""
    from torch.nn.attention.flex_attention import create_block_mask
    from flexsparse import flex
    L = 512
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, L, L, device="cuda")
    first = flex.converted(bm)
    assert flex.converted(bm) is first
    stand_in = object()
    monkeypatch.setattr(flex, "from_block_mask", lambda block_mask: stand_in)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inside = flex.converted(bm)
    assert inside is stand_in and flex.converted(bm) is first
