// Forward kernels for head dim 64 (one file per head dim so that they build in parallel).
#include "fwd_sm90.cuh"

namespace flexsparse {

template <>
void fwd_sm90_hd<64>(AttentionParams const& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::kBFloat16)
    sm90::launch_fwd<sm90::FwdTraits<cutlass::bfloat16_t, 64, 128, 3>>(p, stream);
  else
    sm90::launch_fwd<sm90::FwdTraits<cutlass::half_t, 64, 128, 3>>(p, stream);
}

}  // namespace flexsparse
