// Forward kernels for head dim 64, bf16 (fwd_sm90.cuh, launch_fwd_head_dim).
#include "fwd_sm90.cuh"

namespace flexsparse {

template <>
void fwd_sm90_hd<64, DType::kBFloat16>(AttentionParams const& p, cudaStream_t stream) {
  sm90::launch_fwd_head_dim<DType::kBFloat16, 64>(p, stream);
}

}  // namespace flexsparse
