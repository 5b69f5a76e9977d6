// The CUDA kernels of the mask-build ops (build_masks.h says what they compute), no host
// synchronization, workspace O(N / block). Under FLEXSPARSE_CUDA_DEBUG bit 8589934592
// (opt-in: within noise of the default on an H200), documents (up to kSharedDocs
// documents per row) and prefix-LM up to kFusedMaxKeyBlocks key blocks take one launch:
//
//   fused_kernel        per row, CTA 0 makes the query blocks' forward and dQ lists from
//                       bounds it computes from each key block's first and last column
//                       (monotone_key_block_bounds), and CTA 1 + kb is column_kernel's
//                       key block kb (below, without writing the bounds).
//
// Otherwise (the default; column ranges and the other sizes always), two to four
// launches:
//
//   scan_kernel         (documents with more than kSharedDocs documents per row only)
//                       one CTA per row: prefix sums of the lengths, and their check;
//   column_kernel       one CTA per (key block, row): its columns' intervals (written out
//                       as col_ranges), their per-block statistics, the key block's
//                       dK/dV lists and its hull/cover bounds (workspace); with few
//                       documents it scans the lengths itself in shared memory;
//   list_kernel         (column ranges) one warp per list row: the padded lists;
//   query_block_kernel_smem
//                       one CTA per row: the bounds made non-decreasing over key blocks
//                       (two block scans per sequence) in shared memory, then per query
//                       block the forward and dQ lists by binary search; when a row's
//                       bounds do not fit in shared memory (more than 160K tokens at
//                       block 128 for documents) two kernels do it instead: fill_kernel
//                       (one CTA per sequence and row, into the workspace) and
//                       query_block_kernel (one thread per query block).
// Block grids (build_block_lists: layouts and block states) take one launch,
// grid_list_kernel (below, before the query-block kernels).
// Bad values (negative lengths, rows not summing to L, negative prefixes) stop the kernel
// with a device-side assert, as torch._assert_async does in the torch build.
#undef NDEBUG
#include <cassert>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "build_masks.h"

namespace flexsparse {
namespace build {
namespace {

constexpr int kColumnThreads = 128;
constexpr int kRowThreads = 1024;
constexpr int kQueryThreads = 256;
constexpr int kFusedThreads = 256;

struct Add { __device__ int64_t operator()(int64_t a, int64_t b) const { return a + b; } };
struct Max { __device__ int32_t operator()(int32_t a, int32_t b) const { return a > b ? a : b; } };
struct Min { __device__ int32_t operator()(int32_t a, int32_t b) const { return a < b ? a : b; } };

template <typename T, typename Op>
__device__ __forceinline__ T warp_scan(T v, Op op) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    T o = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v = op(v, o);
  }
  return v;
}

// Inclusive scan of one value per thread across the CTA (blockDim.x a multiple of 32),
// continuing from `carry`, which becomes the running total. Every thread must call it.
template <typename T, typename Op>
__device__ T block_scan(T v, Op op, T& carry, T* buf) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_scan(v, op);
  if (lane == 31) buf[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T x = buf[lane < nw ? lane : nw - 1];                  // lanes >= nw do not matter
    __syncwarp();            // every lane has read buf before lane nw - 1 writes its entry
    T w = warp_scan(x, op);
    if (lane < nw) buf[lane] = w;
  }
  __syncthreads();
  T out = op(carry, warp > 0 ? op(buf[warp - 1], v) : v);
  carry = op(carry, buf[nw - 1]);
  __syncthreads();                                         // buf is reused by the next call
  return out;
}

// Prefix sums of one row of document lengths into `ends`; true when the row is valid
// (no negative length, sum == L). Every thread must call it; all get the answer.
__device__ bool scan_lengths(const int64_t* lengths, int64_t n, int64_t L, int64_t* ends,
                             int64_t* buf) {
  int64_t carry = 0;
  int bad = 0;
  for (int64_t c = 0; c < n; c += blockDim.x) {
    int64_t i = c + threadIdx.x;
    int64_t v = i < n ? lengths[i] : 0;
    bad |= v < 0;
    int64_t incl = block_scan(v, Add(), carry, buf);
    if (i < n) ends[i] = incl;
  }
  bad = __syncthreads_or(bad);
  return !bad && carry == L;
}

#define FS_BAD_LENGTHS \
  "lengths: lengths must be non-negative and each row must sum to the sequence length L"

__global__ void scan_kernel(BuildParams p) {
  __shared__ int64_t buf[32];
  const int64_t b = blockIdx.x;
  bool ok = scan_lengths(p.lengths + b * p.n_docs, p.n_docs, p.Lk, p.ends + b * p.n_docs, buf);
  if (threadIdx.x == 0) assert(ok && FS_BAD_LENGTHS);
}

__device__ __forceinline__ void warp_reduce(Stats& s) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    Stats o;
    o.s_cov = __shfl_xor_sync(0xffffffffu, s.s_cov, d);
    o.e_cov = __shfl_xor_sync(0xffffffffu, s.e_cov, d);
    o.s_miss = __shfl_xor_sync(0xffffffffu, s.s_miss, d);
    o.e_miss = __shfl_xor_sync(0xffffffffu, s.e_miss, d);
    s.merge(o);
  }
}

