// Descriptors of masks rebuilt every step, built in one op call (issue 16): document masks
// from a lengths tensor and prefix-LM masks from per-sample prefix lengths. The result is
// the range-form descriptor of flexsparse.blocklists.column_range_range_descriptor (the
// compact build): the column ranges (Bl, 1, Lk, 2m) and the eight block lists, each row
// at most 4 half-open block ranges. Kept free of torch headers: the CUDA kernels
// (build_masks.cu) and the CPU loops (build_ops.h) share the per-column, per-key-block
// and per-query-block steps below, so both compute the same thing.
//
// Steps (the torch code of blocklists.py they follow, in brackets):
//   1. per key column j: its m masked row intervals, normalized (masks._stack_slots);
//   2. per key block kb and interval r: min/max statistics over its columns
//      (blocklists.key_block_stats), turned into the hull [h0, h1) and the cover [a, b)
//      in query blocks (_query_block_bounds); the kb's dK/dV lists: full = outside every
//      hull, partial = in a hull but in no cover (_set_ranges);
//   3. per interval r, over kb: empty hulls/covers moved so that the bounds never
//      decrease (_monotone_fill);
//   4. per query block qb: the key blocks whose hull / cover holds qb, [#(hi <= qb),
//      #(lo <= qb)) by binary search, and the same algebra for the forward / dQ lists.
// For documents and prefix-LM the bounds never decrease with kb (columns' intervals are
// monotone in j), so the range form always exists and no fallback is needed.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FS_HD __host__ __device__ __forceinline__
#else
#define FS_HD inline
#endif

