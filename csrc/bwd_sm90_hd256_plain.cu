// Backward kernels for head dim 256, plain (no bias, dbias, softcap, dense mask or bitmaps;
// see BwdTraits): 64 keys per CTA, queries and head dim split between the consumer
// warpgroups, one query / dO stage (BwdTraits::kSplitQueries says why).
#include "bwd_sm90.cuh"

namespace flexsparse {

template <>
void bwd_sm90_hd<256, 64, true>(BackwardParams const& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::kBFloat16)
    sm90::launch_bwd<sm90::BwdTraits<cutlass::bfloat16_t, 256, 1, 64, true>>(p, stream);
  else
    sm90::launch_bwd<sm90::BwdTraits<sm90::Fp16Element, 256, 1, 64, true>>(p, stream);
}

}  // namespace flexsparse