// The columns of key block kb of row b (blockDim.x threads, a multiple of 32, at most
// kThreads): their intervals written out as col_ranges, their statistics reduced over the
// CTA, then the key block's bounds (column ranges: into the workspace, for list_kernel)
// or its dK/dV lists (key_block_rows; the bounds into the workspace too unless
// `store_bounds` is false: the fused kernel's row CTA makes its own).
template <int kThreads>
__device__ void key_block_columns(const BuildParams& p, int64_t kb, int64_t b, const int64_t* ends,
                                  int64_t prefix, bool store_bounds) {
  __shared__ int64_t part[kThreads / 32][kMaxSlots][4];    // warps' Stats
  const int m = p.m;
  Stats st[kMaxSlots];
  const int64_t j0 = kb * p.bk, j1 = min64(p.Lk, j0 + p.bk);
  for (int64_t j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
    int64_t s[kMaxSlots], e[kMaxSlots];
    if (p.kind == kColumnRanges) {
      int64_t x[4] = {0, 0, 0, 0};
      for (int c = 0; c < p.C; ++c) x[c] = p.startend[(b * p.Lk + j) * p.C + c];
      flashmask_intervals(p.C, p.causal, p.Lq, p.Lk, j, x, s, e);
    } else {
      document_column(p, ends, prefix, j, s, e);
    }
    int32_t* cr = p.col_ranges + (b * p.Lk + j) * 2 * m;
    if (m == 2) {
      *reinterpret_cast<int4*>(cr) = make_int4((int)s[0], (int)e[0], (int)s[1], (int)e[1]);
    } else {
      for (int r = 0; r < m; ++r) *reinterpret_cast<int2*>(cr + 2 * r) = make_int2((int)s[r], (int)e[r]);
    }
    for (int r = 0; r < m; ++r) st[r].add(s[r], e[r]);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = 0; r < m; ++r) {
    warp_reduce(st[r]);
    if (lane == 0) {
      part[warp][r][0] = st[r].s_cov; part[warp][r][1] = st[r].e_cov;
      part[warp][r][2] = st[r].s_miss; part[warp][r][3] = st[r].e_miss;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t bd[kMaxSlots][4];
    for (int r = 0; r < m; ++r) {
      Stats t;
      for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
        Stats o;
        o.s_cov = part[w][r][0]; o.e_cov = part[w][r][1];
        o.s_miss = part[w][r][2]; o.e_miss = part[w][r][3];
        t.merge(o);
      }
      t.bounds(p.Lq, p.bq, p.nQB, bd[r]);
    }
    if (p.kind == kColumnRanges) {                 // lists: list_kernel
      for (int r = 0; r < m; ++r)
        for (int t = 0; t < 4; ++t) p.bounds[ws_at(p, b, t, r) + kb] = bd[r][t];
    } else {
      bool ok = key_block_rows(p, b, kb, bd, store_bounds);
      assert(ok && "flexsparse build: a key block needs more than 4 block ranges");
    }
  }
}

// What every CTA of a row reads first: the prefix length (prefix-LM), or the document
// ends, scanned into shared memory by the CTA itself (`smem_ends`, with few documents) or
// read from the scan kernel's workspace. The CTA of key block 0 (`checks`) asserts the
// values.
__device__ const int64_t* row_setup(const BuildParams& p, int64_t b, bool shared_ends, bool checks,
                                    int64_t* smem_ends, int64_t* buf, int64_t& prefix) {
  prefix = 0;
  if (p.kind == kPrefixLM) {
    prefix = p.prefix[b];
    if (checks && threadIdx.x == 0) assert(prefix >= 0 && "prefix_len: must be >= 0");
    return nullptr;
  }
  if (shared_ends) {
    bool ok = scan_lengths(p.lengths + b * p.n_docs, p.n_docs, p.Lk, smem_ends, buf);
    if (checks && threadIdx.x == 0) assert(ok && FS_BAD_LENGTHS);
    return smem_ends;
  }
  return p.ends + b * p.n_docs;
}

__global__ void __launch_bounds__(kColumnThreads) column_kernel(BuildParams p, bool shared_ends) {
  extern __shared__ int64_t smem_ends[];
  __shared__ int64_t buf[32];
  const int64_t kb = blockIdx.x, b = blockIdx.y;
  int64_t prefix = 0;
  const int64_t* ends = p.kind == kColumnRanges
                            ? nullptr
                            : row_setup(p, b, shared_ends, kb == 0, smem_ends, buf, prefix);
  key_block_columns<kColumnThreads>(p, kb, b, ends, prefix, true);
}

// Column ranges: the padded lists (descriptor._block_lists of the block states), one warp
// per list row: warps [0, nQB) the forward / dQ rows (over key blocks), the rest the
// dK/dV rows (over query blocks). Pass 1 counts the partial and full blocks of the row;
// pass 2 writes each block at its place: listed ones first, then the others, ascending.
__global__ void __launch_bounds__(kQueryThreads) list_kernel(BuildParams p) {
  const int64_t b = blockIdx.y;
  const int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= p.nQB + p.nKB) return;                  // whole warps leave together
  const bool kv = w < p.nQB;
  const int64_t row = kv ? w : w - p.nQB, n = kv ? p.nKB : p.nQB;
  const int32_t* bounds = p.layout || p.states ? nullptr : p.bounds + ws_at(p, b, 0, 0);
  int32_t* part = partial_list(p, kv, b, row);    // nullptr: nothing to store
  int32_t* part_count = partial_count(p, kv, b, row);
  int32_t* full = full_list(p, kv, b, row);
  int32_t* count_full = full_count(p, kv, b, row);
  auto state = [&](int64_t i) {                    // i: the block along the row
    int64_t qb = kv ? row : i, kb = kv ? i : row;
    if (p.layout != nullptr) return p.layout[(b * p.nQB + qb) * p.nKB + kb] ? int(kFull) : int(kSkip);
    if (p.states != nullptr) return int(p.states[(b * p.nQB + qb) * p.nKB + kb]);
    return block_state(bounds + kb, p.m, p.nKB, (int32_t)qb);
  };
  int64_t np = 0, nf = 0;
  for (int64_t c = 0; c < n; c += 32) {
    int64_t i = c + lane;
    int st = i < n ? state(i) : kSkip;
    np += __popc(__ballot_sync(0xffffffffu, st == kPartial));
    nf += __popc(__ballot_sync(0xffffffffu, st == kFull));
  }
  const unsigned below = (1u << lane) - 1u;
  int64_t bp = 0, bf = 0;                          // listed blocks before this chunk
  for (int64_t c = 0; c < n; c += 32) {
    int64_t i = c + lane;
    int st = i < n ? state(i) : kSkip;
    unsigned sp = __ballot_sync(0xffffffffu, st == kPartial);
    unsigned sf = __ballot_sync(0xffffffffu, st == kFull);
    if (i < n) {
      int64_t before_p = bp + __popc(sp & below), before_f = bf + __popc(sf & below);
      if (part != nullptr) part[st == kPartial ? before_p : np + (i - before_p)] = (int32_t)i;
      full[st == kFull ? before_f : nf + (i - before_f)] = (int32_t)i;
    }
    bp += __popc(sp);
    bf += __popc(sf);
  }
  if (lane == 0) {
    if (part_count != nullptr) *part_count = (int32_t)np;
    *count_full = (int32_t)nf;
  }
}

