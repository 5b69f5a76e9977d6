// Reading the block descriptor on the device: the blocks a row of a list visits, and the
// element predicates of partial blocks. Shared by the forward and backward kernels.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "params.h"

namespace flexsparse {

// The blocks of one row of a block list, in list order. Explicit lists load the index;
// range-form lists compute it from up to 4 half-open ranges. Entries outside
// [0, n_blocks) (a corrupted or hand-made descriptor) come back as -1: callers skip them,
// so a bad descriptor can hide keys but never makes a kernel read out of bounds.
struct ListRow {
  const int32_t* index = nullptr;
  int count = 0;
  int ranges = 0;
  int n_blocks = 0;
  int lo[4] = {0, 0, 0, 0};
  int before[4] = {0, 0, 0, 0};   // blocks in the ranges before range r

  __device__ __forceinline__ ListRow() {}

  __device__ __forceinline__ ListRow(const BlockListParams& p, int b, int h, int row) {
    if (p.count == nullptr) return;
    int64_t r = b * p.batch_stride + (h / p.head_div) * p.head_stride + row * p.row_stride;
    count = max(__ldg(p.count + r), 0);
    n_blocks = p.n_blocks;
    ranges = p.ranges;
    index = p.index + r * p.width;
    if (ranges == 0) {
      count = min(count, p.width);
    } else {
      int total = 0;
      #pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (k < ranges) {
          int a = __ldg(index + 2 * k), e = __ldg(index + 2 * k + 1);
          lo[k] = a;
          before[k] = total;
          total += max(e - a, 0);
        }
      }
      count = min(count, total);
    }
  }

  __device__ __forceinline__ int block_at(int t) const {
    int blk;
    if (ranges == 0) {
      blk = __ldg(index + t);
    } else {
      blk = lo[0] + t;
      #pragma unroll
      for (int k = 1; k < 4; ++k) {
        if (k < ranges && t >= before[k]) blk = lo[k] + (t - before[k]);
      }
    }
    return (blk >= 0 && blk < n_blocks) ? blk : -1;
  }
};

// The tiles one program visits, front to back: the partial list's blocks, then the full
// list's, each block split into `sub` tiles of the kernel's tile size. Warpgroups that must
// agree on the tiles (producer and consumers) each run their own cursor over the same
// lists. Only the current list's position is held (8 words; an indexed walk that could
// return tile t on demand held both lists' ranges, 26 words, and cost ~45 instructions
// per tile: docs/perf-notes.md C29, C30), and a range-form list's ranges are read when the
// cursor reaches them.
struct TileCursor {
  const int32_t* index = nullptr;   // the current list's row: next entry, or next range
  int left = 0;         // blocks left in the current list
  int ranges = 0;       // range form: ranges left after the current one; explicit: -1
  int blk = 0, end = 0; // range form: the current range's next block and its end
  int n_blocks = 0;
  int tile = 0, tiles_left = 0;   // the current run's next tile, tiles left in it
  bool in_partial = true;

  __device__ __forceinline__ TileCursor() {}

  __device__ __forceinline__ void start(const BlockListParams& p, int b, int h, int row) {
    left = 0;
    tiles_left = 0;
    if (p.count == nullptr) return;
    const int64_t r = b * p.batch_stride + (h / p.head_div) * p.head_stride + row * p.row_stride;
    left = max(__ldg(p.count + r), 0);
    n_blocks = p.n_blocks;
    index = p.index + r * p.width;
    if (p.ranges == 0) {
      left = min(left, p.width);
      ranges = -1;
    } else {
      int total = 0;     // as ListRow: the count is at most the blocks the ranges hold
      for (int k = 0; k < p.ranges; ++k) total += max(__ldg(index + 2 * k + 1) - __ldg(index + 2 * k), 0);
      left = min(left, total);
      ranges = p.ranges;
      blk = end = 0;     // the first range is read by next_run
    }
  }