namespace flexsparse {
namespace build {

constexpr int kMaxRanges = 4;       // ranges per list row (ops.schema.MAX_RANGES)
constexpr int kMaxSlots = 3;        // masked intervals per column of the kinds built here
constexpr int64_t kBig = int64_t(1) << 40;

enum Kind : int { kDocumentCausal = 0, kDocument = 1, kPrefixLM = 2, kColumnRanges = 3 };
// The kinds built from a lengths tensor (prefix sums into document ends).
FS_HD bool is_document(int kind) {
  return kind == kDocumentCausal || kind == kDocument;
}

// Column ranges (FlashMask, masks.column_ranges): user data need not be range-shaped, and
// the form cannot depend on the data without a host sync, so this kind gets the static
// build's padded lists instead (index (Bd, Hd, n, N): the listed blocks ascending, then
// the others ascending, as descriptor._block_lists), from the same block states.
inline int slots_of(int kind, int C = 0, bool causal = false) {
  if (kind == kColumnRanges) return (C == 4 && causal) ? 3 : 2;
  return kind == kPrefixLM ? 1 : 2;
}

struct BuildParams {
  int kind = 0;
  int m = 0;                          // intervals per column
  int64_t Bl = 0;                     // rows of the lengths / prefix tensor
  int64_t Lq = 0, Lk = 0, bq = 0, bk = 0, nQB = 0, nKB = 0;
  // documents: lengths (Bl, n_docs) int64 and their inclusive prefix sums (a workspace)
  const int64_t* lengths = nullptr;
  int64_t n_docs = 0;
  int64_t* ends = nullptr;
  // prefix-LM: prefix lengths (Bl,) int64
  const int64_t* prefix = nullptr;
  // column ranges: startend (Bl = Bc * Hc, Lk, C) int64 and the mask's causal flag
  const int64_t* startend = nullptr;
  int C = 0;
  bool causal = false;
  // outputs, int32, contiguous
  int32_t* col_ranges = nullptr;      // (Bl, Lk, 2m)
  int32_t* kv_count = nullptr;        // (Bl, nQB)       partial, per query block
  int32_t* kv_index = nullptr;        // (Bl, nQB, 4, 2); column ranges: (Bl, nQB, nKB)
  int32_t* kv_full_count = nullptr;
  int32_t* kv_full_index = nullptr;
  int32_t* q_count = nullptr;         // (Bl, nKB)       partial, per key block
  int32_t* q_index = nullptr;         // (Bl, nKB, 4, 2); column ranges: (Bl, nKB, nQB)
  int32_t* q_full_count = nullptr;
  int32_t* q_full_index = nullptr;
  // workspace, int32 (Bl, 4, m, nKB): h0, h1, a, b per interval and key block, raw
  // (bounds) and after step 3 (filled)
  int32_t* bounds = nullptr;
  int32_t* filled = nullptr;
  // build_block_lists: the lists come from a block grid (Bl, nQB, nKB) instead of bounds:
  // a bool layout (True = the block is attended whole: masks.block_sparse at the call's
  // block size) or int32 block states (kSkip / kPartial / kFull: descriptor.from_block_state)
  const bool* layout = nullptr;
  const int32_t* states = nullptr;
  // A layout has no partial blocks, so every partial list is empty and its padded row is
  // 0, 1, ..., n - 1: such lists are stored once per layout row b (kv_count (Bl), kv_index
  // (Bl, nKB), q_count (Bl), q_index (Bl, nQB)), written by list row 0, and the op returns
  // them expanded over the list rows (stride 0), which the attention kernels read as one
  // row (params.h, BlockListParams). Half of the bytes a layout's build wrote.
  bool partial_one_row = false;
  // FLEXSPARSE_CUDA_DEBUG bit 8589934592: documents and prefix-LM by the fused one-launch
  // build (build_masks.cu; opt-in: on an H200 no faster than the default).
  bool fused = false;
  // FLEXSPARSE_CUDA_DEBUG bit 274877906944: block grids by list_kernel's warp per list row
  // (the build before grid_list_kernel, for same-run A/Bs).
  bool grid_by_warp = false;
  // FLEXSPARSE_CUDA_DEBUG bit 35184372088832: block grids by grid_list_kernel's two-pass
  // build only (no slabs), for same-run A/Bs.
  bool grid_two_pass = false;
};

// Where list row `row` of layout row b writes its partial list and count (kv: the
// forward / dQ rows, n_rows = nQB; else the dK/dV rows): nullptr where partial_one_row
// stores nothing for it.
FS_HD int32_t* partial_list(const BuildParams& p, bool kv, int64_t b, int64_t row) {
  const int64_t rows = kv ? p.nQB : p.nKB, n = kv ? p.nKB : p.nQB;
  int32_t* base = kv ? p.kv_index : p.q_index;
  if (p.partial_one_row) return row == 0 ? base + b * n : nullptr;
  return base + (b * rows + row) * n;
}

FS_HD int32_t* partial_count(const BuildParams& p, bool kv, int64_t b, int64_t row) {
  int32_t* base = kv ? p.kv_count : p.q_count;
  if (p.partial_one_row) return row == 0 ? base + b : nullptr;
  return base + b * (kv ? p.nQB : p.nKB) + row;
}

// Where list row `row` of layout row b writes its full list and count (every row stores).
FS_HD int32_t* full_list(const BuildParams& p, bool kv, int64_t b, int64_t row) {
  const int64_t rows = kv ? p.nQB : p.nKB, n = kv ? p.nKB : p.nQB;
  return (kv ? p.kv_full_index : p.q_full_index) + (b * rows + row) * n;
}

FS_HD int32_t* full_count(const BuildParams& p, bool kv, int64_t b, int64_t row) {
  return (kv ? p.kv_full_count : p.q_full_count) + b * (kv ? p.nQB : p.nKB) + row;
}

FS_HD int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }
FS_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
FS_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Index of the document holding column j: the first d with ends[d] > j (clamped to the
// last document), as torch.searchsorted(ends, j, right=True).clamp(max=n-1).
FS_HD int64_t document_of(const int64_t* ends, int64_t n, int64_t j) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    int64_t mid = (lo + hi) >> 1;
    if (ends[mid] <= j) lo = mid + 1; else hi = mid;
  }
  return lo < n - 1 ? lo : n - 1;
}

