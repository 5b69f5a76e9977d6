"""FlexAttention masks inside torch.compile(fullgraph=True, dynamic=True) (issue 16): a
BlockMask made inside the compiled function or passed in, from_block_mask, and from_mask_mod
with a mask_mod that closes over tensors, over several lengths in one frame, against
FlexAttention's own semantics (the dense mask of the same mask_mod, restricted to the
BlockMask's listed blocks)."""
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import flexsparse
from flexsparse import flex

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
LENGTHS = (64, 100, 160)      # one not a multiple of the block: no guard on it
BS = 16      # the BlockMasks' block size, and the descriptors' (lengths > one block: a
             # single query block is a size-1 dimension, which torch.compile specializes)


def _compiled(fn):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, backend=counter, fullgraph=True, dynamic=True), counter


def _qkv(L, B=2, H=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed + L)
    return tuple(torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))


def _dense_reference(q, k, v, visible):
    """Attention with a bool (B|1, H|1, Lq, Lk) mask; rows that see nothing give 0."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def causal(b, h, q, kv):
    return q >= kv


def test_block_mask_made_inside_the_compiled_function():
    def f(q, k, v):
        L = q.shape[2]
        bm = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=BS)
        return flexsparse.attention(q, k, v, bm, block_size=(BS, BS))

    fc, counter = _compiled(f)
    for L in LENGTHS:
        q, k, v = _qkv(L)
        vis = create_mask(causal, None, None, L, L, device="cpu")
        torch.testing.assert_close(fc(q, k, v), _dense_reference(q, k, v, vis))
    assert counter.frame_count == 1


def test_block_mask_passed_in_with_partial_full_and_skipped_blocks():
    """A document mask_mod closing over a tensor, a BlockMask with all three block kinds,
    built outside and passed in; and its gradients."""
    def f(q, k, v, bm):
        return flexsparse.attention(q, k, v, bm, block_size=(BS, BS))

    fc, counter = _compiled(f)
    for L in LENGTHS:
        doc = torch.zeros(L, dtype=torch.int64)
        doc[L // 2:] = 1
        doc[3 * L // 4 + 3:] = 2

        def document_causal(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)
        bm = create_block_mask(document_causal, None, None, L, L, device="cpu", BLOCK_SIZE=BS)
        assert bm.full_kv_num_blocks is not None and int(bm.full_kv_num_blocks.sum()) > 0
        q, k, v = (t.requires_grad_() for t in _qkv(L))
        vis = create_mask(document_causal, None, None, L, L, device="cpu")
        out = fc(q, k, v, bm)
        ref = _dense_reference(q, k, v, vis)
        torch.testing.assert_close(out, ref)
        go = torch.randn_like(out)
        torch.testing.assert_close(torch.autograd.grad(out, (q, k, v), go),
                                   torch.autograd.grad(ref, (q, k, v), go))
    assert counter.frame_count == 1


def test_broadcast_block_mask_calls_mask_mod_per_head():
    """FlexAttention calls mask_mod with the real head even when the BlockMask broadcasts
    over heads: a head-dependent mask_mod in a BlockMask built for head 0 (every listed
    block partial, since head 0's pattern has holes in every block)."""
    def per_head(b, h, q, kv):
        return (q >= kv) & ((kv % (h + 2)) != 0)

    def f(q, k, v):
        L = q.shape[2]
        bm = create_block_mask(per_head, None, None, L, L, device="cpu", BLOCK_SIZE=BS)
        return flexsparse.attention(q, k, v, bm, block_size=(BS, BS))

    fc, counter = _compiled(f)
    for L in LENGTHS:
        q, k, v = _qkv(L, H=3)
        bm = create_block_mask(per_head, None, None, L, L, device="cpu", BLOCK_SIZE=BS)
        assert bm.full_kv_num_blocks is None or int(bm.full_kv_num_blocks.sum()) == 0
        vis = create_mask(per_head, 1, 3, L, L, device="cpu")
        want = _dense_reference(q, k, v, vis)
        torch.testing.assert_close(flexsparse.attention(q, k, v, bm, block_size=(BS, BS)), want)
        torch.testing.assert_close(fc(q, k, v), want)
    assert counter.frame_count == 1


def test_from_mask_mod_inside_compile_closing_over_a_tensor():
    def f(q, k, v, prefix):
        L = q.shape[2]

        def prefix_lm(b, h, qi, kv):
            return (kv <= qi) | (kv < prefix[b])
        m = flex.from_mask_mod(prefix_lm, q.shape[0], None, L, L, block_size=BS)
        return flexsparse.attention(q, k, v, m, block_size=(BS, BS))

    fc, counter = _compiled(f)
    for L in LENGTHS:
        q, k, v = _qkv(L)
        prefix = torch.tensor([L // 4, L // 2])
        i = torch.arange(L)
        vis = (i[None, :] <= i[:, None])[None] | (i[None, None, :] < prefix[:, None, None])
        torch.testing.assert_close(fc(q, k, v, prefix), _dense_reference(q, k, v, vis[:, None]))
    assert counter.frame_count == 1


def test_block_listed_twice_fails_the_compiled_graph():
    def f(q, k, v, bm):
        return flexsparse.attention(q, k, v, bm, block_size=(BS, BS))

    L = 64
    bm = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=BS)
    # the diagonal blocks of the partial list also in the full list
    bm.full_kv_num_blocks = torch.ones_like(bm.kv_num_blocks)
    bm.full_kv_indices = bm.kv_indices.clone()
    bm.full_kv_indices[..., 0] = torch.arange(L // BS)
    fc, _ = _compiled(f)
    q, k, v = _qkv(L)
    with pytest.raises(RuntimeError, match="listed twice"):
        fc(q, k, v, bm)
    with pytest.raises(ValueError, match="listed twice"):       # eager: the same check
        flexsparse.attention(q, k, v, bm, block_size=(BS, BS))


def test_block_mask_at_other_lengths_is_refused_inside_compile():
    def f(q, k, v, bm):
        return flexsparse.attention(q, k, v, bm, block_size=(BS, BS))

    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=BS)
    fc, _ = _compiled(f)
    q, k, v = _qkv(96)
    with pytest.raises(Exception, match=r"\(64, 64\)") as e:
        fc(q, k, v, bm)
    assert "96" in str(e.value)
