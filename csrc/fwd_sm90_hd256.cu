// Forward kernels for head dim 256 (one file per head dim so that they build in parallel).
#include "fwd_sm90.cuh"

namespace flexsparse {

template <>
void fwd_sm90_hd<256>(AttentionParams const& p, DType dtype, cudaStream_t stream) {
  // The overlapped schedule at 240 registers per consumer thread, the plain kernel where the
  // call allows: 2-5% over the serial one in the same run (docs/perf-notes.md C38; at 232
  // registers, before the plain kernel, it spilled 84 B and measured 3% slower, C14).
  // FLEXSPARSE_CUDA_DEBUG bit 32 runs the serial one instead, for same-run A/Bs.
  const bool overlap = !(p.debug & 32);
  if (dtype == DType::kBFloat16)
    sm90::launch_fwd_schedule<cutlass::bfloat16_t, 256, 64, 2, 240>(p, stream, overlap);
  else
    sm90::launch_fwd_schedule<sm90::Fp16Element, 256, 64, 2, 240>(p, stream, overlap);
}

}  // namespace flexsparse
