// flexsparse::topk_rows on CUDA: per score row, the positions of its k largest scores
// (neither -inf nor NaN), ascending, then -1 padding; what flexsparse/topk.py defines and
// flexsparse/triton_topk.py computes for rows of up to 8K keys. This kernel takes bf16,
// fp16 and fp32 scores and rows of up to kTopkMaxKeys keys.
//
// One warp per row for rows of up to 8K keys, no barrier wider than a warp
// (docs/perf-notes.md "masks.topk on the GPU": the Triton kernel's time was its chain of
// CTA-wide reductions, one per bit); longer rows a CTA of 4 to 16 warps each, whose 17
// barriers per row cost less than the idle issue slots of a few warps per SM (each row's
// keys take 32-128 KB of shared memory):
// 1. the row's scores become order-preserving 16-bit keys (0 for -inf and NaN, below
//    every kept key) in shared memory, padded with 0 to whole 256-key chunks;
// 2. the k-th largest key T, bit by bit from the top: T | bit stays if at least k keys
//    are >= it (each lane counts 8 keys per 16-byte shared load, two per compare;
//    __reduce_add_sync sums the lanes, shared memory the warps);
// 3. the kept columns in position order, 32 at a time (ballots give each its slot):
//    keys above T, then the first k - #(keys > T) keys equal to T.
// fp32 scores (kWide) have 32-bit keys; shared memory holds their top 16 bits, so step 2
// finds the top half T_hi of the threshold. The keys whose top half is T_hi (the
// candidates) are then read again from global memory: their bottom halves go to a list in
// shared memory (kCandidates per row; more, and each count of the bottom-half search reads
// the row again), where the same bit-by-bit search finds the bottom half of T. Step 3
// compares whole keys, reading again only the candidates' scores.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels.h"

