// Backward kernels for head dim 64 with 64-row query steps: the general kernel, for the
// calls the plain one does not take (bias, softcap, dense mask, bitmaps, more staged column
// ranges than it holds) and for query blocks that are not multiples of 128 (one file per
// head dim and variant so that they build in parallel).
#include "bwd_sm90.cuh"

namespace flexsparse {

template <>
void bwd_sm90_hd<64, 64, false>(BackwardParams const& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::kBFloat16)
    sm90::launch_bwd<sm90::BwdTraits<cutlass::bfloat16_t, 64, 2>>(p, stream);
  else
    sm90::launch_bwd<sm90::BwdTraits<sm90::Fp16Element, 64, 2>>(p, stream);
}

}  // namespace flexsparse
