// Small CuTe helpers for the Hopper (sm_90a) kernels: warpgroup GEMMs and views of the
// GMMA accumulator as (row, column). After FlashAttention-3's utils.h, written for our
// kernels.
#pragma once
#include "tma_encode.cuh"   // before CuTe: TMA descriptors without a lookup per call
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>

#include "params.h"

namespace flexsparse::sm90 {
using namespace cute;

// The element type of the fp16 kernels. CI's compile check (.ci/run) defines
// FLEXSPARSE_COMPILE_CHECK_BF16_ONLY: every fp16 kernel is its bf16 template with another
// element type, so that build instantiates the bf16 ones alone (half the compile on CI's
// two cores); its extension refuses fp16 inputs (attention_ops.cpp) and is never loaded.
// The device's build (tests/gpu.sh) compiles both.
#ifdef FLEXSPARSE_COMPILE_CHECK_BF16_ONLY
using Fp16Element = cutlass::bfloat16_t;
#else
using Fp16Element = cutlass::half_t;
#endif

// Streaming multiprocessors of the current device (persistent grids), read once per device.
inline int sm_count() {
  static int cached[64] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) dev = 0;
  if (cached[dev] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    cached[dev] = n > 0 ? n : 132;
  }
  return cached[dev];
}

// The TMA load of bias tiles (bias_tma_readable holds): the bias as (Lq, Lk, heads,
// batches), keys contiguous, where a broadcast head or batch mode has extent 1 (and any
// valid stride); `heads` and `batches` are set to those extents, for the kernel's
// coordinates (query head h reads bias head h / bias_head_div; batch 0 when broadcast).
template <class Element, class SmemLayout, class Tile>
auto make_bias_tma(AttentionParams const& p, SmemLayout smem_layout, Tile tile, int& heads, int& batches) {
  heads = p.Hq / p.bias_head_div;
  batches = p.bias_sb == 0 ? 1 : p.B;
  const int64_t plane = p.bias_sq * p.Lq;
  return make_tma_copy(SM90_TMA_LOAD{},
                       make_tensor(make_gmem_ptr(static_cast<Element const*>(p.bias)),
                                   make_shape(p.Lq, p.Lk, heads, batches),
                                   make_stride(p.bias_sq, _1{}, p.bias_sh == 0 ? plane : p.bias_sh,
                                               p.bias_sb == 0 ? plane : p.bias_sb)),
                       smem_layout, tile, _1{});
}

// A TMA store of one box with an L2 eviction-priority hint (CuTe's SM90_TMA_STORE takes
// none): what copy(tma, src, dst) issues for a (TMA, 1, 1) partition, plus .L2::cache_hint.
struct TmaStoreHinted {
  uint64_t policy;
  __device__ void operator()(void const* desc, void const* smem, int32_t c0, int32_t c1) const {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3}], [%1], %4;"
                 :: "l"(desc), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(c0), "r"(c1), "l"(policy) : "memory");
  }
  __device__ void operator()(void const* desc, void const* smem, int32_t c0, int32_t c1, int32_t c2) const {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4}], [%1], %5;"
                 :: "l"(desc), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(c0), "r"(c1), "r"(c2), "l"(policy)
                 : "memory");
  }
  __device__ void operator()(void const* desc, void const* smem, int32_t c0, int32_t c1, int32_t c2,
                             int32_t c3) const {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4, %5}], [%1], %6;"
                 :: "l"(desc), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "l"(policy) : "memory");
  }
};

// One TMA mode of a partition, box by box as Copy_Atom::call peels it (a (64 x 128) tile in
// 128-byte swizzled rows is two 64-key boxes), each stored with the policy.
template <class Tma, class Src, class Dst>
__device__ __forceinline__ void tma_store_boxes(Tma const& tma, Src const& src, Dst const& dst, uint64_t policy) {
  if constexpr (is_constant<Tma::NumValSrc, decltype(size(src))>::value) {
    auto crd = dst.data().coord_;
    cute::detail::explode_tuple(TmaStoreHinted{policy},
                                cute::make_tuple(static_cast<void const*>(tma.get_tma_descriptor()),
                                                 static_cast<void const*>(raw_pointer_cast(src.data()))),
                                cute::seq<0, 1>{}, crd, cute::tuple_seq<decltype(crd)>{});
  } else {
    auto s = tensor<0>(src);
    auto d = tensor<0>(dst);
    CUTE_UNROLL
    for (int i = 0; i < size<1>(s); ++i) tma_store_boxes(tma, s(_, i), d(_, i), policy);
  }
}