// Block grids (p.layout, p.states), in one launch (grid_list_kernel). Both list kinds
// are bound by their writes (2 x 4 x n bytes per list row: 256 MB at 128K, B = 1, H = 16;
// a layout's half, its partial lists being one stored row: BuildParams::partial_one_row)
// and by the latency of their loops. By default each list row's grid is read once, 16
// bytes per load, into bit masks held in registers: "slabs" of 32 adjacent blocks of the
// row, two 32-bit words each (bit j: block 32 t + j of slab t is partial / full), slab t
// in lane t % 32 of the warp that makes the row (kSlabsPerLane per lane: rows of up to
// kSlabBlocks blocks). The counts are the words' popcounts reduced over the warp; then
// the warp walks the slabs in order, each broadcast from its lane, and lane j places
// block 32 t + j (place_32): listed ones first, then the others, ascending
// (descriptor._block_lists; the stores of 32 adjacent blocks coalesced, and no second
// read of the grid: docs/perf-notes.md, "Block-grid lists"):
//   forward / dQ rows (one per query block): a warp per row; it loads each 1024 blocks
//     of the row-major grid coalesced (a layout: two 16-byte loads per lane; states:
//     eight), and shuffles hand each slab to its lane (load_slabs);
//   dK/dV rows (one per key block): a CTA per 16 adjacent key blocks reads (256 x 16)
//     tiles, a tile ahead, one grid row per thread (a layout: one 16-byte load; states:
//     four coalesced loads, rows of 64 bytes across four lanes, turned into a row per
//     thread through shared memory). Per key, a warp's two ballots over its 32 rows are
//     that key's slab; shared memory passes it to the warp of the key (warp w makes the
//     lists of key blocks w and w + 8).
// Slabs need every grid row 16-byte aligned (nKB a multiple of 16 for layouts, of 4 for
// states, an aligned base: decided by the launcher, `paths`) and rows of at most
// kSlabBlocks blocks. Other grids, and all under FLEXSPARSE_CUDA_DEBUG bit
// 35184372088832 (for same-run A/Bs: build_bench --variants), take the two-pass build
// (grid_row_lists, grid_column_lists): pass 0 counts the partial and full blocks of each
// row, pass 1 re-reads the grid and places each block, reading one state per lane:
//   forward / dQ rows: a warp per row, 16 blocks per lane (32 apart: the loads
//     independent, each one's loads and stores coalesced), along the row-major grid;
//   dK/dV rows: a CTA per 16 adjacent key blocks reads the grid's (128 x 16) tiles row by
//     row into shared memory, and warp w makes the lists of key blocks w and w + 8 from
//     them, 4 query blocks per lane (list_kernel's warp per key block read its column one
//     byte per lane, nKB bytes apart: a sector per state).
// Launch bounds (256, 4): 64 registers, four CTAs per SM as list_kernel has; with two the
// latency-bound loops ran slower than list_kernel's (docs/perf-notes.md, "Block-grid
// lists").
constexpr int kRowVec = 16;
constexpr int kTileKeys = 16, kTileRows = 128;
constexpr int kTileWarps = kQueryThreads / 32;
constexpr int kKeysPerWarp = kTileKeys / kTileWarps;
constexpr int kColVec = kTileRows / 32;
constexpr int kSlabsPerLane = 4;
constexpr int kSlabBlocks = 32 * 32 * kSlabsPerLane;   // 4096: 512K tokens at block 128
constexpr int kSlabTileRows = kQueryThreads;           // a grid row per thread
constexpr int kTilesPerSlabReg = 32 / kTileWarps;      // dK/dV tiles per slab register
constexpr unsigned kRowsBySlabs = 1, kColumnsBySlabs = 2;   // grid_list_kernel's `paths`

// 32 adjacent blocks of a list row, from c: bit j of sp / sf says block c + j is partial /
// full (is_p, is_f: this lane's bits, which a caller may hold already). Lane j places
// block c + j (when `place` and it is in the row) in the row's lists: listed ones first,
// then the others, ascending (np, nf: the row's totals; bp, bf: its listed blocks before
// c, advanced past these 32). The warp's stores are coalesced. part nullptr: the partial
// list is not stored (BuildParams::partial_one_row).
__device__ __forceinline__ void place_32(unsigned sp, unsigned sf, bool is_p, bool is_f, int32_t c,
                                         int32_t n, bool place, int32_t np, int32_t nf, int32_t& bp,
                                         int32_t& bf, int32_t* part, int32_t* full) {
  const int lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  const int32_t i = c + lane;
  if (place && i < n) {
    const int32_t before_p = bp + __popc(sp & below), before_f = bf + __popc(sf & below);
    if (part != nullptr) part[is_p ? before_p : np + (i - before_p)] = i;
    full[is_f ? before_f : nf + (i - before_f)] = i;
  }
  bp += __popc(sp);
  bf += __popc(sf);
}

