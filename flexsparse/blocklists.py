"""Block lists from sparse entries, and the O(N) builder for column-range masks.

`BlockDescriptor.from_block_state` starts from a dense (Bd, Hd, nQB, nKB) state: simple,
static-shaped (works under torch.compile), but O(nQB x nKB) in time and memory. The
builders here start from the list of *visited* blocks ("entries": batch/head, query
block, key block, full or partial) and never build the dense grid, so their cost is
O(entries): O(N) for banded masks (sliding windows, documents of bounded length, ...).
They are eager-only (the number of entries is data dependent) and sync once or twice
with the device to size their outputs.

Column ranges (`column_range_descriptor`): per key block, the query blocks that a
masked interval covers entirely form one contiguous range per interval; the visited
query blocks of a key block are the gaps between those ranges (at most m + 1 runs for m
intervals). Only those blocks are enumerated and classified, with the same per-key-block
interval statistics as `masks.col_ranges_block_state`, so the result is the same block
grid that function gives, without the grid.
"""
from typing import Optional, Tuple

import torch

from .descriptor import BlockDescriptor
from .ops.schema import MAX_RANGES

_BIG = 1 << 40
# Up to this many blocks (nQB x nKB) the lists keep the full widths nKB / nQB, as
# from_block_state does: tiny, and the shapes then depend on the lengths only, so a
# descriptor passed into torch.compile(dynamic=True) does not recompile when the data
# changes. Past it the widths are the longest list (O(N) for banded masks).
FULL_WIDTH_BLOCKS = 1 << 16