// copy(tma, src, dst) of a (TMA, 1, 1) partition, evict-first in L2 where asked.
template <class Tma, class Src, class Dst>
__device__ __forceinline__ void tma_store(Tma const& tma, Src const& src, Dst&& dst, bool evict_first) {
  if (evict_first) tma_store_boxes(tma, src(_, 0, 0), dst(_, 0, 0), uint64_t(TMA::CacheHintSm90::EVICT_FIRST));
  else copy(tma, src, dst);
}

struct NoWgmma {
  __device__ void operator()() const {}
};

// A descriptor iterator advanced by `units` (16-byte units of the start-address field)
// with one 64-bit add (k_slice, shifted_operand).
__device__ __forceinline__ GMMA::DescriptorIterator desc_plus(GMMA::DescriptorIterator const& it,
                                                              uint64_t units) {
  return GMMA::DescriptorIterator{GmmaDescriptor{it.desc_.desc_ + units}};
}

// The k-th slice of a wgmma operand. A shared-memory (descriptor) operand's descriptor is
// advanced by one 64-bit add: CuTe's DescriptorIterator adds to the low word and copies the
// high one, which ptxas rebuilds with a UMOV beside a UIADD3 before every wgmma (two per
// SS wgmma); a 64-bit add is one UIADD3.64 (as FlashAttention-4's Hopper code compiles;
// docs/perf-notes.md C59). The descriptor fields the offset reaches are in the low word,
// which a valid descriptor never carries out of. (-DFLEXSPARSE_DESC32: CuTe's 32-bit add,
// for a same-machine A/B of two builds, tests/gpu.sh desc_ab.)
template <class Operand>
__device__ __forceinline__ auto k_slice(Operand const& t, int k) {
#ifdef FLEXSPARSE_DESC32
  constexpr bool kDesc64 = false;
#else
  constexpr bool kDesc64 = true;
#endif
  if constexpr (kDesc64 && is_same<remove_cvref_t<decltype(t.data())>, GMMA::DescriptorIterator>::value) {
    return make_tensor(desc_plus(t.data(), uint64_t(t.layout()(0, 0, k))), t(_, _, k).layout());
  } else {
    return t(_, _, k);
  }
}

// A shared-memory (descriptor) operand moved by `units` of 16 bytes: its descriptor's
// start-address field (bits 0-13, 16-byte units) advanced by one 64-bit add, as k_slice
// does (the field cannot carry out below 256 KB of shared memory).
template <class Operand>
__device__ __forceinline__ auto shifted_operand(Operand const& t, uint32_t units) {
  return make_tensor(desc_plus(t.data(), units), t.layout());
}

// C (+)= A * B over the K mode with one warpgroup-wide wgmma batch. zero_init: C = A * B.
// wait >= 0: wait until at most `wait` batches are in flight before returning.
// more(): further wgmmas of the same batch, issued after A * B's (e.g. onto C).
template <bool zero_init, int wait, class TiledMma, class TA, class TB, class TC, class More = NoWgmma>
__device__ __forceinline__ void gemm(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC,
                                     More const& more = More{}) {
  constexpr bool kRegA = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(tCrA));
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (zero_init) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(tiled_mma, k_slice(tCrA, k), k_slice(tCrB, k), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  more();
  warpgroup_commit_batch();
  if constexpr (wait >= 0) warpgroup_wait<wait>();
  warpgroup_fence_operand(tCrC);
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(tCrA));
}

