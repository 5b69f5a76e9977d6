"""One Triton launch that writes the column ranges of an interval mask (issue 5: O(N) builds).

The named column-range masks (causal, sliding_window, document, prefix_lm,
shared_question, global_tokens) see, in key column j, one interval of query rows
[lo(j), hi(j)); and_ intersects intervals, or_ of two unions them. Their torch builders in
flexsparse/masks.py define the column ranges (and are the CPU and torch.compile path); at
1M tokens they take ~25-60 small torch ops and int64 temporaries of 8-16 MB each. Here one
program per 1024 columns evaluates the interval bounds from a packed parameter table
(flexsparse/intervals.py) and writes the normalized int32 slots that
`masks._stack_slots(mask.slots(sz), sz)` gives, bit for bit.

Parameter table, int32, per batch row b: K intervals x (lo, hi) x T terms x 4 ints
(code, c, below, alt), then the cumulative document boundaries (n + 1 ints). A term's
value in column j is `alt if j < below else base`, base by code: 1 -> j + c, 2 -> c,
3 -> start of j's document, 4 -> its end; code 0 = no term. lo = max of its terms,
hi = min of its terms.

Output slots (m of them, each (start, end) of a masked row interval, clamped to [0, Lq],
empty ones written as (0, 0), or (Lq, Lq) for LOWER), in masks._simplify's order:
K = 1: UPPER [0, lo) if lo has terms, LOWER [hi, Lq) if hi has terms.
K = 2 (A or B): UPPER [0, min(lo_A, lo_B)), LOWER [max(hi_A, hi_B), Lq),
  GENERAL [hi_B, lo_A), GENERAL [hi_A, lo_B): the masked sets of A and B intersected
  term by term, as masks._or_slots does; a slot is there when both of its bounds are.
"""
import torch
import triton
import triton.language as tl

TERMS = 4             # terms per bound
BLOCK_COLS = 1024
_BIG = tl.constexpr(1 << 30)


@triton.jit
def _bound(P, row, j, d_start, d_end, k: tl.constexpr, side: tl.constexpr, T: tl.constexpr):
    """max (side 0, lo) or min (side 1, hi) over the bound's terms; +-BIG when it has none."""
    if side == 0:
        v = j * 0 - _BIG
    else:
        v = j * 0 + _BIG
    for t in tl.static_range(T):
        p = P + row + ((k * 2 + side) * T + t) * 4
        code = tl.load(p)
        c = tl.load(p + 1)
        below = tl.load(p + 2)
        alt = tl.load(p + 3)
        x = tl.where(code == 1, j + c, tl.where(code == 2, c, tl.where(code == 3, d_start, d_end)))
        x = tl.where(j < below, alt, x)
        if side == 0:
            v = tl.where(code != 0, tl.maximum(v, x), v)
        else:
            v = tl.where(code != 0, tl.minimum(v, x), v)
    return v


@triton.jit
def _put(CR, cols, ok, slot, s, e, Lq, FILL_LQ: tl.constexpr, TWO_M: tl.constexpr):
    s = tl.minimum(tl.maximum(s, 0), Lq)
    e = tl.minimum(tl.maximum(e, 0), Lq)
    empty = s >= e
    if FILL_LQ:
        fill = Lq
    else:
        fill = 0
    base = CR + cols * TWO_M + 2 * slot
    tl.store(base, tl.where(empty, fill, s), mask=ok)
    tl.store(base + 1, tl.where(empty, fill, e), mask=ok)


