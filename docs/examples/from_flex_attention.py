"""Converting a FlexAttention model to flexsparse, and checking that the outputs agree.

An existing layer calls torch.nn.attention.flex_attention with a BlockMask made from a
mask_mod (here: a sliding window of 48 inside documents, plus 4 global tokens). The
same mask runs in flexsparse three ways:
- the BlockMask as it is: `flexsparse.attention(q, k, v, block_mask)`;
- `flex.from_block_mask(bm)`: an exact flexsparse mask (mask_mod is evaluated only in
  the BlockMask's partial blocks), compiled once and reused;
- `flex.from_mask_mod(mask_mod, B, H, L, L)`: straight from mask_mod, no BlockMask.
Outputs are compared with flex_attention's, gradients with flex_attention's on a GPU and
with float64 PyTorch attention on the dense mask_mod everywhere (FlexAttention has no
backward on CPU).

    python docs/examples/from_flex_attention.py
"""
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flexsparse
from flexsparse import flex as converters, masks

dev = "cuda" if torch.cuda.is_available() else "cpu"       # CPU: the reference backend
dt = torch.bfloat16 if dev == "cuda" else torch.float32
torch.manual_seed(0)
B, H, L, D, WINDOW, GLOBAL = 2, 4, 256, 32, 48, 4
doc_id = torch.repeat_interleave(torch.arange(3, device=dev), torch.tensor([100, 60, 96], device=dev))


def mask_mod(b, h, q_idx, kv_idx):          # the model's FlexAttention mask
    local = (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW) & (doc_id[q_idx] == doc_id[kv_idx])
    return local | (kv_idx < GLOBAL) & (q_idx >= kv_idx)


block_mask = create_block_mask(mask_mod, None, None, L, L, device=dev, BLOCK_SIZE=64)

q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
dout = torch.randn(B, H, L, D, device=dev, dtype=dt)


def run(attend):
    for t in (q, k, v):
        t.grad = None
    out = attend(q, k, v)
    out.backward(dout)
    return out.detach(), [t.grad.clone() for t in (q, k, v)]


i = torch.arange(L, device=dev)
dense_mask = torch.vmap(torch.vmap(lambda a, b: mask_mod(0, 0, a, b), (None, 0)), (0, None))(i, i)


def dense_attention(q, k, v):           # float64, the mask_mod evaluated on every element
    s = (q.double() @ k.double().transpose(-1, -2)) / D ** 0.5
    return (s.masked_fill(~dense_mask, float("-inf")).softmax(-1) @ v.double()).to(dt)


flex = torch.compile(flex_attention) if dev == "cuda" else flex_attention
ref, ref_grads = run(dense_attention)
if dev == "cuda":
    want, want_grads = run(lambda q, k, v: flex(q, k, v, block_mask=block_mask))
else:
    with torch.no_grad():
        want = flex(q.detach(), k.detach(), v.detach(), block_mask=block_mask)
    want_grads = ref_grads
tol = dict(atol=3e-2, rtol=3e-2) if dt == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)
torch.testing.assert_close(want, ref, **tol)            # flex itself against float64

converted = converters.from_block_mask(block_mask)
desc = converted.compile(B, H, H, L, L, device=dev, block_size=(64, 64))   # once, reused
print(desc)
ways = {
    "BlockMask passed as it is": block_mask,
    "flex.from_block_mask": desc,
    "flex.from_mask_mod": converters.from_mask_mod(mask_mod, None, None, L, L, device=dev),
}
for name, m in ways.items():
    got, got_grads = run(lambda q, k, v: flexsparse.attention(q, k, v, m))
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **tol)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, **tol)
    print(f"{name}: output matches flex_attention (max |diff| "
          f"{(got - want).abs().max().item():.2e}), dq/dk/dv match "
          f"{'flex_attention and ' if dev == 'cuda' else ''}float64 attention")

# the converted mask is the same element for element
assert torch.equal(converted.to_dense(1, 1, L, L, device=dev)[0, 0], dense_mask)
print(f"OK from_flex_attention on {dev}: three conversions agree with flex_attention")