// One step of a list row over the whole warp: 32 V blocks from c, block c + 32 v + lane
// in bit v of this lane's masks of partial (pm) and full (fm) ones (so that each v is 32
// adjacent blocks: coalesced loads and stores), counted, and placed when `place` (np, nf:
// the row's totals from pass 0). bp, bf: the row's listed blocks before this step.
template <int V>
__device__ __forceinline__ void step_lists(unsigned pm, unsigned fm, int32_t c, int32_t n, bool place,
                                           int32_t np, int32_t nf, int32_t& bp, int32_t& bf,
                                           int32_t* part, int32_t* full) {
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const bool is_p = (pm >> v) & 1u, is_f = (fm >> v) & 1u;
    place_32(__ballot_sync(0xffffffffu, is_p), __ballot_sync(0xffffffffu, is_f), is_p, is_f, c + 32 * v,
             n, place, np, nf, bp, bf, part, full);
  }
}

__device__ void grid_row_lists(const BuildParams& p, int64_t b, int64_t row) {
  const int lane = threadIdx.x & 31;
  const int32_t n = (int32_t)p.nKB;
  int32_t* part = partial_list(p, true, b, row);
  int32_t* full = p.kv_full_index + (b * p.nQB + row) * n;
  int32_t np = 0, nf = 0;
  for (int pass = 0; pass < 2; ++pass) {
    int32_t bp = 0, bf = 0;
    for (int32_t c = 0; c < n; c += 32 * kRowVec) {
      unsigned pm = 0, fm = 0;
#pragma unroll
      for (int v = 0; v < kRowVec; ++v) {
        const int32_t i = c + 32 * v + lane;
        const int st = i < n ? grid_state(p, b, row, i) : int(kSkip);
        pm |= unsigned(st == kPartial) << v;
        fm |= unsigned(st == kFull) << v;
      }
      step_lists<kRowVec>(pm, fm, c, n, pass == 1, np, nf, bp, bf, part, full);
    }
    np = bp;
    nf = bf;
  }
  if (lane == 0) {
    if (int32_t* c = partial_count(p, true, b, row)) *c = np;
    p.kv_full_count[b * p.nQB + row] = nf;
  }
}

__device__ void grid_column_lists(const BuildParams& p, int64_t b, int64_t kb0) {
  __shared__ uint8_t tile[kTileRows][kTileKeys + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int32_t n = (int32_t)p.nQB;
  int32_t np[kKeysPerWarp] = {}, nf[kKeysPerWarp] = {};
  for (int pass = 0; pass < 2; ++pass) {
    int32_t bp[kKeysPerWarp] = {}, bf[kKeysPerWarp] = {};
    for (int32_t c = 0; c < n; c += kTileRows) {
      __syncthreads();                             // the last tile has been read
#pragma unroll
      for (int e0 = 0; e0 < kTileRows * kTileKeys; e0 += kQueryThreads) {
        const int e = e0 + threadIdx.x, r = e / kTileKeys, k = e % kTileKeys;
        const int64_t qb = c + r, kb = kb0 + k;
        tile[r][k] = uint8_t(qb < n && kb < p.nKB ? grid_state(p, b, qb, kb) : int(kSkip));
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kKeysPerWarp; ++j) {
        const int col = warp + j * kTileWarps;
        const int64_t kb = kb0 + col;
        unsigned pm = 0, fm = 0;
#pragma unroll
        for (int v = 0; v < kColVec; ++v) {
          const int st = tile[32 * v + lane][col];
          pm |= unsigned(st == kPartial) << v;
          fm |= unsigned(st == kFull) << v;
        }
        const int64_t kbc = min(kb, p.nKB - 1), at = (b * p.nKB + kbc) * n;   // (kb < nKB: placed)
        step_lists<kColVec>(pm, fm, c, n, pass == 1 && kb < p.nKB, np[j], nf[j], bp[j], bf[j],
                            partial_list(p, false, b, kbc), p.q_full_index + at);
      }
    }
#pragma unroll
    for (int j = 0; j < kKeysPerWarp; ++j) {
      np[j] = bp[j];
      nf[j] = bf[j];
    }
  }
#pragma unroll
  for (int j = 0; j < kKeysPerWarp; ++j) {
    const int64_t kb = kb0 + warp + j * kTileWarps;
    if (lane == 0 && kb < p.nKB) {
      if (int32_t* c = partial_count(p, false, b, kb)) *c = np[j];
      p.q_full_count[b * p.nKB + kb] = nf[j];
    }
  }
}

// Bit e of the result: byte e of x is nonzero (a layout's True, as grid_state reads it).
__device__ __forceinline__ unsigned nonzero_bytes(unsigned x) {
  const unsigned hi = (((x & 0x7f7f7f7fu) + 0x7f7f7f7fu) | x) & 0x80808080u;   // bit 7 per byte
  return (hi * 0x00204081u) >> 28;              // bits 7, 15, 23, 31 to 28-31, no carries
}

// Bit k: byte k of the 16 is nonzero.
__device__ __forceinline__ unsigned nonzero_bytes16(int4 v) {
  return nonzero_bytes(v.x) | nonzero_bytes(v.y) << 4 | nonzero_bytes(v.z) << 8 |
         nonzero_bytes(v.w) << 12;
}

// Bits u of the two nibbles (partial, full): state u of v is partial / full.
__device__ __forceinline__ unsigned pack_states4(int4 v) {
  const int s[4] = {v.x, v.y, v.z, v.w};
  unsigned pf = 0;
#pragma unroll
  for (int u = 0; u < 4; ++u) pf |= unsigned(s[u] == kPartial) << u | unsigned(s[u] == kFull) << (4 + u);
  return pf;
}

// Slabs 32 j + s (s < 32) of a grid row of n blocks (`row`: its first state, 16-byte
// aligned), lane s's: bit i of pm / fm = block 32 (32 j + s) + i is partial / full, 0 past
// n (a multiple of 16 for layouts, of 4 for states: each 16-byte piece is in the row whole
// or past it whole). The warp loads the 1024 blocks coalesced, lane l the 16-byte pieces
// l + 32 e, and the shuffles hand each 16-block half of a slab to its lane.
template <bool kStates>
__device__ __forceinline__ void load_slabs(const void* row, int j, int32_t n, unsigned& pm, unsigned& fm) {
  const int lane = threadIdx.x & 31;
  const int4 zero = make_int4(0, 0, 0, 0);
  if constexpr (kStates) {
    // piece e of lane l: blocks 128 e + 4 l + u, bits 4 (l % 4) + u of half 8 e + l / 4
    // (partial bits 0-15, full bits 16-31), OR-ed over the lane's quad
    const int4* q = reinterpret_cast<const int4*>(static_cast<const int32_t*>(row) + 1024 * j);
    int4 v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 1024 * j + 128 * e + 4 * lane < n ? __ldg(q + lane + 32 * e) : zero;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const unsigned pf = pack_states4(v[e]);
      unsigned h = ((pf & 0xfu) | (pf >> 4) << 16) << (4 * (lane & 3));
      h |= __shfl_xor_sync(0xffffffffu, h, 1);
      h |= __shfl_xor_sync(0xffffffffu, h, 2);
      // slab s: halves 2 s and 2 s + 1, of piece s / 4, quads 2 s % 8 and (2 s + 1) % 8
      const unsigned a = __shfl_sync(0xffffffffu, h, 4 * ((2 * lane) & 7));
      const unsigned c = __shfl_sync(0xffffffffu, h, 4 * ((2 * lane + 1) & 7));
      if (lane / 4 == e) {
        pm = (a & 0xffffu) | c << 16;
        fm = a >> 16 | (c & 0xffff0000u);
      }
    }
  } else {
    // piece e of lane l: blocks 512 e + 16 l + i, bits 16 e + i of x (half 32 e + l)
    const int4* q = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(row) + 1024 * j);
    int4 v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) v[e] = 1024 * j + 512 * e + 16 * lane < n ? __ldg(q + lane + 32 * e) : zero;
    const unsigned x = nonzero_bytes16(v[0]) | nonzero_bytes16(v[1]) << 16;
    // slab s: halves 2 s and 2 s + 1, of piece s / 16, lanes 2 s % 32 and (2 s + 1) % 32
    const unsigned a = __shfl_sync(0xffffffffu, x, (2 * lane) & 31);
    const unsigned c = __shfl_sync(0xffffffffu, x, (2 * lane + 1) & 31);
    const int sh = 16 * (lane / 16);
    pm = 0;
    fm = ((a >> sh) & 0xffffu) | (c >> sh) << 16;
  }
}