// Step 1: the masked row intervals of key column j, normalized as masks._stack_slots does
// (clamped to [0, Lq]; an empty upper interval [0, e) is (0, 0), an empty lower one
// [s, Lq) is (Lq, Lq)). Documents: doc_start / doc_end of j's document; slot 0 hides the
// rows above the document (and above the diagonal when causal), slot 1 the rows below it.
// Prefix-LM: slot 0 hides the rows above the diagonal in columns past the prefix.
FS_HD void column_intervals(int kind, int64_t Lq, int64_t Lk, int64_t j, int64_t doc_start,
                            int64_t doc_end, int64_t prefix, int64_t* s, int64_t* e) {
  if (kind == kPrefixLM) {
    int64_t end = j < prefix ? 0 : j - (Lk - Lq);
    end = clamp64(end, 0, Lq);
    s[0] = 0;
    e[0] = end;                       // empty: (0, 0) already
    return;
  }
  int64_t upper = kind == kDocumentCausal ? max64(doc_start, j) : doc_start;   // Lq == Lk
  s[0] = 0;
  e[0] = clamp64(upper, 0, Lq);
  int64_t lower = clamp64(doc_end, 0, Lq);
  s[1] = lower;
  e[1] = Lq;
  if (lower >= Lq) s[1] = Lq;
}

// Step 1 for column ranges: the slots of masks.column_ranges after masks._simplify
// (upper first, then lower, then general intervals), normalized as above. x: the column's
// C values.
FS_HD void flashmask_intervals(int C, bool causal, int64_t Lq, int64_t Lk, int64_t j,
                               const int64_t* x, int64_t* s, int64_t* e) {
  const int UPPER = 0, LOWER = 1, GENERAL = 2;
  int kind[kMaxSlots];
  int n = 0;
  if (causal) { kind[n] = UPPER; s[n] = 0; e[n] = j - (Lk - Lq); ++n; }
  if (C == 1) {
    kind[n] = LOWER; s[n] = x[0]; e[n] = Lq; ++n;
  } else if (C == 2 && causal) {
    kind[n] = GENERAL; s[n] = x[0]; e[n] = x[1]; ++n;
  } else if (C == 2) {
    kind[n] = UPPER; s[n] = 0; e[n] = x[1]; ++n;
    kind[n] = LOWER; s[n] = x[0]; e[n] = Lq; ++n;
  } else {
    kind[n] = GENERAL; s[n] = x[0]; e[n] = x[1]; ++n;
    kind[n] = GENERAL; s[n] = x[2]; e[n] = x[3]; ++n;
  }
  for (int r = 0; r < n; ++r) {
    s[r] = clamp64(s[r], 0, Lq);
    e[r] = clamp64(e[r], 0, Lq);
    if (s[r] >= e[r]) s[r] = e[r] = kind[r] == LOWER ? Lq : 0;
  }
}

// Block state of (qb, kb) from kb's bounds (masks.col_ranges_block_state): skipped if an
// interval covers the query block in every column, full if none touches it, else partial.
enum State : int { kSkip = 0, kPartial = 1, kFull = 2 };
FS_HD int block_state(const int32_t* bounds_kb, int m, int64_t stride, int32_t qb) {
  bool skip = false, touched = false;
  for (int r = 0; r < m; ++r) {
    int32_t h0 = bounds_kb[(0 * m + r) * stride], h1 = bounds_kb[(1 * m + r) * stride];
    int32_t a = bounds_kb[(2 * m + r) * stride], b = bounds_kb[(3 * m + r) * stride];
    skip = skip || (a <= qb && qb < b);
    touched = touched || (h0 <= qb && qb < h1);
  }
  return skip ? kSkip : (touched ? kPartial : kFull);
}

// Block state of (qb, kb) in row b of a block grid (p.layout or p.states).
FS_HD int grid_state(const BuildParams& p, int64_t b, int64_t qb, int64_t kb) {
  const int64_t at = (b * p.nQB + qb) * p.nKB + kb;
  return p.layout != nullptr ? (p.layout[at] ? int(kFull) : int(kSkip)) : int(p.states[at]);
}

// Step 2: per key block statistics of one interval (blocklists.key_block_stats; padded
// columns are neutral, empty intervals neither cover nor touch anything).
struct Stats {
  int64_t s_cov = 0, e_cov = kBig, s_miss = kBig, e_miss = -kBig;

