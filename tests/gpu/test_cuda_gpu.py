"""The CUDA backend (csrc/, flexsparse._C) on a Hopper GPU, with the FlashAttention error
rule of test_triton_gpu.check: every mask kind, dtype and head dim against float64.
Skipped without CUDA or without the built extension."""
import os
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

# The backward kernels land separately; until then the forward alone is checked.
BACKWARD = os.environ.get("FLEXSPARSE_CUDA_BACKWARD", "0") == "1"


def check(*args, **kw):
    return T.check(*args, backend="cuda", backward=BACKWARD, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", T.KINDS)
def test_mask_kinds(kind, dtype):
    B, Hq, Hkv, L = 2, 4, 2, 1000
    torch.manual_seed(hash(kind) % 1000)
    check(B, Hq, Hkv, L, L, 128, T.mask_kinds(B, Hkv, L)[kind], dtype)


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
    """Strided q/k/v (a transposed (B, L, H, D) layout) give what Triton gives."""
    torch.manual_seed(7)
    B, H, L, D = 2, 4, 333, 128
    q, k, v = (torch.randn(B, L, H, D, device=T.DEV, dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    a = flexsparse.attention(q, k, v, M.causal(), backend="cuda")
    b = flexsparse.attention(q, k, v, M.causal(), backend="triton")
    torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


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


def test_auto_picks_cuda_for_inference_on_measured_masks():
    """backend="auto": cuda for a no-grad causal hd128 call (measured faster), triton for
    the same call with grad (no CUDA backward yet) and for a partial-heavy document mask."""
    from flexsparse.ops import backends as B
    L = 4096    # causal: 32 partial blocks of 528 listed (6%); the documents: most partial
    q = torch.randn(1, 2, L, 128, device=T.DEV, dtype=torch.bfloat16)
    causal = M.causal().compile(1, 2, 2, L, L, device=T.DEV)
    doc = M.document([100] * 40 + [96]).compile(1, 2, 2, L, L, device=T.DEV)
    mt = causal.mask_tensors()
    assert B.choose(q, q, q, None, mt, False, causal.block_size) == "cuda"
    assert B.choose(q, q, q, None, mt, True, causal.block_size) == "triton"
    assert B.choose(q, q, q, None, doc.mask_tensors(), False, doc.block_size) == "triton"
    with torch.no_grad():
        a = flexsparse.attention(q, q, q, causal)
    torch.testing.assert_close(a, flexsparse.attention(q, q, q, causal, backend="triton"),
                               atol=2e-2, rtol=2e-2)


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
