// Backward entry: workspace size, what the kernels support, and the head dim's kernels
// (bwd_sm90_hd*.cu, kernels in bwd_sm90.cuh).
#include "kernels.h"

namespace flexsparse {

size_t bwd_sm90_workspace_bytes(BackwardParams const& p) {
  const AttentionParams& f = p.fwd;
  const size_t rows = static_cast<size_t>(f.B) * f.Hq * bwd_lq_pad(f);
  // dq_accum, lse2, delta; deterministic: a turn counter per 64 rows (one per query step of
  // either size) and warpgroup half
  return rows * (f.D + 2) * sizeof(float) + (p.deterministic ? rows / 64 * 2 * sizeof(int) : 0);
}

std::string bwd_sm90_unsupported(BackwardParams const& p) {
  const AttentionParams& f = p.fwd;
  if (f.D != 64 && f.D != 128) return "head dim " + std::to_string(f.D) + " (backward: 64 or 128)";
  if (f.block_k % 128 != 0 || f.block_q % 64 != 0)
    return "descriptor block size (" + std::to_string(f.block_q) + ", " + std::to_string(f.block_k) +
           ") must be multiples of (64, 128) for the backward";
  if (p.dbias != nullptr && (p.dbias_sb == 0 || p.dbias_sh == 0 || p.dbias_sq == 0 || p.dbias_sk == 0))
    return "dbias must be a full (B, Hq, Lq, Lk) tensor (the op reduces it to the bias's shape)";
  return "";
}

void bwd_sm90(BackwardParams const& p, DType dtype, cudaStream_t stream) {
  switch (p.fwd.D) {
    // 128-row query steps where the query blocks allow them (BwdTraits);
    // FLEXSPARSE_CUDA_DEBUG bit 256: 64-row steps, for same-run A/Bs.
    case 64:
      if (p.fwd.block_q % 128 == 0 && !(p.fwd.debug & 256)) bwd_sm90_hd<64, 128>(p, dtype, stream);
      else bwd_sm90_hd<64, 64>(p, dtype, stream);
      break;
    case 128: bwd_sm90_hd<128, 64>(p, dtype, stream); break;
    default: throw std::invalid_argument("flexsparse CUDA backward: head dim must be 64 or 128");
  }
}

}  // namespace flexsparse
