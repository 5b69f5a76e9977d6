// Backward kernels for head dim 64 with 128-row query steps (BwdTraits says why).
#include "bwd_sm90.cuh"

namespace flexsparse {

template <>
void bwd_sm90_hd<64, 128, true>(BackwardParams const& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::kBFloat16)
    sm90::launch_bwd<sm90::BwdTraits<cutlass::bfloat16_t, 64, 2, 128, true>>(p, stream);
  else
    sm90::launch_bwd<sm90::BwdTraits<sm90::Fp16Element, 64, 2, 128, true>>(p, stream);
}

}  // namespace flexsparse
