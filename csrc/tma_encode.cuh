// TMA descriptors without a driver-symbol lookup per descriptor.
//
// CuTe's make_tma_copy encodes each descriptor through CUTLASS_CUDA_DRIVER_WRAPPER_CALL
// (cutlass/cuda_host_adapter.hpp), which without CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL
// asks the runtime for cuTensorMapEncodeTiled's address (cudaGetDriverEntryPoint[ByVersion])
// on every call: four lookups per forward call, five to seven per backward (CUTLASS issue
// 3003 reports the same overhead between GEMM launches). Linking libcuda for the direct
// call is not needed: the address is looked up once here and kept.
//
// This header must come before any CuTe header in a translation unit, so that
// copy_traits_sm90_tma.hpp expands the wrapper macro redefined below. Compiling with
// -DFLEXSPARSE_TMA_ENCODE_LOOKUP_PER_CALL keeps CUTLASS's lookup per call (A/Bs:
// AB_FLAGS=-DFLEXSPARSE_TMA_ENCODE_LOOKUP_PER_CALL bash tests/gpu.sh build_ab).
#pragma once
#include <cuda_runtime.h>
#include <cutlass/cuda_host_adapter.hpp>

#include <atomic>

#if !defined(FLEXSPARSE_TMA_ENCODE_LOOKUP_PER_CALL) && !defined(__CUDACC_RTC__) && \
    !defined(CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL) && (__CUDACC_VER_MAJOR__ >= 12)

namespace flexsparse {

// cuTensorMapEncodeTiled through an address looked up once per process (a failed lookup,
// e.g. before the runtime could reach the driver, is not kept: the next call asks again).
inline CUresult cached_cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank,
                                              void* address, const cuuint64_t* dims,
                                              const cuuint64_t* strides, const cuuint32_t* box,
                                              const cuuint32_t* element_strides,
                                              CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                              CUtensorMapL2promotion l2_promotion,
                                              CUtensorMapFloatOOBfill oob_fill) {
  static std::atomic<void*> cached{nullptr};
  void* fn = cached.load(std::memory_order_acquire);
  if (fn == nullptr) {
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if (__CUDACC_VER_MAJOR__ > 12)
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) return CUDA_ERROR_UNKNOWN;
    cached.store(fn, std::memory_order_release);
  }
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  return reinterpret_cast<Encode>(fn)(
      map, type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2_promotion, oob_fill);
}

}  // namespace flexsparse

#undef CUTLASS_CUDA_DRIVER_WRAPPER_CALL
#define CUTLASS_CUDA_DRIVER_WRAPPER_CALL(func) ::flexsparse::cached_##func

#endif
