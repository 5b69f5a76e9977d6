"""Independent definitions for tests: masks as Python predicates, attention as dense float64 autograd.

Nothing here imports flexsparse's mask or reference code: it is the second opinion.
"""
import math

import torch


def predicate_dense(pred, B, H, Lq, Lk):
    """bool (B, H, Lq, Lk) from pred(b, h, i, j)."""
    out = torch.zeros(B, H, Lq, Lk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                for j in range(Lk):
                    out[b, h, i, j] = bool(pred(b, h, i, j))
    return out


def causal(Lq, Lk):
    return lambda b, h, i, j: j <= i + (Lk - Lq)


def sliding(Lq, Lk, left, right):
    def pred(b, h, i, j):
        ip = i + (Lk - Lq)
        return (left is None or ip - left <= j) and (right is None or j <= ip + right)
    return pred


def document(lengths, causal_):
    def doc_of(lens, x):
        acc = 0
        for d, n in enumerate(lens):
            acc += n
            if x < acc:
                return d
        return len(lens)

    def pred(b, h, i, j):
        lens = lengths[b] if isinstance(lengths[0], (list, tuple)) else lengths
        same = doc_of(lens, i) == doc_of(lens, j)
        return same and (not causal_ or j <= i)
    return pred


def prefix_lm(Lq, Lk, prefix):
    def pred(b, h, i, j):
        p = prefix[b] if isinstance(prefix, (list, tuple)) else prefix
        return j < p or j <= i + (Lk - Lq)
    return pred


def shared_question(q_len, answers):
    bounds = []
    start = q_len
    for n in answers:
        bounds.append((start, start + n))
        start += n

    def seg(x):
        if x < q_len:
            return -1
        for a, (s, e) in enumerate(bounds):
            if s <= x < e:
                return a
        return None

    def pred(b, h, i, j):
        if j > i:
            return False
        return seg(j) == -1 or seg(j) == seg(i)
    return pred


def flashmask(t, causal_, Lq, Lk):
    """FlashMask column ranges, straight from the spec. t: (B|1, H|1, Lk, C)."""
    C = t.shape[-1]

    def pred(b, h, i, j):
        r = t[min(b, t.shape[0] - 1), min(h, t.shape[1] - 1), j].tolist()
        if causal_ and j > i + (Lk - Lq):
            return False
        if C == 1:
            return not (i >= r[0])
        if C == 2 and causal_:
            return not (r[0] <= i < r[1])
        if C == 2:
            return not (i >= r[0] or i < r[1])
        return not (r[0] <= i < r[1] or r[2] <= i < r[3])
    return pred


def block_layout(layout, bq, bk):
    def pred(b, h, i, j):
        return bool(layout[min(b, layout.shape[0] - 1), min(h, layout.shape[1] - 1), i // bq, j // bk])
    return pred


def attention(q, k, v, vis=None, bias=None, scale=None, softcap=0.0, counts=None):
    """Dense float64 attention with autograd. vis: bool broadcastable to (B, Hq, Lq, Lk);
    counts: per-(i, j) multiplicity (index lists). Returns (out, lse)."""
    B, Hq, Lq, D = q.shape
    G = Hq // k.shape[1]
    k = k.repeat_interleave(G, 1)
    v = v.repeat_interleave(G, 1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        b = bias
        if b.shape[1] not in (1, Hq):
            b = b.repeat_interleave(G, 1)
        s = s + b
    if counts is not None:
        vis = counts > 0
        s = s + torch.log(counts.clamp(min=1).to(s.dtype))
    if vis is None:
        vis = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    if vis.shape[1] not in (1, Hq):
        vis = vis.repeat_interleave(G, 1)
    vis = vis.expand(B, Hq, Lq, k.shape[2])
    row_any = vis.any(-1, keepdim=True)
    s = s.masked_fill(~vis, -math.inf)
    s = torch.where(row_any, s, torch.zeros_like(s))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1) * row_any
    lse = torch.where(row_any.squeeze(-1), lse, torch.full_like(lse, -math.inf))
    return p @ v, lse


def index_counts(idx, B, Hkv, G, Lq, Lk):
    """Multiplicity (B, Hq, Lq, Lk) of each key in each query's list (−1 ignored)."""
    idx = idx.expand(B, Hkv, Lq, idx.shape[-1]).long()
    counts = torch.zeros(B, Hkv, Lq, Lk + 1)
    counts.scatter_add_(-1, torch.where(idx >= 0, idx, Lk), torch.ones_like(idx, dtype=counts.dtype))
    return counts[..., :Lk].repeat_interleave(G, 1)
