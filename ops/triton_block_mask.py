"""The block descriptor inside the Triton block kernels: how its tensors become kernel
arguments (host) and how the kernels read them (device). Both sides of each encoding sit
here, next to each other.

Block lists. The descriptor has four (docs/design.md): per query block, the key blocks with
element predicates (`kv_partial` = kv_count / kv_index) and without (`kv_full` =
kv_full_count / kv_full_index); per key block, the transposed lists (`q_partial` = q_count /
q_index, `q_full` = q_full_count / q_full_index). Each reaches a kernel as one tuple argument
of seven, `BlockListArgs` (count, index, batch stride, head stride, head divisor, row
width, row stride), plus a RANGES constexpr: 0 for explicit indices, R for the range form
with R range slots read, `EMPTY_LIST` when no row has a block (the loop is compiled out). A
row starts at `row = b * batch_stride + (h // head_div) * head_stride + block * row_stride`
(row stride 0: lists whose rows are one row expanded, stride 0, as the full mask's and a
layout's partial lists are, read as that one row without a copy), `_list_count` clamps
its count, and `_ranges_load` / `_list_tile` give its blocks.

Element predicates (applied in partial blocks only). Dense mask, column ranges and the
partial-block bitmaps reach every attention kernel as one tuple of 20, `preds` (the fields of
`PredicateArgs`), plus the constexprs of `PredicateFlags`; only `_visible` unpacks it.
Triton specializes each element of a tuple argument as it would a separate argument, so the
kernels compile to the same code as with the 20 passed one by one (the PTX of 36 launches
compared equal, docs/design.md). Up to four column-range slots per key are read ahead of the
tile as `_cr_prefetch`'s tuple of (start, end) vectors; `CR_KINDS` says per slot which bounds
are needed.

Head broadcast for every per-head tensor: a head dim of size 1, Hkv or Hq is read at head
`h // head_div` with head_div = Hq, G or 1. Batch dims of size 1 get stride 0.

Host caches (each keyed by the mask tensors' identity and version, never by address):
`_FACTS`, facts that need a host sync (one per descriptor tensor, skipped while a CUDA graph
is captured), and `_MASK_ARGS`, the kernel arguments of the last few descriptors. The
measurements behind them: docs/perf-notes.md changes 7, 13 and 14.
"""
import collections
import operator
import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .visibility import LIST_NAMES, complete_mask
from .schema import MAX_RANGES          # range-form lists: ranges per row _ranges_load reads

# RANGES of a block list that is empty in every row: its loop is compiled out.
EMPTY_LIST = -1

# Column-range slot kinds (2 bits per slot in CR_KINDS, see _slot_kinds): a slot whose
# starts are all 0 masks rows [0, e) ("upper"), one whose ends are all Lq masks [s, Lq)
# ("lower"): one bound to load and one compare per element instead of two and three.
KIND_GENERAL, KIND_UPPER, KIND_LOWER = 0, 1, 2


# ========================================================================== device: block lists

@triton.jit
def _ranges_load(idx_ptr, n, RANGES: tl.constexpr):
    """Range-form list (RANGES > 0): the start block of each of up to 4 ranges
    [lo_r, hi_r) and the cumulative lengths c_r = sum of the lengths before range r."""
    z = n * 0
    lo0 = z
    lo1 = z
    lo2 = z
    lo3 = z
    c1 = z
    c2 = z
    c3 = z
    if RANGES > 0:
        lo0 = tl.load(idx_ptr)
        c1 = tl.load(idx_ptr + 1) - lo0
    if RANGES > 1:
        lo1 = tl.load(idx_ptr + 2)
        c2 = c1 + tl.load(idx_ptr + 3) - lo1
    if RANGES > 2:
        lo2 = tl.load(idx_ptr + 4)
        c3 = c2 + tl.load(idx_ptr + 5) - lo2
    if RANGES > 3:
        lo3 = tl.load(idx_ptr + 6)
    return lo0, lo1, lo2, lo3, c1, c2, c3


