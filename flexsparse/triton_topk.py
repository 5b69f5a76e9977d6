"""Top-k key positions per score row in one Triton kernel: a select on the score bits.

The GPU path of `flexsparse.topk.topk_indices` (whose torch code defines the result: per
row, the k largest scores that are neither -inf nor NaN, their positions ascending, -1
padding) for rows of up to RESIDENT_MAX keys. One program per row reads the row once
into registers and writes only its k positions: no copy of the scores (the torch path
copies them to turn NaN into -inf), no (rows, Lk) temporary, no sort.

1. Each score's bits become an unsigned key that orders as the scores do (sign bit set:
   all bits flipped; else the sign bit set). -inf and NaN get key 0, below every valid
   key, so they are never kept.
2. The k-th largest key T, bit by bit from the top: T | bit is kept if at least k keys
   are >= it (one count over the row per bit: 16 for 16-bit scores, 32 for fp32).
   Optionally its top bytes first from 256-bin histograms (HIST_DIGITS). Then
   `ties` = k - #(keys > T) keys equal to T are kept: the first ones by position.
   A row with at most k valid keys keeps them all (T = 0).
3. Kept columns are written in position order (an exclusive prefix sum gives each its
   slot), then -1 padding.

Causal rows (query i sees keys j <= i + off) just read fewer columns. Longer rows than
the block are read once per step (not resident), correct but slower than torch.topk.
"""
import math

import torch
import triton
import triton.language as tl

# (bit width, bits of +inf with the sign cleared) of each float type, read as integers.
_KEY_BITS = {torch.bfloat16: (16, 0x7F80), torch.float16: (16, 0x7C00), torch.float32: (32, 0x7F800000)}
_INT_VIEW = {16: torch.int16, 32: torch.int32}
# Rows up to this many columns stay in registers for the whole search (one read of the
# scores); longer rows are read once per step of the search, from L2. On the H100 the
# kernel beats torch.topk's time only on resident rows of up to 8K columns (bf16 scores,
# docs/perf-notes.md "masks.topk"), so flexsparse.topk takes it only for those.
RESIDENT_MAX = 8192
ELEMENTS_PER_THREAD = 32
# Top bytes of the threshold found by 256-bin histograms before the bit-by-bit search:
# fewer serial steps, more work per step. 0 measured fastest on resident rows (5.7 ms
# against 6.9 with 1 and 8.0 with 2 at 8K); 2 on rows read from L2 (still slower than
# torch.topk there).
HIST_DIGITS = 0


@triton.jit
def _keys(row, cols, n, s_col, KEY_BITS: tl.constexpr, INF_BITS: tl.constexpr):
    """Order-preserving unsigned keys of the row's scores at `cols` (< n); 0 = not kept."""
    inside = cols < n
    raw = tl.load(row + cols.to(tl.int64) * s_col, mask=inside, other=0)
    if KEY_BITS == 32:
        bits = raw.to(tl.int64) & 0xFFFFFFFF
    else:
        bits = raw.to(tl.int32) & 0xFFFF
    sign = 1 << (KEY_BITS - 1)
    magnitude = bits & (sign - 1)
    valid = inside & (magnitude <= INF_BITS) & (bits != (sign | INF_BITS))   # not NaN, not -inf
    key = tl.where(bits >= sign, bits ^ (2 * sign - 1), bits | sign)
    return tl.where(valid, key, 0)


@triton.jit
def _count_at_least(row, cols, n, s_col, resident_keys, bound, RESIDENT: tl.constexpr,
                    BLOCK: tl.constexpr, KEY_BITS: tl.constexpr, INF_BITS: tl.constexpr):
    """How many keys of the row are >= bound (from registers when the row is resident)."""
    if RESIDENT:
        count = tl.sum((resident_keys >= bound).to(tl.int32), 0)
    else:
        count = tl.zeros([], dtype=tl.int32)
        for c0 in range(0, n, BLOCK):
            key = _keys(row, c0 + cols, n, s_col, KEY_BITS, INF_BITS)
            count += tl.sum((key >= bound).to(tl.int32), 0)
    return count


