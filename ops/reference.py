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

NAME = "reference"
# Elements of one (b, h, rows, cols) score chunk in the compute dtype.
CHUNK_ELEMENTS = 1 << 24


def not_supported_reasons(query, key, value, bias, mask) -> list:
    return []


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_groups(t: torch.Tensor, Hkv: int, G: int) -> torch.Tensor:
    """(b, h, ...) with h in {1, Hkv, Hkv*G}  ->  (b, hkv|1, g|1, ...)."""
    if t.shape[1] == Hkv * G and G > 1:
        return t.unflatten(1, (Hkv, G))
    return t.unsqueeze(2)


def from_groups_sum(t: torch.Tensor, shape) -> torch.Tensor:
    """Sum a group-form gradient (b, hkv, g, rows, cols) down to a broadcast `shape` (4-D)."""
    Bb, Hb, Lqb, Lkb = shape
    if Lkb == 1:
        t = t.sum(-1, keepdim=True)
    if Lqb == 1:
        t = t.sum(-2, keepdim=True)
    Hkv, G = t.shape[1], t.shape[2]
    if Hb == Hkv * G:
        t = t.flatten(1, 2)
    elif Hb == Hkv:
        t = t.sum(2)
    else:
        t = t.sum((1, 2)).unsqueeze(1)
    if Bb == 1:
        t = t.sum(0, keepdim=True)
    return t