  FS_HD void add(int64_t s, int64_t e) {
    bool nonempty = s < e;
    s_cov = max64(s_cov, s);
    e_cov = min64(e_cov, nonempty ? e : 0);
    s_miss = min64(s_miss, nonempty ? s : kBig);
    e_miss = max64(e_miss, nonempty ? e : -kBig);
  }
  FS_HD void merge(const Stats& o) {
    s_cov = max64(s_cov, o.s_cov);
    e_cov = min64(e_cov, o.e_cov);
    s_miss = min64(s_miss, o.s_miss);
    e_miss = max64(e_miss, o.e_miss);
  }
  // hull [h0, h1) and cover [a, b) in query blocks (blocklists._query_block_bounds)
  FS_HD void bounds(int64_t Lq, int64_t bq, int64_t nQB, int32_t out[4]) const {
    bool touched = s_miss < kBig;
    out[0] = (int32_t)clamp64(touched ? s_miss / bq : 0, 0, nQB);
    out[1] = (int32_t)clamp64(touched ? (e_miss + bq - 1) / bq : 0, 0, nQB);
    out[2] = (int32_t)clamp64((s_cov + bq - 1) / bq, 0, nQB);
    out[3] = (int32_t)clamp64(e_cov >= Lq ? nQB : e_cov / bq, 0, nQB);
  }
};

// Step 1 for documents and prefix-LM: column j's intervals from the row's document ends
// (inclusive prefix sums of the lengths; unused for prefix-LM) or its prefix length.
FS_HD void document_column(const BuildParams& p, const int64_t* ends, int64_t prefix, int64_t j,
                           int64_t* s, int64_t* e) {
  int64_t ds = 0, de = 0;
  if (p.kind != kPrefixLM) {
    int64_t d = document_of(ends, p.n_docs, j);
    de = ends[d];
    ds = d > 0 ? ends[d - 1] : 0;          // = ends[d] - lengths[d]
  }
  column_intervals(p.kind, p.Lq, p.Lk, j, ds, de, prefix, s, e);
}

// Step 2 for documents and prefix-LM from two columns. Their normalized intervals never
// decrease with j (document starts and ends, the diagonal, the prefix all move right), an
// upper slot starts at 0 in every column and a lower one ends at Lq, so a slot's empty
// columns are a prefix of the key block (upper) or a suffix (lower). Then every statistic
// of the block is reached at its first or its last column: the block's bounds need those
// two columns, not all of them (tests/host/build_stats.cpp checks this against every
// column). It lets one CTA per row make the query blocks' lists without waiting for the
// key blocks' CTAs (build_masks.cu, fused_kernel). Not for column ranges (user data).
FS_HD void monotone_key_block_bounds(const BuildParams& p, const int64_t* ends, int64_t prefix,
                                     int64_t kb, int32_t (*bd)[4]) {
  const int64_t first = kb * p.bk, last = min64(p.Lk, first + p.bk) - 1;
  Stats st[kMaxSlots];
  for (int c = 0; c < 2; ++c) {
    int64_t s[kMaxSlots], e[kMaxSlots];
    document_column(p, ends, prefix, c == 0 ? first : last, s, e);
    for (int r = 0; r < p.m; ++r) st[r].add(s[r], e[r]);
  }
  for (int r = 0; r < p.m; ++r) st[r].bounds(p.Lq, p.bq, p.nQB, bd[r]);
}

// ---- block sets of one list row, as maximal ranges

// The union of the nonempty intervals [lo[i], hi[i]) (k <= kMaxSlots), as sorted disjoint
// maximal ranges; returns their number.
FS_HD int union_of(const int32_t* lo, const int32_t* hi, int k, int32_t* ulo, int32_t* uhi) {
  int n = 0;
  for (int i = 0; i < k; ++i) {
    if (hi[i] <= lo[i]) continue;
    int p = n++;                       // insertion sort by start
    while (p > 0 && ulo[p - 1] > lo[i]) { ulo[p] = ulo[p - 1]; uhi[p] = uhi[p - 1]; --p; }
    ulo[p] = lo[i];
    uhi[p] = hi[i];
  }
  int out = 0;
  for (int i = 0; i < n; ++i) {
    if (out > 0 && ulo[i] <= uhi[out - 1]) {
      if (uhi[i] > uhi[out - 1]) uhi[out - 1] = uhi[i];
    } else {
      ulo[out] = ulo[i];
      uhi[out] = uhi[i];
      ++out;
    }
  }
  return out;
}