@triton.jit
def _topk_rows_kernel(S, s_lead, s_row, s_col, OUT, o_lead, o_row, ROWS, Lk, K, row0, off,
                      CAUSAL: tl.constexpr, KEY_BITS: tl.constexpr, INF_BITS: tl.constexpr,
                      BLOCK: tl.constexpr, RESIDENT: tl.constexpr, HIST_DIGITS: tl.constexpr):
    pid = tl.program_id(0)
    lead = pid // ROWS
    r = pid % ROWS
    row = S + lead.to(tl.int64) * s_lead + r.to(tl.int64) * s_row
    out = OUT + lead.to(tl.int64) * o_lead + r.to(tl.int64) * o_row
    n = Lk
    if CAUSAL:
        n = tl.minimum(tl.maximum(row0 + r + off + 1, 0), Lk)
    cols = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    # RESIDENT: the whole row (n <= BLOCK) is loaded once and stays in registers.
    if RESIDENT:
        resident_keys = _keys(row, cols, n, s_col, KEY_BITS, INF_BITS)
    else:
        resident_keys = cols

    # The K-th largest key T (the largest T with K keys >= T): its top HIST_DIGITS bytes
    # from 256-bin histograms of the keys that match the bytes found so far, the rest bit
    # by bit from counts. Each step waits for a reduction over the row, so fewer, wider
    # steps (histograms) trade instructions for latency.
    if KEY_BITS == 32:
        threshold = tl.zeros([], dtype=tl.int64)
    else:
        threshold = tl.zeros([], dtype=tl.int32)
    ties = K * 0            # keys equal to the threshold that are kept (the first ones)
    valid = _count_at_least(row, cols, n, s_col, resident_keys, 1, RESIDENT, BLOCK, KEY_BITS, INF_BITS)
    if valid > K:           # else every valid key is kept: threshold 0, no ties
        k_rem = K + 0       # the rank of T among the keys that match its bytes found so far
        for d in tl.static_range(HIST_DIGITS):
            shift = KEY_BITS - 8 * (d + 1)
            hist = tl.zeros([256], dtype=tl.int32)
            for c0 in range(0, n, BLOCK):
                if RESIDENT:
                    key = resident_keys
                else:
                    key = _keys(row, c0 + cols, n, s_col, KEY_BITS, INF_BITS)
                match = (key > 0) & ((key >> (shift + 8)) == (threshold >> (shift + 8)))
                hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
            above = tl.sum(hist, 0) - tl.cumsum(hist, 0)     # matching keys with a larger byte
            hit = (above < k_rem) & (above + hist >= k_rem)
            digit = tl.max(tl.where(hit, bins, -1), 0)
            k_rem -= tl.sum(tl.where(bins == digit, above, 0), 0)
            threshold = threshold | (digit.to(threshold.dtype) << shift)
        for bit in tl.static_range(KEY_BITS - 8 * HIST_DIGITS - 1, -1, -1):
            # (the bit in the key's type: an int literal above 2^31 is not int64 in Triton)
            bound = threshold | ((threshold * 0 + 1) << bit)
            if _count_at_least(row, cols, n, s_col, resident_keys, bound, RESIDENT, BLOCK,
                               KEY_BITS, INF_BITS) >= K:
                threshold = bound
        ties = K - _count_at_least(row, cols, n, s_col, resident_keys, threshold + 1, RESIDENT, BLOCK,
                                   KEY_BITS, INF_BITS)

    # Kept columns in position order: keys above the threshold, then the first `ties` keys
    # equal to it; each kept column's slot is an exclusive prefix sum.
    kept = tl.zeros([], dtype=tl.int32)
    seen_ties = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n, BLOCK):
        if RESIDENT:
            key = resident_keys
        else:
            key = _keys(row, c0 + cols, n, s_col, KEY_BITS, INF_BITS)
        tie = ((key == threshold) & (key > 0)).to(tl.int32)
        kept_tie = (tie != 0) & (seen_ties + tl.cumsum(tie, 0) - tie < ties)
        keep = ((key > threshold) | kept_tie).to(tl.int32)
        slot = kept + tl.cumsum(keep, 0) - keep
        tl.store(out + slot, c0 + cols, mask=(keep != 0) & (slot < K))   # never past the row's K
        kept += tl.sum(keep, 0)
        seen_ties += tl.sum(tie, 0)
    for p0 in range(0, K, BLOCK):
        p = p0 + cols
        tl.store(out + p, tl.full([BLOCK], -1, tl.int32), mask=(p >= kept) & (p < K))


def supports(scores: torch.Tensor) -> bool:
    """Whether topk_rows takes these scores (a float type it knows)."""
    return scores.dtype in _KEY_BITS


def topk_rows(scores: torch.Tensor, k: int, causal: bool = False, row0: int = 0,
              num_queries: int = None, block: int = None, num_warps: int = None,
              hist_digits: int = None) -> torch.Tensor:
    """int32 (..., rows, k): per row of `scores` (..., rows, Lk), the positions of its k
    largest scores that are neither -inf nor NaN, ascending, then -1 padding.

    causal: row r is query row0 + r of num_queries and sees keys j <= row0 + r + Lk -
    num_queries. block, num_warps: columns a program holds at once and its warps (default:
    the whole row up to RESIDENT_MAX columns, ELEMENTS_PER_THREAD per thread)."""
    if not supports(scores):
        raise TypeError(f"scores: dtype {scores.dtype} (topk_rows takes bf16, fp16 or fp32)")
    *lead_shape, rows, Lk = scores.shape
    out = torch.empty((*lead_shape, rows, k), dtype=torch.int32, device=scores.device)
    if out.numel() == 0:
        return out
    n_lead = math.prod(lead_shape)
    key_bits, inf_bits = _KEY_BITS[scores.dtype]
    # the bits, read as integers; the leading dims as one (a view where their strides allow)
    s = scores.view(_INT_VIEW[key_bits]).reshape(n_lead, rows, Lk)
    o = out.view(n_lead, rows, k)
    block = min(RESIDENT_MAX if block is None else block, max(16, triton.next_power_of_2(Lk)))
    if num_warps is None:
        num_warps = min(16, max(1, block // (32 * ELEMENTS_PER_THREAD)))
    off = Lk - (rows if num_queries is None else num_queries)
    _topk_rows_kernel[(n_lead * rows,)](
        s, s.stride(0), s.stride(1), s.stride(2), o, o.stride(0), o.stride(1), rows, Lk, k, row0, off,
        CAUSAL=bool(causal), KEY_BITS=key_bits, INF_BITS=inf_bits, BLOCK=block, RESIDENT=block >= Lk,
        HIST_DIGITS=HIST_DIGITS if hist_digits is None else hist_digits, num_warps=num_warps)
    return out