def chunk_rows(total_rows, per_row, align):
    """Rows per chunk so one chunk holds about CHUNK_ELEMENTS elements; a multiple of align."""
    rows = max(1, CHUNK_ELEMENTS // max(1, per_row))
    rows = max(align, rows // align * align)
    return min(rows, max(total_rows, 1))


def _row_step(mask: MaskTensors, B, Hq, G, Lq, Lk, D, block_q):
    """Query rows per chunk: scores (rows x Lk), or gathered K/V rows (rows x W x D) for
    index lists; block masks step in whole query blocks."""
    if mask.attn_indices is not None:
        W = mask.attn_indices.shape[-1]
        return chunk_rows(Lq, B * Hq * W * D // max(G, 1) + B * Hq * W, 1)
    return chunk_rows(Lq, B * Hq * Lk, block_q)


# ---------------------------------------------------------------- visibility

def ranges_to_grid(ranges: torch.Tensor, n: int, count=None) -> torch.Tensor:
    """bool (.., n): which of blocks 0..n-1 a range-form row (.., R, 2) of [lo, hi) holds.
    count (..): only the row's first `count` blocks, in range order (negative: none), as
    the kernels read a list row."""
    blocks = torch.arange(n, device=ranges.device)
    r = ranges.to(torch.int64)
    lo, hi = r[..., 0:1], r[..., 1:2]                       # (.., R, 1)
    hit = (blocks >= lo) & (blocks < hi)                    # (.., R, n)
    if count is not None:
        length = (hi - lo).clamp(min=0)
        before = length.cumsum(-2) - length                 # blocks in the ranges before
        hit = hit & (before + blocks - lo < count.to(torch.int64)[..., None, None])
    return hit.any(-2)


def block_state(mask: MaskTensors, qb0, qb1, nKB, device):
    """int32 (Bd, Hd, qb1-qb0, nKB): 0 skipped, 1 partial, 2 full.

    A list is either explicit, index (Bd, Hd, nQB, W) with the first `count` entries used,
    or in range form, index (Bd, Hd, nQB, R, 2) of half-open block ranges [lo, hi)."""
    state = None
    for count, index, value in ((mask.kv_count, mask.kv_index, 1),
                                (mask.kv_full_count, mask.kv_full_index, 2)):
        if index.dim() == 5:
            hit = ranges_to_grid(index[:, :, qb0:qb1], nKB, count[:, :, qb0:qb1])
            s = torch.where(hit, value, 0).to(torch.int32)
        else:
            c = count[:, :, qb0:qb1].to(torch.int64)
            idx = index[:, :, qb0:qb1, :].to(torch.int64)
            # the first `count` entries; entries outside [0, nKB) are skipped (as in the kernels)
            valid = ((torch.arange(idx.shape[-1], device=device) < c[..., None])
                     & (idx >= 0) & (idx < nKB))
            s = torch.zeros(c.shape + (nKB,), dtype=torch.int32, device=device)
            src = torch.where(valid, torch.full_like(idx, value, dtype=torch.int32),
                              torch.zeros_like(idx, dtype=torch.int32))
            s.scatter_reduce_(-1, idx.clamp(0, max(nKB - 1, 0)), src, "amax")
        state = s if state is None else torch.maximum(state, s)
    return state


def col_ranges_visible(col_ranges: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """bool (Bc, Hc, r1-r0, Lk): True where no masked interval of column j holds row i."""
    i = torch.arange(r0, r1, device=col_ranges.device)[:, None]
    masked = torch.zeros((1, 1, r1 - r0, col_ranges.shape[2]), dtype=torch.bool,
                         device=col_ranges.device)
    for r in range(col_ranges.shape[-1] // 2):
        start = col_ranges[..., 2 * r][:, :, None, :]
        end = col_ranges[..., 2 * r + 1][:, :, None, :]
        masked = masked | ((start <= i) & (i < end))
    return ~masked


def _bits_visible(mask: MaskTensors, qb0, qb1, rows, Lk, block_q, block_k):
    """bool (Bd, Hd, rows, Lk) from the partial-block bitmaps (True where no bitmap).
    An entry outside [0, P) of a corrupted index (P bitmaps in the pool) reads no bitmap,
    as -1 does (docs/semantics.md, "Corrupted descriptors")."""
    pidx = mask.partial_bits_index[:, :, qb0:qb1, :].to(torch.int64)
    pool = mask.partial_bits
    has = (pidx >= 0) & (pidx < pool.shape[0])
    if pool.shape[0] == 0:                                  # nothing to read
        pool = torch.zeros((1,) + tuple(pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    words = pool[torch.where(has, pidx, 0)]                 # (Bd, Hd, n, nKB, bq, nw)
    col = torch.arange(block_k, device=words.device)
    bits = (words[..., col // 32] >> (col % 32)) & 1           # (Bd, Hd, n, nKB, bq, bk)
    vis = (bits != 0) | (~has)[..., None, None]
    Bd, Hd, n, nKB = pidx.shape
    vis = vis.permute(0, 1, 2, 4, 3, 5).reshape(Bd, Hd, n * block_q, nKB * block_k)
    return vis[:, :, :rows, :Lk]


# ---------------------------------------------------------------- the op's block lists

# The eight block lists of a descriptor, in schema order.
LIST_NAMES = ("kv_count", "kv_index", "kv_full_count", "kv_full_index",
              "q_count", "q_index", "q_full_count", "q_full_index")


def lists_from_state(state, value):
    """(count, index) of the blocks whose state is `value`, ascending, explicit form."""
    sel = state == value
    count = sel.sum(-1).to(torch.int32)
    order = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices
    W = max(int(count.max().item()) if count.numel() else 0, 1)
    return count.contiguous(), order[..., :W].to(torch.int32).contiguous()


def complete_mask(mask: MaskTensors, Lq, Lk, block_q, block_k, device) -> MaskTensors:
    """The raw op's contract: any of the eight block lists may be left out. Without kv
    lists every block is listed (partial where element predicates are given, else full);
    without q lists they are the transpose of the kv lists. Lists given are kept. Index
    masks need none."""
    if mask.attn_indices is not None or all(getattr(mask, n) is not None for n in LIST_NAMES):
        return mask
    nQB, nKB = -(-Lq // block_q), -(-Lk // block_k)
    if mask.kv_count is None or mask.kv_full_count is None:
        has_pred = (mask.dense_mask is not None or mask.col_ranges is not None
                    or mask.partial_bits_index is not None)
        state = torch.full((1, 1, nQB, nKB), 1 if has_pred else 2, dtype=torch.int32,
                           device=device)
    else:
        state = block_state(mask, 0, nQB, nKB, device)
    stT = state.transpose(-1, -2)
    built = [*lists_from_state(state, 1), *lists_from_state(state, 2),
             *lists_from_state(stT, 1), *lists_from_state(stT, 2)]
    return mask._replace(**{n: getattr(mask, n) if getattr(mask, n) is not None else t
                            for n, t in zip(LIST_NAMES, built)})


def visible_rows(mask: MaskTensors, r0, r1, Lk, block_q, block_k, Hkv, G):
    """Group-form bool (b, hkv|1, g|1, r1-r0, Lk) of visible entries for query rows [r0, r1).

    r0 must be a multiple of block_q. Visible = full block, or partial block and every
    present element predicate (dense mask, column ranges, bitmaps) allows it.
    """
    device = mask.kv_count.device
    rows = r1 - r0
    qb0, qb1 = r0 // block_q, -(-r1 // block_q)
    nKB = -(-Lk // block_k)
    state = block_state(mask, qb0, qb1, nKB, device)
    state = state.repeat_interleave(block_q, dim=-2)[..., :rows, :]
    state = state.repeat_interleave(block_k, dim=-1)[..., :Lk]
    pred = torch.ones((1, 1, 1, 1, 1), dtype=torch.bool, device=device)
    if mask.dense_mask is not None:
        dm = mask.dense_mask
        dm = dm[:, :, r0:r1] if dm.shape[2] != 1 else dm
        pred = pred & to_groups(dm, Hkv, G)
    if mask.col_ranges is not None:
        pred = pred & to_groups(col_ranges_visible(mask.col_ranges, r0, r1), Hkv, G)
    if mask.partial_bits_index is not None:
        bits = _bits_visible(mask, qb0, qb1, rows, Lk, block_q, block_k)
        pred = pred & to_groups(bits, Hkv, G)
    state = to_groups(state, Hkv, G)
    return (state == 2) | ((state == 1) & pred)


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
