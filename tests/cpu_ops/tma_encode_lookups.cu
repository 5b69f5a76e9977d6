// Host check that csrc/tma_encode.cuh takes effect: CuTe's make_tma_copy, compiled after
// that header as the kernels' translation units compile it, asks the runtime for
// cuTensorMapEncodeTiled's address once per process, not once per descriptor
// (docs/perf-notes.md C125). The runtime's cudaGetDriverEntryPointByVersion is replaced
// by a counting stub here (linked against the shared cudart, so the executable's
// definition is the one called), which hands out a fake encoder; no GPU or driver needed.
// Built and run by .ci/run:
//   nvcc -std=c++17 --expt-relaxed-constexpr -arch=sm_90a -cudart shared -I csrc -I <cutlass include> \
//        tests/cpu_ops/tma_encode_lookups.cu -o /tmp/tma_lookups && /tmp/tma_lookups 1
// The control, by hand: with -DFLEXSPARSE_TMA_ENCODE_LOOKUP_PER_CALL (CUTLASS's own
// wrapper) one lookup per descriptor, `/tmp/tma_lookups_per_call 3` (the stub sees
// CUTLASS's lookups too; 2026-12-01: 3 lookups, and the check with 1 fails).
#include <cstdio>
#include <cstdlib>

#include "tma_encode.cuh"
#include <cute/tensor.hpp>

using namespace cute;

static int lookups = 0, encodes = 0;

static CUresult fake_encode(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                            const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                            CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
  ++encodes;
  return CUDA_SUCCESS;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int, unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
  ++lookups;
  *fn = std::strcmp(symbol, "cuTensorMapEncodeTiled") == 0 ? reinterpret_cast<void*>(&fake_encode) : nullptr;
  if (status) *status = *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

int main(int argc, char** argv) {
  const int want_lookups = argc > 1 ? std::atoi(argv[1]) : 1;
  static cutlass::bfloat16_t data[4 * 128 * 64];
  // three descriptors of a (L, D) tensor with 64 x 64 boxes, as launch_fwd makes them
  using SmemLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::bfloat16_t>{},
                                            Shape<_64, _64>{}));
  for (int i = 0; i < 3; ++i) {
    auto gmem = make_tensor(make_gmem_ptr(data), make_shape(4 * 128, 64), make_stride(64, _1{}));
    auto tma = make_tma_copy(SM90_TMA_LOAD{}, gmem, SmemLayout{}, Shape<_64, _64>{}, _1{});
    (void)tma;
  }
  std::printf("descriptors encoded: %d, driver lookups: %d (expected %d)\n", encodes, lookups, want_lookups);
  return encodes == 3 && lookups == want_lookups ? 0 : 1;
}
