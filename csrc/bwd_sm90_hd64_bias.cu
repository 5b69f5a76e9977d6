// Backward kernels for head dim 64 with bias tiles through shared memory (BwdTraits::
// kBiasTiles; one file per head dim and variant so that they build in parallel).
#include "bwd_sm90.cuh"

namespace flexsparse {

template <>
void bwd_sm90_hd<64, 64, false, true>(BackwardParams const& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::kBFloat16)
    sm90::launch_bwd<sm90::BwdTraits<cutlass::bfloat16_t, 64, 2, 64, false, true>>(p, stream);
  else
    sm90::launch_bwd<sm90::BwdTraits<sm90::Fp16Element, 64, 2, 64, false, true>>(p, stream);
}

}  // namespace flexsparse
