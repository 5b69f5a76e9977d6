"""What a descriptor's mask tensors make visible: the semantics that every backend and the
mask layer share (the reference backend computes attention with it; descriptors print,
convert and compare with it; the Triton kernels take its completed block lists).

Tensors in "group form" (b, hkv, g, rows, cols): query head h = hkv * G + g, so GQA never
copies K/V; chunks of query rows keep memory at O(rows x Lk).
"""
import torch

from .schema import MaskTensors

# Elements of one (b, h, rows, cols) chunk in the compute dtype.
CHUNK_ELEMENTS = 1 << 24


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
