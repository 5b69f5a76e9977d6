"""On a GPU: interval masks build their column ranges in one launch (flexsparse/triton_intervals.py),
bit for bit the torch builder's, and the descriptors they give attend like the CPU ones."""
import pytest
import torch

import flexsparse
from flexsparse import masks as M
from flexsparse.masks import Sizes, _stack_slots

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def named(L):
    docs = [L // 3, 0, L - 2 * (L // 3) - 5, L // 3 + 5]
    return {
        "causal": M.causal(),
        "sliding": M.sliding_window(300),
        "sliding_lr": M.sliding_window(200, 50),
        "document": M.document(docs),
        "document_b": M.document(torch.tensor([docs, [L, 0, 0, 0]])),
        "prefix": M.prefix_lm(L // 4),
        "prefix_b": M.prefix_lm(torch.tensor([7, L // 2])),
        "shared_question": M.shared_question(L // 4, [L // 2, L - L // 4 - L // 2]),
        "global+sliding": M.or_(M.sliding_window(256), M.global_tokens(64)),
        "document&sliding": M.and_(M.document(docs), M.sliding_window(100)),
    }


@pytest.mark.parametrize("L", [1000, 4096])
@pytest.mark.parametrize("name", list(named(16)))
def test_one_launch_ranges_match_torch(name, L):
    m = named(L)[name]
    sz = Sizes(2, 4, 2, L, L, 128, 128, torch.device("cuda", torch.cuda.current_device()))
    got = m._column_ranges(sz)
    ref = _stack_slots(m.slots(sz), sz)
    assert got.shape == ref.shape and torch.equal(got, ref)
    gpu = m.compile(2, 4, 2, L, L, device="cuda")
    M.clear_cache()
    cpu = m.compile(2, 4, 2, L, L, device="cpu")
    assert torch.equal(gpu.to_dense().cpu(), cpu.to_dense())


def dense(q, k, v, vis):
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~vis, float("-inf")).float(), -1).to(q.dtype)
    return p @ v


def test_attention_with_global_tokens():
    """FlashAttention error rule against dense float64 and dense float16 attention."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1536, 64, device="cuda", dtype=torch.float16, generator=g)
               for _ in range(3))
    mask = M.or_(M.sliding_window(200), M.global_tokens(100))
    vis = mask.to_dense(1, 4, 1536, 1536, device="cuda")
    out = flexsparse.attention(q, k, v, mask)
    ref = dense(q.double(), k.double(), v.double(), vis)
    low = dense(q, k, v, vis)
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * (low.double() - ref).abs().max().item() + 1e-5
