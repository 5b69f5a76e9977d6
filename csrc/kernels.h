// Entry points of the CUDA kernels, called by the op implementations in attention_ops.cpp.
// Kept free of torch and CuTe headers so that each side compiles on its own.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include <stdexcept>
#include <string>

#include "params.h"

#define CUDA_CHECK(expr)                                                              \
  do {                                                                                \
    cudaError_t err_ = (expr);                                                        \
    if (err_ != cudaSuccess)                                                          \
      throw std::runtime_error(std::string("flexsparse CUDA: ") + #expr + ": " +      \
                               cudaGetErrorString(err_));                             \
  } while (0)

namespace flexsparse {

enum class DType { kFloat16, kBFloat16 };

// Whether TMA can move (query rows x keys) tiles of a 16-bit (B, H, Lq, Lk) tensor with
// these element strides: keys contiguous, rows not broadcast, row, head and batch strides
// in whole 16 bytes, a 16-byte aligned base (the bias-tile kernels' bias and dbias).
inline bool tma_tileable(const void* ptr, int64_t s_row, int64_t s_key, int64_t s_head, int64_t s_batch) {
  return ptr != nullptr && s_key == 1 && s_row != 0 && s_row % 8 == 0 && s_head % 8 == 0 &&
         s_batch % 8 == 0 && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}
inline bool bias_tma_readable(AttentionTensors const& p) {
  return tma_tileable(p.bias, p.bias_sq, p.bias_sk, p.bias_sh, p.bias_sb);
}

// Hopper forward: out and lse for every query row (fully masked rows: 0 and -inf).
void fwd_sm90(AttentionParams const& p, DType dtype, cudaStream_t stream);
#if defined(FLEXSPARSE_FWD_TRACE) || defined(FLEXSPARSE_BWD_TRACE)
// A timeline probe's stamp buffer (a __device__ array of its translation unit, `symbol`;
// its first `bytes`): zeroed before a launch (stream-ordered), and copied to the host
// array that the probe's op returns after it (a synchronous copy: trace builds only).
template <class Symbol>
void trace_clear(const Symbol& symbol, size_t bytes, cudaStream_t stream) {
  void* buf = nullptr;
  CUDA_CHECK(cudaGetSymbolAddress(&buf, symbol));
  CUDA_CHECK(cudaMemsetAsync(buf, 0, bytes, stream));
}
template <class Symbol>
void trace_fetch(const Symbol& symbol, void* host, size_t bytes, cudaStream_t stream) {
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaMemcpyFromSymbol(host, symbol, bytes));
}
#endif
#ifdef FLEXSPARSE_FWD_TRACE
// The forward's timeline probe (fwd_sm90.cuh, trace builds only): the stamps of the last
// launch, [kFwdTraceCtas][kFwdTraceTiles][4][kFwdTraceEvents], copied to this host array
// after each launch and returned by the op flexsparse::fwd_trace (tests/gpu/fwd_trace.py).
constexpr int kFwdTraceCtas = 3, kFwdTraceTiles = 260, kFwdTraceEvents = 8;
uint32_t* fwd_trace_host();
#endif
// Its tile sizes: the descriptor's block_q must be a multiple of fwd_tile_m(), block_k a
// multiple of fwd_tile_n(head_dim).
int fwd_tile_m();
int fwd_tile_n(int head_dim);
template <int kHeadDim, DType kDType>
void fwd_sm90_hd(AttentionParams const& p, cudaStream_t stream);
// Defined in fwd_sm90_hd{64,128,256}.cu (bf16) and fwd_sm90_hd{64,128,256}_fp16.cu, one file
// per head dim and type so that they build in parallel (declared here, before fwd_sm90 uses
// them, as C++ asks of explicit specializations).
template <> void fwd_sm90_hd<64, DType::kBFloat16>(AttentionParams const& p, cudaStream_t stream);
template <> void fwd_sm90_hd<64, DType::kFloat16>(AttentionParams const& p, cudaStream_t stream);
template <> void fwd_sm90_hd<128, DType::kBFloat16>(AttentionParams const& p, cudaStream_t stream);
template <> void fwd_sm90_hd<128, DType::kFloat16>(AttentionParams const& p, cudaStream_t stream);
template <> void fwd_sm90_hd<256, DType::kBFloat16>(AttentionParams const& p, cudaStream_t stream);
template <> void fwd_sm90_hd<256, DType::kFloat16>(AttentionParams const& p, cudaStream_t stream);