def lists_from_entries(row: torch.Tensor, col: torch.Tensor, n_rows: int, n_cols: int, *,
                       presorted: bool = False, width: Optional[int] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Padded ascending lists from (row, col) pairs, each pair at most once.

    row, col: int64 (E,). Returns count int32 (n_rows,) and index int32 (n_rows, W),
    W = max(1, max count) unless `width` is given; padding entries are 0.
    `presorted`: pairs are already sorted by (row, col).
    """
    device = row.device
    E = row.numel()
    if E and not presorted:
        key, _ = torch.sort(row * n_cols + col)
        row, col = key // n_cols, key % n_cols
    count = torch.bincount(row, minlength=n_rows) if E else torch.zeros(
        n_rows, dtype=torch.int64, device=device)
    if width is None:
        width = int(count.max()) if (E and n_rows) else 0
    width = max(1, width)
    index = torch.zeros((n_rows, width), dtype=torch.int32, device=device)
    if E:
        start = torch.cumsum(count, 0) - count
        pos = torch.arange(E, device=device) - start[row]
        index[row, pos] = col.to(torch.int32)
    return count.to(torch.int32), index


def descriptor_from_entries(bh_shape, nQB: int, nKB: int, bh: torch.Tensor, qb: torch.Tensor,
                            kb: torch.Tensor, full: torch.Tensor, *, seq_lengths, block_size,
                            num_heads, order: Optional[str] = None, **predicates
                            ) -> BlockDescriptor:
    """A BlockDescriptor from its visited blocks.

    bh: flat batch*head index in [0, Bd*Hd) (bh_shape = (Bd, Hd)); qb, kb: block indices;
    full: bool, False = partial. Entries must be unique. `order`: "q" if the entries are
    sorted by (bh, kb, qb) (the transposed lists need no sort), "kv" if sorted by
    (bh, qb, kb), None if unsorted.
    """
    Bd, Hd = bh_shape
    bh, qb, kb = bh.to(torch.int64), qb.to(torch.int64), kb.to(torch.int64)
    small = nQB * nKB <= FULL_WIDTH_BLOCKS
    out = {}
    for kind, sel in (("full", full), ("partial", ~full)):
        b_, q_, k_ = bh[sel], qb[sel], kb[sel]
        kv_c, kv_i = lists_from_entries(b_ * nQB + q_, k_, Bd * Hd * nQB, nKB,
                                        presorted=(order == "kv"), width=nKB if small else None)
        q_c, q_i = lists_from_entries(b_ * nKB + k_, q_, Bd * Hd * nKB, nQB,
                                      presorted=(order == "q"), width=nQB if small else None)
        out[kind] = (kv_c.view(Bd, Hd, nQB), kv_i.view(Bd, Hd, nQB, -1),
                     q_c.view(Bd, Hd, nKB), q_i.view(Bd, Hd, nKB, -1))
    (kv_c, kv_i, q_c, q_i), (kvf_c, kvf_i, qf_c, qf_i) = out["partial"], out["full"]
    return BlockDescriptor(tuple(seq_lengths), tuple(block_size), tuple(num_heads),
                           kv_c, kv_i, kvf_c, kvf_i, q_c, q_i, qf_c, qf_i, **predicates)


# ------------------------------------------------------------------ column ranges

def key_block_stats(cr: torch.Tensor, nKB: int, bk: int):
    """Per key block and interval: cover stats (s_cov, e_cov) and miss stats (s_miss, e_miss).

    cr (Bc, Hc, Lk, 2m) -> four int64 (Bc*Hc*nKB, m). Same rules as
    masks.col_ranges_block_state (which uses these): padded columns are neutral, empty
    intervals neither cover nor touch anything.
    """
    Bc, Hc, Lk, two_m = cr.shape
    m = two_m // 2
    pad = nKB * bk - Lk
    s = cr[..., 0::2].to(torch.int64)                    # (Bc, Hc, Lk, m)
    e = cr[..., 1::2].to(torch.int64)
    nonempty = s < e

    def pool(x, fill, op):
        x = torch.nn.functional.pad(x, (0, 0, 0, pad), value=fill)
        x = x.view(Bc * Hc * nKB, bk, m)
        return x.amax(1) if op == "max" else x.amin(1)

    s_cov = pool(s, 0, "max")
    e_cov = pool(torch.where(nonempty, e, 0), _BIG, "min")
    s_miss = pool(torch.where(nonempty, s, _BIG), _BIG, "min")
    e_miss = pool(torch.where(nonempty, e, -_BIG), -_BIG, "max")
    return s_cov, e_cov, s_miss, e_miss


def _query_block_bounds(s_cov, e_cov, s_miss, e_miss, Lq: int, bq: int, nQB: int):
    """Block statistics in query blocks: hull [h0, h1) (blocks an interval touches in some
    column) and cover [a, b) (blocks it covers in every column), clamped to [0, nQB]."""
    touched = s_miss < _BIG
    h0 = torch.where(touched, s_miss // bq, 0).clamp(0, nQB)
    h1 = torch.where(touched, (e_miss + bq - 1) // bq, 0).clamp(0, nQB)
    a = ((s_cov + bq - 1) // bq).clamp(0, nQB)
    b = torch.where(e_cov >= Lq, nQB, e_cov // bq).clamp(0, nQB)
    return h0, h1, a, b


def column_range_entries(cr: torch.Tensor, Lq: int, block_q: int, block_k: int):
    """Visited blocks of a column-range mask: (bh, qb, kb, full), sorted by (bh, kb, qb)."""
    Bc, Hc, Lk, two_m = cr.shape
    m = two_m // 2
    device = cr.device
    nQB, nKB = -(-Lq // block_q), -(-Lk // block_k)
    s_cov, e_cov, s_miss, e_miss = key_block_stats(cr, nKB, block_k)
    # Query blocks skipped because interval r covers all their rows: [a, b) per (kb, r).
    a, b = _query_block_bounds(s_cov, e_cov, s_miss, e_miss, Lq, block_q, nQB)[2:]
    empty = b <= a
    a = torch.where(empty, 0, a)
    b = torch.where(empty, 0, b)
    a, order = torch.sort(a, dim=-1)
    b = torch.gather(b, -1, order)
    covered_to = torch.cummax(b, dim=-1).values           # end of the union so far
    zero = torch.zeros_like(a[:, :1])
    run_start = torch.cat([zero, covered_to], -1)                          # (R, m+1)
    run_end = torch.cat([a, torch.full_like(zero, nQB)], -1)
    run_end = torch.maximum(run_end, run_start)
    counts = (run_end - run_start).flatten()
    E = int(counts.sum())
    runs = torch.arange(counts.numel(), device=device)
    rep = torch.repeat_interleave(runs, counts, output_size=E)
    offsets = torch.cumsum(counts, 0) - counts
    qb = run_start.flatten()[rep] + (torch.arange(E, device=device) - offsets[rep])
    key_row = rep // (m + 1)                                # bh * nKB + kb
    kb = key_row % nKB
    bh = key_row // nKB
    r0 = qb * block_q
    r1 = torch.clamp(r0 + block_q, max=Lq)
    full = ((s_miss[key_row] >= r1[:, None]) | (e_miss[key_row] <= r0[:, None])).all(-1)
    return bh, qb, kb, full


def column_range_descriptor(cr: torch.Tensor, *, seq_lengths, block_size, num_heads
                            ) -> BlockDescriptor:
    """O(entries) BlockDescriptor of a normalized column-range tensor (Bc, Hc, Lk, 2m)."""
    Lq, Lk = seq_lengths
    bq, bk = block_size
    Bc, Hc = cr.shape[:2]
    nQB, nKB = -(-Lq // bq), -(-Lk // bk)
    bh, qb, kb, full = column_range_entries(cr, Lq, bq, bk)
    return descriptor_from_entries((Bc, Hc), nQB, nKB, bh, qb, kb, full, order="q",
                                   seq_lengths=seq_lengths, block_size=block_size,
                                   num_heads=num_heads, col_ranges=cr)


# ------------------------------------------------------------------ column ranges as ranges
#
# Range form: a block list may be given as R half-open ranges of block indices,
# index (.., n, R, 2) int32, instead of explicit indices (.., n, W); the count stays the
# number of blocks. For the masks people use (causal, windows, documents, prefix-LM,
# shared-question, global + sliding) every row has a few ranges, so the descriptor is
# O(N / block) in time and memory where padded lists are O(N^2 / block^2).
#
# Per key block kb and masked interval r, in query blocks: the hull [h0, h1) holds the
# query blocks that the interval touches in some column of kb, the cover [a, b) those it
# covers in every column (same statistics as col_ranges_block_state). Then per kb:
# full = outside every hull, partial = inside a hull but no cover, skipped = in a cover.
# The transposed (per query block) sets are ranges too when h0, h1, a, b never decrease
# with kb: {kb : h0(kb) <= qb < h1(kb)} = [#(h1 <= qb), #(h0 <= qb)), two searchsorted.

# Ranges per row: always ops.schema.MAX_RANGES (unused ones empty), so shapes depend on the
# lengths only and a descriptor passed into torch.compile(dynamic=True) does not recompile.


def _pieces(lo, hi, n):
    """The union of intervals [lo, hi) (.., k) as k disjoint pieces sorted by start
    (pieces inside an earlier one become empty)."""
    empty = hi <= lo
    lo = torch.where(empty, n, lo)
    hi = torch.where(empty, n, hi)
    lo, order = torch.sort(lo, dim=-1)
    hi = torch.gather(hi, -1, order)
    ends = torch.cummax(hi, -1).values
    before = torch.cat([torch.zeros_like(ends[..., :1]), ends[..., :-1]], -1)
    lo = torch.maximum(lo, before)
    return lo, torch.maximum(hi, lo)


def _gaps(lo, hi, n):
    """[0, n) minus the union of sorted disjoint pieces: k + 1 ranges."""
    start = torch.cat([torch.zeros_like(lo[..., :1]), torch.cummax(hi, -1).values], -1)
    end = torch.cat([lo, torch.full_like(lo[..., :1], n)], -1)
    return start, torch.maximum(end, start)


def _set_ranges(h0, h1, a, b, n):
    """Full and partial ranges (lo, hi pairs, .. x k) from hulls [h0, h1) and covers [a, b) (.., m)."""
    hl, hh = _pieces(h0, h1, n)
    full = _gaps(hl, hh, n)
    cl, ch = _gaps(*_pieces(a, b, n), n)                 # where no cover is
    lo = torch.maximum(hl[..., :, None], cl[..., None, :]).flatten(-2)
    hi = torch.minimum(hh[..., :, None], ch[..., None, :]).flatten(-2)
    return full, (lo, torch.maximum(hi, lo))


def _compact(lo, hi, n, R):
    """Nonempty ranges first (sorted by start), the first R kept, as int32 (.., R, 2)."""
    empty = hi <= lo
    key = torch.where(empty, n + 1, lo)
    key, order = torch.sort(key, dim=-1)
    lo = torch.gather(lo, -1, order)[..., :R]
    hi = torch.gather(hi, -1, order)[..., :R]
    hi = torch.maximum(hi, lo)
    out = torch.stack([lo, hi], -1).to(torch.int32)
    if out.shape[-2] < R:                                  # pad with empty ranges [0, 0)
        out = torch.nn.functional.pad(out, (0, 0, 0, R - out.shape[-2]))
    return out


def _monotone_fill(lo, hi, n):
    """Empty intervals of sequences over kb (dim -2) moved so that lo and hi never decrease
    and they stay empty; returns (lo, hi, ok) with ok a 0-d bool tensor."""
    empty = hi <= lo
    nxt = torch.where(empty, n, lo).flip(-2).cummin(-2).values.flip(-2)
    prev = torch.where(empty, 0, hi).cummax(-2).values
    lo = torch.where(empty, nxt, lo)
    hi = torch.where(empty, prev, hi)
    ok = (~empty | (hi <= lo)).all()
    ok = ok & (lo[..., 1:, :] >= lo[..., :-1, :]).all() & (hi[..., 1:, :] >= hi[..., :-1, :]).all()
    return lo, hi, ok


def _triton_ranges():
    """flexsparse/triton_ranges.py (the GPU builder: 3 launches instead of ~300 ops), or None."""
    try:
        from . import triton_ranges
    except ImportError:
        return None
    return triton_ranges


def column_range_range_descriptor(cr: torch.Tensor, *, seq_lengths, block_size, num_heads
                                  ) -> Optional[BlockDescriptor]:
    """Range-form BlockDescriptor of a normalized column-range tensor (Bc, Hc, Lk, 2m), or
    None when some row would need more than MAX_RANGES ranges or a bound decreases with kb
    (use column_range_descriptor then). O(Lk + blocks); one host sync. On CUDA tensors
    the Triton kernels of flexsparse/triton_ranges.py compute the same block sets."""
    Lq, Lk = seq_lengths
    bq, bk = block_size
    Bc, Hc, _, two_m = cr.shape
    if cr.is_cuda and Lq > 0 and Lk > 0 and _triton_ranges() is not None:
        lists = _triton_ranges().column_range_lists(cr, Lq, bq, bk)
        if lists is None:
            return None
        return BlockDescriptor(tuple(seq_lengths), tuple(block_size), tuple(num_heads),
                               *lists, col_ranges=cr)
    m = two_m // 2
    BH = Bc * Hc
    nQB, nKB = -(-Lq // bq), -(-Lk // bk)
    stats = key_block_stats(cr, nKB, bk)                          # (BH*nKB, m) each
    h0, h1, a, b = _query_block_bounds(*stats, Lq, bq, nQB)
    # per key block (dK/dV pass): ranges of query blocks
    (qf_lo, qf_hi), (qp_lo, qp_hi) = _set_ranges(h0, h1, a, b, nQB)
    # per query block (forward, dQ): transpose the hulls and covers
    qbs = torch.arange(nQB, device=cr.device).expand(BH, m, nQB).contiguous()
    sets, ok = [], torch.ones((), dtype=torch.bool, device=cr.device)
    for lo, hi in ((h0, h1), (a, b)):
        lo, hi, good = _monotone_fill(lo.view(BH, nKB, m), hi.view(BH, nKB, m), nQB)
        ok = ok & good
        lo = lo.transpose(1, 2).contiguous()                   # (BH, m, nKB)
        hi = hi.transpose(1, 2).contiguous()
        first = torch.searchsorted(hi, qbs, right=True)        # #(hi <= qb)
        last = torch.searchsorted(lo, qbs, right=True)         # #(lo <= qb)
        sets += [first.transpose(1, 2), last.transpose(1, 2)]   # (BH, nQB, m)
    (kf_lo, kf_hi), (kp_lo, kp_hi) = _set_ranges(*sets, nKB)
    widths = torch.stack([((hi > lo).sum(-1)).amax() if lo.numel() else lo.new_zeros(())
                          for lo, hi in ((qf_lo, qf_hi), (qp_lo, qp_hi), (kf_lo, kf_hi),
                                         (kp_lo, kp_hi))])
    if not bool(ok & (widths.max() <= MAX_RANGES)):
        return None
    out = []
    for (lo, hi), n_rows, n in (((kp_lo, kp_hi), nQB, nKB), ((kf_lo, kf_hi), nQB, nKB),
                                ((qp_lo, qp_hi), nKB, nQB), ((qf_lo, qf_hi), nKB, nQB)):
        count = (hi - lo).clamp(min=0).sum(-1).to(torch.int32).view(Bc, Hc, n_rows)
        out += [count, _compact(lo, hi, n, MAX_RANGES).view(Bc, Hc, n_rows, MAX_RANGES, 2)]
    return BlockDescriptor(tuple(seq_lengths), tuple(block_size), tuple(num_heads), *out,
                           col_ranges=cr)
