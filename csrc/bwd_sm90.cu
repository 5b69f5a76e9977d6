// Backward entry: workspace size, what the kernels support, and the head dim's kernels
// (bwd_sm90_hd*.cu, kernels in bwd_sm90.cuh).
#include <algorithm>

#include "kernels.h"

namespace flexsparse {

size_t bwd_sm90_workspace_bytes(BackwardParams const& p) {
  const AttentionParams& f = p.fwd;
  const size_t rows = static_cast<size_t>(f.B) * f.Hq * std::max(bwd_lq_pad(f, 64), bwd_lq_pad(f, 80));
  // dq_accum, lse2, delta; deterministic: a turn counter per 64 rows (one per query step of
  // either size) and warpgroup half; last, the persistent kernel's tile counter (launch_bwd)
  return rows * (f.D + 2) * sizeof(float) + (p.deterministic ? rows / 64 * 2 * sizeof(int) : 0) +
         sizeof(int);
}

std::string bwd_sm90_unsupported(BackwardParams const& p) {
  const AttentionParams& f = p.fwd;
  if (f.D != 64 && f.D != 128 && f.D != 256)
    return "head dim " + std::to_string(f.D) + " (backward: 64, 128 or 256)";
  const int keys = f.D == 256 ? 64 : 128;   // keys per CTA (BwdTraits::kBlockN)
  if (f.block_k % keys != 0 || f.block_q % 64 != 0)
    return "descriptor block size (" + std::to_string(f.block_q) + ", " + std::to_string(f.block_k) +
           ") must be multiples of (64, " + std::to_string(keys) + ") for the backward at head dim " +
           std::to_string(f.D);
  if (p.dbias != nullptr && (p.dbias_sb == 0 || p.dbias_sh == 0 || p.dbias_sq == 0 || p.dbias_sk == 0))
    return "dbias must be a full (B, Hq, Lq, Lk) tensor (the op reduces it to the bias's shape)";
  return "";
}

// The calls BwdTraits::kPlain kernels take: no bias, dbias, softcap, dense mask or
// bitmaps, and column ranges that fit the shared-memory staging.
static bool plain_call(BackwardParams const& p) {
  const AttentionParams& f = p.fwd;
  return f.bias == nullptr && p.dbias == nullptr && f.softcap == 0.f && f.pred.dense == nullptr &&
         f.pred.bits_index == nullptr && (f.pred.col_ranges == nullptr || f.pred.n_col_ranges <= kBwdMaxStagedRanges);
}

// The calls BwdTraits::kBiasTiles kernels take: head dim 64 or 128, no softcap, a bias
// (and dbias) whose tiles TMA can move: keys contiguous, no broadcast over queries,
// 16-byte aligned base and strides. FLEXSPARSE_CUDA_DEBUG bit 512: the general kernel
// instead (A/Bs).
static bool bias_tiles_call(BackwardParams const& p) {
  const AttentionParams& f = p.fwd;
  if (!bias_tma_readable(f) || (f.D != 64 && f.D != 128) || f.softcap != 0.f || (f.debug & 512)) return false;
  return p.dbias == nullptr || tma_tileable(p.dbias, p.dbias_sq, p.dbias_sk, p.dbias_sh, p.dbias_sb);
}

// Of the plain calls (the caller checks), those the 80-row head dim 128 kernel can take
// (BwdTraits, kRowSteps): without column ranges (no room to stage them), not
// deterministic, and every block list one row for all (stride 0: the full mask), so that
// walking all query rows is walking the lists.
// With its stores at hand-computed addresses (C105) and before the dV product (C106) it
// measured 3% faster than the 64-row kernel on the full 8K row (docs/perf-notes.md C109;
// 6% slower before, C68). FLEXSPARSE_CUDA_DEBUG bit 268435456: the 64-row kernel instead
// (A/Bs).
static bool row_steps_call(BackwardParams const& p) {
  const AttentionParams& f = p.fwd;
  const bool one_row = f.kv_partial.row_stride == 0 && f.kv_full.row_stride == 0 &&
                       f.q_partial.row_stride == 0 && f.q_full.row_stride == 0;
  return f.D == 128 && one_row && f.pred.col_ranges == nullptr && !p.deterministic &&
         !(f.debug & 268435456);
}

void bwd_sm90(BackwardParams const& p, DType dtype, cudaStream_t stream) {
  if (bias_tiles_call(p)) {
    // (these kernels write every dbias entry, zeros where the descriptor lists no block)
    if (p.fwd.D == 64) bwd_sm90_hd<64, 64, false, true>(p, dtype, stream);
    else bwd_sm90_hd<128, 64, false, true>(p, dtype, stream);
    return;
  }
  // The other kernels write dbias only where the descriptor lists a block. (dbias is the
  // op's contiguous (B, Hq, Lq, Lk) tensor in the query's 16-bit dtype.)
  if (p.dbias != nullptr)
    CUDA_CHECK(cudaMemsetAsync(p.dbias, 0,
                               static_cast<size_t>(p.fwd.B) * p.fwd.Hq * p.fwd.Lq * p.fwd.Lk * sizeof(uint16_t),
                               stream));
  // FLEXSPARSE_CUDA_DEBUG bit 256: the general kernel for plain calls too (same-run A/Bs).
  const bool plain = plain_call(p) && !(p.fwd.debug & 256);
  switch (p.fwd.D) {
    // Plain calls take 128-row query steps where the query blocks allow them (BwdTraits).
    case 64:
      if (plain && p.fwd.block_q % 128 == 0) bwd_sm90_hd<64, 128, true>(p, dtype, stream);
      else bwd_sm90_hd<64, 64, false>(p, dtype, stream);
      break;
    // (hd128 has no plain 64-row kernel: one without spills measured the same as the
    // general kernel twice, docs/perf-notes.md C29 and C40.)
    case 128:
      if (plain && row_steps_call(p)) bwd_sm90_hd<128, 80, true>(p, dtype, stream);
      else bwd_sm90_hd<128, 64, false>(p, dtype, stream);
      break;
    case 256:
      if (plain) bwd_sm90_hd<256, 64, true>(p, dtype, stream);
      else bwd_sm90_hd<256, 64, false>(p, dtype, stream);
      break;
    default: throw std::invalid_argument("flexsparse CUDA backward: head dim must be 64, 128 or 256");
  }
}

}  // namespace flexsparse
