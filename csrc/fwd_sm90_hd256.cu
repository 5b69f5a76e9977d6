// Forward kernels for head dim 256 (one file per head dim so that they build in parallel).
#include "fwd_sm90.cuh"

namespace flexsparse {

template <>
void fwd_sm90_hd<256>(AttentionParams const& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::kBFloat16)
    sm90::launch_fwd<sm90::FwdTraits<cutlass::bfloat16_t, 256, 64, 2>>(p, stream);
  else
    sm90::launch_fwd<sm90::FwdTraits<cutlass::half_t, 256, 64, 2>>(p, stream);
}

}  // namespace flexsparse