@triton.jit
def _block_at(idx_ptr, t, lo0, lo1, lo2, lo3, c1, c2, c3, n_blocks, RANGES: tl.constexpr):
    """The t-th block of a list, loaded (explicit list) or computed (range form), clamped
    into [0, n_blocks), and the score penalty of its tile: 0, or -inf when a corrupted
    descriptor put the entry out of range. The tile is then hidden (its scores -inf, so
    it adds nothing) and its loads stay in bounds (docs/semantics.md)."""
    if RANGES == 0:
        blk = tl.load(idx_ptr + t)
    else:
        blk = lo0 + t
        if RANGES > 1:
            blk = tl.where(t >= c1, lo1 + (t - c1), blk)
        if RANGES > 2:
            blk = tl.where(t >= c2, lo2 + (t - c2), blk)
        if RANGES > 3:
            blk = tl.where(t >= c3, lo3 + (t - c3), blk)
    ok = (blk >= 0) & (blk < n_blocks)
    pen = tl.where(ok, 0.0, float("-inf"))
    return tl.minimum(tl.maximum(blk, 0), n_blocks - 1), pen


@triton.jit
def _list_tile(idx_ptr, walk, it, SUB: tl.constexpr, L, block: tl.constexpr,
               BLOCK: tl.constexpr, offs, RANGES: tl.constexpr):
    """Tile `it` of a block list's walk (SUB tiles of BLOCK rows or columns per listed
    block; walk = _ranges_load(...)): the block, its penalty (_block_at) and the tile's
    indices."""
    lo0, lo1, lo2, lo3, c1, c2, c3 = walk
    blk, pen = _block_at(idx_ptr, it // SUB, lo0, lo1, lo2, lo3, c1, c2, c3, tl.cdiv(L, block),
                         RANGES)
    return blk, pen, blk * block + (it % SUB) * BLOCK + offs