@triton.jit
def _interval_ranges_kernel(P, CR, Lk, Lq, p_sb, n_docs, doc_at,
                            K: tl.constexpr, T: tl.constexpr, HAS_DOC: tl.constexpr,
                            DOC_STEPS: tl.constexpr, S_UPPER: tl.constexpr,
                            S_LOWER: tl.constexpr, S_GEN_AB: tl.constexpr,
                            S_GEN_BA: tl.constexpr, TWO_M: tl.constexpr, BLOCK: tl.constexpr):
    """S_*: the output slot of each kind (-1: absent), fixed by the launcher."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    j = pid * BLOCK + tl.arange(0, BLOCK)
    ok = j < Lk
    row = b * p_sb
    d_start = j * 0
    d_end = j * 0
    if HAS_DOC:
        # d = #(ends <= j) clamped to n - 1 (torch.searchsorted(ends, j, right=True)), by
        # bisection over the cumulative boundaries cum[0..n] (ends = cum[1..n]).
        cum = P + row + doc_at
        lo = j * 0
        hi = j * 0 + n_docs
        for _ in tl.static_range(DOC_STEPS):
            mid = (lo + hi) // 2
            go = (lo < hi) & (tl.load(cum + 1 + mid, mask=ok & (lo < hi), other=0) <= j)
            lo = tl.where(go, mid + 1, lo)
            hi = tl.where((lo < hi) & ~go, mid, hi)
        d = tl.minimum(lo, n_docs - 1)
        d_start = tl.load(cum + d, mask=ok, other=0)
        d_end = tl.load(cum + d + 1, mask=ok, other=0)
    cols = (b * Lk + j).to(tl.int64)
    zero = j * 0
    lo_a = _bound(P, row, j, d_start, d_end, 0, 0, T)
    hi_a = _bound(P, row, j, d_start, d_end, 0, 1, T)
    if K == 1:
        if S_UPPER >= 0:
            _put(CR, cols, ok, S_UPPER, zero, lo_a, Lq, False, TWO_M)
        if S_LOWER >= 0:
            _put(CR, cols, ok, S_LOWER, hi_a, zero + Lq, Lq, True, TWO_M)
    else:
        lo_b = _bound(P, row, j, d_start, d_end, 1, 0, T)
        hi_b = _bound(P, row, j, d_start, d_end, 1, 1, T)
        if S_UPPER >= 0:
            _put(CR, cols, ok, S_UPPER, zero, tl.minimum(lo_a, lo_b), Lq, False, TWO_M)
        if S_LOWER >= 0:
            _put(CR, cols, ok, S_LOWER, tl.maximum(hi_a, hi_b), zero + Lq, Lq, True, TWO_M)
        if S_GEN_AB >= 0:
            _put(CR, cols, ok, S_GEN_AB, hi_b, lo_a, Lq, False, TWO_M)
        if S_GEN_BA >= 0:
            _put(CR, cols, ok, S_GEN_BA, hi_a, lo_b, Lq, False, TWO_M)


def slot_layout(present):
    """Output slot of each kind (UPPER, LOWER, GENERAL A/B, GENERAL B/A; -1 absent) for
    intervals whose bounds `present` = [(lo has terms, hi has terms), ...]."""
    if len(present) == 1:
        (lo_a, hi_a), (lo_b, hi_b) = present[0], (True, True)
        kinds = (lo_a, hi_a, False, False)
    else:
        (lo_a, hi_a), (lo_b, hi_b) = present
        kinds = (lo_a and lo_b, hi_a and hi_b, lo_a and hi_b, hi_a and lo_b)
    slots, n = [], 0
    for k in kinds:
        slots.append(n if k else -1)
        n += bool(k)
    return slots, n


def interval_column_ranges(params: torch.Tensor, present, n_docs: int, doc_at: int,
                           Lq: int, Lk: int) -> torch.Tensor:
    """Column ranges (Bp, 1, Lk, 2m) int32 of an interval mask from its parameter table
    `params` (Bp, row) int32 (flexsparse/intervals.py packs it); `present`: per interval,
    (lo has terms, hi has terms)."""
    slots, m = slot_layout(present)
    Bp = params.shape[0]
    cr = torch.empty((Bp, 1, Lk, 2 * m), dtype=torch.int32, device=params.device)
    if m == 0 or Lk == 0:
        return cr
    _interval_ranges_kernel[(triton.cdiv(Lk, BLOCK_COLS), Bp)](
        params, cr, Lk, Lq, params.stride(0), max(n_docs, 1), doc_at,
        K=len(present), T=TERMS, HAS_DOC=n_docs > 0, DOC_STEPS=max(1, n_docs).bit_length(),
        S_UPPER=slots[0], S_LOWER=slots[1], S_GEN_AB=slots[2], S_GEN_BA=slots[3],
        TWO_M=2 * m, BLOCK=BLOCK_COLS, num_warps=4)
    return cr
