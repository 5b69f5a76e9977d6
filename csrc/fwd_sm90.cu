// Forward entry: picks the head dim's kernels (fwd_sm90_hd*.cu, kernel in fwd_sm90.cuh).
#include "kernels.h"

namespace flexsparse {

int fwd_tile_m() { return 128; }
int fwd_tile_n(int head_dim) { return head_dim == 256 ? 64 : 128; }

void fwd_sm90(AttentionParams const& p, DType dtype, cudaStream_t stream) {
  const bool bf16 = dtype == DType::kBFloat16;
  switch (p.D) {
    case 64:
      bf16 ? fwd_sm90_hd<64, DType::kBFloat16>(p, stream) : fwd_sm90_hd<64, DType::kFloat16>(p, stream);
      break;
    case 128:
      bf16 ? fwd_sm90_hd<128, DType::kBFloat16>(p, stream) : fwd_sm90_hd<128, DType::kFloat16>(p, stream);
      break;
    case 256:
      bf16 ? fwd_sm90_hd<256, DType::kBFloat16>(p, stream) : fwd_sm90_hd<256, DType::kFloat16>(p, stream);
      break;
    default: throw std::invalid_argument("flexsparse CUDA forward: head dim must be 64, 128 or 256");
  }
}

}  // namespace flexsparse