  // The list's next run of consecutive blocks, [first, first + n), n >= 0 (0: the run
  // lies wholly outside [0, n_blocks) and is skipped); requires left > 0. An explicit list
  // gives one block per run; a range-form list the rest of its current range (up to the
  // count), so that the tiles of a range cost one test each (next's tiles_left path)
  // instead of a block read each.
  __device__ __forceinline__ void next_run(int& first, int& n) {
    if (ranges < 0) {
      --left;
      const int e = __ldg(index++);
      first = e;
      n = (e >= 0 && e < n_blocks) ? 1 : 0;
      return;
    }
    while (blk >= end && ranges > 0) {   // ranges past the count read nothing more
      blk = __ldg(index);
      end = __ldg(index + 1);
      index += 2;
      --ranges;
    }
    // left <= the blocks the ranges still hold (start), so k >= 1 unless the ranges ran
    // out; then the walk ends here.
    const int k = min(end - blk, left);
    if (k <= 0) {
      left = 0;
      n = 0;
      return;
    }
    first = max(blk, 0);
    n = max(min(blk + k, n_blocks) - first, 0);
    left -= k;
    blk += k;
  }

  // Starts at row `row` of the partial lists at (b, h).
  __device__ __forceinline__ TileCursor(const BlockListParams& partial_lists, int b, int h, int row) {
    start(partial_lists, b, h, row);
  }

  // The next tile (false: none left): its index along the listed dimension (`sub` kernel
  // tiles per listed block) and whether it needs element predicates. Blocks outside
  // [0, n_blocks) are skipped whole. The full lists and (b, h, row) are passed again here
  // rather than held, to save registers; they must be the same on every call.
  // full_started: where given, a cursor already started on the full lists' row (its
  // loads done elsewhere, e.g. by the forward's producer), copied in place of start().
  __device__ __forceinline__ bool next(const BlockListParams& full_lists, int b, int h, int row,
                                       int sub, int& t, bool& is_partial,
                                       const TileCursor* full_started = nullptr) {
    while (tiles_left == 0) {
      if (left == 0) {
        if (!in_partial) return false;
        if (full_started != nullptr) *this = *full_started;
        else start(full_lists, b, h, row);
        in_partial = false;
        continue;
      }
      int first, n;
      next_run(first, n);
      tile = n > 0 ? first * sub : 0;
      tiles_left = n * sub;
    }
    t = tile++;
    --tiles_left;
    is_partial = in_partial;
    return true;
  }
};

// The rows a key column shows, as one interval, where its hidden ranges leave one. The key
// hides rows [a.x, a.x + a.y) and [b.x, b.x + b.y) ((start, length) as the kernels stage
// column ranges; length 0: no range). Rows are 0..R-1. Returns false where the visible rows
// are not one interval (the caller then tests the ranges themselves), else v = (start,
// length): row i is visible iff unsigned(i - v.x) < unsigned(v.y), one compare per score
// instead of one per range. Causal, sliding-window, document and prefix-LM keys all give
// one interval. Rows >= R come out hidden (the kernels never store them).
__device__ __forceinline__ bool visible_interval(int2 a, int2 b, int R, int2& v) {
  auto clip = [R](int2 s, int& lo, int& hi) {          // to [0, R); empty: lo >= hi
    lo = max(s.x, 0);
    hi = static_cast<int>(min(static_cast<long long>(s.x) + max(s.y, 0), static_cast<long long>(R)));
  };
  int a0, a1, b0, b1;
  clip(a, a0, a1);
  clip(b, b0, b1);
  const bool ea = a0 >= a1, eb = b0 >= b1;
  if (ea && eb) {
    v = make_int2(0, R);
    return true;
  }
  if (ea || eb || max(a0, b0) <= min(a1, b1)) {         // one hidden interval [h0, h1)
    const int h0 = ea ? b0 : eb ? a0 : min(a0, b0);
    const int h1 = ea ? b1 : eb ? a1 : max(a1, b1);
    if (h0 == 0) v = make_int2(h1, R - h1);
    else if (h1 == R) v = make_int2(0, h0);
    else return false;
    return true;
  }
  // two disjoint hidden intervals: visible between them iff they reach row 0 and row R
  const bool a_first = a0 < b0;
  const int f0 = a_first ? a0 : b0, f1 = a_first ? a1 : b1;
  const int s0 = a_first ? b0 : a0, s1 = a_first ? b1 : a1;
  if (f0 != 0 || s1 != R) return false;
  v = make_int2(f1, s0 - f1);
  return true;
}

