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
    assert not pick(q, q, q, torch.empty(1, 2, 256, 256), blocks, needs_grad=False)
    assert not pick(q, q, q, None, blocks, needs_grad=True, deterministic=True)
    assert pick(q, q, q, None, blocks, needs_grad=False, deterministic=True)
    dense = MaskTensors(**_lists(), dense_mask=torch.ones(1, 1, 256, 256, dtype=torch.bool))
    assert not pick(q, q, q, None, dense, needs_grad=False)
    bits = MaskTensors(**_lists(), partial_bits_index=torch.zeros(1, 1, 2, 2, dtype=torch.int32),
                       partial_bits=torch.zeros(1, 128, 4, dtype=torch.int32))
    assert not pick(q, q, q, None, bits, needs_grad=False)
    index = MaskTensors(attn_indices=torch.zeros(1, 1, 256, 4, dtype=torch.int32))
    assert not pick(q, q, q, None, index, needs_grad=False)