// Writes ranges (at most kMaxRanges; the rest (0, 0)) and their block count. Returns false
// if there were more ranges than fit (never for the kinds built here).
FS_HD bool put_row(const int32_t* lo, const int32_t* hi, int k, int32_t* count, int32_t* index) {
  int32_t total = 0;
  for (int i = 0; i < kMaxRanges; ++i) {
    int32_t a = i < k ? lo[i] : 0, b = i < k ? hi[i] : 0;
    index[2 * i] = a;
    index[2 * i + 1] = b;
    total += b - a;
  }
  *count = total;
  return k <= kMaxRanges;
}

// One list row from the hulls and covers of its k intervals over [0, n): the full blocks
// (outside every hull) and the partial ones (in a hull, in no cover). Returns false if a
// set needed more than kMaxRanges ranges.
FS_HD bool write_rows(const int32_t* hlo, const int32_t* hhi, const int32_t* clo,
                      const int32_t* chi, int k, int32_t n, int32_t* full_count,
                      int32_t* full_index, int32_t* part_count, int32_t* part_index) {
  int32_t ulo[kMaxSlots], uhi[kMaxSlots], vlo[kMaxSlots], vhi[kMaxSlots];
  int nu = union_of(hlo, hhi, k, ulo, uhi);
  int nc = union_of(clo, chi, k, vlo, vhi);
  // full: [0, n) minus the hulls
  int32_t flo[kMaxSlots + 1], fhi[kMaxSlots + 1];
  int nf = 0;
  int32_t at = 0;
  for (int i = 0; i < nu; ++i) {
    if (ulo[i] > at) { flo[nf] = at; fhi[nf] = ulo[i]; ++nf; }
    at = uhi[i];
  }
  if (at < n) { flo[nf] = at; fhi[nf] = n; ++nf; }
  // partial: the hulls minus the covers
  int32_t plo[2 * kMaxSlots], phi[2 * kMaxSlots];
  int np = 0;
  for (int i = 0; i < nu; ++i) {
    int32_t x = ulo[i];
    for (int c = 0; c < nc && x < uhi[i]; ++c) {
      if (vhi[c] <= x) continue;
      if (vlo[c] >= uhi[i]) break;
      if (vlo[c] > x) { plo[np] = x; phi[np] = vlo[c]; ++np; }
      x = vhi[c];
    }
    if (x < uhi[i]) { plo[np] = x; phi[np] = uhi[i]; ++np; }
  }
  bool ok = put_row(flo, fhi, nf, full_count, full_index);
  return put_row(plo, phi, np, part_count, part_index) && ok;
}