// The band of a window (PredicateParams::window: (left, right) on the device, query i sees
// key j iff i + Lk - Lq - left <= j <= i + Lk - Lq + right): key j shows the rows
// j + a <= i < j + b, returned as (a, b) = (Lq - Lk - right, Lq - Lk + left + 1). Read where
// it is used (from L1): held in registers across a step loop it cost spills (C113).
__device__ __forceinline__ int2 window_band(const int32_t* window, int Lq, int Lk) {
  const int left = __ldg(window), right = __ldg(window + 1);
  return make_int2(Lq - Lk - right, Lq - Lk + left + 1);
}

// The rows key j shows under a window whose band is j + a <= i < j + b (window_band),
// clipped to the rows 0..R-1, as
// visible_interval's (start, length): row i is visible iff unsigned(i - v.x) < unsigned(v.y).
// (64-bit sums: a and b reach past +-2^29 for windows wider than any sequence.)
__device__ __forceinline__ int2 band_rows(int j, int a, int b, int R) {
  const long long lo = max(static_cast<long long>(j) + a, 0LL);
  const long long hi = min(static_cast<long long>(j) + b, static_cast<long long>(R));
  return make_int2(static_cast<int>(lo < hi ? lo : 0), static_cast<int>(lo < hi ? hi - lo : 0));
}

// How many of a thread's columns of an m64nN accumulator lie below column offset q of the
// thread's first one: the thread's columns sit at 8 (c / 2) + (c % 2) past it (c = 0 ..
// cols - 1), so the count is 2 (q / 8) + min(q % 8, 2) (FlashAttention-4's mask_r2p
// transform), 0 for q <= 0, at most cols.
__device__ __forceinline__ int columns_below(int q, int cols) {
  if (q <= 0) return 0;
  const int r = q & 7;
  const int n = 2 * (q >> 3) + (r < 2 ? r : 2);
  return n < cols ? n : cols;
}

// Bit c set for the thread's columns c at offsets in [lo, hi) from its first column (cols
// <= 32): per score then a bit test and a select, which ptxas makes R2P and FSEL.
__device__ __forceinline__ uint32_t column_mask(int lo, int hi, int cols) {
  auto below = [](int n) { return n >= 32 ? 0xffffffffu : (1u << n) - 1u; };
  return below(columns_below(hi, cols)) & ~below(columns_below(lo, cols));
}

// Element predicate of a partial block at (query i, key j); i < Lq and j < Lk are
// checked by the caller. block_q/block_k: the descriptor's block sizes (bitmaps).
__device__ __forceinline__ bool visible(const PredicateParams& p, int b, int h, int i, int j,
                                        int block_q, int block_k) {
  bool vis = true;
  if (p.col_ranges != nullptr) {
    const int32_t* cr = p.col_ranges + b * p.cr_sb + (h / p.cr_head_div) * p.cr_sh + j * p.cr_sk;
    for (int r = 0; r < p.n_col_ranges; ++r) {
      int s = __ldg(cr + 2 * r), e = __ldg(cr + 2 * r + 1);
      vis = vis && (i < s || i >= e);
    }
  }
  if (vis && p.dense != nullptr) {
    vis = __ldg(p.dense + b * p.dense_sb + (h / p.dense_head_div) * p.dense_sh +
                i * p.dense_sq + j * p.dense_sk) != 0;
  }
  if (vis && p.bits_index != nullptr) {
    int qb = i / block_q, kb = j / block_k;
    int idx = __ldg(p.bits_index + b * p.bi_sb + (h / p.bi_head_div) * p.bi_sh + qb * p.bi_sq + kb);
    if (idx >= 0 && idx < p.bits_count) {
      int r = i - qb * block_q, c = j - kb * block_k;
      uint32_t w = static_cast<uint32_t>(__ldg(p.bits + idx * p.bits_sp + r * p.bits_sr + (c >> 5)));
      vis = (w >> (c & 31)) & 1u;
    }
  }
  return vis;
}

}  // namespace flexsparse