namespace flexsparse {
namespace {

constexpr int kChunk = 256;   // keys per warp step of the count (32 lanes x 8 keys)
constexpr int kCandidates = 1024;   // fp32: candidates listed per row in shared memory

// The order-preserving key of a 16-bit float's bits; 0 for NaN and -inf.
__device__ __forceinline__ uint32_t score_key(uint32_t bits, uint32_t inf_bits) {
  const uint32_t magnitude = bits & 0x7FFFu;
  if (magnitude > inf_bits || bits == (0x8000u | inf_bits)) return 0;
  return (bits & 0x8000u) ? (~bits & 0xFFFFu) : (bits | 0x8000u);
}

// The order-preserving key of an fp32's bits; 0 for NaN and -inf (every other key is at
// least 0x00800000: its top half is never 0).
__device__ __forceinline__ uint32_t score_key32(uint32_t bits) {
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u || bits == 0xFF800000u) return 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The threads that work one row: a warp (kWarps == 1; a CTA holds several rows and nothing
// syncs wider than a warp) or the CTA's kWarps warps (one row per CTA, for long rows, where
// one warp per row leaves too few warps per SM to hide the shared-memory latency).
template <int kWarps>
struct RowTeam {
  static constexpr int kThreads = 32 * kWarps;
  int* scratch;   // kWarps > 1: 4 * kWarps ints of shared memory
  int warp, lane, tid, parity = 0;

  // The sum of v over the team. Two scratch halves in turn: a half is written again only
  // after the next sum's barrier, which every thread reaches after reading it.
  __device__ __forceinline__ int sum(int v) {
    v = __reduce_add_sync(0xFFFFFFFFu, v);
    if constexpr (kWarps == 1) {
      return v;
    } else {
      int* half = scratch + parity * kWarps;
      parity ^= 1;
      if (lane == 0) half[warp] = v;
      __syncthreads();
      int total = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += half[w];
      return total;
    }
  }
};

// Keys >= bound among the row's n_pad keys (shared memory, 8 per lane per 16-byte load).
// __vsetgeu2 compares both 16-bit halves of a word at once (5 instructions per word on
// sm_90, against 4 per key unpacked); the two halves' counts add up in the two halves of
// one accumulator (at most n_pad / 64 <= 1024 each).
template <int kWarps>
__device__ __forceinline__ int count_at_least(RowTeam<kWarps>& team, const uint4* keys, int n_chunks8,
                                              uint32_t bound) {
  const uint32_t bound2 = bound | (bound << 16);
  uint32_t packed = 0;
  for (int i = team.tid; i < n_chunks8; i += team.kThreads) {
    const uint4 w = keys[i];
    packed += __vsetgeu2(w.x, bound2) + __vsetgeu2(w.y, bound2) + __vsetgeu2(w.z, bound2) +
              __vsetgeu2(w.w, bound2);
  }
  return team.sum(static_cast<int>((packed & 0xFFFFu) + (packed >> 16)));
}

// Shared memory per row: its 16-bit keys (n_pad of them), then (kWide) the candidate list
// and its count; the team's scratch after the rows (TopkParams::smem_keys_per_warp: one
// row's size in 16-bit units).
template <bool kWide>
__host__ __device__ constexpr int row_smem_units(int n_pad) {
  return n_pad + (kWide ? 2 * (kCandidates + 4) : 0);
}

template <int kWarps, bool kWide>
__global__ void __launch_bounds__(kWarps == 1 ? 256 : 32 * kWarps)
topk_rows_kernel(TopkParams p) {
  extern __shared__ __align__(16) uint16_t smem[];
  RowTeam<kWarps> team;
  team.warp = threadIdx.x / 32;
  team.lane = threadIdx.x % 32;
  team.tid = kWarps == 1 ? team.lane : threadIdx.x;
  const int64_t row_id = kWarps == 1
      ? static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + team.warp : int64_t(blockIdx.x);
  if (row_id >= p.n_rows) return;   // (kWarps == 1: the whole warp; else the whole CTA)
  const int64_t lead = row_id / p.rows, r = row_id % p.rows;
  using Score = std::conditional_t<kWide, uint32_t, uint16_t>;   // a score's bits
  const Score* row = static_cast<const Score*>(p.scores) + lead * p.s_lead + r * p.s_row;
  int32_t* out = p.out + lead * p.o_lead + r * p.o_row;
  int n = p.Lk;
  if (p.causal) n = static_cast<int>(min(max(p.row0 + r + p.off + 1, int64_t(0)), int64_t(p.Lk)));
  const int n_pad = (n + kChunk - 1) / kChunk * kChunk;
  uint16_t* keys = smem + (kWarps == 1 ? static_cast<int64_t>(team.warp) * p.smem_keys_per_warp : 0);
  team.scratch = reinterpret_cast<int*>(smem + p.smem_keys_per_warp);

  // 1. keys into shared memory; the valid ones counted. Contiguous, 16-byte aligned rows:
  //    8 scores per 16-byte load (the only pass over global memory), the tail and other
  //    rows one score per load.
  int valid = 0;
  int c_vec = 0;   // columns below this were read 8 at a time
  // (kWide: 4 scores per 16-byte load, their keys' top halves.)
  constexpr int kPerLoad = kWide ? 4 : 8;
  if (p.s_col == 1 && (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    c_vec = n / kPerLoad * kPerLoad;
    const uint4* row8 = reinterpret_cast<const uint4*>(row);
#pragma unroll 4
    for (int i = team.tid; i < c_vec / kPerLoad; i += team.kThreads) {
      const uint4 w = __ldg(row8 + i);
      if constexpr (kWide) {
        const uint32_t k0 = score_key32(w.x) >> 16, k1 = score_key32(w.y) >> 16;
        const uint32_t k2 = score_key32(w.z) >> 16, k3 = score_key32(w.w) >> 16;
        valid += int(k0 != 0) + int(k1 != 0) + int(k2 != 0) + int(k3 != 0);
        reinterpret_cast<uint2*>(keys)[i] = make_uint2(k0 | (k1 << 16), k2 | (k3 << 16));
      } else {
        uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t lo = score_key(words[j] & 0xFFFFu, p.inf_bits);
          const uint32_t hi = score_key(words[j] >> 16, p.inf_bits);
          valid += int(lo != 0) + int(hi != 0);
          words[j] = lo | (hi << 16);
        }
        reinterpret_cast<uint4*>(keys)[i] = make_uint4(words[0], words[1], words[2], words[3]);
      }
    }
  }
  // The whole key of column c (kWide: read again from global memory), and its top half.
  auto key_of = [&](int c) -> uint32_t {
    if constexpr (kWide) return score_key32(__ldg(row + (int64_t)c * p.s_col));
    else return score_key(__ldg(row + (int64_t)c * p.s_col), p.inf_bits);
  };
  for (int c = c_vec + team.tid; c < n_pad; c += team.kThreads) {
    uint32_t key = 0;
    if (c < n) key = kWide ? key_of(c) >> 16 : key_of(c);
    keys[c] = static_cast<uint16_t>(key);
    valid += key != 0;
  }
  valid = team.sum(valid);   // (kWarps > 1: its barrier also publishes the keys)
  __syncwarp();

  // 2. the threshold (0 with every valid key kept when there are at most k)
  const uint4* keys8 = reinterpret_cast<const uint4*>(keys);
  const int n_chunks8 = n_pad / 8;
  uint32_t threshold = 0;   // kWide: the top half here, the whole key below
  int ties = 0;
  if (valid > p.k) {
    for (int bit = 15; bit >= 0; --bit) {
      const uint32_t bound = threshold | (1u << bit);
      if (count_at_least(team, keys8, n_chunks8, bound) >= p.k) threshold = bound;
    }
    // (threshold + 1 fits 16 bits: the largest kept key is +inf's, below 0xFFFF)
    ties = p.k - count_at_least(team, keys8, n_chunks8, threshold + 1);
    if constexpr (kWide) {
      // The bottom half among the `ties` keys still to keep from the candidates (top half
      // == threshold): their bottom halves listed while they fit.
      const uint32_t top = threshold;
      uint32_t* list = reinterpret_cast<uint32_t*>(keys + n_pad);
      int* listed = reinterpret_cast<int*>(list + kCandidates);
      if (team.tid == 0) *listed = 0;
      team.sum(0);   // (the count is zeroed before anyone adds to it)
      __syncwarp();
      for (int c = team.tid; c < n; c += team.kThreads) {
        if (keys[c] != top) continue;
        const int slot = atomicAdd(listed, 1);
        if (slot < kCandidates) list[slot] = key_of(c) & 0xFFFFu;
      }
      team.sum(0);   // (every candidate is listed and counted)
      __syncwarp();
      const int n_listed = *reinterpret_cast<volatile int*>(listed);
      // bottom halves >= bound among the candidates
      auto count_bottom = [&](uint32_t bound) {
        int cnt = 0;
        if (n_listed <= kCandidates) {
          for (int e = team.tid; e < n_listed; e += team.kThreads) cnt += list[e] >= bound;
        } else {
          for (int c = team.tid; c < n; c += team.kThreads)
            if (keys[c] == top) cnt += (key_of(c) & 0xFFFFu) >= bound;
        }
        return team.sum(cnt);
      };
      uint32_t bottom = 0;
      for (int bit = 15; bit >= 0; --bit) {
        const uint32_t bound = bottom | (1u << bit);
        if (count_bottom(bound) >= ties) bottom = bound;
      }
      ties -= count_bottom(bottom + 1);   // (bottom + 1 <= 0x10000: above every bottom half)
      threshold = (top << 16) | bottom;
    }
  }
  // Column c's key as step 3 compares it with the threshold: kWide, the whole key where the
  // top half ties with the threshold's, else the top half shifted (which decides alone).
  auto full_key = [&](int c) -> uint32_t {
    const uint32_t key = keys[c];
    if constexpr (kWide) return (key != 0 && key == (threshold >> 16)) ? key_of(c) : key << 16;
    else return key;
  };

  // 3. kept columns in position order, 32 at a time per warp: keys above the threshold,
  //    then the first `ties` keys equal to it. With kWarps > 1 each warp takes a slice of
  //    the columns, after the counts of the slices before it.
  int c_begin = 0, c_end = n, kept = 0, seen_ties = 0;
  const uint32_t below = (1u << team.lane) - 1;
  if constexpr (kWarps > 1) {
    const int slice = (n + team.kThreads - 1) / team.kThreads * 32;
    c_begin = min(team.warp * slice, n);
    c_end = min(c_begin + slice, n);
    int above = 0, equal = 0;
    for (int c = c_begin + team.lane; c < c_end; c += 32) {
      const uint32_t key = full_key(c);
      above += key > threshold;
      equal += key == threshold && key != 0;
    }
    above = __reduce_add_sync(0xFFFFFFFFu, above);
    equal = __reduce_add_sync(0xFFFFFFFFu, equal);
    int* counts = team.scratch + 2 * kWarps;   // (the sums' halves are done with)
    if (team.lane == 0) { counts[team.warp] = above; counts[kWarps + team.warp] = equal; }
    __syncthreads();
    int above_before = 0;
    for (int w = 0; w < team.warp; ++w) { above_before += counts[w]; seen_ties += counts[kWarps + w]; }
    kept = above_before + min(seen_ties, ties);
  }
  for (int c0 = c_begin; c0 < c_end; c0 += 32) {
    const int c = c0 + team.lane;
    const uint32_t key = c < c_end ? full_key(c) : 0;
    const bool tie = key == threshold && key != 0;
    const uint32_t tie_mask = __ballot_sync(0xFFFFFFFFu, tie);
    const bool keep = key > threshold || (tie && seen_ties + __popc(tie_mask & below) < ties);
    const uint32_t keep_mask = __ballot_sync(0xFFFFFFFFu, keep);
    const int slot = kept + __popc(keep_mask & below);
    if (keep && slot < p.k) out[slot] = c;
    kept += __popc(keep_mask);
    seen_ties += __popc(tie_mask);
  }
  // Every row keeps min(valid, k) positions.
  for (int s = min(valid, p.k) + team.tid; s < p.k; s += team.kThreads) out[s] = -1;
}

template <int kWarps, bool kWide>
void launch(TopkParams p, int n_pad, cudaStream_t stream) {
  p.smem_keys_per_warp = row_smem_units<kWide>(n_pad);
  const int row_bytes = p.smem_keys_per_warp * static_cast<int>(sizeof(uint16_t));
  int rows_per_cta = 1;
  if (kWarps == 1) {
    // as many rows as fit in ~96 KB (two CTAs per SM), at most 8
    rows_per_cta = (96 * 1024) / row_bytes;
    rows_per_cta = rows_per_cta < 1 ? 1 : (rows_per_cta > 8 ? 8 : rows_per_cta);
  }
  const size_t smem = static_cast<size_t>(rows_per_cta) * row_bytes + 4 * kWarps * sizeof(int);
  if (smem > 48 * 1024)
    cudaFuncSetAttribute(topk_rows_kernel<kWarps, kWide>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(smem));
  const int64_t blocks = (p.n_rows + rows_per_cta - 1) / rows_per_cta;
  const int threads = kWarps == 1 ? 32 * rows_per_cta : 32 * kWarps;
  topk_rows_kernel<kWarps, kWide><<<static_cast<unsigned>(blocks), threads, smem, stream>>>(p);
}

}  // namespace

void topk_rows_cuda(TopkParams p, cudaStream_t stream) {
  // Shared memory per row: its keys padded to whole chunks (kTopkMaxKeys at most: 128 KB),
  // and for fp32 rows the candidate list (4 KB).
  const int n_pad = p.Lk > 0 ? (p.Lk + kChunk - 1) / kChunk * kChunk : kChunk;
  // Warps per row by length, from the H100 sweep in docs/perf-notes.md ("masks.topk on the
  // GPU"): the fewest that keep enough warps per SM busy with the row's shared memory.
  int warps = p.warps_per_row;
  if (warps <= 0) warps = p.Lk <= 8192 ? 1 : p.Lk <= 16384 ? 4 : p.Lk <= 32768 ? 8 : 16;
  auto go = [&](auto wide) {
    constexpr bool kWide = decltype(wide)::value;
    switch (warps) {
      case 1: launch<1, kWide>(p, n_pad, stream); break;
      case 4: launch<4, kWide>(p, n_pad, stream); break;
      case 8: launch<8, kWide>(p, n_pad, stream); break;
      default: launch<16, kWide>(p, n_pad, stream); break;
    }
  };
  if (p.wide) go(std::true_type{});
  else go(std::false_type{});
}

}  // namespace flexsparse