@triton.jit
def _list_row(b, h, r, sb, sh, hdiv, rs):
    """The offset of block row r's list for batch b and query head h: the lists' heads hold
    hdiv query heads each (GQA-shared lists), rs 0 where every row reads one list."""
    return b * sb + (h // hdiv) * sh + r * rs


@triton.jit
def _list_count(count_ptr, width, n_blocks, RANGES: tl.constexpr):
    """A list row's block count, clamped to what can be read: [0, width] for explicit
    lists (the row's index entries), [0, n_blocks] for range-form ones (no row lists a
    block twice), so that a corrupted count never reads past its row."""
    c = tl.maximum(tl.load(count_ptr), 0)
    if RANGES == 0:
        c = tl.minimum(c, width)
    else:
        c = tl.minimum(c, n_blocks)
    return c


@triton.jit
def _in_ranges(idx_ptr, x, RANGES: tl.constexpr):
    """Whether block x lies in one of the RANGES ranges of a range-form row."""
    hit = x < 0
    for r in tl.static_range(RANGES):
        hit = hit | ((x >= tl.load(idx_ptr + 2 * r)) & (x < tl.load(idx_ptr + 2 * r + 1)))
    return hit


# =================================================================== device: element predicates

@triton.jit
def _cr_prefetch(preds, b, h, j, Lk,
                 N_COL_RANGES: tl.constexpr, CR_KINDS: tl.constexpr, ACTIVE: tl.constexpr):
    """Column ranges of key columns j (up to 4 intervals) as the tuple (s0, e0, ..., s3, e3)
    of vectors shaped like j: hoisted out of the dK/dV loop (j is fixed there); loaded per
    tile in the forward and dQ loops (docs/perf-notes.md, "Numbers moved out of the code")."""
    (DM, dm_sb, dm_sh, dm_sq, dm_sk, dm_hdiv, CR, cr_sb, cr_sh, cr_sk, cr_hdiv,
     PBI, pbi_sb, pbi_sh, pbi_sq, pbi_hdiv, PB, pb_sp, pb_sr, pb_n) = preds
    z = j * 0
    s0 = z
    e0 = z
    s1 = z
    e1 = z
    s2 = z
    e2 = z
    s3 = z
    e3 = z
    if ACTIVE and N_COL_RANGES > 0 and N_COL_RANGES <= 4:
        ok = j < Lk
        base = CR + b * cr_sb + (h // cr_hdiv) * cr_sh + j * cr_sk
        s0, e0 = _slot_load(base, ok, z, CR_KINDS & 3)
        if N_COL_RANGES > 1:
            s1, e1 = _slot_load(base + 2, ok, z, (CR_KINDS >> 2) & 3)
        if N_COL_RANGES > 2:
            s2, e2 = _slot_load(base + 4, ok, z, (CR_KINDS >> 4) & 3)
        if N_COL_RANGES > 3:
            s3, e3 = _slot_load(base + 6, ok, z, (CR_KINDS >> 6) & 3)
    return s0, e0, s1, e1, s2, e2, s3, e3


@triton.jit
def _slots_on_columns(slots):
    """The prefetched slots of keys j as rows of a (query, key) tile: x[None, :]."""
    s0, e0, s1, e1, s2, e2, s3, e3 = slots
    return (s0[None, :], e0[None, :], s1[None, :], e1[None, :],
            s2[None, :], e2[None, :], s3[None, :], e3[None, :])


@triton.jit
def _slots_on_rows(slots):
    """The prefetched slots of keys j as columns of a transposed (key, query) tile:
    x[:, None]."""
    s0, e0, s1, e1, s2, e2, s3, e3 = slots
    return (s0[:, None], e0[:, None], s1[:, None], e1[:, None],
            s2[:, None], e2[:, None], s3[:, None], e3[:, None])


@triton.jit
def _slot_load(ptr, ok, z, KIND: tl.constexpr):
    s = z
    e = z
    if KIND != 1:
        s = tl.load(ptr, mask=ok, other=0)
    if KIND != 2:
        e = tl.load(ptr + 1, mask=ok, other=0)
    return s, e


@triton.jit
def _slot_visible(i, s, e, KIND: tl.constexpr):
    if KIND == 1:
        v = i >= e
    elif KIND == 2:
        v = i < s
    else:
        v = (i < s) | (i >= e)
    return v


@triton.jit
def _visible(i, j, Lq, Lk, qb, kb, block_q: tl.constexpr, block_k: tl.constexpr, b, h,
             preds, slots,
             HAS_DM: tl.constexpr, N_COL_RANGES: tl.constexpr, CR_KINDS: tl.constexpr,
             HAS_BITS: tl.constexpr, CHECK_I: tl.constexpr, CHECK_J: tl.constexpr):
    """Element visibility inside a partial block; i, j broadcastable index tiles.
    preds: the PredicateArgs tuple. slots: the prefetched column ranges (broadcast like j)
    when 1 <= N_COL_RANGES <= 4.
    CHECK_I / CHECK_J: the caller needs rows >= Lq / columns >= Lk hidden (they are, also,
    whenever a predicate is loaded); where padded rows or columns cannot change a stored
    result the compares are left out."""
    (DM, dm_sb, dm_sh, dm_sq, dm_sk, dm_hdiv, CR, cr_sb, cr_sh, cr_sk, cr_hdiv,
     PBI, pbi_sb, pbi_sh, pbi_sq, pbi_hdiv, PB, pb_sp, pb_sr, pb_n) = preds
    s0, e0, s1, e1, s2, e2, s3, e3 = slots
    if N_COL_RANGES > 0 and N_COL_RANGES <= 4:
        vis = _slot_visible(i, s0, e0, CR_KINDS & 3)
        if N_COL_RANGES > 1:
            vis = vis & _slot_visible(i, s1, e1, (CR_KINDS >> 2) & 3)
        if N_COL_RANGES > 2:
            vis = vis & _slot_visible(i, s2, e2, (CR_KINDS >> 4) & 3)
        if N_COL_RANGES > 3:
            vis = vis & _slot_visible(i, s3, e3, (CR_KINDS >> 6) & 3)
        if CHECK_I or HAS_DM or HAS_BITS:
            vis = vis & (i < Lq)
        if CHECK_J or HAS_DM or HAS_BITS:
            vis = vis & (j < Lk)
    else:
        vis = (i < Lq) & (j < Lk)
    if HAS_DM:
        d = tl.load(DM + b * dm_sb + (h // dm_hdiv) * dm_sh + i * dm_sq + j * dm_sk,
                    mask=vis, other=0)
        vis = vis & (d != 0)
    if N_COL_RANGES > 4:
        base = CR + b * cr_sb + (h // cr_hdiv) * cr_sh + j * cr_sk
        j_ok = j < Lk
        for r in tl.static_range(N_COL_RANGES):
            start = tl.load(base + 2 * r, mask=j_ok, other=0)
            end = tl.load(base + 2 * r + 1, mask=j_ok, other=0)
            vis = vis & ((i < start) | (i >= end))
    if HAS_BITS:
        p = tl.load(PBI + b * pbi_sb + (h // pbi_hdiv) * pbi_sh + qb * pbi_sq + kb)
        c = j - kb * block_k
        # an entry outside [0, P) reads no bitmap, as -1 (docs/semantics.md, "Corrupted
        # descriptors"); `!= 0` makes the mask bool for Triton 3.9
        w = tl.load(PB + p.to(tl.int64) * pb_sp + (i - qb * block_q) * pb_sr + (c // 32),
                    mask=(vis & (p >= 0) & (p < pb_n)) != 0, other=-1)
        vis = vis & (((w >> (c % 32)) & 1) != 0)
    return vis


@triton.jit
def _query_tile_visible(i, j, kb, qb, b, h, Lq, Lk, block_q: tl.constexpr,
                        block_k: tl.constexpr, preds,
                        HAS_DM: tl.constexpr, N_COL_RANGES: tl.constexpr, CR_KINDS: tl.constexpr,
                        HAS_BITS: tl.constexpr, CHECK_J: tl.constexpr):
    """_visible for a tile with queries i as rows and keys j as columns (the forward and dQ
    loops), the column ranges of keys j loaded for this tile."""
    slots = _cr_prefetch(preds, b, h, j, Lk, N_COL_RANGES, CR_KINDS, True)
    return _visible(i[:, None], j[None, :], Lq, Lk, qb, kb, block_q, block_k, b, h,
                    preds, _slots_on_columns(slots),
                    HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, False, CHECK_J)


# ======================================================================= host: kernel arguments

class BlockListArgs(NamedTuple):
    """One block list as kernel arguments, in the kernels' parameter order."""
    count: torch.Tensor         # (Bd, Hd, n) int32
    index: torch.Tensor         # (Bd, Hd, n, W) or (Bd, Hd, n, R, 2) int32; a dummy if empty
    batch_stride: int           # of count (and, times row_width, of index); 0 when Bd == 1
    head_stride: int
    head_div: int               # the list's head = query head // head_div
    row_width: int              # index entries per row: W, or 2R for the range form
    row_stride: int             # 1, or 0 where every row is one stored row (expanded lists)


class PredicateArgs(NamedTuple):
    """The element predicates as kernel arguments, in the kernels' parameter order (a
    dummy tensor and zero strides for an absent one). In kernels: DM, dm_*, CR, cr_*, PBI,
    pbi_*, PB, pb_*."""
    dense_mask: torch.Tensor    # uint8 view of the bool mask (B|1, H, Lq|1, Lk|1)
    dense_mask_sb: int
    dense_mask_sh: int
    dense_mask_sq: int
    dense_mask_sk: int
    dense_mask_head_div: int
    col_ranges: torch.Tensor    # int32 (Bc, Hc, Lk, 2m), contiguous
    col_ranges_sb: int
    col_ranges_sh: int
    col_ranges_sk: int
    col_ranges_head_div: int
    bits_index: torch.Tensor    # partial_bits_index, int32 (Bd, Hd, nQB, nKB)
    bits_index_sb: int
    bits_index_sh: int
    bits_index_sq: int
    bits_index_head_div: int
    bits: torch.Tensor          # partial_bits, int32 (P, block_q, ceil(block_k / 32))
    bits_sp: int
    bits_sr: int
    bits_count: int             # P: an index entry outside [0, P) reads no bitmap


class PredicateFlags(NamedTuple):
    """The predicates' constexprs (kernel keyword arguments of the same names)."""
    HAS_DM: bool                # a dense mask is given
    N_COL_RANGES: int               # column-range slots per key (0: none)
    CR_KINDS: int               # 2 bits per slot (of the first 4): KIND_GENERAL/UPPER/LOWER
    HAS_BITS: bool              # partial-block bitmaps are given


class ListRanges(NamedTuple):
    """The RANGES constexpr of each block list (0, R or EMPTY_LIST, see the docstring)."""
    kv_partial: int
    kv_full: int
    q_partial: int
    q_full: int

    def kv_constexprs(self) -> dict:
        """Keyword arguments of the kernels that walk the kv lists (forward, dQ)."""
        return dict(KV_PARTIAL_RANGES=self.kv_partial, KV_FULL_RANGES=self.kv_full)

    def q_constexprs(self) -> dict:
        """Keyword arguments of the kernels that walk the q lists (dK/dV)."""
        return dict(Q_PARTIAL_RANGES=self.q_partial, Q_FULL_RANGES=self.q_full)


class MaskArgs(NamedTuple):
    """Everything the kernels take from the descriptor, built once per (mask tensors,
    shapes) by mask_args()."""
    kv_partial: BlockListArgs   # kv_count / kv_index: key blocks with element predicates
    kv_full: BlockListArgs      # kv_full_count / kv_full_index: key blocks without
    q_partial: BlockListArgs    # q_count / q_index: the transposes, per key block
    q_full: BlockListArgs       # q_full_count / q_full_index
    ranges: ListRanges
    predicates: PredicateArgs
    flags: PredicateFlags
    reverse_query_tiles: int    # the kernels' rev_q: heavy query tiles first (_tile_order)
    dummy: torch.Tensor         # int32 stand-in for absent pointer arguments


def _head_div(size, Hq, Hkv, what):
    if size == Hq:
        return 1
    if size == Hkv:
        return Hq // Hkv
    if size == 1:
        return Hq
    raise ValueError(f"triton: {what} head dim {size} must be 1, Hkv={Hkv} or Hq={Hq}")


def _bstride(t, dim):
    return 0 if t.shape[dim] == 1 else t.stride(dim)


def _all_lists(mask, Lq, Lk, block_q, block_k, device):
    """The eight block lists (the op layer fills in missing ones: visibility.complete_mask)."""
    full = complete_mask(mask, Lq, Lk, block_q, block_k, device)
    return [getattr(full, n) for n in LIST_NAMES]


def _list_args(count, index, n_rows, Hq, Hkv, what, dummy):
    """BlockListArgs of one block list, and its RANGES constexpr (0: explicit indices
    (Bd, Hd, n, W); R: range form (Bd, Hd, n, R, 2)). Lists whose rows are one row expanded
    (stride 0 in both tensors) pass that row only, with row stride 0."""
    Bd, Hd, n = count.shape
    one_row = n > 1 and index.dim() >= 4 and count.stride(2) == 0 and index.stride(2) == 0
    if one_row:
        count, index = count[:, :, :1], index[:, :, :1]
    count = count.to(torch.int32).contiguous()
    index = index.to(torch.int32).contiguous()
    ranges = index.shape[3] if index.dim() == 5 else 0
    stored = 1 if one_row else n
    if (n != n_rows or tuple(index.shape[:3]) != (Bd, Hd, stored) or index.dim() not in (4, 5)
            or (ranges and index.shape[4] != 2)):
        raise ValueError(f"triton: {what} has shape {tuple(count.shape)} / "
                         f"{tuple(index.shape)}, expected (Bd, Hd, {n_rows}) / "
                         f"(Bd, Hd, {n_rows}, W) or (Bd, Hd, {n_rows}, R, 2)")
    if ranges > MAX_RANGES:
        raise NotImplementedError(f"triton: {what} has {ranges} ranges per row "
                                  f"(at most {MAX_RANGES})")
    row = index[0, 0, 0].numel() if index.numel() else 1
    if index.numel() == 0:
        index = dummy
    return BlockListArgs(count, index, 0 if Bd == 1 else Hd * stored, stored,
                         _head_div(Hd, Hq, Hkv, what), row, 0 if one_row else 1), ranges


def _pred_args(mask, Hq, Hkv, Lq, dummy_i32, dummy_u8, read_kinds=True):
    """PredicateArgs (shared by all kernels) and their PredicateFlags; the column-range slot
    kinds are read on the host only when `read_kinds` (else all KIND_GENERAL)."""
    dm = mask.dense_mask
    if dm is not None:
        dmu = dm.view(torch.uint8) if dm.dtype == torch.bool else (dm != 0).to(torch.uint8)
        dm_args = (dmu, _bstride(dmu, 0), _bstride(dmu, 1), _bstride(dmu, 2), _bstride(dmu, 3),
                   _head_div(dm.shape[1], Hq, Hkv, "dense_mask"))
    else:
        dm_args = (dummy_u8, 0, 0, 0, 0, 1)
    cr = mask.col_ranges
    n_ranges = 0
    if cr is not None:
        cr = cr.to(torch.int32).contiguous()
        Bc, Hc, Lkc, two_m = cr.shape
        n_ranges = two_m // 2
        cr_args = (cr, 0 if Bc == 1 else Hc * Lkc * two_m, Lkc * two_m, two_m,
                   _head_div(Hc, Hq, Hkv, "col_ranges"))
    else:
        cr_args = (dummy_i32, 0, 0, 0, 1)
    has_bits = mask.partial_bits_index is not None
    if has_bits:
        pbi = mask.partial_bits_index.to(torch.int32).contiguous()
        pb = mask.partial_bits.to(torch.int32).contiguous()
        Bd, Hd, nQB, nKB = pbi.shape
        P, bq, nw = pb.shape
        if pb.numel() == 0:
            pb = dummy_i32
        pb_args = (pbi, 0 if Bd == 1 else Hd * nQB * nKB, nQB * nKB, nKB,
                   _head_div(Hd, Hq, Hkv, "partial_bits_index"), pb, bq * nw, nw, P)
    else:
        pb_args = (dummy_i32, 0, 0, 0, 1, dummy_i32, 0, 0, 0)
    kinds = _slot_kinds(cr, Lq) if read_kinds and 0 < n_ranges <= 4 else KIND_GENERAL
    flags = PredicateFlags(HAS_DM=dm is not None, N_COL_RANGES=n_ranges, CR_KINDS=kinds,
                           HAS_BITS=has_bits)
    return PredicateArgs(*dm_args, *cr_args, *pb_args), flags


# ---------------------------------------------------------------- descriptor facts (host syncs)

_FACTS = {}
FACT_COMPUTES = 0       # host syncs for descriptor facts so far (bench reports them per row)


def _capturing(device) -> bool:
    """A CUDA graph is being captured on the current stream: no host syncs, nothing cached."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _cached_fact(tensors, compute):
    """compute() once per set of tensor objects (and their versions): host syncs happen the
    first time a descriptor is seen, never while a CUDA graph is captured (then None).
    Keyed by identity through weak references, not by address: a freed descriptor's
    address is soon reused by the next one, and an address key answered for the wrong mask."""
    key = (compute.__name__,) + tuple(id(t) for t in tensors)
    entry = _FACTS.get(key)
    versions = tuple(t._version for t in tensors)
    if (entry is not None and all(r() is t for r, t in zip(entry[0], tensors))
            and entry[1] == versions):
        return entry[2]
    if _capturing(tensors[0].device):
        return None
    global FACT_COMPUTES
    FACT_COMPUTES += 1
    value = compute()
    if len(_FACTS) > 1024:
        _FACTS.clear()
    _FACTS[key] = ([weakref.ref(t) for t in tensors], versions, value)
    return value


def _trim_lists(lists, forms, trim=True):
    """The RANGES constexpr of each of the four lists, trimmed to what the descriptor uses:
    EMPTY_LIST where no row has a block (the full mask's partial lists), and for the range
    form the range slots up to the last one that is non-empty in some row (causal and the
    full mask use one of the four), so the kernels neither load nor test the others. One
    host sync per descriptor, cached; untrimmed while a CUDA graph is captured, or when
    `trim` is off (kernel option trim_lists, for A/B timing)."""
    tensors = tuple(lists)
    if not trim:
        return forms

    def trimmed():
        facts = []
        for count, index, R in zip(tensors[0::2], tensors[1::2], forms):
            if count.numel() == 0:
                facts.append(torch.zeros((), dtype=torch.int64, device=count.device))
                continue
            used = (count.max() > 0).long()
            if R > 0:
                nonempty = (index[..., 1] > index[..., 0]).reshape(-1, R).any(0)
                slots = torch.arange(1, R + 1, device=index.device) * nonempty
                used = used * slots.max().clamp(min=1)
            facts.append(used)
        got = torch.stack(facts).tolist()
        return tuple(EMPTY_LIST if n == 0 else (R and n) for n, R in zip(got, forms))
    value = _cached_fact(tensors, trimmed)
    return forms if value is None else value


def _slot_kinds(cr, Lq) -> int:
    """CR_KINDS: per slot r (2 bits at 2r) KIND_UPPER if every start is 0, KIND_LOWER if
    every end is Lq, else KIND_GENERAL (one host sync per column-range tensor)."""
    def slot_kinds():
        m = cr.shape[-1] // 2
        flat = cr.reshape(-1, m, 2)
        starts_zero, ends_lq = torch.stack([(flat[..., 0] == 0).all(0),
                                            (flat[..., 1] == Lq).all(0)]).tolist()
        code = 0
        for r in range(m):
            kind = KIND_UPPER if starts_zero[r] else (KIND_LOWER if ends_lq[r] else KIND_GENERAL)
            code |= kind << (2 * r)
        return code
    code = _cached_fact((cr,), slot_kinds) if cr.numel() else 0
    return code if code is not None else 0


# ---------------------------------------------------------------- caches keyed by the mask

def _mask_key(mask):
    """(key part, mask tensors present): the mask tensors by identity and version."""
    present = [t for t in mask if t is not None]
    return (tuple(map(id, mask)), tuple([t._version for t in present])), present


class _MaskKeyedCache:
    """A small LRU whose keys include _mask_key: each entry holds the mask tensors, so their
    ids are not reused while it lives, and a hit checks identity. Nothing is kept while a
    CUDA graph is captured (descriptor facts are not computed then)."""

    def __init__(self, size):
        self.size = size
        self._entries = collections.OrderedDict()

    def __len__(self):
        return len(self._entries)

    def clear(self):
        self._entries.clear()

    def get(self, key, present):
        hit = self._entries.get(key)
        if hit is not None and all(map(operator.is_, hit[0], present)):
            self._entries.move_to_end(key)
            return hit[1]
        return None

    def put(self, key, present, value, device):
        if _capturing(device):
            return
        self._entries[key] = (present, value)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)


# MaskArgs of the last few (mask tensors, shapes): a call with a descriptor seen before
# skips rebuilding them (host time per call matters next to 0.3 ms kernels); kept small,
# since entries hold their tensors.
_MASK_ARGS = _MaskKeyedCache(8)


def mask_args(mask, Hq, Hkv, Lq, Lk, block_q, block_k, device, trim_lists=True) -> MaskArgs:
    """The descriptor's kernel arguments for these sizes (cached, see _MASK_ARGS)."""
    mkey, present = _mask_key(mask)
    key = (mkey, Hq, Hkv, Lq, Lk, block_q, block_k, device, trim_lists)
    hit = _MASK_ARGS.get(key, present)
    if hit is not None:
        return hit
    dummy_i32 = torch.zeros(1, dtype=torch.int32, device=device)
    dummy_u8 = torch.zeros(1, dtype=torch.uint8, device=device)
    lists = _all_lists(mask, Lq, Lk, block_q, block_k, device)
    nQB, nKB = -(-Lq // block_q), -(-Lk // block_k)
    kv_partial, kv_partial_r = _list_args(lists[0], lists[1], nQB, Hq, Hkv,
                                          "kv_count/kv_index", dummy_i32)
    kv_full, kv_full_r = _list_args(lists[2], lists[3], nQB, Hq, Hkv,
                                    "kv_full_count/kv_full_index", dummy_i32)
    q_partial, q_partial_r = _list_args(lists[4], lists[5], nKB, Hq, Hkv, "q_count/q_index",
                                        dummy_i32)
    q_full, q_full_r = _list_args(lists[6], lists[7], nKB, Hq, Hkv,
                                  "q_full_count/q_full_index", dummy_i32)
    ranges = ListRanges(*_trim_lists(lists, (kv_partial_r, kv_full_r, q_partial_r, q_full_r),
                                     trim_lists))
    # trim_lists=False: no host reads of the descriptor at all (also no slot kinds)
    preds, flags = _pred_args(mask, Hq, Hkv, Lq, dummy_i32, dummy_u8, read_kinds=trim_lists)
    # Query tiles last-first when the column ranges only hide rows above the keys (some slot
    # starts at 0 for every key, none ends at Lq for every key: causal, prefix-LM, so work
    # grows with the query index; windows and documents also cut rows below), see _tile_order.
    slot_kinds = [(flags.CR_KINDS >> (2 * r)) & 3 for r in range(min(flags.N_COL_RANGES, 4))]
    rev_q = int(KIND_UPPER in slot_kinds and KIND_LOWER not in slot_kinds)
    value = MaskArgs(kv_partial, kv_full, q_partial, q_full, ranges, preds, flags, rev_q,
                     dummy_i32)
    _MASK_ARGS.put(key, present, value, device)
    return value
