// Forward kernels for head dim 64 (one file per head dim so that they build in parallel).
#include "fwd_sm90.cuh"

namespace flexsparse {

template <>
void fwd_sm90_hd<64>(AttentionParams const& p, DType dtype, cudaStream_t stream) {
  // The overlapped schedule (docs/perf-notes.md, C14); FLEXSPARSE_CUDA_DEBUG bit 32 runs
  // the serial one instead, for same-run A/Bs.
  // 240 registers per consumer thread: at 232 the overlapped loop spilled 8 B; same speed
  // (C15). Three consumer warpgroups at 160 where the descriptor allows (C65).
  const bool overlap = !(p.debug & 32);
  if (dtype == DType::kBFloat16)
    sm90::launch_fwd_schedule<cutlass::bfloat16_t, 64, 128, 3, 240, 160>(p, stream, overlap);
  else
    sm90::launch_fwd_schedule<sm90::Fp16Element, 64, 128, 3, 240, 160>(p, stream, overlap);
}

}  // namespace flexsparse
