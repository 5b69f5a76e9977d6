// Backward kernels for head dim 128 with 80-row query steps over all query rows (the full
// mask; BwdTraits says why).
// CuTe's wgmma selectors offer N = 80 (and the other N that are no power of two, nor 96
// or 192) only with this defined; this unit alone needs them.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include "bwd_sm90.cuh"

namespace flexsparse {

template <>
void bwd_sm90_hd<128, 80, true>(BackwardParams const& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::kBFloat16)
    sm90::launch_bwd<sm90::BwdTraits<cutlass::bfloat16_t, 128, 2, 80, true>>(p, stream);
  else
    sm90::launch_bwd<sm90::BwdTraits<sm90::Fp16Element, 128, 2, 80, true>>(p, stream);
}

}  // namespace flexsparse
