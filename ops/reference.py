"""The reference backend: pure PyTorch, any device, float64-capable. It defines the semantics.

Work is done in chunks of query rows so that memory stays O(rows x Lk) (or O(rows x W)
for index lists), never a full (Lq, Lk) tensor per head. Inside a chunk everything is
laid out in "group form" (b, hkv, g, rows, cols): query head h = hkv * G + g, so GQA
never copies K/V. Forward and backward are written out by hand (no autograd inside the
op) and checked against autograd of a naive float64 computation in the tests.
"""
import math

import torch

from .schema import MaskTensors, lse_dtype
from .visibility import chunk_rows, from_groups_sum, to_groups, visible_rows

NAME = "reference"


def not_supported_reasons(query, key, value, bias, mask) -> list:
    return []


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_step(mask: MaskTensors, B, Hq, G, Lq, Lk, D, block_q):
    """Query rows per chunk: scores (rows x Lk), or gathered K/V rows (rows x W x D) for
    index lists; block masks step in whole query blocks."""
    if mask.attn_indices is not None:
        W = mask.attn_indices.shape[-1]
        return chunk_rows(Lq, B * Hq * W * D // max(G, 1) + B * Hq * W, 1)
    return chunk_rows(Lq, B * Hq * Lk, block_q)


# ---------------------------------------------------------------- shared math

def _bias_rows(bias, r0, r1, Hkv, G, dtype):
    b = bias[:, :, r0:r1] if bias.shape[2] != 1 else bias
    return to_groups(b, Hkv, G).to(dtype)


def _softcap(s, softcap):
    if softcap > 0:
        t = torch.tanh(s / softcap)
        return softcap * t, t
    return s, None


def _softmax_with_lse(s, vis):
    """Masked softmax along the last dim; rows with nothing visible give p = 0, lse = -inf.
    A row with a visible score of +inf (or NaN) has no softmax: p NaN, and lse NaN too, as
    in the kernels' online softmax (docs/semantics.md, "Non-finite input")."""
    s = s.masked_fill(~vis, -math.inf)
    m_raw = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m_raw), m_raw, torch.zeros_like(m_raw))
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    p = e / torch.where(l > 0, l, torch.ones_like(l))
    lse = torch.log(l) + m
    lse = torch.where(m_raw == math.inf, torch.full_like(lse, math.nan), lse).squeeze(-1)
    return p, lse


def _probs_from_lse(s, vis, lse5):
    lse_safe = torch.where(torch.isfinite(lse5), lse5, torch.zeros_like(lse5))
    p = torch.exp(s - lse_safe[..., None])
    return torch.where(vis, p, torch.zeros_like(p))


def _prepare(query, key, value):
    B, Hq, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    G = Hq // Hkv
    cd = _compute_dtype(query.dtype)
    k5 = key.to(cd).unsqueeze(2)      # (B, Hkv, 1, Lk, D)
    v5 = value.to(cd).unsqueeze(2)
    return B, Hq, Lq, D, Hkv, Lk, G, cd, k5, v5


def _gather_rows(x, idx, valid):
    """x (B, Hkv, Lk, D), idx (B|1, Hkv|1, rows, W) -> (B, Hkv, rows, W, D); entries that
    are not valid (-1 padding) read nothing: zeros, so a NaN or inf in row 0 (where the
    padding points after clamping) reaches no other row."""
    B, Hkv, _, D = x.shape
    rows, W = idx.shape[-2:]
    flat = idx.expand(B, Hkv, rows, W).reshape(B, Hkv, rows * W, 1).expand(-1, -1, -1, D)
    got = torch.gather(x, 2, flat).view(B, Hkv, rows, W, D)
    return torch.where(valid.unsqueeze(-1), got, torch.zeros((), dtype=x.dtype, device=x.device))


def _index_rows(mask, r0, r1, Lk):
    idx = mask.attn_indices[:, :, r0:r1].to(torch.int64)
    valid = (idx >= 0) & (idx < Lk)
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def _gather_bias(bias5, idx, valid, B, Hkv, G, rows, Lk):
    """Group-form bias (b, hkv|1, g|1, rows|1, Lk|1) gathered at idx -> (B, Hkv, G, rows, W);
    0 at padding entries (they read nothing)."""
    full = bias5.expand(B, Hkv, G, rows, Lk)
    ix = idx.unsqueeze(2).expand(B, Hkv, G, rows, idx.shape[-1])
    got = torch.gather(full, -1, ix)
    return torch.where(valid.unsqueeze(2), got, torch.zeros((), dtype=got.dtype, device=got.device))