// GMMA accumulator layout ((2, 2, N/8), MMA_M, MMA_N) viewed as (rows, columns):
// rows (2, MMA_M), columns (2, N/8, MMA_N).
template <class Layout>
__device__ __forceinline__ auto rowcol(Layout l) {
  static_assert(decltype(rank<0>(l))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The accumulator of S = Q K^T (16-bit P after conversion) as the register A operand of
// the next wgmma: ((2, 2, 2), MMA_M, N/16 * MMA_N).
template <class Layout>
__device__ __forceinline__ auto accumulator_as_a(Layout l) {
  using X = Underscore;
  auto d = logical_divide(get<0>(l), Shape<X, X, _2>{});
  return make_layout(make_layout(get<0>(d), get<1>(d), get<2, 0>(d)), get<1>(l),
                     coalesce(make_layout(get<2, 1>(d), get<2>(l))));
}

// A register tensor of `To` with the same (static) layout, converted element-wise.
template <class To, class Engine, class Layout>
__device__ __forceinline__ auto convert_type(Tensor<Engine, Layout> const& t) {
  using From = typename Engine::value_type;
  constexpr int n = decltype(size(t))::value;
  Tensor out = make_tensor<To>(t.layout());
  cutlass::NumericArrayConverter<To, From, n> op;
  *reinterpret_cast<cutlass::Array<To, n>*>(out.data()) =
      op(*reinterpret_cast<cutlass::Array<From, n> const*>(t.data()));
  return out;
}

// max(a, b), NaN if either is (fmaxf drops a NaN).
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Max / sum over the 4 threads of a quad, which hold one accumulator row between them.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Named barrier kHwId0 + wg (a hardware id: 0 is __syncthreads, 1..15 are free in our
// kernels, which use none of CUTLASS's reserved ones) for a warp-uniform wg below
// kWarpgroups (at most 3), as branches between immediates, so that the id never sits in a
// register (ptxas spilled such ids and reloaded them from local memory before every barrier
// of the forward's main loop). The backward keeps plain ids: there the branch measured 0-3%
// slower (docs/perf-notes.md C25).
template <int kId, int kThreads>
__device__ __forceinline__ void bar_sync_hw() {
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kThreads));
}
template <int kId, int kThreads>
__device__ __forceinline__ void bar_arrive_hw() {
  asm volatile("bar.arrive %0, %1;" ::"n"(kId), "n"(kThreads));
}
// The same barriers with the id as a register operand (bar.sync/bar.arrive take one):
// no branch or predicate per barrier, the id computed from the warp-uniform wg where it is
// used (the three-warpgroup forward's scheduler barriers).
template <int kThreads>
__device__ __forceinline__ void bar_sync_id(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(kThreads));
}
template <int kThreads>
__device__ __forceinline__ void bar_arrive_id(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(kThreads));
}
template <int kHwId0, int kWarpgroups>
constexpr bool wg_barrier_ids_ok() {
  return kWarpgroups >= 2 && kWarpgroups <= 3 && kHwId0 >= 1 && kHwId0 + kWarpgroups <= 16;
}
template <int kThreads, int kHwId0, int kWarpgroups = 2>
__device__ __forceinline__ void bar_sync_wg(int wg) {
  static_assert(wg_barrier_ids_ok<kHwId0, kWarpgroups>(), "hardware barrier ids 1..15, two or three warpgroups");
  if (wg == 0) bar_sync_hw<kHwId0, kThreads>();
  else if (kWarpgroups == 2 || wg == 1) bar_sync_hw<kHwId0 + 1, kThreads>();
  else bar_sync_hw<kHwId0 + 2, kThreads>();
}
template <int kThreads, int kHwId0, int kWarpgroups = 2>
__device__ __forceinline__ void bar_arrive_wg(int wg) {
  static_assert(wg_barrier_ids_ok<kHwId0, kWarpgroups>(), "hardware barrier ids 1..15, two or three warpgroups");
  if (wg == 0) bar_arrive_hw<kHwId0, kThreads>();
  else if (kWarpgroups == 2 || wg == 1) bar_arrive_hw<kHwId0 + 1, kThreads>();
  else bar_arrive_hw<kHwId0 + 2, kThreads>();
}

// bar_sync_wg that also tells whether `pred` held in every participating thread (PTX
// bar.red.and: the same barrier, with an AND of one predicate per thread).
template <int kId, int kThreads>
__device__ __forceinline__ bool bar_sync_and_hw(bool pred) {
  uint32_t all;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n"
               " bar.red.and.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}"
               : "=r"(all) : "r"(uint32_t(pred)), "n"(kId), "n"(kThreads) : "memory");
  return all != 0;
}
template <int kThreads, int kHwId0, int kWarpgroups = 2>
__device__ __forceinline__ bool bar_sync_and_wg(int wg, bool pred) {
  static_assert(wg_barrier_ids_ok<kHwId0, kWarpgroups>(), "hardware barrier ids 1..15, two or three warpgroups");
  if (wg == 0) return bar_sync_and_hw<kHwId0, kThreads>(pred);
  if (kWarpgroups == 2 || wg == 1) return bar_sync_and_hw<kHwId0 + 1, kThreads>(pred);
  return bar_sync_and_hw<kHwId0 + 2, kThreads>(pred);
}

}  // namespace flexsparse::sm90
