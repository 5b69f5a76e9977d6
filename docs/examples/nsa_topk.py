"""NSA-style selected attention: each query attends to the keys of its top-k key blocks.

Native Sparse Attention's selection branch: keys are compressed per block (here: the mean
of each block of 16 keys), every query scores the compressed blocks, keeps its top-k
blocks (causal: only blocks that start at or before it; its own block always), and
attends to all keys of those blocks, shared across the query heads of a KV group (GQA).
The selection becomes per-query key index lists, `masks.indices(idx, causal=True)`.
`masks.topk(scores, k)` does the same for token-level scores. Both are checked against
float64 PyTorch attention on the equivalent dense mask, outputs and gradients.

    python docs/examples/nsa_topk.py
"""
import torch

import flexsparse
from flexsparse import masks

dev = "cuda" if torch.cuda.is_available() else "cpu"       # CPU: the reference backend
dt = torch.bfloat16 if dev == "cuda" else torch.float32
torch.manual_seed(0)
B, Hq, Hkv, L, D, BLOCK, TOPK = 2, 8, 2, 128, 32, 16, 3
G, nB = Hq // Hkv, L // BLOCK

q = torch.randn(B, Hq, L, D, device=dev, dtype=dt, requires_grad=True)
k = torch.randn(B, Hkv, L, D, device=dev, dtype=dt, requires_grad=True)
v = torch.randn(B, Hkv, L, D, device=dev, dtype=dt, requires_grad=True)

with torch.no_grad():
    # block scores of each KV group: its query heads' mean against the compressed keys
    k_cmp = k.float().view(B, Hkv, nB, BLOCK, D).mean(3)                    # (B, Hkv, nB, D)
    q_grp = q.float().view(B, Hkv, G, L, D).mean(2)                         # (B, Hkv, L, D)
    s = q_grp @ k_cmp.transpose(-1, -2)                                     # (B, Hkv, L, nB)
    i = torch.arange(L, device=dev)
    own = (i // BLOCK)[:, None] == torch.arange(nB, device=dev)
    s = s.masked_fill(torch.arange(nB, device=dev) * BLOCK > i[:, None], float("-inf"))
    s = s.masked_fill(own, float("inf"))                                    # own block kept
    top = s.topk(min(TOPK, nB), -1)
    blocks = torch.where(top.values > float("-inf"), top.indices, -1)      # (B, Hkv, L, TOPK)
    # block -> its keys: index lists of TOPK * BLOCK entries, -1 = unused
    idx = blocks[..., None] * BLOCK + torch.arange(BLOCK, device=dev)
    idx = torch.where(blocks[..., None] >= 0, idx, -1).flatten(-2).sort(-1).values

selected = masks.indices(idx, causal=True)      # future keys of the own block -> -1


def dense_reference(mask_bool):                 # float64 attention on a dense mask
    kk = k.double().repeat_interleave(G, 1)
    vv = v.double().repeat_interleave(G, 1)
    sc = (q.double() @ kk.transpose(-1, -2)) / D ** 0.5
    return sc.masked_fill(~mask_bool, float("-inf")).softmax(-1) @ vv


def dense_from_indices(ix, causal):
    m = torch.zeros(B, ix.shape[1], L, L + 1, dtype=torch.bool, device=dev)
    m.scatter_(-1, torch.where(ix >= 0, ix, L).long(), True)
    m = m[..., :L]
    if causal:
        m &= torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    return m.repeat_interleave(Hq // ix.shape[1], 1)


def check(name, mask, mask_bool):
    dout = torch.randn(B, Hq, L, D, device=dev, dtype=dt)
    res = []
    for f in (lambda: flexsparse.attention(q, k, v, mask), lambda: dense_reference(mask_bool)):
        for t in (q, k, v):
            t.grad = None
        out = f()
        out.backward(dout.to(out.dtype))
        res.append([out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()])
    tol = dict(atol=5e-2, rtol=5e-2) if dt == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    for n, a, b in zip(["out", "dq", "dk", "dv"], *res):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=n: f"{name} {n}: {m}")
    density = mask_bool.float().mean().item()
    print(f"{name}: out, dq, dk, dv match float64 attention on the dense mask "
          f"(density {density:.3f})")


check("NSA block selection, masks.indices", selected, dense_from_indices(idx, causal=True))
dense = selected.to_dense(B, Hq, L, L, num_kv_heads=Hkv)     # per KV head: (B, Hkv, L, L)
assert torch.equal(dense.repeat_interleave(Hq // dense.shape[1], 1), dense_from_indices(idx, True))

# token-level top-k from any score (here: a random learned-relevance stand-in)
scores = torch.randn(B, Hkv, L, L, device=dev)
tk = masks.topk(scores, 24, causal=True)
want = torch.zeros(B, Hkv, L, L, dtype=torch.bool, device=dev)
causal_scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=dev).tril(),
                                   float("-inf"))
top = causal_scores.topk(24, -1)
want.scatter_(-1, top.indices, top.values > float("-inf"))
check("token top-k, masks.topk", tk, want.repeat_interleave(G, 1))
print(f"OK nsa_topk on {dev}: selected attention matches float64 on the dense masks")