// The lists of one row of n blocks from its slabs (this lane's: slab 32 j + lane in pm[j],
// fm[j]): the counts (np, nf), then the slabs in order, each broadcast to the warp and
// its 32 blocks placed (place_32).
__device__ __forceinline__ void place_slabs(const unsigned (&pm)[kSlabsPerLane],
                                            const unsigned (&fm)[kSlabsPerLane], int32_t n,
                                            int32_t* part, int32_t* full, int32_t& np, int32_t& nf) {
  unsigned cp = 0, cf = 0;
#pragma unroll
  for (int j = 0; j < kSlabsPerLane; ++j) {
    cp += __popc(pm[j]);
    cf += __popc(fm[j]);
  }
  np = (int32_t)__reduce_add_sync(0xffffffffu, cp);
  nf = (int32_t)__reduce_add_sync(0xffffffffu, cf);
  int32_t bp = 0, bf = 0;                          // listed blocks before the slab
#pragma unroll
  for (int j = 0; j < kSlabsPerLane; ++j) {
#pragma unroll 4
    for (int s = 0; s < 32; ++s) {
      const int32_t c = 32 * (32 * j + s);
      if (c >= n) return;                          // n: the same in the whole warp
      const unsigned sp = __shfl_sync(0xffffffffu, pm[j], s), sf = __shfl_sync(0xffffffffu, fm[j], s);
      const int lane = threadIdx.x & 31;
      place_32(sp, sf, (sp >> lane) & 1u, (sf >> lane) & 1u, c, n, true, np, nf, bp, bf, part, full);
    }
  }
}

template <bool kStates>
__device__ void slab_row_lists(const BuildParams& p, int64_t b, int64_t row) {
  const int lane = threadIdx.x & 31;
  const int32_t n = (int32_t)p.nKB;
  const int64_t at = (b * p.nQB + row) * p.nKB;
  const void* grid = kStates ? static_cast<const void*>(p.states + at) : static_cast<const void*>(p.layout + at);
  unsigned pm[kSlabsPerLane] = {}, fm[kSlabsPerLane] = {};
#pragma unroll
  for (int j = 0; j < kSlabsPerLane; ++j)
    if (1024 * j < n) load_slabs<kStates>(grid, j, n, pm[j], fm[j]);   // the same in the warp
  int32_t np, nf;
  place_slabs(pm, fm, n, partial_list(p, true, b, row), p.kv_full_index + at, np, nf);
  if (lane == 0) {
    if (int32_t* c = partial_count(p, true, b, row)) *c = np;
    p.kv_full_count[b * p.nQB + row] = nf;
  }
}

// The grid of a (256 x 16) tile, query blocks from row0, key blocks kb0 + k (k < nk, a
// multiple of 4; the others, and rows past nQB, skip), loaded a tile ahead: a layout's
// row r by thread r (16 bytes: one load); states as 16-byte pieces t + 256 e (row
// (t + 256 e) / 4 = t / 4 + 64 e, keys 4 (t % 4) + u), four per thread: coalesced, each
// grid row's 64 bytes in adjacent lanes. `at`: this thread's piece 0 in the tile at row 0.
template <bool kStates>
struct SlabTile {
  static constexpr int kPieces = kStates ? 4 : 1;
  using Elem = typename std::conditional<kStates, int32_t, bool>::type;
  int4 v[kPieces];