# ---------------------------------------------------------------- forward

def _probs_times_values(p, v):
    """p @ v, where a non-finite value reaches only the rows that see its key (p > 0): an
    invisible key has p = 0, and 0 * inf = NaN must not poison rows that never see it
    (docs/semantics.md, "Non-finite input")."""
    bad = ~torch.isfinite(v)
    if not bool(bad.any()):
        return p @ v
    out = p @ torch.where(bad, torch.zeros_like(v), v)
    keys = bad.any(-1).flatten(0, -2).any(0).nonzero().flatten()      # keys holding one
    p_j = p[..., keys].unsqueeze(-1)                                    # (.., rows, J, 1)
    v_j = torch.where(bad, v, torch.zeros_like(v))[..., keys, :].unsqueeze(-3)   # (.., 1, J, Dv)
    return out + torch.where(p_j > 0, p_j * v_j, torch.zeros_like(p_j * v_j)).sum(-2)


def forward(query, key, value, bias, mask: MaskTensors, block_q, block_k, scale, softcap,
            deterministic, options=None):
    # `options` (kernel options) tune kernels; the reference has none to tune.
    B, Hq, Lq, D, Hkv, Lk, G, cd, k5, v5 = _prepare(query, key, value)
    Dv = value.shape[-1]
    out = torch.zeros((B, Hq, Lq, Dv), dtype=query.dtype, device=query.device)
    lse = torch.full((B, Hq, Lq), -math.inf, dtype=lse_dtype(query.dtype), device=query.device)
    if Lq == 0 or Lk == 0:
        return out, lse
    index_mode = mask.attn_indices is not None
    step = _row_step(mask, B, Hq, G, Lq, Lk, max(D, Dv), block_q)
    for r0 in range(0, Lq, step):
        r1 = min(Lq, r0 + step)
        rows = r1 - r0
        q5 = query[:, :, r0:r1].to(cd).unflatten(1, (Hkv, G))
        if index_mode:
            idx, valid = _index_rows(mask, r0, r1, Lk)
            k_sel = _gather_rows(k5.squeeze(2), idx, valid)
            v_sel = _gather_rows(v5.squeeze(2), idx, valid)
            s, _ = _softcap(torch.einsum("bhgrd,bhrwd->bhgrw", q5, k_sel) * scale, softcap)
            if bias is not None:
                s = s + _gather_bias(_bias_rows(bias, r0, r1, Hkv, G, cd), idx, valid, B, Hkv, G,
                                     rows, Lk)
            p, l = _softmax_with_lse(s, valid.unsqueeze(2))
            o = torch.einsum("bhgrw,bhrwd->bhgrd", p, v_sel)
        else:
            vis = visible_rows(mask, r0, r1, Lk, block_q, block_k, Hkv, G)
            s, _ = _softcap(q5 @ k5.transpose(-1, -2) * scale, softcap)
            if bias is not None:
                s = s + _bias_rows(bias, r0, r1, Hkv, G, cd)
            p, l = _softmax_with_lse(s, vis)
            o = _probs_times_values(p, v5)
        out[:, :, r0:r1] = o.flatten(1, 2).to(query.dtype)
        lse[:, :, r0:r1] = l.flatten(1, 2).to(lse.dtype)
    return out, lse


# ---------------------------------------------------------------- backward

