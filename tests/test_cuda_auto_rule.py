"""Where backend="auto" prefers the CUDA backend (ops/cuda_backend.preferred_for): a rule on
shapes and mask kinds only, so it is checked here on CPU tensors; the GPU side of the
choice is tests/gpu/test_cuda_gpu.py::test_auto_picks_cuda_where_measured_faster."""
import torch

from flexsparse.ops import MaskTensors, cuda_backend as C


def _lists():
    c = torch.zeros(1, 1, 2, dtype=torch.int32)
    i = torch.zeros(1, 1, 2, 2, dtype=torch.int32)
    return dict(kv_count=c, kv_index=i, kv_full_count=c, kv_full_index=i)


def test_preferred_for():
    q = torch.empty(1, 2, 256, 128)
    blocks = MaskTensors(**_lists())
    pick = C.preferred_for
    assert pick(q, q, q, None, blocks, needs_grad=True)
    assert pick(q[..., :64], q, q, None, blocks, needs_grad=False)
    assert pick(torch.empty(1, 2, 256, 256), q, q, None, blocks, needs_grad=True)
    assert not pick(torch.empty(1, 2, 256, 96), q, q, None, blocks, needs_grad=False)
    # a bias: hd128 and hd64, where the bias-tile kernels run
    bias = torch.empty(1, 2, 256, 256)
    assert pick(q, q, q, bias, blocks, needs_grad=False)
    assert pick(q, q, q, bias, blocks, needs_grad=True)
    q64 = q[..., :64]
    assert pick(q64, q64, q64, bias, blocks, needs_grad=False)
    assert pick(q64, q64, q64, bias.expand(3, 2, 256, 256), blocks, needs_grad=True)
    assert not pick(q, q, q, bias, blocks, needs_grad=True, softcap=True)
    q256 = torch.empty(1, 2, 256, 256)
    assert not pick(q256, q256, q256, bias, blocks, needs_grad=True)
    odd = torch.empty(1, 2, 250, 128)
    assert not pick(odd, odd, odd, torch.empty(1, 2, 250, 250), blocks, needs_grad=True)
    assert not pick(q, q, q, torch.empty(1, 2, 1, 256), blocks, needs_grad=True)   # one row for all
    assert not pick(q, q, q, torch.empty(1, 2, 256, 1), blocks, needs_grad=True)
    assert not pick(q, q, q, torch.empty(1, 2, 256, 256).transpose(-1, -2), blocks, needs_grad=True)
    assert not pick(q, q, q, bias, blocks, needs_grad=True, deterministic=True)
    assert not pick(q, q, q, None, blocks, needs_grad=True, deterministic=True)
    assert pick(q, q, q, None, blocks, needs_grad=False, deterministic=True)
    dense = MaskTensors(**_lists(), dense_mask=torch.ones(1, 1, 256, 256, dtype=torch.bool))
    assert not pick(q, q, q, None, dense, needs_grad=False)
    bits = MaskTensors(**_lists(), partial_bits_index=torch.zeros(1, 1, 2, 2, dtype=torch.int32),
                       partial_bits=torch.zeros(1, 128, 4, dtype=torch.int32))
    assert not pick(q, q, q, None, bits, needs_grad=False)
    # index masks: measured at 1, 2, 4, 8, 16 query heads per kv head, no bias, no softcap
    index = MaskTensors(attn_indices=torch.zeros(1, 1, 256, 4, dtype=torch.int32))
    q8, kv2 = torch.empty(1, 8, 256, 128), torch.empty(1, 2, 256, 128)
    assert pick(q8, kv2, kv2, None, index, needs_grad=False)
    assert pick(q8, kv2, kv2, None, index, needs_grad=True)
    assert pick(q8, kv2, kv2, None, index, needs_grad=True, deterministic=True)
    assert pick(q8[..., :64], kv2[..., :64], kv2[..., :64], None, index, needs_grad=True)
    assert pick(q, q, q, None, index, needs_grad=False)                # 1 head per kv head
    assert pick(torch.empty(1, 32, 256, 128), kv2, kv2, None, index, needs_grad=False)   # 16
    q6 = torch.empty(1, 6, 256, 128)
    assert not pick(q6, kv2, kv2, None, index, needs_grad=False)       # 3: not measured
    assert not pick(torch.empty(1, 64, 256, 128), kv2, kv2, None, index, needs_grad=False)
    assert not pick(q8, kv2, kv2, torch.empty(1, 8, 256, 256), index, needs_grad=False)
    assert not pick(q8, kv2, kv2, None, index, needs_grad=False, softcap=True)
    assert not pick(q8[..., :96], kv2[..., :96], kv2[..., :96], None, index, needs_grad=False)


def test_bias_rule_adds_no_guard_under_compile():
    """The bias rule's shape and stride conditions (Lk % 8 == 0, ...) are read only where
    known without a guard: one frame over lengths that are and are not multiples of 8,
    where the compiled rule keeps such calls on Triton (eagerly they go to CUDA)."""
    from torch._dynamo.testing import CompileCounter

    blocks = MaskTensors(**_lists())

    def rule(q, bias):
        return torch.full((1,), float(C.preferred_for(q, q, q, bias, blocks, needs_grad=True)))

    counter = CompileCounter()
    compiled = torch.compile(rule, backend=counter, fullgraph=True, dynamic=True)
    for L in (256, 250, 264):
        q, bias = torch.empty(1, 2, L, 128), torch.empty(1, 2, L, L)
        assert compiled(q, bias).item() == 0.0
        assert rule(q, bias).item() == float(L % 8 == 0)
    assert counter.frame_count == 1