  __device__ __forceinline__ void load(const Elem* at, int32_t row0, int32_t nQB, int64_t nKB, bool keys_in) {
    const int32_t r = kStates ? threadIdx.x / 4 : threadIdx.x;
#pragma unroll
    for (int e = 0; e < kPieces; ++e) {
      const int32_t qb0 = row0 + 64 * e;            // (rows of piece e past the thread's)
      v[e] = keys_in && qb0 + r < nQB ? __ldg(reinterpret_cast<const int4*>(at + qb0 * nKB))
                                      : make_int4(0, 0, 0, 0);
    }
  }
};

template <bool kStates>
__device__ void slab_column_lists(const BuildParams& p, int64_t b, int64_t kb0) {
  // per tile (two in flight) and key, the tile's slab of warp w: (partial, full) words
  __shared__ uint2 words[2][kTileKeys][kTileWarps];
  __shared__ unsigned pieces[kSlabTileRows];       // states: byte f, piece f's nibbles (partial, full)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int32_t n = (int32_t)p.nQB;
  const int nk = (int)min64(kTileKeys, p.nKB - kb0);
  const int32_t tiles = (n + kSlabTileRows - 1) / kSlabTileRows;
  // this warp's keys' slabs: slab 32 j + lane of key warp + kk * kTileWarps in [kk][j]
  unsigned pm[kKeysPerWarp][kSlabsPerLane] = {}, fm[kKeysPerWarp][kSlabsPerLane] = {};
  using Elem = typename SlabTile<kStates>::Elem;
  const Elem* grid;
  if constexpr (kStates) grid = p.states;
  else grid = p.layout;
  const int c = kStates ? 4 * (threadIdx.x % 4) : 0;   // this thread's first key in the tile
  const Elem* at = grid + (b * p.nQB + (kStates ? threadIdx.x / 4 : threadIdx.x)) * p.nKB + kb0 + c;
  SlabTile<kStates> next;
  next.load(at, 0, n, p.nKB, c < nk);
#pragma unroll
  for (int j = 0; j < kSlabsPerLane; ++j) {
    // tile 4 j + q (kTilesPerSlabReg = 4): rows from 256 (4 j + q), warp w's slab
    // 32 j + 8 q + w, held by lane 8 q + w
#pragma unroll 1
    for (int q = 0; q < kTilesPerSlabReg; ++q) {
      const int32_t tile = kTilesPerSlabReg * j + q;
      if (tile >= tiles) break;                    // the same in the whole CTA
      unsigned cp, cf;                             // bit k: row threadIdx.x's key k
      if constexpr (kStates) {
        // (the last tile's pieces were read before its second barrier)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          reinterpret_cast<uint8_t*>(pieces)[threadIdx.x + kSlabTileRows * e] = (uint8_t)pack_states4(next.v[e]);
        next.load(at, (tile + 1) * kSlabTileRows, n, p.nKB, c < nk);
        __syncthreads();
        const unsigned r4 = pieces[threadIdx.x];   // row threadIdx.x's four pieces
        unsigned lo = r4 & 0x0f0f0f0fu, hi = (r4 >> 4) & 0x0f0f0f0fu;
        lo = (lo | lo >> 4) & 0x00ff00ffu;
        hi = (hi | hi >> 4) & 0x00ff00ffu;
        cp = (lo | lo >> 8) & 0xffffu;
        cf = (hi | hi >> 8) & 0xffffu;
      } else {
        cp = 0;
        cf = nonzero_bytes16(next.v[0]);
        next.load(at, (tile + 1) * kSlabTileRows, n, p.nKB, c < nk);
      }
      unsigned mine_p = 0, mine_f = 0;             // lane k: key k's slab
#pragma unroll
      for (int k = 0; k < kTileKeys; ++k) {
        const unsigned sf = __ballot_sync(0xffffffffu, (cf >> k) & 1u);
        const unsigned sp = kStates ? __ballot_sync(0xffffffffu, (cp >> k) & 1u) : 0u;
        if (lane == k) {
          mine_p = sp;
          mine_f = sf;
        }
      }
      // Two buffers: a warp writes this tile's after the barrier of the last tile, which
      // every warp passed only after reading the tile before it (the same buffer).
      if (lane < kTileKeys) words[q & 1][lane][warp] = make_uint2(mine_p, mine_f);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kKeysPerWarp; ++kk) {
        const uint2 w2 = words[q & 1][warp + kk * kTileWarps][lane % kTileWarps];
        if (lane / kTileWarps == q) {
          pm[kk][j] = w2.x;
          fm[kk][j] = w2.y;
        }
      }
    }
  }
#pragma unroll
  for (int kk = 0; kk < kKeysPerWarp; ++kk) {
    const int64_t kb = kb0 + warp + kk * kTileWarps;
    if (kb >= p.nKB) continue;                     // the same in the whole warp
    const int64_t at = (b * p.nKB + kb) * n;
    int32_t np, nf;
    place_slabs(pm[kk], fm[kk], n, partial_list(p, false, b, kb), p.q_full_index + at, np, nf);
    if (lane == 0) {
      if (int32_t* c = partial_count(p, false, b, kb)) *c = np;
      p.q_full_count[b * p.nKB + kb] = nf;
    }
  }
}