def backward(grad_out, grad_lse, query, key, value, out, lse, bias, mask: MaskTensors,
             block_q, block_k, scale, softcap, deterministic, bias_requires_grad, options=None):
    B, Hq, Lq, D, Hkv, Lk, G, cd, k5, v5 = _prepare(query, key, value)
    Dv = value.shape[-1]
    dq = torch.zeros((B, Hq, Lq, D), dtype=cd, device=query.device)
    dk = torch.zeros((B, Hkv, Lk, D), dtype=cd, device=query.device)
    dv = torch.zeros((B, Hkv, Lk, Dv), dtype=cd, device=query.device)
    want_dbias = bias is not None and bias_requires_grad
    dbias = torch.zeros(bias.shape, dtype=cd, device=bias.device) if want_dbias else None
    index_mode = mask.attn_indices is not None
    if Lq > 0 and Lk > 0:
        step = _row_step(mask, B, Hq, G, Lq, Lk, max(D, Dv), block_q)
        for r0 in range(0, Lq, step):
            r1 = min(Lq, r0 + step)
            rows = r1 - r0
            q5 = query[:, :, r0:r1].to(cd).unflatten(1, (Hkv, G))
            do5 = grad_out[:, :, r0:r1].to(cd).unflatten(1, (Hkv, G))
            o5 = out[:, :, r0:r1].to(cd).unflatten(1, (Hkv, G))
            lse5 = lse[:, :, r0:r1].to(cd).unflatten(1, (Hkv, G))
            delta = (do5 * o5).sum(-1, keepdim=True)
            if grad_lse is not None:
                delta = delta - grad_lse[:, :, r0:r1].to(cd).unflatten(1, (Hkv, G))[..., None]
            if index_mode:
                idx, valid = _index_rows(mask, r0, r1, Lk)
                k_sel = _gather_rows(k5.squeeze(2), idx, valid)
                v_sel = _gather_rows(v5.squeeze(2), idx, valid)
                s, t = _softcap(torch.einsum("bhgrd,bhrwd->bhgrw", q5, k_sel) * scale, softcap)
                if bias is not None:
                    s = s + _gather_bias(_bias_rows(bias, r0, r1, Hkv, G, cd), idx, valid, B,
                                         Hkv, G, rows, Lk)
                p = _probs_from_lse(s, valid.unsqueeze(2), lse5)
                dp = torch.einsum("bhgrd,bhrwd->bhgrw", do5, v_sel)
                ds = p * (dp - delta)
                if want_dbias:
                    full = torch.zeros((B, Hkv, G, rows, Lk), dtype=cd, device=query.device)
                    full.scatter_add_(-1, idx.unsqueeze(2).expand_as(ds), ds)
                    _accumulate_dbias(dbias, full, r0, r1)
                if t is not None:
                    ds = ds * (1 - t * t)
                ds = ds * scale
                dq[:, :, r0:r1] = torch.einsum("bhgrw,bhrwd->bhgrd", ds, k_sel).flatten(1, 2)
                W = idx.shape[-1]
                flat = idx.expand(B, Hkv, rows, W).reshape(B, Hkv, rows * W, 1)
                dk_c = torch.einsum("bhgrw,bhgrd->bhrwd", ds, q5).reshape(B, Hkv, rows * W, D)
                dv_c = torch.einsum("bhgrw,bhgrd->bhrwd", p, do5).reshape(B, Hkv, rows * W, Dv)
                dk.scatter_add_(2, flat.expand(-1, -1, -1, D), dk_c)
                dv.scatter_add_(2, flat.expand(-1, -1, -1, Dv), dv_c)
            else:
                vis = visible_rows(mask, r0, r1, Lk, block_q, block_k, Hkv, G)
                s, t = _softcap(q5 @ k5.transpose(-1, -2) * scale, softcap)
                if bias is not None:
                    s = s + _bias_rows(bias, r0, r1, Hkv, G, cd)
                p = _probs_from_lse(s, vis, lse5)
                dp = do5 @ v5.transpose(-1, -2)
                ds = p * (dp - delta)
                if want_dbias:
                    _accumulate_dbias(dbias, ds, r0, r1)
                if t is not None:
                    ds = ds * (1 - t * t)
                ds = ds * scale
                dq[:, :, r0:r1] = (ds @ k5).flatten(1, 2)
                dk += torch.einsum("bhgrk,bhgrd->bhkd", ds, q5)
                dv += torch.einsum("bhgrk,bhgrd->bhkd", p, do5)
    dbias_out = dbias.to(bias.dtype) if want_dbias else query.new_empty((0,))
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), dbias_out


def _accumulate_dbias(dbias, ds5, r0, r1):
    Bb, Hb, Lqb, Lkb = dbias.shape
    part = from_groups_sum(ds5, (Bb, Hb, 1 if Lqb == 1 else r1 - r0, Lkb))
    if Lqb == 1:
        dbias += part
    else:
        dbias[:, :, r0:r1] += part