// Hopper backward (bwd_sm90.cu). The caller allocates bwd_sm90_workspace_bytes(p) bytes of
// device memory for p.workspace (uninitialised); nothing else is allocated inside.
size_t bwd_sm90_workspace_bytes(BackwardParams const& p);
// Query rows of the workspace's per-row arrays for a kernel of `step`-row query steps: Lq
// rounded up to 128 (a whole number of 64- or 128-row steps), or to 80 for 80-row steps.
// bwd_sm90_workspace_bytes sizes the workspace for the larger.
inline int bwd_lq_pad(AttentionParams const& p, int step) {
  return step == 80 ? (p.Lq + 79) / 80 * 80 : (p.Lq + 127) / 128 * 128;
}
void bwd_sm90(BackwardParams const& p, DType dtype, cudaStream_t stream);
#ifdef FLEXSPARSE_BWD_TRACE
// The backward's timeline probe (bwd_sm90.cuh, trace builds only): the stamps of the last
// launch, [kBwdTraceCtas][kBwdTraceSteps + 1][2][kBwdTraceEvents], copied to this host
// array after each launch and returned by the op flexsparse::bwd_trace
// (tests/gpu/bwd_trace.py).
constexpr int kBwdTraceCtas = 3, kBwdTraceSteps = 130, kBwdTraceEvents = 12;
uint32_t* bwd_trace_host();
// Every CTA's life in the last launch (bwd_sm90.cuh, BWD_LIFE), [kBwdLifeCtas][kBwdLifeEvents]
// words, returned by the op flexsparse::bwd_life: where each CTA's fixed cost goes and the
// gap between one CTA's end and the next one's start on the same SM.
constexpr int kBwdLifeCtas = 16384, kBwdLifeEvents = 8;
uint32_t* bwd_life_host();
#endif
// Column ranges per key the backward stages in shared memory. The plain kernels
// (BwdTraits::kPlain) have no path for more, so bwd_sm90 and BwdTraits read this one value.
constexpr int kBwdMaxStagedRanges = 4;
// One head dim, query-step size (kBlockM rows per step) and feature set (kPlain: no bias,
// softcap, dense mask or bitmaps; kBiasTiles: bias and dbias tiles through shared memory;
// see BwdTraits). bwd_sm90 picks among them.
template <int kHeadDim, int kBlockM, bool kPlain, bool kBiasTiles = false>
void bwd_sm90_hd(BackwardParams const& p, DType dtype, cudaStream_t stream);
// Defined in bwd_sm90_hd*.cu.
template <> void bwd_sm90_hd<64, 64, false>(BackwardParams const& p, DType dtype, cudaStream_t stream);
template <> void bwd_sm90_hd<64, 128, true>(BackwardParams const& p, DType dtype, cudaStream_t stream);
template <> void bwd_sm90_hd<128, 64, false>(BackwardParams const& p, DType dtype, cudaStream_t stream);
template <> void bwd_sm90_hd<128, 80, true>(BackwardParams const& p, DType dtype, cudaStream_t stream);
template <> void bwd_sm90_hd<256, 64, false>(BackwardParams const& p, DType dtype, cudaStream_t stream);
template <> void bwd_sm90_hd<256, 64, true>(BackwardParams const& p, DType dtype, cudaStream_t stream);
template <> void bwd_sm90_hd<64, 64, false, true>(BackwardParams const& p, DType dtype, cudaStream_t stream);
template <> void bwd_sm90_hd<128, 64, false, true>(BackwardParams const& p, DType dtype, cudaStream_t stream);
// What the backward does not support (empty string: supported), e.g. a dbias that
// broadcasts over some dimension.
std::string bwd_sm90_unsupported(BackwardParams const& p);

// Index attention forward (index_fwd.cu): out and lse for every query row (rows with no
// active entry: 0 and -inf). Head dims 64, 128, 256 (D = Dv); any G, W, Lq, Lk < 2^31.
void index_fwd_sm90(IndexParams const& p, DType dtype, cudaStream_t stream);

// Index attention backward (index_bwd.cu): dq, dk, dv of index masks, no float atomics,
// bitwise deterministic. The caller allocates index_bwd_workspace_bytes(p) bytes for
// p.workspace (uninitialised). Head dims 64, 128, 256; needs Bi*Hi*Lq*W < 2^31 and
// Bi*Hi*(Lk+1) < 2^31 (index_bwd_unsupported says so).
size_t index_bwd_workspace_bytes(IndexBackwardParams const& p);
std::string index_bwd_unsupported(IndexBackwardParams const& p);
void index_bwd_sm90(IndexBackwardParams const& p, DType dtype, cudaStream_t stream);

// Top-k positions per row of 16-bit scores (topk.cu), rows of up to kTopkMaxKeys keys.
void topk_rows_cuda(TopkParams p, cudaStream_t stream);

}  // namespace flexsparse