// CTAs [0, row_ctas): a warp per forward / dQ row; the others: 16 key blocks' dK/dV rows.
// kPaths: kRowsBySlabs, kColumnsBySlabs (the launcher's choice), else the two-pass build;
// one kernel per choice, so that each is given the registers of its own paths.
// FLEXSPARSE_CUDA_DEBUG bit 274877906944 (p.grid_by_warp): list_kernel's warp per row for
// both kinds instead (the same-run A/B of build_bench --variants).
template <unsigned kPaths>
__global__ void __launch_bounds__(kQueryThreads, 4) grid_list_kernel(BuildParams p, unsigned row_ctas) {
  if (blockIdx.x >= row_ctas) {
    const int64_t b = blockIdx.y, kb0 = int64_t(blockIdx.x - row_ctas) * kTileKeys;
    if constexpr (!(kPaths & kColumnsBySlabs)) grid_column_lists(p, b, kb0);
    else if (p.states != nullptr) slab_column_lists<true>(p, b, kb0);
    else slab_column_lists<false>(p, b, kb0);
    return;
  }
  const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (row >= p.nQB) return;                        // whole warps leave together
  const int64_t b = blockIdx.y;
  if constexpr (!(kPaths & kRowsBySlabs)) grid_row_lists(p, b, row);
  else if (p.states != nullptr) slab_row_lists<true>(p, b, row);
  else slab_row_lists<false>(p, b, row);
}

// Step 3 for one (lo, hi) sequence over the key blocks: empty intervals take the last
// end before them and the next start after them (blocklists._monotone_fill), by two block
// scans per 1024 key blocks. Every thread of the CTA must call it.
__device__ void fill_pair(const int32_t* lo, const int32_t* hi, int32_t* flo, int32_t* fhi,
                          int32_t nKB, int32_t nQB, int32_t* buf) {
  int32_t carry = 0;                               // hi of an empty interval: the last end
  for (int32_t c = 0; c < nKB; c += blockDim.x) {
    int32_t i = c + threadIdx.x;
    bool in = i < nKB, empty = in && hi[i] <= lo[i];
    int32_t v = in && !empty ? hi[i] : 0;
    int32_t incl = block_scan(v, Max(), carry, buf);
    if (in) fhi[i] = empty ? incl : hi[i];
  }
  carry = nQB;                                     // lo of an empty interval: the next start
  for (int32_t c = 0; c < nKB; c += blockDim.x) {
    int32_t i = nKB - 1 - (c + (int32_t)threadIdx.x);
    bool in = i >= 0, empty = in && hi[i] <= lo[i];
    int32_t v = in && !empty ? lo[i] : nQB;
    int32_t incl = block_scan(v, Min(), carry, buf);
    if (in) flo[i] = empty ? incl : lo[i];
  }
}

// Rows whose bounds fit in shared memory: one CTA per row fills them there and then
// makes every query block's lists (binary searches in shared memory).
__global__ void __launch_bounds__(kRowThreads) query_block_kernel_smem(BuildParams p) {
  extern __shared__ int32_t filled[];              // (4, m, nKB)
  __shared__ int32_t buf[32];
  const int64_t b = blockIdx.x;
  for (int t0 = 0; t0 < 4; t0 += 2) {              // hull (h0, h1), cover (a, b)
    for (int r = 0; r < p.m; ++r) {
      fill_pair(p.bounds + ws_at(p, b, t0, r), p.bounds + ws_at(p, b, t0 + 1, r),
                filled + (t0 * p.m + r) * p.nKB, filled + ((t0 + 1) * p.m + r) * p.nKB,
                (int32_t)p.nKB, (int32_t)p.nQB, buf);
    }
  }
  __syncthreads();
  for (int64_t qb = threadIdx.x; qb < p.nQB; qb += blockDim.x) {
    bool ok = query_block_rows(p, b, qb, filled);
    assert(ok && "flexsparse build: a query block needs more than 4 block ranges");
  }
}

// Longer rows: one CTA per (sequence, row) fills the workspace ...
__global__ void __launch_bounds__(kRowThreads) fill_kernel(BuildParams p) {
  __shared__ int32_t buf[32];
  const int64_t b = blockIdx.y;
  const int r = blockIdx.x >> 1, t0 = (blockIdx.x & 1) * 2;
  fill_pair(p.bounds + ws_at(p, b, t0, r), p.bounds + ws_at(p, b, t0 + 1, r),
            p.filled + ws_at(p, b, t0, r), p.filled + ws_at(p, b, t0 + 1, r),
            (int32_t)p.nKB, (int32_t)p.nQB, buf);
}

// ... and one thread per query block makes its lists.
__global__ void __launch_bounds__(kQueryThreads) query_block_kernel(BuildParams p) {
  const int64_t b = blockIdx.y, qb = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (qb >= p.nQB) return;
  bool ok = query_block_rows(p, b, qb, p.filled + ws_at(p, b, 0, 0));
  assert(ok && "flexsparse build: a query block needs more than 4 block ranges");
}

// The fused build (documents and prefix-LM, one launch): CTA 0 of each row makes the
// query blocks' lists, the others (1 + kb) are column_kernel's key blocks. The row CTA
// needs every key block's bounds; those follow from each block's first and last column
// (monotone_key_block_bounds), so it computes them itself instead of waiting for the key
// blocks' CTAs: into the workspace, made non-decreasing there (fill_pair), then one
// thread per query block as query_block_kernel. The column CTAs then skip writing the
// bounds (same values; the row CTA's are the ones read).
__device__ void row_lists(const BuildParams& p, int64_t b, const int64_t* ends, int64_t prefix) {
  __shared__ int32_t buf[32];
  for (int64_t kb = threadIdx.x; kb < p.nKB; kb += blockDim.x) {
    int32_t bd[kMaxSlots][4];
    monotone_key_block_bounds(p, ends, prefix, kb, bd);
    for (int r = 0; r < p.m; ++r)
      for (int t = 0; t < 4; ++t) p.bounds[ws_at(p, b, t, r) + kb] = bd[r][t];
  }
  __syncthreads();                                 // the CTA's global writes visible to it
  for (int t0 = 0; t0 < 4; t0 += 2) {              // hull (h0, h1), cover (a, b)
    for (int r = 0; r < p.m; ++r) {
      fill_pair(p.bounds + ws_at(p, b, t0, r), p.bounds + ws_at(p, b, t0 + 1, r),
                p.filled + ws_at(p, b, t0, r), p.filled + ws_at(p, b, t0 + 1, r),
                (int32_t)p.nKB, (int32_t)p.nQB, buf);
    }
  }
  __syncthreads();
  for (int64_t qb = threadIdx.x; qb < p.nQB; qb += blockDim.x) {
    bool ok = query_block_rows(p, b, qb, p.filled + ws_at(p, b, 0, 0));
    assert(ok && "flexsparse build: a query block needs more than 4 block ranges");
  }
}

