// flexsparse::topk_rows on CUDA: per score row, the positions of its k largest scores
// (neither -inf nor NaN), ascending, then -1 padding; what flexsparse/topk.py defines and
// flexsparse/triton_topk.py computes for rows of up to 8K keys. This kernel takes 16-bit
// scores (bf16, fp16) and rows of up to kMaxKeys keys.
//
// One warp per row, no barrier wider than a warp (docs/perf-notes.md "masks.topk on the
// GPU": the Triton kernel's time was its chain of CTA-wide reductions, one per bit):
// 1. the row's scores become order-preserving 16-bit keys (0 for -inf and NaN, below
//    every kept key) in the warp's slice of shared memory, padded with 0 to whole
//    256-key chunks;
// 2. the k-th largest key T, bit by bit from the top: T | bit stays if at least k keys
//    are >= it (each lane counts 8 keys per 16-byte shared load, two per compare;
//    __reduce_add_sync sums the lanes);
// 3. the kept columns in position order, 32 at a time (ballots give each its slot):
//    keys above T, then the first k - #(keys > T) keys equal to T.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels.h"

namespace flexsparse {
namespace {

constexpr int kChunk = 256;   // keys per warp step of the count (32 lanes x 8 keys)

// The order-preserving key of a 16-bit float's bits; 0 for NaN and -inf.
__device__ __forceinline__ uint32_t score_key(uint32_t bits, uint32_t inf_bits) {
  const uint32_t magnitude = bits & 0x7FFFu;
  if (magnitude > inf_bits || bits == (0x8000u | inf_bits)) return 0;
  return (bits & 0x8000u) ? (~bits & 0xFFFFu) : (bits | 0x8000u);
}

// Keys >= bound among the row's n_pad keys (shared memory, 8 per lane per 16-byte load).
// __vsetgeu2 compares both 16-bit halves of a word at once (5 instructions per word on
// sm_90, against 4 per key unpacked); the two halves' counts add up in the two halves of
// one accumulator (at most n_pad / 64 <= 1024 each).
__device__ __forceinline__ int count_at_least(const uint4* keys, int n_chunks8, uint32_t bound, int lane) {
  const uint32_t bound2 = bound | (bound << 16);
  uint32_t packed = 0;
  for (int i = lane; i < n_chunks8; i += 32) {
    const uint4 w = keys[i];
    packed += __vsetgeu2(w.x, bound2) + __vsetgeu2(w.y, bound2) + __vsetgeu2(w.z, bound2) +
              __vsetgeu2(w.w, bound2);
  }
  return __reduce_add_sync(0xFFFFFFFFu, static_cast<int>((packed & 0xFFFFu) + (packed >> 16)));
}

__global__ void topk_rows_kernel(TopkParams p) {
  extern __shared__ __align__(16) uint16_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row_id = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + warp;
  if (row_id >= p.n_rows) return;   // the whole warp: nothing below syncs wider than it
  const int64_t lead = row_id / p.rows, r = row_id % p.rows;
  const uint16_t* row = p.scores + lead * p.s_lead + r * p.s_row;
  int32_t* out = p.out + lead * p.o_lead + r * p.o_row;
  int n = p.Lk;
  if (p.causal) n = static_cast<int>(min(max(p.row0 + r + p.off + 1, int64_t(0)), int64_t(p.Lk)));
  const int n_pad = (n + kChunk - 1) / kChunk * kChunk;
  uint16_t* keys = smem + static_cast<int64_t>(warp) * p.smem_keys_per_warp;

  // 1. keys into shared memory; the valid ones counted. Contiguous, 16-byte aligned rows:
  //    8 scores per 16-byte load (the only pass over global memory), the tail and other
  //    rows one score per load.
  int valid = 0;
  int c_vec = 0;   // columns below this were read 8 at a time
  if (p.s_col == 1 && (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    c_vec = n / 8 * 8;
    const uint4* row8 = reinterpret_cast<const uint4*>(row);
    uint4* keys8w = reinterpret_cast<uint4*>(keys);
#pragma unroll 4
    for (int i = lane; i < c_vec / 8; i += 32) {
      const uint4 w = __ldg(row8 + i);
      uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t lo = score_key(words[j] & 0xFFFFu, p.inf_bits);
        const uint32_t hi = score_key(words[j] >> 16, p.inf_bits);
        valid += int(lo != 0) + int(hi != 0);
        words[j] = lo | (hi << 16);
      }
      keys8w[i] = make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
  for (int c = c_vec + lane; c < n_pad; c += 32) {
    uint32_t key = 0;
    if (c < n) key = score_key(__ldg(row + c * p.s_col), p.inf_bits);
    keys[c] = static_cast<uint16_t>(key);
    valid += key != 0;
  }
  valid = __reduce_add_sync(0xFFFFFFFFu, valid);
  __syncwarp();

  // 2. the threshold (0 with every valid key kept when there are at most k)
  const uint4* keys8 = reinterpret_cast<const uint4*>(keys);
  const int n_chunks8 = n_pad / 8;
  uint32_t threshold = 0;
  int ties = 0;
  if (valid > p.k) {
    for (int bit = 15; bit >= 0; --bit) {
      const uint32_t bound = threshold | (1u << bit);
      if (count_at_least(keys8, n_chunks8, bound, lane) >= p.k) threshold = bound;
    }
    // (threshold + 1 fits 16 bits: the largest kept key is +inf's, below 0xFFFF)
    ties = p.k - count_at_least(keys8, n_chunks8, threshold + 1, lane);
  }

  // 3. kept columns in position order
  int kept = 0, seen_ties = 0;
  const uint32_t below = (1u << lane) - 1;
  for (int c0 = 0; c0 < n; c0 += 32) {
    const int c = c0 + lane;
    const uint32_t key = c < n ? keys[c] : 0;
    const bool tie = key == threshold && key != 0;
    const uint32_t tie_mask = __ballot_sync(0xFFFFFFFFu, tie);
    const bool keep = key > threshold || (tie && seen_ties + __popc(tie_mask & below) < ties);
    const uint32_t keep_mask = __ballot_sync(0xFFFFFFFFu, keep);
    const int slot = kept + __popc(keep_mask & below);
    if (keep && slot < p.k) out[slot] = c;
    kept += __popc(keep_mask);
    seen_ties += __popc(tie_mask);
  }
  for (int s = kept + lane; s < p.k; s += 32) out[s] = -1;
}

}  // namespace

void topk_rows_cuda(TopkParams p, cudaStream_t stream) {
  // Shared memory per row: its keys padded to whole chunks. Warps per CTA: as many rows
  // as fit in ~96 KB (two CTAs per SM), at most 8.
  const int n_pad = p.Lk > 0 ? (p.Lk + kChunk - 1) / kChunk * kChunk : kChunk;
  p.smem_keys_per_warp = n_pad;
  const int row_bytes = n_pad * static_cast<int>(sizeof(uint16_t));
  int warps = (96 * 1024) / row_bytes;
  warps = warps < 1 ? 1 : (warps > 8 ? 8 : warps);
  const size_t smem = static_cast<size_t>(warps) * row_bytes;
  if (smem > 48 * 1024)
    cudaFuncSetAttribute(topk_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(smem));
  const int64_t blocks = (p.n_rows + warps - 1) / warps;
  topk_rows_kernel<<<static_cast<unsigned>(blocks), warps * 32, smem, stream>>>(p);
}

}  // namespace flexsparse