// Step 4: #(seq[i] <= x) over a sequence that never decreases (torch.searchsorted(seq, x,
// right=True)). `stride` steps between elements.
FS_HD int32_t count_le(const int32_t* seq, int32_t n, int32_t x) {
  int32_t lo = 0, hi = n;
  while (lo < hi) {
    int32_t mid = (lo + hi) >> 1;
    if (seq[mid] <= x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Workspace layout: (Bl, 4, m, nKB), element (b, t, r, kb); t: 0 h0, 1 h1, 2 a, 3 b.
FS_HD int64_t ws_at(const BuildParams& p, int64_t b, int t, int r) {
  return ((b * 4 + t) * p.m + r) * p.nKB;
}

// Step 4 for query block qb of row b: the forward / dQ lists. `filled`: row b's filled
// bounds, (4, m, nKB) (in the workspace, or a copy in shared memory).
FS_HD bool query_block_rows(const BuildParams& p, int64_t b, int64_t qb, const int32_t* filled) {
  int32_t hlo[kMaxSlots], hhi[kMaxSlots], clo[kMaxSlots], chi[kMaxSlots];
  const int32_t nKB = (int32_t)p.nKB, x = (int32_t)qb;
  for (int r = 0; r < p.m; ++r) {
    hlo[r] = count_le(filled + (1 * p.m + r) * p.nKB, nKB, x);   // #(h1 <= qb)
    hhi[r] = count_le(filled + (0 * p.m + r) * p.nKB, nKB, x);   // #(h0 <= qb)
    clo[r] = count_le(filled + (3 * p.m + r) * p.nKB, nKB, x);   // #(b <= qb)
    chi[r] = count_le(filled + (2 * p.m + r) * p.nKB, nKB, x);   // #(a <= qb)
  }
  int64_t row = b * p.nQB + qb;
  return write_rows(hlo, hhi, clo, chi, p.m, nKB, p.kv_full_count + row,
                    p.kv_full_index + row * 2 * kMaxRanges, p.kv_count + row,
                    p.kv_index + row * 2 * kMaxRanges);
}

// Step 2's lists for key block kb of row b from its hull/cover bounds (h0, h1, a, b) per
// interval; also stores the bounds in the workspace (unless the fused kernel's row CTA
// makes them itself).
FS_HD bool key_block_rows(const BuildParams& p, int64_t b, int64_t kb, const int32_t (*bd)[4],
                          bool store_bounds = true) {
  int32_t hlo[kMaxSlots], hhi[kMaxSlots], clo[kMaxSlots], chi[kMaxSlots];
  for (int r = 0; r < p.m; ++r) {
    hlo[r] = bd[r][0]; hhi[r] = bd[r][1]; clo[r] = bd[r][2]; chi[r] = bd[r][3];
    if (store_bounds)
      for (int t = 0; t < 4; ++t) p.bounds[ws_at(p, b, t, r) + kb] = bd[r][t];
  }
  int64_t row = b * p.nKB + kb;
  return write_rows(hlo, hhi, clo, chi, p.m, (int32_t)p.nQB, p.q_full_count + row,
                    p.q_full_index + row * 2 * kMaxRanges, p.q_count + row,
                    p.q_index + row * 2 * kMaxRanges);
}

// ---- entry points (build_masks.cu)

// Launches the kernels on `stream` (a cudaStream_t): 2 when the bounds of a row fit in
// shared memory (kSharedBoundsBytes: nKB <= 1280 for documents, 160K tokens at block 128)
// and a row has at most kSharedDocs documents; one more for each of these that does not
// hold. Lengths / prefix values are checked on the device (a device-side assert).
void build_column_ranges_cuda(const BuildParams& p, void* stream);
// Documents with at most this many documents per row (and documents x key blocks at most
// kSharedScanWork) scan their lengths inside the column kernel (no separate scan, no
// `ends` workspace).
constexpr int64_t kSharedDocs = 2048;
constexpr int64_t kSharedScanWork = int64_t(1) << 22;
// Whether the CUDA build needs the `ends` workspace (and a scan kernel) for these sizes.
inline bool needs_ends(const BuildParams& p) {
  return is_document(p.kind) && (p.n_docs > kSharedDocs || p.n_docs * p.nKB > kSharedScanWork);
}
constexpr int64_t kSharedBoundsBytes = 40 * 1024;   // + static: under the 48 KB default
// With `fused` (FLEXSPARSE_CUDA_DEBUG bit 8589934592, opt-in: no faster measured), documents
// (with their lengths scanned in shared memory) and prefix-LM build in one launch
// (fused_kernel) up to this many key blocks per row; longer rows keep the kernels above,
// whose query-block work is spread over more threads.
constexpr int64_t kFusedMaxKeyBlocks = 2048;
inline bool fused_build(const BuildParams& p) {
  return p.fused && p.kind != kColumnRanges && !needs_ends(p) && p.nQB > 0 &&
         p.nKB <= kFusedMaxKeyBlocks;
}
// The padded lists of a block grid (p.layout or p.states; outputs as for column ranges):
// one launch.
void build_block_lists_cuda(const BuildParams& p, void* stream);

}  // namespace build
}  // namespace flexsparse