__global__ void __launch_bounds__(kFusedThreads) fused_kernel(BuildParams p) {
  extern __shared__ int64_t smem_ends[];
  __shared__ int64_t buf[32];
  const int64_t b = blockIdx.y;
  int64_t prefix;
  const int64_t* ends = row_setup(p, b, is_document(p.kind), blockIdx.x == 1, smem_ends, buf, prefix);
  if (blockIdx.x == 0) row_lists(p, b, ends, prefix);
  else key_block_columns<kFusedThreads>(p, blockIdx.x - 1, b, ends, prefix, false);
}

void check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("flexsparse build: ") + what + ": " +
                             cudaGetErrorString(err));
}

}  // namespace

void build_column_ranges_cuda(const BuildParams& p, void* stream_) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  if (p.Bl == 0 || p.nKB == 0) return;
  if (p.Bl > 65535) throw std::runtime_error("flexsparse build: more than 65535 rows");
  if (fused_build(p)) {
    size_t smem = is_document(p.kind) ? p.n_docs * sizeof(int64_t) : 0;
    fused_kernel<<<dim3((unsigned)(p.nKB + 1), (unsigned)p.Bl), kFusedThreads, smem, stream>>>(p);
    check_launch("fused_kernel");
    return;
  }
  // with few documents every column CTA scans the lengths itself
  bool shared_ends = is_document(p.kind) && !needs_ends(p);
  if (needs_ends(p)) {
    scan_kernel<<<(unsigned)p.Bl, kRowThreads, 0, stream>>>(p);
    check_launch("scan_kernel");
  }
  size_t smem = shared_ends ? p.n_docs * sizeof(int64_t) : 0;
  column_kernel<<<dim3((unsigned)p.nKB, (unsigned)p.Bl), kColumnThreads, smem, stream>>>(
      p, shared_ends);
  check_launch("column_kernel");
  if (p.nQB == 0) return;
  if (p.kind == kColumnRanges) {
    int64_t threads = (p.nQB + p.nKB) * 32;
    list_kernel<<<dim3((unsigned)((threads + kQueryThreads - 1) / kQueryThreads), (unsigned)p.Bl),
                  kQueryThreads, 0, stream>>>(p);
    check_launch("list_kernel");
    return;
  }
  const size_t bounds_bytes = 4 * p.m * p.nKB * sizeof(int32_t);
  if ((int64_t)bounds_bytes <= kSharedBoundsBytes) {
    query_block_kernel_smem<<<(unsigned)p.Bl, kRowThreads, bounds_bytes, stream>>>(p);
    check_launch("query_block_kernel_smem");
  } else {
    fill_kernel<<<dim3(2 * p.m, (unsigned)p.Bl), kRowThreads, 0, stream>>>(p);
    check_launch("fill_kernel");
    unsigned blocks = (unsigned)((p.nQB + kQueryThreads - 1) / kQueryThreads);
    query_block_kernel<<<dim3(blocks, (unsigned)p.Bl), kQueryThreads, 0, stream>>>(p);
    check_launch("query_block_kernel");
  }
}

void build_block_lists_cuda(const BuildParams& p, void* stream_) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  if (p.Bl == 0 || p.nQB + p.nKB == 0) return;
  if (p.Bl > 65535) throw std::runtime_error("flexsparse build: more than 65535 layout rows");
  if (p.grid_by_warp) {
    const int64_t threads = (p.nQB + p.nKB) * 32;
    list_kernel<<<dim3((unsigned)((threads + kQueryThreads - 1) / kQueryThreads), (unsigned)p.Bl),
                  kQueryThreads, 0, stream>>>(p);
    check_launch("list_kernel (block layout)");
    return;
  }
  // Slabs: every grid row 16-byte aligned (the base, and nKB states a multiple of 16 bytes)
  // and list rows of at most kSlabBlocks blocks.
  const void* grid = p.states != nullptr ? static_cast<const void*>(p.states) : static_cast<const void*>(p.layout);
  const int64_t row_bytes = p.nKB * (p.states != nullptr ? 4 : 1);
  const bool slabs = reinterpret_cast<uintptr_t>(grid) % 16 == 0 && row_bytes % 16 == 0 && !p.grid_two_pass;
  const unsigned paths = (slabs && p.nKB <= kSlabBlocks ? kRowsBySlabs : 0u) |
                         (slabs && p.nQB <= kSlabBlocks ? kColumnsBySlabs : 0u);
  const int64_t row_ctas = (p.nQB * 32 + kQueryThreads - 1) / kQueryThreads;
  const int64_t tiles = (p.nKB + kTileKeys - 1) / kTileKeys;
  const dim3 grid_dim((unsigned)(row_ctas + tiles), (unsigned)p.Bl);
  // (Slab rows beside two-pass columns, the grids of more than kSlabBlocks query blocks,
  // take the two-pass build for both: that pairing spilled a register at launch bounds
  // (256, 4).)
  if (paths == (kRowsBySlabs | kColumnsBySlabs))
    grid_list_kernel<kRowsBySlabs | kColumnsBySlabs><<<grid_dim, kQueryThreads, 0, stream>>>(p, (unsigned)row_ctas);
  else if (paths == kColumnsBySlabs)
    grid_list_kernel<kColumnsBySlabs><<<grid_dim, kQueryThreads, 0, stream>>>(p, (unsigned)row_ctas);
  else
    grid_list_kernel<0><<<grid_dim, kQueryThreads, 0, stream>>>(p, (unsigned)row_ctas);
  check_launch("grid_list_kernel");
}

}  // namespace build
}  // namespace flexsparse
