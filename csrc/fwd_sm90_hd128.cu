// Forward kernels for head dim 128 (one file per head dim so that they build in parallel).
#include "fwd_sm90.cuh"

namespace flexsparse {

template <>
void fwd_sm90_hd<128>(AttentionParams const& p, DType dtype, cudaStream_t stream) {
  // The overlapped schedule (docs/perf-notes.md, C14); FLEXSPARSE_CUDA_DEBUG bit 32 runs
  // the serial one instead, for same-run A/Bs. 240 registers per consumer thread (as
  // FlashAttention-4's Hopper forward): 2-4% over 232 in the same run (perf-notes C23).
  const bool overlap = !(p.debug & 32);
  if (dtype == DType::kBFloat16)
    sm90::launch_fwd_schedule<cutlass::bfloat16_t, 128, 128, 2, 240>(p, stream, overlap);
  else
    sm90::launch_fwd_schedule<sm90::Fp16Element, 128, 128, 2, 240>(p, stream, overlap);
}

}  // namespace flexsparse
