// Forward entry: picks the head dim's kernels (fwd_sm90_hd*.cu, kernel in fwd_sm90.cuh).
#include "kernels.h"

namespace flexsparse {

int fwd_tile_m() { return 128; }
int fwd_tile_n(int head_dim) { return head_dim == 256 ? 64 : 128; }

namespace {
template <int kHeadDim>
void fwd_head_dim(AttentionParams const& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::kBFloat16) fwd_sm90_hd<kHeadDim, DType::kBFloat16>(p, stream);
  else fwd_sm90_hd<kHeadDim, DType::kFloat16>(p, stream);
}
}  // namespace

void fwd_sm90(AttentionParams const& p, DType dtype, cudaStream_t stream) {
  switch (p.D) {
    case 64: fwd_head_dim<64>(p, dtype, stream); break;
    case 128: fwd_head_dim<128>(p, dtype, stream); break;
    case 256: fwd_head_dim<256>(p, dtype, stream); break;
    default: throw std::invalid_argument("flexsparse CUDA forward: head dim must be 64, 128 or 256");
  }
}

}  // namespace flexsparse
