// Forward attention over a block descriptor on Hopper (sm_90a).
//
// A persistent kernel: each CTA takes work tiles (a 128-row query tile of one (batch,
// head); 192 rows in the three-consumer build, FwdTraits) one after another, so that one
// tile's epilogue and the next one's first loads overlap. The producer takes the next
// work tile from a global counter (in work-tile order, as the hardware would hand out one
// CTA per tile) and passes it to the consumers through shared memory. A CTA has a
// producer and two (or three) consumer warpgroups:
//   warpgroup 0 (producer, registers given back): one thread issues TMA loads of the
//     query tile and then, in list order, of the key and value tiles the descriptor lists
//     for this query block (partial list first, then full list), through two TMA
//     pipelines (keys, values) of kStages stages each;
//   warpgroups 1, 2 [, 3] (consumers, 64 query rows each): S = Q K^T with wgmma from shared
//     memory, element predicates on partial tiles, online softmax in registers,
//     O += P V with P as the register A operand. With FwdTraits::kOverlap (hd64, hd128
//     without bias) the two consumers take turns at the tensor cores and each runs the
//     softmax of tile t while its O += P V of tile t-1 computes (FlashAttention-3's
//     ping-pong and intra-warpgroup overlap); otherwise each tile is done in turn.
// Skipped blocks are never loaded. Rows past Lq and columns past Lk come from TMA as
// zeros and are masked here; out and lse of rows past Lq are not written.
// Layout after FlashAttention-3's hopper/ forward (collective mainloop + epilogue).
#include <cmath>
#include <stdexcept>
#include <type_traits>

#include "tma_encode.cuh"   // before CuTe: TMA descriptors without a lookup per call
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#pragma once
#include "block_lists.cuh"
#include "kernels.h"
#include "sm90_utils.cuh"

// Timeline probe, compiled in only with -DFLEXSPARSE_FWD_TRACE (tests/gpu.sh trace, which
// builds a separate copy): one thread of each role stamps the SM clock at fixed points of
// each key tile of two consecutive work tiles (the CTA's (FLEXSPARSE_CUDA_DEBUG >> 16)-th
// and the next), and at the edge of each (FWD_TRACE_EDGE), in CTAs 0, 1 and gridDim / 2,
// into a global buffer that the host copies out after each launch (trace_fetch; the op
// flexsparse::fwd_trace returns it to tests/gpu/fwd_trace.py). Roles: 0, 1 the consumer
// warpgroups, 2 the producer. No printf in the kernel: a function call there makes ptxas
// serialize every wgmma of the kernel (C7510), which is what the printing probe measured
// until 2026-11-29 (docs/perf-notes.md, the 43rd session's note on the edge trace).
#ifdef FLEXSPARSE_FWD_TRACE
constexpr int kTraceCtas = flexsparse::kFwdTraceCtas, kTraceTiles = flexsparse::kFwdTraceTiles,
              kTraceEvents = flexsparse::kFwdTraceEvents;
constexpr uint32_t kTraceRow = 4 * kTraceEvents;                     // words per key-tile slot
constexpr uint32_t kTraceWords = kTraceCtas * kTraceTiles * kTraceRow;
// The stamps ([CTA slot][tile][role][event], the first kTraceWords words), then the sink:
// one 32-byte row per warp of the first 256 CTAs, where the threads that do not record
// store, so that they do not all store to one address. A thread's place is one 32-bit
// word index (trace_at), not a pointer and counters: the probe's registers are what make
// the traced kernel spill.
static __device__ uint32_t fwd_trace_mem[kTraceWords + 256 * 12 * kTraceEvents];
__device__ __forceinline__ int fwd_trace_cta() {
  return blockIdx.x < 2 ? blockIdx.x : blockIdx.x == gridDim.x / 2 ? 2 : -1;
}
// The word index of (CTA slot, tile, role, event 0), and of this warp's sink row.
__device__ __forceinline__ uint32_t fwd_trace_word(int cta, int tile, int role) {
  return (uint32_t(cta) * kTraceTiles + tile) * kTraceRow + role * kTraceEvents;
}
__device__ __forceinline__ uint32_t fwd_trace_sink_row() {
  return kTraceWords + ((blockIdx.x % 256) * 12 + threadIdx.x / 32) * kTraceEvents;
}
__device__ __forceinline__ uint32_t fwd_trace_clock() {
  uint32_t c;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(c));
  return c;
}
#define FWD_TRACE(e)                                                                    \
  asm volatile("{\n .reg .u32 c;\n mov.u32 c, %%clock;\n st.global.u32 [%0], c;\n}" \
               ::"l"(fwd_trace_mem + trace_at + (e)))
// The key tile a recording thread's place is at (its slot's tile).
#define FWD_TRACE_TILE() ((trace_at / kTraceRow) % kTraceTiles)
// The next key tile's slot (threads that do not record stay on their sink; the last slots
// are kept for the work-tile edges).
#define FWD_TRACE_NEXT()                                     \
  if (trace_at < kTraceWords) {                              \
    trace_at += kTraceRow;                                   \
    if (FWD_TRACE_TILE() >= kTraceTiles - 3) trace_at = fwd_trace_sink_row(); \
  }
// Once per role, before its loop over work tiles.
#define FWD_TRACE_DECL() uint32_t trace_at = fwd_trace_sink_row()
// At work tile k: the traced ones are k0 = (FLEXSPARSE_CUDA_DEBUG >> 16) and k0 + 1, whose
// key tiles take consecutive slots, so that the edge between them shows.
#define FWD_TRACE_WORK(role, k, k0, on)                                          \
  {                                                                              \
    const bool rec_ = (on) && fwd_trace_cta() >= 0 && (role) < 3;                \
    if (rec_ && (k) == (k0))                                                     \
      trace_at = fwd_trace_word(fwd_trace_cta(), 0, role);                       \
    else if (!(rec_ && (k) == (k0) + 1 && trace_at < kTraceWords))               \
      trace_at = fwd_trace_sink_row();                                           \
  }
// Edge event e of traced work tile k (row kTraceTiles - 2 - (k - k0)): consumers 0 queries
// ready, 1 last key tile done (finish), 2 the P V before it done, 3 the last P V issued,
// 4 it is done, 5 O / l and the lse done, 6 O stored or its store issued, 7 the work tile's
// first key-tile slot (a count, not a clock); producer 0 before the wait for the query
// buffer, 1 after it, 2 the query load issued.
#define FWD_TRACE_EDGE(role, k, k0, on, e, value)                                                    \
  if ((on) && fwd_trace_cta() >= 0 && (role) < 3 && ((k) == (k0) || (k) == (k0) + 1))               \
    fwd_trace_mem[fwd_trace_word(fwd_trace_cta(), kTraceTiles - 2 - ((k) - (k0)), role) + (e)] = (value)
// Clock and global timer (ns) side by side at the traced work tile's start (i = 0) and end
// (i = 1), to convert cycles to time, and the CTA's index (event 4): row kTraceTiles - 1 of
// the CTA's slot, role 3.
#define FWD_TRACE_CALIBRATE(on, i)                                                          \
  if ((on) && fwd_trace_cta() >= 0) {                                                       \
    uint32_t c, g;                                                                          \
    asm volatile("mov.u32 %0, %%clock;\n mov.u32 %1, %%globaltimer_lo;" : "=r"(c), "=r"(g)); \
    const uint32_t at_ = fwd_trace_word(fwd_trace_cta(), kTraceTiles - 1, 3);               \
    fwd_trace_mem[at_ + 2 * (i)] = c;                                                       \
    fwd_trace_mem[at_ + 2 * (i) + 1] = g;                                                   \
    fwd_trace_mem[at_ + 4] = blockIdx.x;                                                    \
  }
#else
#define FWD_TRACE_TILE() 0
#define FWD_TRACE(e) \
  do {               \
  } while (0)
#define FWD_TRACE_NEXT() \
  do {                   \
  } while (0)
#define FWD_TRACE_DECL() \
  do {                   \
  } while (0)
#define FWD_TRACE_WORK(role, k, k0, on) \
  do {                                  \
  } while (0)
#define FWD_TRACE_EDGE(role, k, k0, on, e, value) \
  do {                                            \
  } while (0)
#define FWD_TRACE_CALIBRATE(on, i) \
  do {                             \
  } while (0)
#endif

namespace flexsparse::sm90 {

// kOverlap: FlashAttention-3's consumer schedule. Within a warpgroup the softmax of tile t
// runs while its O += P(t-1) V(t-1) wgmma does (intra-warpgroup overlap), and the two
// consumer warpgroups take turns issuing their wgmmas (ping-pong), so one warpgroup's
// softmax overlaps the other's matmuls. Without it each tile is QK^T, softmax, PV in turn.
// kConsumerRegs: registers per consumer thread after setmaxnreg. The launch reserves 168
// per thread (65536 / 384 threads, rounded down to a multiple of 8), so the warpgroups
// share 3 * 168 = 504: the producer keeps 504 - 2 * kConsumerRegs (40 or 24). Asking for
// more than the pool holds makes a consumer's setmaxnreg wait forever.
// kConsumerWarpgroups: 2 (128-row work tiles), or 3 (192-row work tiles, 512 threads, a
// pool of 4 * 128 = 512: consumers at 160, the producer at 32), FlashAttention-3's hd64
// configuration (docs/perf-notes.md C65): at hd64 a warpgroup's softmax takes about twice
// its two products' tensor-core time, so two warpgroups leave the tensor cores idle part
// of each tile and three do not. A work tile must then lie in one descriptor row
// (block_q a multiple of 192, e.g. a mask compiled with block_size=(384, 128)), or the
// kv lists' rows must all be one (row_stride 0: the full mask).
// kTmaStore: the epilogue writes O through shared memory (stmatrix) and one TMA store per
// warpgroup instead of 4-byte global stores from registers.
// kPlain: built without the dense mask, the partial bitmaps and the per-score read of
// more than kMaxStagedRanges column ranges (launch_fwd_schedule picks it for calls that
// have none of them), so that their per-work-tile pointers hold no registers.
// kBiasTiles: each key tile's (128 x kBlockN) bias loaded by TMA into shared memory, one
// (64 x kBlockN) half per consumer warpgroup (in place of the O staging buffer: the
// epilogue stores from registers), and read with ldmatrix, instead of per-score global
// loads (docs/perf-notes.md C49, C51). Serial schedule: read with ldmatrix while QK^T
// runs. Overlapped schedule (kBiasMma): added to S by the tensor cores, see below.
// Biased calls take bias tiles where fwd_bias_tiles_ok holds.
// kQBuffers: 2 gives the query tile two buffers, so that the producer loads the next work
// tile's queries as soon as it has issued this one's key and value loads, not after the
// consumers' last Q K^T of this one (a work tile's edge: docs/perf-notes.md C89, C90,
// C92). The default at hd64 (short work tiles gain most), opt-in at hd128; the epilogue
// then stores from registers by 16-byte stores (the O staging buffer's shared memory
// holds the second query buffer at hd128), or at hd64 through the staging buffer and TMA
// when kTmaStore (hd64's default, C111).
// kBandMasks (C113): where the call has a window (PredicateParams::window), partial tiles
// hide their scores by two bounds per row made into a bit mask of the thread's columns
// (column_mask: R2P and FSEL) and stage no column ranges (no loads, no shared-memory
// interval, no warpgroup barrier).
template <class Element_, int kHeadDim_, int kBlockN_, int kStages_, bool kOverlap_ = false,
          int kConsumerRegs_ = 232, bool kTmaStore_ = true, bool kPlain_ = false,
          bool kBiasTiles_ = false, int kConsumerWarpgroups_ = 2, int kQBuffers_ = 1,
          bool kBandMasks_ = false>
struct FwdTraits {
  using Element = Element_;
  static constexpr bool kBandMasks = kBandMasks_;
  static constexpr int kQBuffers = kQBuffers_;
  static_assert(kQBuffers_ == 1 || (kQBuffers_ == 2 && !kBiasTiles_ && (!kTmaStore_ || kHeadDim_ <= 64)),
                "two query buffers: without the bias tiles, and with the O staging buffer at "
                "head dim 64 only (beside them at 128 it would not fit)");
  static constexpr bool kBiasTiles = kBiasTiles_;
  static_assert(!kBiasTiles_ || !kTmaStore_, "bias tiles take the O staging buffer's place");
  static_assert(!kBiasTiles_ || !kPlain_ || kOverlap_, "bias tiles in a plain kernel: overlapped only");
  static constexpr bool kOverlap = kOverlap_;
  static constexpr bool kPlain = kPlain_;
  static constexpr bool kTmaStore = kTmaStore_;
  static constexpr int kConsumerWarpgroups = kConsumerWarpgroups_;
  static_assert(kConsumerWarpgroups == 2 || (kConsumerWarpgroups == 3 && kPlain_ && kOverlap_ && !kBiasTiles_),
                "three consumer warpgroups: the plain overlapped kernel only");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;   // 64 query rows per warpgroup
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kMmaThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = kMmaThreads + 128;
  // The register pool (see above): what __launch_bounds__(kThreads, 1) gives each thread,
  // rounded down to 8, times the warpgroups (504 at 384 threads, 512 at 512).
  static constexpr int kRegisterPool = 65536 / kThreads / 8 * 8 * (kConsumerWarpgroups + 1);
  static constexpr int kConsumerRegs = kConsumerRegs_;
  static constexpr int kProducerRegs = kRegisterPool - kConsumerWarpgroups * kConsumerRegs_;
  static_assert(kProducerRegs >= 24 && kProducerRegs <= 256 && kProducerRegs % 8 == 0 &&
                kConsumerRegs_ % 8 == 0, "setmaxnreg: 24..256, multiples of 8");
  // Partial tiles stage up to this many column ranges per key in shared memory; masks
  // with more read them from global memory per score.
  static constexpr int kMaxStagedRanges = 4;

  using TileQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TilePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;
  using AtomLayout = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileQK>(), AtomLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TilePV, GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayout{}));

  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V as the (head dim, key) B operand of O += P V: the same bytes, transposed view.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));

  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;     // (L, D, H, B)
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                          GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{},
                                       take<0, 2>(SmemLayoutKV{}),
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);

  // The output: each consumer warpgroup stages its 64 rows in shared memory and stores them
  // with one TMA store (rows past Lq are clipped by the tensor map).
  using SmemLayoutO = decltype(tile_to_shape(SmemAtom{}, Shape<_64, Int<kHeadDim>>{}));
  using GmemTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)),
                                             GmemShape{}, GmemStride{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutO{},
                                      Shape<_64, Int<kHeadDim>>{}, _1{}));
  // One warpgroup's share of the O += P V product, for the register-to-shared copy.
  using TiledMmaPVWarpgroup = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>()));
  using SmemCopyO = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{},
                                               TiledMmaPVWarpgroup{}));
  static constexpr int kSmemO = kTmaStore ? kConsumerWarpgroups * cosize_v<SmemLayoutO> : 8;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;

  struct SharedStorage {
    array_aligned<Element, cosize_v<SmemLayoutQ> * kQBuffers, 1024> q;   // buffer i at i * cosize
    array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
    array_aligned<Element, kSmemO, 1024> o;
    // Column ranges of a partial tile, per consumer warpgroup (each stages its own, so the
    // warpgroups never wait for each other), double-buffered: [key][slot].
    alignas(16) int32_t col_ranges[kConsumerWarpgroups][2][kBlockN * 2 * kMaxStagedRanges];
    // The same tile's visible rows per key as one (start, length) interval, where every key
    // of the tile has one (visible_interval): one compare per score instead of one per range.
    alignas(16) int2 col_visible[kConsumerWarpgroups][2][kBlockN];
    // Per query buffer (work tile k uses buffer k % kQBuffers):
    alignas(16) cutlass::arch::ClusterTransactionBarrier::ValueType barrier_q[kQBuffers];
    // Completes when every consumer thread is done with the query tile (its last QK^T),
    // so the producer may load a later work tile's queries over it.
    alignas(16) cutlass::arch::ClusterBarrier::ValueType barrier_q_empty[kQBuffers];
    // The work tile the producer started, for the consumers (-1: no more). Written before
    // the producer's arrival at barrier_q, read after the consumers' wait on it; rewritten
    // only after barrier_q_empty completes.
    int work_tile[kQBuffers];
    typename Pipeline::SharedStorage pipe_k;
    typename Pipeline::SharedStorage pipe_v;
    // kBiasTiles: consumer warpgroup w's half of the bias buffer holds its 64 rows of the
    // current key tile's bias (bias_full[w]) until its threads have used them
    // (bias_empty[w]: each of its 128 threads arrives), so that the warpgroups, half a
    // tile apart in the overlapped schedule, free and refill their halves independently.
    cutlass::arch::ClusterTransactionBarrier::ValueType bias_full[2];
    cutlass::arch::ClusterBarrier::ValueType bias_empty[2];
    // Work tile k's list cursors at their start (TileCursor::start done on the partial
    // lists, [0], and on the full lists, [1]), slot k % (2 kQBuffers). The producer walks
    // the lists (the list's count and entries: dependent global loads, ~2,500 cycles in the
    // traces, docs/perf-notes.md C96) before it waits for the query buffer, so that the
    // walk overlaps that wait, and hands the started cursors to the consumers, who would
    // otherwise repeat those loads at each work tile's start. Written before the producer's
    // arrival at barrier_q, read by the consumers after their wait on it (the partial one
    // at the work tile's start, the full one where the walk turns to the full lists; both
    // before the consumers release the work tile's query buffer). The producer writes tile
    // k's before its wait for tile k - kQBuffers's buffer; its previous wait saw the
    // consumers done with tile k - 1 - kQBuffers, so every tile up to that one is done with
    // its slot, and the slot's previous tile is k - 2 kQBuffers. (Last member: the other
    // members' offsets do not depend on its size.)
    TileCursor cursor[2][2 * kQBuffers_];
  };
  // kBiasTiles: a key tile's bias, (queries, keys) with keys contiguous as in global memory,
  // in a buffer past SharedStorage, as two halves of (64, kBlockN), one per warpgroup.
  using SmemLayoutBias = decltype(tile_to_shape(SmemAtom{}, Shape<_64, Int<kBlockN>>{}));
  static constexpr uint32_t kBytesBias = 64 * kBlockN * sizeof(Element);   // per half
  static constexpr int kBiasOffset = (sizeof(SharedStorage) + 1023) / 1024 * 1024;
  // kBiasMma: the overlapped schedule adds the bias tile to S on the tensor cores, in the
  // same wgmma batch as S = Q K^T and in the same shape (64 x kBlockN x 16), so that the
  // accumulator chains as between QK^T's own k-steps: for each band of 16 query rows,
  // S += (c I)[rows of the band] x Bias[band rows, keys], the identity as A (a window of
  // one tall (112 x 16) tile: rows 48..63 hold c I) and the bias half as the MN-major B
  // operand (its (queries, keys) tile read as (keys, queries)), with c = 1 / scale. S then
  // holds s + bias / scale and the softmax is the unbiased one (scale folded into exp2's
  // argument): no bias value passes through registers (the ldmatrix, the 16-bit-to-float
  // conversions and two float operations per score go; perf-notes C52). c is one 16-bit
  // value: calls where it is off 1 / scale by more than 2^-12 take the serial kernel
  // (fwd_bias_mma_ok). An infinite bias entry makes NaN scores in its key's column of the
  // band (inf * 0): the row max propagates NaN, and the work tiles where it shows are
  // queued (AttentionParams::redo) for the serial kernel, which launch_fwd_schedule runs
  // after this one over that queue only.
  static constexpr bool kBiasMma = kBiasTiles && kOverlap;
  using SmemLayoutIdentity = decltype(tile_to_shape(GMMA::Layout_K_INTER_Atom<Element>{},
                                                    Shape<_112, _16>{}, Step<_2, _1>{}));
  using SmemLayoutIdentityWindow = decltype(tile_to_shape(GMMA::Layout_K_INTER_Atom<Element>{},
                                                          Shape<_64, _16>{}, Step<_2, _1>{}));
  using SmemLayoutBiasT = decltype(composition(
      SmemLayoutBias{}, make_ordered_layout(Shape<Int<kBlockN>, _64>{}, Step<_2, _1>{})));
  static constexpr int kIdentityOffset = kBiasOffset + 2 * kBytesBias;
  static constexpr int kBytesIdentity = 112 * 16 * sizeof(Element);
  using TiledMmaBias = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, _16>,
                           GMMA::Major::K, GMMA::Major::MN>()));
  static constexpr int kSmemBytes = !kBiasTiles ? int(sizeof(SharedStorage))
                                    : kIdentityOffset + (kBiasMma ? kBytesIdentity : 0);
  // One warpgroup's share of S = Q K^T, for the bias halves' shared-to-register copy.
  using TiledMmaQKWarpgroup = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>()));
  using TmaBias = conditional_t<kBiasTiles,
      decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutBias{},
                             Shape<_64, Int<kBlockN>>{}, _1{})), int>;

  struct KernelParams {
    AttentionParams p;
    TmaQ tma_q;
    TmaKV tma_k;
    TmaKV tma_v;
    TmaO tma_o;   // kTmaStore only
    TmaBias tma_bias;   // kBiasTiles only
    int bias_heads = 1, bias_batches = 1;   // the bias's extents of TMA's head and batch modes
  };
};

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1)
fwd_kernel(CUTE_GRID_CONSTANT typename T::KernelParams const kp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kHeadDim = T::kHeadDim;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;

  extern __shared__ char smem_raw[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  AttentionParams const& p = kp.p;

  // Work tiles in (batch, head, query tile) order, query tiles fastest, so that the CTAs
  // running at one time share the keys and values of a few heads in L2; with
  // reverse_tiles the heaviest query tiles of a head come first.
  const int n_m = (p.Lq + kBlockM - 1) / kBlockM;
  const int n_work = p.redo_pass ? p.redo[0] : n_m * p.Hq * p.B;
  // Kernel tiles per descriptor key block; the tiles of a work tile are read front to
  // back (TileCursor: a tile_at(t) lookup per tile cost ~45 instructions per warp,
  // docs/perf-notes.md C30).
  const int sub = p.block_k / kBlockN;
  int m_block = 0, h = 0, b = 0, hk = 0, qb = 0;
  TileCursor walk;
  // The next tile of the work tile; full_started: the full lists' cursor, started by the
  // producer (the consumers' walk), or nullptr (the producer's: it starts its own).
  auto walk_next = [&](int& n, bool& partial, const TileCursor* full_started) {
    return walk.next(p.kv_full, b, h, qb, sub, n, partial, full_started);
  };
  // Work tile w's coordinates, and its list cursor: started here (loads), or given.
  auto set_work_tile = [&](int w, const TileCursor* started = nullptr) {
    const int m = w % n_m;
    m_block = p.reverse_tiles ? n_m - 1 - m : m;
    h = (w / n_m) % p.Hq;
    b = w / n_m / p.Hq;
    hk = h / (p.Hq / p.Hkv);
    qb = m_block * kBlockM / p.block_q;
    walk = started != nullptr ? *started : TileCursor(p.kv_partial, b, h, qb);
  };

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int warp_in_group = cutlass::canonical_warp_idx_sync() % 4;
  const bool lane_leader = cute::elect_one_sync();

  typename T::Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = T::kBytesKV;
  pipe_params.role = warpgroup == 0 ? T::Pipeline::ThreadCategory::Producer
                                    : T::Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x % 128 == 0;
  pipe_params.num_consumers = T::kMmaThreads;
  if (threadIdx.x == 0) {
    for (int i = 0; i < T::kQBuffers; ++i) {
      Barrier::init(&ss.barrier_q[i], 1);
      cutlass::arch::ClusterBarrier::init(&ss.barrier_q_empty[i], T::kMmaThreads);
    }
    if (T::kBiasTiles) {
      for (int w = 0; w < 2; ++w) {
        Barrier::init(&ss.bias_full[w], 1);
        cutlass::arch::ClusterBarrier::init(&ss.bias_empty[w], 128);
      }
    }
  }
  typename T::Pipeline pipe_k(ss.pipe_k, pipe_params, Shape<_1, _1, _1>{});
  typename T::Pipeline pipe_v(ss.pipe_v, pipe_params, Shape<_1, _1, _1>{});
  // kBiasMma: the tall identity tile, c I in rows 48..63 (c: 1 / scale in 16 bits).
  if constexpr (T::kBiasMma) {
    Tensor sI = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem_raw + T::kIdentityOffset)),
                            typename T::SmemLayoutIdentity{});
    const Element c = Element(1.f / p.scale);
    for (int e = threadIdx.x; e < 112 * 16; e += T::kThreads) {
      const int r = e / 16, k = e % 16;
      sI(r, k) = r - 48 == k ? c : Element(0.f);
    }
    cutlass::arch::fence_view_async_shared();   // generic-proxy writes, read by wgmma
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  auto query_buffer = [&](int i) {
    return make_tensor(make_smem_ptr(ss.q.data() + i * cosize_v<typename T::SmemLayoutQ>),
                       typename T::SmemLayoutQ{});
  };
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutVt{});
  // kBiasTiles: warpgroup w's half of the bias buffer
  auto bias_half = [&](int w) {
    return make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem_raw + T::kBiasOffset + w * T::kBytesBias)),
                       typename T::SmemLayoutBias{});
  };

  if (warpgroup == 0) {
    // ------------------------------------------------------------------ producer
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (warp_in_group == 0 && lane_leader) {
      Tensor mQ = kp.tma_q.get_tma_tensor(make_shape(p.Lq, p.D, p.Hq, p.B));
      Tensor mK = kp.tma_k.get_tma_tensor(make_shape(p.Lk, p.D, p.Hkv, p.B));
      Tensor mV = kp.tma_v.get_tma_tensor(make_shape(p.Lk, p.D, p.Hkv, p.B));
      auto cta_q = kp.tma_q.get_slice(0);
      auto cta_k = kp.tma_k.get_slice(0);
      auto cta_v = kp.tma_v.get_slice(0);
      Tensor tKsK = cta_k.partition_D(sK);
      Tensor tVsV = cta_v.partition_D(sV);
      // The key/value pipeline runs on across work tiles. Each work tile (and the final
      // "no more") is one phase of its query buffer's barrier_q and barrier_q_empty.
      auto write = cutlass::make_producer_start_state<typename T::Pipeline>();
      int bias_loads = 0;   // kBiasTiles: bias tiles loaded so far (the buffer's phase)
      int q_loads = 0;   // (the query-load probe below)
      int w = blockIdx.x;
      FWD_TRACE_DECL();
      for (int k = 0;; ++k) {
        const int qbuf = k % T::kQBuffers;
        FWD_TRACE_WORK(2, k, int(p.debug >> 16), true);
        FWD_TRACE_EDGE(2, k, int(p.debug >> 16), true, 0, fwd_trace_clock());
        // The walk, before the wait (see SharedStorage::cursor).
        int wt = -1, n = 0;
        bool partial = false, listed = false;
        if (w < n_work) {
          wt = p.redo_pass ? p.redo[1 + redo_words(n_m * p.Hq * p.B) + w] : w;
          set_work_tile(wt);
          ss.cursor[0][k % (2 * T::kQBuffers)] = walk;
          ss.cursor[1][k % (2 * T::kQBuffers)] = TileCursor(p.kv_full, b, h, qb);
          listed = walk_next(n, partial, nullptr);
        }
        if (k >= T::kQBuffers)
          cutlass::arch::ClusterBarrier::wait(&ss.barrier_q_empty[qbuf], (k / T::kQBuffers - 1) & 1);
        FWD_TRACE_EDGE(2, k, int(p.debug >> 16), true, 1, fwd_trace_clock());
        if (w >= n_work) {
          ss.work_tile[qbuf] = -1;
          Barrier::arrive(&ss.barrier_q[qbuf]);
          break;
        }
        ss.work_tile[qbuf] = wt;
        // The next work tile is taken once this one's loads are issued (about kStages
        // tiles before the consumers finish it), not earlier: a CTA holding a claimed
        // tile it cannot start yet unbalances the end of the grid.
        auto take_next = [&] {
          w = p.tile_counter != nullptr ? gridDim.x + atomicAdd(p.tile_counter, 1) : w + gridDim.x;
        };
        if (!listed) {     // nothing listed: the consumers write 0 / -inf
          Barrier::arrive(&ss.barrier_q[qbuf]);
          take_next();
          continue;
        }
        Tensor gQ = local_tile(mQ(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                               make_coord(m_block, 0));
        // Probe (FLEXSPARSE_CUDA_DEBUG bit 4398046511104, wrong results): the query tiles are
        // loaded for the CTA's first work tiles only (one per buffer), the later ones reuse
        // them, so that the time the next work tile waits for its queries shows (perf-notes,
        // issue 15).
        if (q_loads >= T::kQBuffers && (p.debug_high & 2048)) {
          Barrier::arrive(&ss.barrier_q[qbuf]);
        } else {
          Barrier::arrive_and_expect_tx(&ss.barrier_q[qbuf], T::kBytesQ);
          copy(kp.tma_q.with(ss.barrier_q[qbuf], 0), cta_q.partition_S(gQ),
               cta_q.partition_D(query_buffer(qbuf)));
          ++q_loads;
        }
        FWD_TRACE_EDGE(2, k, int(p.debug >> 16), true, 2, fwd_trace_clock());
        Tensor gK = local_tile(mK(_, _, hk, b), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                               make_coord(_, 0));                     // (N, D, n)
        Tensor gV = local_tile(mV(_, _, hk, b), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                               make_coord(_, 0));
        Tensor tKgK = cta_k.partition_S(gK);
        Tensor tVgV = cta_v.partition_S(gV);
        // kBiasTiles: the bias of this head in (64, kBlockN) tiles
        auto bias_tiles = [&] {
          if constexpr (T::kBiasTiles) {
            Tensor mB = kp.tma_bias.get_tma_tensor(make_shape(p.Lq, p.Lk, kp.bias_heads, kp.bias_batches));
            Tensor gB = local_tile(mB(_, _, h / p.bias_head_div, kp.bias_batches == 1 ? 0 : b),
                                   Shape<_64, Int<kBlockN>>{}, make_coord(_, _));
            return kp.tma_bias.get_slice(0).partition_S(gB);             // (TMA, M, N, m, n)
          } else {
            return 0;
          }
        }();
        do {
          FWD_TRACE(0);
          pipe_k.producer_acquire(write);
          FWD_TRACE(1);
          copy(kp.tma_k.with(*pipe_k.producer_get_barrier(write), 0), tKgK(_, _, _, n),
               tKsK(_, _, _, write.index()));
          if constexpr (T::kBiasTiles) {
            // Each warpgroup's half once that warpgroup has used the last tile's (its S
            // complete), before V: V's stage frees later (at the P V two tiles back), and
            // a bias load behind it reached the consumers too late (perf-notes C52). A
            // half wholly past Lq is not loaded (its rows are never stored): the barrier
            // completes on the arrival alone. (FLEXSPARSE_CUDA_DEBUG bit 524288: no bias
            // loads at all; wrong results, timing only.)
            for (int w = 0; w < 2; ++w) {
              if (bias_loads > 0) cutlass::arch::ClusterBarrier::wait(&ss.bias_empty[w], (bias_loads - 1) & 1);
              if ((m_block * 2 + w) * 64 < p.Lq && !(p.debug & 524288)) {
                Barrier::arrive_and_expect_tx(&ss.bias_full[w], T::kBytesBias);
                copy(kp.tma_bias.with(ss.bias_full[w], 0), bias_tiles(_, _, _, m_block * 2 + w, n),
                     kp.tma_bias.get_slice(0).partition_D(bias_half(w)));
              } else {
                Barrier::arrive(&ss.bias_full[w]);
              }
            }
            ++bias_loads;
          }
          pipe_v.producer_acquire(write);
          FWD_TRACE(2);
          copy(kp.tma_v.with(*pipe_v.producer_get_barrier(write), 0), tVgV(_, _, _, n),
               tVsV(_, _, _, write.index()));
          FWD_TRACE(3);
          ++write;
          FWD_TRACE_NEXT();
        } while (walk_next(n, partial, nullptr));
        take_next();
      }
    }
  } else {
    // ------------------------------------------------------------------ consumers
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    const int tid = threadIdx.x - 128;
    typename T::TiledMmaQK mma_qk;
    typename T::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(tid);
    auto thr_pv = mma_pv.get_thread_slice(tid);
    // Shared-memory operand descriptors are the same for every thread of a warpgroup: take
    // them from the warpgroup's first thread, with the warpgroup index from a shuffle
    // (canonical_warp_group_idx), so that ptxas sees them warp-uniform and keeps them in
    // uniform registers (from the thread index they sat in ordinary registers and were
    // moved with R2UR before every wgmma: docs/perf-notes.md, C24).
    auto wg_qk = mma_qk.get_thread_slice((warpgroup - 1) * 128);
    auto wg_pv = mma_pv.get_thread_slice((warpgroup - 1) * 128);
    // The query tile's operand in buffer 0; buffer 1's is the same descriptor with its
    // address field advanced (shifted_operand), so that it stays in uniform registers.
    Tensor tSrQ_buf0 = wg_qk.partition_fragment_A(query_buffer(0));
    Tensor tSrK = wg_qk.partition_fragment_B(sK);
    Tensor tOrV = wg_pv.partition_fragment_B(sVt);
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});

    // (row, column) of every score this thread holds, within the tile.
    Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tScS = thr_qk.partition_C(cS);
    Tensor coord = make_tensor(tScS.data(), rowcol(tScS.layout()));
    constexpr int kRows = decltype(size<0>(coord))::value;
    constexpr int kCols = decltype(size<1>(coord))::value;
    constexpr int kMaxStagedRanges = T::kMaxStagedRanges;
    static_assert(T::kMaxStagedRanges == 4, "staging keeps 4 (start, end) slots per key");
    static_assert(kRows == 2 && kCols == kBlockN / 4, "GMMA C fragment: 2 rows, N / 4 columns");
    // This thread's first accumulator row and column within a tile; the others are at
    // fixed offsets (rows + 8 r, columns + 8 (c / 2) + c % 2: the GMMA C fragment).
    const int row_base = get<0>(coord(0, 0));
    const int col_base = get<1>(coord(0, 0));

    const float LOG2E = 1.4426950408889634f;
    // The overlapped schedule is built without the per-score bias loads (their registers
    // would spill beside S, P and O in flight): biased calls run it only with bias tiles,
    // which the tensor cores add (kBiasMma), so nothing here reads the bias.
    const bool has_bias = !T::kBiasMma && (!T::kOverlap || T::kBiasTiles) && p.bias != nullptr;
    const bool has_softcap = p.softcap > 0.f;
    // Without bias or softcap the row max is kept on the raw scores and the scale is
    // folded into exp2's argument (one FFMA per score); else scores are taken to the
    // log2 domain first.
    const bool log2_scores = has_bias || has_softcap;
    const float exp_scale = log2_scores ? 1.f : p.scale * LOG2E;
    // Where the work tile's rows, bias and element predicates start (set per work tile).
    int i0 = 0;
    const Element* bias = nullptr;
    bool bias_pairs_ok = false;
    const int32_t* cr_base = nullptr;
    // Whether this work tile's partial tiles stage their column ranges, and one key per
    // thread (see load_extras): set per work tile, not recomputed per tile.
    bool stage_ranges = false, stage_by_key = false;
    // kBandMasks: the call's window hides the partial tiles' scores (nothing staged).
    const bool band_tiles = T::kBandMasks && p.pred.window != nullptr && p.pred.col_ranges != nullptr;
    const uint8_t* dense = nullptr;
    const int32_t* bits_row = nullptr;
    auto set_tile_inputs = [&] {
      i0 = m_block * kBlockM;
      bias = static_cast<const Element*>(p.bias);
      if (has_bias) bias += b * p.bias_sb + (h / p.bias_head_div) * p.bias_sh;
      // 32-bit loads of key pairs: contiguous, 4-byte aligned bias rows (col_base and the
      // pair's first key are even).
      bias_pairs_ok = has_bias && p.bias_sk == 1 && p.bias_sq % 2 == 0 &&
                      reinterpret_cast<uintptr_t>(bias) % 4 == 0;
      const PredicateParams& pr = p.pred;
      cr_base = pr.col_ranges == nullptr ? nullptr
          : pr.col_ranges + b * pr.cr_sb + (h / pr.cr_head_div) * pr.cr_sh;
      stage_ranges = cr_base != nullptr && pr.n_col_ranges <= kMaxStagedRanges && !(p.debug & 4) && !band_tiles;
      stage_by_key = stage_ranges && pr.n_col_ranges <= 2 && !(p.debug & 8);
      dense = T::kPlain || pr.dense == nullptr ? nullptr
          : pr.dense + b * pr.dense_sb + (h / pr.dense_head_div) * pr.dense_sh;
      bits_row = T::kPlain || pr.bits_index == nullptr ? nullptr
          : pr.bits_index + b * pr.bi_sb + (h / pr.bi_head_div) * pr.bi_sh + qb * pr.bi_sq;
    };
    constexpr int kWarpgroups = T::kConsumerWarpgroups;
    const int wg = warpgroup - 1;                  // consumer warpgroup: 0 .. kWarpgroups - 1
    const int wg_tid = tid % 128;
    constexpr int kStagedPerWarpgroup = kBlockN * 4 / 128;   // (key, slot) pairs per thread
    // Hardware barrier ids, one per consumer warpgroup each (15: the trace probe's).
    constexpr int kBarrierColRanges = 1;
    constexpr int kBarrierSchedule = kBarrierColRanges + kWarpgroups;
    constexpr int kBarrierEpilogue = kBarrierSchedule + kWarpgroups;
    int buf = 0;

    float row_max[kRows], row_sum[kRows];

    // Bias of scores (r, c) and (r, c + 1) of tile n (adjacent keys), loaded before the
    // product so that the latency hides behind it: one 32-bit load when the rows allow it.
    auto load_bias_pair = [&](int n, int r, int c) -> uint32_t {
      const Element* row = bias + min(i0 + row_base + 8 * r, p.Lq - 1) * p.bias_sq;
      const int j = n * kBlockN + col_base + 8 * (c / 2);
      if (bias_pairs_ok && j + 1 < p.Lk) return __ldg(reinterpret_cast<const uint32_t*>(row + j));
      const Element lo = row[min(j, p.Lk - 1) * p.bias_sk];
      const Element hi = row[min(j + 1, p.Lk - 1) * p.bias_sk];
      return uint32_t(reinterpret_cast<const uint16_t&>(lo)) |
             (uint32_t(reinterpret_cast<const uint16_t&>(hi)) << 16);
    };
    using FragS = decltype(partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{}));
    // What a tile needs besides K and V, loaded before its QK^T wgmma so that the loads'
    // latency hides behind it.
    struct TileExtras {
      int n;
      bool partial, staged;
      // by_key: staged one key per thread (at most 2 ranges per key); all_interval: every
      // key of the tile shows one interval of rows (set when staged, by the barrier).
      bool by_key, all_interval;
      int2 cr_vals[kStagedPerWarpgroup];
      uint32_t bias_pairs[kRows][kCols / 2];
    };
    auto load_extras = [&](TileExtras& x) {
      // Partial tiles with column ranges: the tile's ranges as 4 (start, length) slots per
      // key: row i is hidden by a slot iff unsigned(i - start) < length. Unused slots are
      // (0, 0) and hide nothing; keys past Lk get a slot that hides every row. More than 4
      // ranges per key: read per score from global memory instead (slow path).
      x.staged = x.partial && stage_ranges;
      // At most 2 ranges per key (causal, windows, documents, prefix-LM): one key per
      // thread, so that the thread can tell the key's visible interval when it stages it.
      // FLEXSPARSE_CUDA_DEBUG bit 8: the (key, slot) staging and range tests instead (A/Bs).
      x.by_key = x.partial && stage_by_key;
      x.all_interval = false;
      if (x.by_key) {
        if (wg_tid < kBlockN) {
          const int j = x.n * kBlockN + wg_tid;
          int2 s0 = make_int2(0, 0), s1 = make_int2(0, 0);
          if (j >= p.Lk) {
            s0 = make_int2(0, 0x7fffffff);
          } else {
            const int32_t* cr = cr_base + (int64_t)j * p.pred.cr_sk;
            if (p.pred.n_col_ranges >= 1) {
              const int lo = __ldg(cr), hi = __ldg(cr + 1);
              s0 = make_int2(lo, max(hi - lo, 0));
            }
            if (p.pred.n_col_ranges >= 2) {
              const int lo = __ldg(cr + 2), hi = __ldg(cr + 3);
              s1 = make_int2(lo, max(hi - lo, 0));
            }
          }
          x.cr_vals[0] = s0;
          x.cr_vals[1] = s1;
        }
      } else if (x.staged) {
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kStagedPerWarpgroup; ++e) {
          const int pair = wg_tid + e * 128;        // (key, slot) pair, < kBlockN * 4
          const int col = pair >> 2, slot = pair & 3;
          const int j = x.n * kBlockN + col;
          int2 v = make_int2(0, 0);
          if (j >= p.Lk) {
            if (slot == 0) v = make_int2(0, 0x7fffffff);
          } else if (slot < p.pred.n_col_ranges) {
            const int32_t* cr = cr_base + (int64_t)j * p.pred.cr_sk + 2 * slot;
            const int lo = __ldg(cr), hi = __ldg(cr + 1);
            v = make_int2(lo, max(hi - lo, 0));
          }
          x.cr_vals[e] = v;
        }
      }
      if (has_bias && !T::kBiasTiles) {   // (kBiasTiles: read_bias_tile, while the product runs)
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < kCols; c += 2) x.bias_pairs[r][c / 2] = load_bias_pair(x.n, r, c);
        }
      }
    };
    // kBiasTiles: the bias tile read into S's fragment layout; tiles read so far.
    auto s2r_bias = [&] {
      if constexpr (T::kBiasTiles)
        return make_tiled_copy_C(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, typename T::TiledMmaQKWarpgroup{});
      else
        return 0;
    }();
    int bias_reads = 0;
    // kBiasTiles: this warpgroup's half of the next tile's bias, once loaded, into tBrB
    // (S's fragment layout).
    auto read_bias_tile = [&](auto& tBrB) {
      if constexpr (T::kBiasTiles) {
        Barrier::wait(&ss.bias_full[wg], bias_reads & 1);
        auto thr_b = s2r_bias.get_thread_slice(wg_tid);
        copy(s2r_bias, thr_b.partition_S(bias_half(wg)), thr_b.retile_D(tBrB));
        ++bias_reads;
      }
    };
    // The warpgroup's half is free once this thread's ldmatrix has returned its data, which
    // the scores just computed from it (tSrS) prove. (Arriving right after the ldmatrix let
    // the next tile's TMA overwrite the buffer before the read was served, queued behind the
    // QK^T wgmma's operand reads: wrong scores where the bias sits in L2, perf-notes C49.)
    auto release_bias_tile = [&](auto& tSrS) {
      warpgroup_fence_operand(tSrS);
      cutlass::arch::ClusterBarrier::arrive(&ss.bias_empty[wg]);
    };
    // Scores of a finished QK^T: to the log2 domain where needed (softcap, bias), invisible
    // ones to -inf. Always inlined: called twice in the overlapped loop, it is past NVVM's
    // inlining threshold, and a call would put the score fragment in local memory.
    // full (std::true_type): a tile known to be neither partial nor past Lk, whose extras
    // were not loaded (the overlapped loop's full-tile path): only the log2 pass is left.
    auto finish_scores = [&](FragS& tSrS, TileExtras& x, auto full) __attribute__((always_inline)) {
      constexpr bool kFull = decltype(full)::value;
      Tensor S = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
      const int j0 = x.n * kBlockN;
      if (kFull) {
        // (nothing staged, nothing to hide)
      } else if (x.by_key) {
        // Key wg_tid's two ranges where hide_ranges<2> reads them, and its visible interval;
        // the barrier (double-buffered as below) also ANDs whether every key has one.
        bool interval = true;
        if (wg_tid < kBlockN) {
          const int2 s0 = x.cr_vals[0], s1 = x.cr_vals[1];
          reinterpret_cast<int4*>(ss.col_ranges[wg][buf])[wg_tid * 2] = make_int4(s0.x, s0.y, s1.x, s1.y);
          int2 vis = make_int2(0, 0);
          interval = visible_interval(s0, s1, p.Lq, vis);
          ss.col_visible[wg][buf][wg_tid] = vis;
        }
        x.all_interval = bar_sync_and_wg<128, kBarrierColRanges, kWarpgroups>(wg, interval);
      } else if (x.staged) {
        // This warpgroup's buffer (double-buffered: the barrier also tells that its
        // threads are done with the buffer of two tiles ago).
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kStagedPerWarpgroup; ++e)
          reinterpret_cast<int2*>(ss.col_ranges[wg][buf])[wg_tid + e * 128] = x.cr_vals[e];
        bar_sync_wg<128, kBarrierColRanges, kWarpgroups>(wg);
      }
      // Probe switches (FLEXSPARSE_CUDA_DEBUG): 1 = partial tiles without predicates,
      // 2 = no predicate work at all on partial tiles, 4 = no staging (wrong results;
      // timing only).
      const bool check = !kFull && ((x.partial && !(p.debug & 2)) || j0 + kBlockN > p.Lk);
      if (log2_scores) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < kCols; ++c) {
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < kRows; ++r) {
            float s = S(r, c);
            s = has_softcap ? p.softcap * tanhf(s * p.scale / p.softcap) : s * p.scale;
            s *= LOG2E;
            if (has_bias) {
              const uint32_t pair = x.bias_pairs[r][c / 2];
              const uint16_t bits = (c & 1) ? uint16_t(pair >> 16) : uint16_t(pair & 0xffff);
              s += LOG2E * static_cast<float>(reinterpret_cast<const Element&>(bits));
            }
            S(r, c) = s;
          }
        }
      }
      if (check) {
        // Hide invisible scores, each predicate in its own branch-free pass. Rows past Lq
        // need no mask: they are never stored, and their scores (zero queries) are finite.
        const bool preds = x.partial && !(p.debug & 1);
        if (T::kBandMasks && band_tiles && preds) {
          // Key j shows the rows j + band_a <= i < j + band_b, so row i sees the keys
          // i - band_b < j <= i - band_a below Lk: as offsets from this thread's first column,
          // one 32-bit mask of its columns per row. (The window is read per tile, from L1:
          // held across the loop it cost hd128's kernel 36 more bytes of spills.)
          static_assert(kCols <= 32, "one 32-bit mask of the thread's columns per row");
          const int2 band = window_band(p.pred.window, p.Lq, p.Lk);
          const int band_a = band.x, band_b = band.y;
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < kRows; ++r) {
            const int i = i0 + row_base + 8 * r;
            const int first = j0 + col_base;
            const uint32_t m = column_mask(i - band_b + 1 - first, min(i - band_a + 1, p.Lk) - first, kCols);
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < kCols; ++c) S(r, c) = (m >> c) & 1u ? S(r, c) : -INFINITY;
          }
        } else if (x.staged && preds && x.all_interval) {
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const int jt = col_base + 8 * (c / 2) + (c & 1);
            const int2 v = ss.col_visible[wg][buf][jt];
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < kRows; ++r) {
              const int i = i0 + row_base + 8 * r;
              S(r, c) = unsigned(i - v.x) < unsigned(v.y) ? S(r, c) : -INFINITY;
            }
          }
        } else if (x.staged && preds) {
          auto hide_ranges = [&](auto slots) {
            constexpr int kSlots = decltype(slots)::value;
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < kCols; ++c) {
              // Accumulator column c of this thread: 8 * (c / 2) + 2 * (lane % 4) + c % 2.
              const int jt = col_base + 8 * (c / 2) + (c & 1);
              int4 rg[kSlots / 2];
              CUTLASS_PRAGMA_UNROLL
              for (int e = 0; e < kSlots / 2; ++e)
                rg[e] = reinterpret_cast<const int4*>(ss.col_ranges[wg][buf])[jt * 2 + e];
              CUTLASS_PRAGMA_UNROLL
              for (int r = 0; r < kRows; ++r) {
                const int i = i0 + row_base + 8 * r;
                bool hidden = false;
                CUTLASS_PRAGMA_UNROLL
                for (int e = 0; e < kSlots / 2; ++e) {
                  hidden |= unsigned(i - rg[e].x) < unsigned(rg[e].y);
                  hidden |= unsigned(i - rg[e].z) < unsigned(rg[e].w);
                }
                S(r, c) = hidden ? -INFINITY : S(r, c);
              }
            }
          };
          if (p.pred.n_col_ranges <= 2) hide_ranges(Int<2>{});
          else hide_ranges(Int<4>{});
        } else if (j0 + kBlockN > p.Lk) {
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const bool col_ok = j0 + col_base + 8 * (c / 2) + (c & 1) < p.Lk;
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < kRows; ++r) S(r, c) = col_ok ? S(r, c) : -INFINITY;
          }
        }
        if (!T::kPlain && preds && cr_base != nullptr && !x.staged) {   // more than 4 ranges per key
          for (int c = 0; c < kCols; ++c) {
            const int j = min(j0 + col_base + 8 * (c / 2) + (c & 1), p.Lk - 1);
            const int32_t* cr = cr_base + (int64_t)j * p.pred.cr_sk;
            for (int e = 0; e < p.pred.n_col_ranges; ++e) {
              const int lo = __ldg(cr + 2 * e), hi = __ldg(cr + 2 * e + 1);
              CUTLASS_PRAGMA_UNROLL
              for (int r = 0; r < kRows; ++r) {
                const int i = i0 + row_base + 8 * r;
                S(r, c) = (i >= lo && i < hi) ? -INFINITY : S(r, c);
              }
            }
          }
        }
        if (!T::kPlain && preds && bits_row != nullptr) {
          const int idx = __ldg(bits_row + j0 / p.block_k);
          if (idx >= 0 && idx < p.pred.bits_count) {
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < kRows; ++r) {
              const int32_t* w = p.pred.bits + idx * p.pred.bits_sp +
                                 ((i0 + row_base + 8 * r) % p.block_q) * p.pred.bits_sr + (j0 % p.block_k) / 32;
              CUTLASS_PRAGMA_UNROLL
              for (int e = 0; e < kBlockN / 32; ++e) {
                const uint32_t word = __ldg(w + e);
                CUTLASS_PRAGMA_UNROLL
                for (int c = 8 * e; c < 8 * e + 8; ++c) {   // the 8 columns of this word
                  const int jt = col_base + 8 * (c / 2) + (c & 1);
                  S(r, c) = (word >> (jt & 31)) & 1u ? S(r, c) : -INFINITY;
                }
              }
            }
          }
        }
        if (!T::kPlain && preds && dense != nullptr) {
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const int j = min(j0 + col_base + 8 * (c / 2) + (c & 1), p.Lk - 1);
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < kRows; ++r) {
              const int i = min(i0 + row_base + 8 * r, p.Lq - 1);
              const bool d = __ldg(dense + i * p.pred.dense_sq + j * p.pred.dense_sk) != 0;
              S(r, c) = d ? S(r, c) : -INFINITY;
            }
          }
        }
      }
      if (!kFull && x.staged) buf ^= 1;
    };
    // kBiasMma: whether a row of this thread's in the current work tile met a NaN score
    // (an infinite bias entry; the work tile then goes to the redo queue).
    bool nan_scores = false;
    // Lazy rescaling (FlashAttention-4's): a row keeps the max it subtracts until a tile's
    // max exceeds it by more than kRescaleMargin in exp2's argument. P then stays below
    // 2^kRescaleMargin (16-bit P keeps its relative precision; sums and O are float), and
    // on most tiles no row of a warp moves, so the warp skips O's rescale (kHeadDim / 2
    // FMULs per thread per tile; time follows the consumers' instructions, perf-notes C24).
    // The lse uses the max that was subtracted, so it is exact all the same.
    // FLEXSPARSE_CUDA_DEBUG bit 8388608: a new max on every rise, O rescaled every tile (A/Bs).
    constexpr float kRescaleMargin = 8.f;
    const bool eager_rescale = p.debug & 8388608;
    const float rescale_margin = eager_rescale ? 0.f : kRescaleMargin;
    // Online softmax: the row max to subtract, P = exp2(s - max) in place of the scores, the
    // running sums, and alpha = exp2(m_old - m_new), the factor for the running output (1
    // where the max stays).
    auto softmax = [&](FragS& tSrS, float (&alpha)[kRows]) {
      Tensor S = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        float m = row_max[r];
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < kCols; ++c) m = T::kBiasMma ? fmax_nan(m, S(r, c)) : fmaxf(m, S(r, c));
        // (Rows past Lq may read a bias half that was not loaded: not theirs to report.)
        if constexpr (T::kBiasMma) nan_scores |= m != m && i0 + row_base + 8 * r < p.Lq;
        m = quad_max(m);
        // m >= row_max (both -inf, or NaN from an infinite bias entry: no move). From -inf
        // to a finite max always moves, with alpha = 0 (O and the sum are 0 then).
        const bool moves = (m - row_max[r]) * exp_scale > rescale_margin;
        alpha[r] = moves ? exp2f((row_max[r] - m) * exp_scale) : 1.f;
        if (moves) row_max[r] = m;
        const float m_scaled = row_max[r] == -INFINITY ? 0.f : row_max[r] * exp_scale;
        float sum = 0.f;
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < kCols; ++c) {
          const float e = exp2f(S(r, c) * exp_scale - m_scaled);
          S(r, c) = e;
          sum += e;
        }
        row_sum[r] = row_sum[r] * alpha[r] + sum;
      }
    };
    // O *= alpha, where a row of this warp moved its max (a warp-uniform branch: the
    // warpgroup's other warps and the wgmmas are not involved).
    auto rescale_o = [&](float const (&alpha)[kRows]) {
      bool moved = eager_rescale;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) moved |= alpha[r] != 1.f;
      if (!__any_sync(0xffffffffu, moved)) return;
      Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size<1>(O); ++c) O(r, c) *= alpha[r];
      }
    };

    // This thread's rows of O to the work tile (ob, oh, oi0)'s output by 16-byte stores: in
    // each quad, lane q holds columns 8 j + 2 q, + 1 of its two rows; a 4 x 4 transpose over
    // the quad (four shuffles per group of four j) gives lane q all eight columns of
    // j = 4 g + q. (The two-query-buffer kernels, which have no staging buffer.)
    auto rows_out16 = [&](int ob, int oh, int oi0) __attribute__((always_inline)) {
      Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
      Element* out = static_cast<Element*>(p.out) + ((int64_t)ob * p.Hq + oh) * p.Lq * kHeadDim;
      const int q = tid % 4;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int i = oi0 + row_base + 8 * r;
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < kHeadDim / 32; ++g) {
          uint32_t pairs[4], mine[4] = {0u, 0u, 0u, 0u};
          CUTLASS_PRAGMA_UNROLL
          for (int t = 0; t < 4; ++t) {
            const int c = 2 * (4 * g + t);
            auto pair = cutlass::NumericArrayConverter<Element, float, 2>()(
                cutlass::Array<float, 2>{{O(r, c), O(r, c + 1)}});
            pairs[t] = reinterpret_cast<const uint32_t&>(pair);
          }
          // Round s: lane q sends its pair for j = 4 g + ((q - s) & 3) and receives, from
          // lane (q + s) & 3, that lane's pair for j = 4 g + q (selects, not a dynamic
          // register index).
          CUTLASS_PRAGMA_UNROLL
          for (int s4 = 0; s4 < 4; ++s4) {
            const int send_t = (q - s4) & 3, src = (q + s4) & 3;
            uint32_t send = pairs[0];
            CUTLASS_PRAGMA_UNROLL
            for (int t = 1; t < 4; ++t) send = send_t == t ? pairs[t] : send;
            const uint32_t got = __shfl_sync(0xffffffffu, send, (threadIdx.x & 31 & ~3) | src);
            CUTLASS_PRAGMA_UNROLL
            for (int t = 0; t < 4; ++t) mine[t] = src == t ? got : mine[t];
          }
          if (i < p.Lq)
            *reinterpret_cast<uint4*>(out + (int64_t)i * kHeadDim + 8 * (4 * g + q)) =
                make_uint4(mine[0], mine[1], mine[2], mine[3]);
        }
      }
    };
    // The lse of a row from its max (raw or log2-domain scores, as exp_scale says) and sum.
    auto row_lse = [&](float m, float l) __attribute__((always_inline)) {
      return l > 0.f ? (m * exp_scale + __log2f(l)) * 0.6931471805599453f : -INFINITY;
    };
    // The query tile's operand in buffer i.
    auto query_operand = [&](int i) __attribute__((always_inline)) {
      return shifted_operand(tSrQ_buf0, i * uint32_t(cosize_v<typename T::SmemLayoutQ> * sizeof(Element) / 16));
    };
    int qbuf = 0;   // this work tile's query buffer
    // Every consumer thread has read the query tile (its last QK^T is complete).
    auto release_q = [&] { cutlass::arch::ClusterBarrier::arrive(&ss.barrier_q_empty[qbuf]); };
    // The key/value pipeline runs on across work tiles (read, or read_k and read_v).
    typename T::PipelineState read, read_k, read_v;
    FWD_TRACE_DECL();
    for (int k = 0;; ++k) {
    qbuf = k % T::kQBuffers;
    Barrier::wait(&ss.barrier_q[qbuf], (k / T::kQBuffers) & 1);
    const int w = *reinterpret_cast<volatile int*>(&ss.work_tile[qbuf]);
    if (w < 0) break;
    auto tSrQ = query_operand(qbuf);
    const TileCursor started = ss.cursor[0][k % (2 * T::kQBuffers)];
    set_work_tile(w, &started);
    // (The slot's address from k, which the loop holds anyway, rather than a pointer.)
    auto next_tile = [&](int& n, bool& partial) __attribute__((always_inline)) {
      return walk_next(n, partial, &ss.cursor[1][k % (2 * T::kQBuffers)]);
    };
    set_tile_inputs();
    // (Roles 0, 1: the first two consumer warpgroups; a third records nothing.)
    FWD_TRACE_WORK(wg < 2 ? wg : 3, k, int(p.debug >> 16), wg_tid == 0);
    FWD_TRACE_EDGE(wg < 2 ? wg : 3, k, int(p.debug >> 16), wg_tid == 0, 0, fwd_trace_clock());
    FWD_TRACE_EDGE(wg < 2 ? wg : 3, k, int(p.debug >> 16), wg_tid == 0, 7, uint32_t(FWD_TRACE_TILE()));
    FWD_TRACE_CALIBRATE(k == (p.debug >> 16) && tid == 0, 0);
    clear(tOrO);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }
    nan_scores = false;
    // (Nothing listed: no tile, and the epilogue writes 0 and -inf.)
    int n;
    bool partial;
    if constexpr (!T::kOverlap) {
      while (next_tile(n, partial)) {
        TileExtras x;
        x.n = n;
        x.partial = partial;
        load_extras(x);
        FragS tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
        pipe_k.consumer_wait(read);
        if constexpr (T::kBiasTiles) {
          // The tile's bias from shared memory into the pairs finish_scores adds, while the
          // product runs.
          gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
          Tensor tBrB = make_tensor<Element>(tSrS.layout());
          read_bias_tile(tBrB);
          Tensor Bv = make_tensor(tBrB.data(), rowcol(tBrB.layout()));
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < kRows; ++r) {
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < kCols; c += 2) {
              const Element lo = Bv(r, c), hi = Bv(r, c + 1);
              x.bias_pairs[r][c / 2] = uint32_t(reinterpret_cast<const uint16_t&>(lo)) |
                                       (uint32_t(reinterpret_cast<const uint16_t&>(hi)) << 16);
            }
          }
          warpgroup_wait<0>();
          warpgroup_fence_operand(tSrS);
        } else {
          gemm<true, 0>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
        }
        pipe_k.consumer_release(read);
        finish_scores(tSrS, x, std::false_type{});
        if constexpr (T::kBiasTiles) release_bias_tile(tSrS);
        float alpha[kRows];
        softmax(tSrS, alpha);
        rescale_o(alpha);
        Tensor tOrP_ = convert_type<Element>(tSrS);
        Tensor tOrP = make_tensor(tOrP_.data(), accumulator_as_a(tSrS.layout()));
        pipe_v.consumer_wait(read);
        gemm<false, 0>(mma_pv, tOrP, tOrV(_, _, _, read.index()), tOrO);
        pipe_v.consumer_release(read);
        ++read;
      }
      release_q();
    } else {
      // Per tile t: [scale O by alpha(t-1) once O += P(t-2) V(t-2) is done]; issue
      // S(t) = Q K(t)^T and O += P(t-1) V(t-1) in this warpgroup's turn at the tensor cores;
      // wait for S(t) only; mask and softmax of tile t while P(t-1) V(t-1) runs. P(t) goes
      // to the other of two register buffers (the loop is unrolled by two), so nothing in
      // the softmax touches a register that the running wgmma reads or writes, and ptxas
      // has no reason to put the wait for it before the softmax (docs/perf-notes.md, C39).
      // Scheduler barriers make the warpgroups issue their pairs of wgmmas in turn, in a
      // ring (warpgroup 0 first): a warpgroup's turn ends with an arrival at the next one's
      // barrier.
      // Three warpgroups take the ids from a register: their hand-off then needs no
      // predicate and branch after the last wgmma; two warpgroups keep immediates, where
      // a register id measured slower (docs/perf-notes.md C126, C25).
      auto issue_begin = [&] {
        if constexpr (kWarpgroups == 3) bar_sync_id<2 * 128>(kBarrierSchedule + wg);
        else bar_sync_wg<2 * 128, kBarrierSchedule, kWarpgroups>(wg);
      };
      auto issue_end = [&] {
        const int next = wg + 1 == kWarpgroups ? 0 : wg + 1;
        if constexpr (kWarpgroups == 3) bar_arrive_id<2 * 128>(kBarrierSchedule + next);
        else bar_arrive_wg<2 * 128, kBarrierSchedule, kWarpgroups>(next);
      };
      using FragP = decltype(make_tensor<Element>(accumulator_as_a(FragS{}.layout())));
      FragP tOrP0 = make_tensor<Element>(accumulator_as_a(FragS{}.layout()));
      FragP tOrP1 = make_tensor<Element>(accumulator_as_a(FragS{}.layout()));
      float alpha[kRows];
      bool v_in_flight = false;   // an O += P V is issued and its V stage not yet released
      // kBiasMma: S += (c I) Bias, band by band of 16 query rows, wgmmas of QK^T's shape
      // issued after QK^T's own k-steps in one batch (no fence between them: the
      // accumulator chains as between k-steps).
      typename T::TiledMmaBias mma_bias;
      auto issue_bias_bands = [&](FragS& tSrS) {
        if constexpr (T::kBiasMma) {
          if (p.debug & 262144) return;   // (bit 262144: probe, no bias wgmmas)
          auto wg_b = mma_bias.get_thread_slice(0);
          Tensor sBt = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(
                                       smem_raw + T::kBiasOffset + wg * T::kBytesBias)),
                                   typename T::SmemLayoutBiasT{});
          Tensor tBsB = wg_b.partition_fragment_B(sBt);   // (MMA, 1, 4): the 4 bands
          mma_bias.accumulate_ = GMMA::ScaleOut::One;
          CUTLASS_PRAGMA_UNROLL
          for (int band = 0; band < 4; ++band) {
            // The window of the tall tile from row 48 - 16 band: c I in the band's rows.
            Tensor sI = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(
                                        smem_raw + T::kIdentityOffset) + (6 - 2 * band) * 128),
                                    typename T::SmemLayoutIdentityWindow{});
            Tensor tIsI = wg_b.partition_fragment_A(sI);   // (MMA, 1, 1)
            cute::gemm(mma_bias, tIsI(_, _, 0), tBsB(_, _, band), tSrS);
          }
        }
      };
      // Issue S = Q K^T of the tile (kBiasMma: + its bias), holding this warpgroup's turn at
      // the tensor cores.
      // full: the full-tile path (finish_scores), which loads no extras.
      auto issue_qk = [&](TileExtras& x, FragS& tSrS, auto full) {
        FWD_TRACE(0);
        if constexpr (!decltype(full)::value) load_extras(x);
        pipe_k.consumer_wait(read_k);
        if constexpr (T::kBiasMma) {
          Barrier::wait(&ss.bias_full[wg], bias_reads & 1);
          ++bias_reads;
        }
        FWD_TRACE(1);
        issue_begin();
        FWD_TRACE(2);
        if constexpr (T::kBiasMma)
          gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS, [&] { issue_bias_bands(tSrS); });
        else
          gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
        FWD_TRACE(3);
      };
      // S (and its bias wgmmas) complete: the K stage and the bias half are free.
      auto release_k = [&] {
        pipe_k.consumer_release(read_k);
        ++read_k;
        if constexpr (T::kBiasMma) cutlass::arch::ClusterBarrier::arrive(&ss.bias_empty[wg]);
      };
      auto release_v = [&] {
        pipe_v.consumer_release(read_v);
        ++read_v;
      };
      auto keep_p = [&](FragS const& tSrS, FragP& tOrP) {
        Tensor P = convert_type<Element>(tSrS);
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < size(P); ++e) tOrP(e) = P(e);
      };
      // S(t) done: its K stage released, invisible scores hidden, the online softmax, P(t)
      // into p_next.
      auto scores_to_p = [&](FragS& tSrS, TileExtras& x, FragP& p_next, auto full) __attribute__((always_inline)) {
        warpgroup_fence_operand(tSrS);
        FWD_TRACE(5);
        release_k();
        finish_scores(tSrS, x, full);
        softmax(tSrS, alpha);
        FWD_TRACE(6);
        keep_p(tSrS, p_next);
        FWD_TRACE(7);
        FWD_TRACE_NEXT();
      };
      // x: the current tile's, before load_extras (full tiles load none).
      auto init_extras = [&](TileExtras& x, auto full) __attribute__((always_inline)) {
        constexpr bool kFull = decltype(full)::value;
        x.n = n;
        x.partial = kFull ? false : partial;
        if constexpr (kFull) x.staged = x.by_key = x.all_interval = false;
      };
      // Tile t >= 1. In flight on entry: O += P(t-2) V(t-2) (t >= 2), which read p_next.
      // full: std::true_type where the tile is neither partial nor past Lk (full_tile).
      auto step = [&](FragP& p_prev, FragP& p_next, auto full) __attribute__((always_inline)) {
        TileExtras x;
        init_extras(x, full);
        FragS tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        if (v_in_flight) release_v();
        // O (which holds P(t-2) V(t-2)) takes alpha(t-1) here, outside the turn.
        rescale_o(alpha);
        issue_qk(x, tSrS, full);
        pipe_v.consumer_wait(read_v);
        gemm<false, -1>(mma_pv, p_prev, tOrV(_, _, _, read_v.index()), tOrO);
        v_in_flight = true;
        issue_end();
        FWD_TRACE(4);
        warpgroup_wait<1>();
        scores_to_p(tSrS, x, p_next, full);
      };
      // The last tile's O += P V, from the buffer that holds its P.
      auto finish = [&](FragP& p_last) __attribute__((always_inline)) {
        release_q();
        FWD_TRACE_CALIBRATE(k == (p.debug >> 16) && tid == 0, 1);
        FWD_TRACE_EDGE(wg < 2 ? wg : 3, k, int(p.debug >> 16), wg_tid == 0, 1, fwd_trace_clock());
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        FWD_TRACE_EDGE(wg < 2 ? wg : 3, k, int(p.debug >> 16), wg_tid == 0, 2, fwd_trace_clock());
        if (v_in_flight) release_v();
        rescale_o(alpha);
        pipe_v.consumer_wait(read_v);
        issue_begin();
        gemm<false, -1>(mma_pv, p_last, tOrV(_, _, _, read_v.index()), tOrO);
        issue_end();
        FWD_TRACE_EDGE(wg < 2 ? wg : 3, k, int(p.debug >> 16), wg_tid == 0, 3, fwd_trace_clock());
        // Warpgroup 0 takes the last turn that the last warpgroup handed it, so that every
        // arrival at a scheduler barrier is matched when the CTA exits.
        if (wg == 0) issue_begin();
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        FWD_TRACE_EDGE(wg < 2 ? wg : 3, k, int(p.debug >> 16), wg_tid == 0, 4, fwd_trace_clock());
        release_v();
      };
      if (next_tile(n, partial)) {
        if (wg == kWarpgroups - 1) issue_end();   // warpgroup 0's first turn
        {
          TileExtras x;
          x.n = n;
          x.partial = partial;
          FragS tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
          issue_qk(x, tSrS, std::false_type{});
          issue_end();
          FWD_TRACE(4);
          warpgroup_wait<0>();
          scores_to_p(tSrS, x, tOrP0, std::false_type{});
        }
        // Tiles after the first: the full-tile path where the tile allows it (perf-notes
        // C60: it drops the per-tile flag tests and the extras' branches from the consumer
        // warps' path). FLEXSPARSE_CUDA_DEBUG bit 16777216: every tile on the general
        // path (A/Bs).
        const int full_tiles_end = (p.debug & 16777216) ? 0 : p.Lk / kBlockN;
        // run_step(full) with full = std::true_type on the full-tile path, else false_type.
        auto either_path = [&](auto&& run_step) __attribute__((always_inline)) {
          if (!partial && n < full_tiles_end) run_step(std::true_type{});
          else run_step(std::false_type{});
        };
        if constexpr (kWarpgroups == 3) {
          // One P buffer (at 160 registers two P buffers made ptxas serialise every wgmma,
          // C7512): P(t) is written after the wait for O += P(t-1) V(t-1), which follows
          // the softmax of tile t (FlashAttention-3's order).
          auto step_one_buffer = [&](auto full) __attribute__((always_inline)) {
            TileExtras x;
            init_extras(x, full);
            FragS tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
            rescale_o(alpha);   // O holds P(t-2) V(t-2), complete
            issue_qk(x, tSrS, full);
            pipe_v.consumer_wait(read_v);
            gemm<false, -1>(mma_pv, tOrP0, tOrV(_, _, _, read_v.index()), tOrO);
            issue_end();
            FWD_TRACE(4);
            warpgroup_wait<1>();
            warpgroup_fence_operand(tSrS);
            FWD_TRACE(5);
            release_k();
            finish_scores(tSrS, x, full);
            softmax(tSrS, alpha);
            FWD_TRACE(6);
            warpgroup_wait<0>();   // (so event 7 holds the wait for P V as well)
            warpgroup_fence_operand(tOrO);
            release_v();
            keep_p(tSrS, tOrP0);
            FWD_TRACE(7);
            FWD_TRACE_NEXT();
          };
          while (next_tile(n, partial)) either_path(step_one_buffer);
          finish(tOrP0);
        } else {
          while (true) {
            if (!next_tile(n, partial)) { finish(tOrP0); break; }
            either_path([&](auto full) __attribute__((always_inline)) { step(tOrP0, tOrP1, full); });
            if (!next_tile(n, partial)) { finish(tOrP1); break; }
            either_path([&](auto full) __attribute__((always_inline)) { step(tOrP1, tOrP0, full); });
          }
        }
      } else {
        release_q();
      }
    }

    // ------------------------------------------------------------------ epilogue
    // kBiasMma: a work tile with NaN scores goes to the redo queue, once (its out and lse
    // are written below all the same, and overwritten by the redo pass). (A kBiasMma
    // launch is never the redo pass, so n_work counts all the work tiles here.)
    if constexpr (T::kBiasMma) {
      if (__any_sync(0xffffffffu, nan_scores) && tid % 32 == 0 && p.redo != nullptr) {
        const unsigned bit = 1u << (w % 32);
        if (!(atomicOr(reinterpret_cast<unsigned*>(p.redo + 1) + w / 32, bit) & bit))
          p.redo[1 + redo_words(n_work) + atomicAdd(p.redo, 1)] = w;
      }
    }
    // O / l and the lse per row (rows past Lq are never written), then O to memory.
    float* lse = p.lse + ((int64_t)b * p.Hq + h) * p.Lq;
    Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float l = quad_sum(row_sum[r]);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(O); ++c) O(r, c) *= inv;
      const int i = i0 + row_base + 8 * r;
      if (tid % 4 == 0 && i < p.Lq)
        lse[i] = row_lse(row_max[r], l);
    }
    FWD_TRACE_EDGE(wg < 2 ? wg : 3, k, int(p.debug >> 16), wg_tid == 0, 5, fwd_trace_clock());
    // Probe (FLEXSPARSE_CUDA_DEBUG bit 8796093022208, wrong results): no O store, so that
    // the epilogue's share of a work tile shows (perf-notes, issue 15).
    if (p.debug_high & 4096) {
    } else if constexpr (T::kTmaStore) {
      Tensor rO = convert_type<Element>(tOrO);
      Tensor sO = make_tensor(make_smem_ptr(ss.o.data() + wg * cosize_v<typename T::SmemLayoutO>),
                              typename T::SmemLayoutO{});
      typename T::SmemCopyO smem_copy_o;
      auto thr_copy_o = smem_copy_o.get_thread_slice(wg_tid);
      const bool store_leader = wg_tid == 0;
      if (store_leader) tma_store_wait<0>();   // the last work tile's store has read sO
      bar_sync_wg<128, kBarrierEpilogue, kWarpgroups>(wg);
      copy(smem_copy_o, thr_copy_o.retile_S(rO), thr_copy_o.partition_D(sO));
      cutlass::arch::fence_view_async_shared();
      bar_sync_wg<128, kBarrierEpilogue, kWarpgroups>(wg);
      if (store_leader) {
        Tensor mO = kp.tma_o.get_tma_tensor(make_shape(p.Lq, p.D, p.Hq, p.B));
        Tensor gO = local_tile(mO(_, _, h, b), Shape<_64, Int<kHeadDim>>{},
                               make_coord(m_block * kWarpgroups + wg, 0));
        auto cta_o = kp.tma_o.get_slice(0);
        copy(kp.tma_o, cta_o.partition_S(sO), cta_o.partition_D(gO));
        tma_store_arrive();
      }
    } else if constexpr (T::kQBuffers == 2) {
      rows_out16(b, h, i0);
    } else {
      Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
      Tensor tOcO = thr_pv.partition_C(cO);
      Tensor ocoord = make_tensor(tOcO.data(), rowcol(tOcO.layout()));
      Element* out = static_cast<Element*>(p.out) + ((int64_t)b * p.Hq + h) * p.Lq * kHeadDim;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int i = i0 + get<0>(ocoord(r, 0));
        if (i < p.Lq) {
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < size<1>(O); c += 2) {
            const int d = get<1>(ocoord(r, c));
            // Columns c, c + 1 of the accumulator are adjacent head-dim entries.
            auto pair = cutlass::NumericArrayConverter<Element, float, 2>()(
                cutlass::Array<float, 2>{{O(r, c), O(r, c + 1)}});
            *reinterpret_cast<cutlass::Array<Element, 2>*>(out + (int64_t)i * kHeadDim + d) = pair;
          }
        }
      }
    }
    FWD_TRACE_EDGE(wg < 2 ? wg : 3, k, int(p.debug >> 16), wg_tid == 0, 6, fwd_trace_clock());
    }   // work tiles
    if constexpr (T::kTmaStore) {
      if (wg_tid == 0) tma_store_wait<0>();   // shared memory outlives the last store
    }
  }

#endif
}

template <class T>
void launch_fwd(AttentionParams const& p, cudaStream_t stream) {
  using Element = typename T::Element;
  auto gmem = [&](const void* ptr, int L, int H, int64_t sl, int64_t sh, int64_t sb) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                       make_shape(L, p.D, H, p.B), make_stride(sl, _1{}, sh, sb));
  };
  typename T::KernelParams kp{
      p,
      make_tma_copy(SM90_TMA_LOAD{}, gmem(p.q, p.Lq, p.Hq, p.q_sm, p.q_sh, p.q_sb),
                    typename T::SmemLayoutQ{}, Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gmem(p.k, p.Lk, p.Hkv, p.k_sn, p.k_sh, p.k_sb),
                    take<0, 2>(typename T::SmemLayoutKV{}),
                    Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gmem(p.v, p.Lk, p.Hkv, p.v_sn, p.v_sh, p.v_sb),
                    take<0, 2>(typename T::SmemLayoutKV{}),
                    Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}, _1{}),
      {}, {}};
  if constexpr (T::kBiasTiles) {
    kp.tma_bias = make_bias_tma<Element>(p, typename T::SmemLayoutBias{},
                                         Shape<_64, Int<T::kBlockN>>{}, kp.bias_heads,
                                         kp.bias_batches);
  }
  if constexpr (T::kTmaStore) {
    kp.tma_o = make_tma_copy(
        SM90_TMA_STORE{},
        make_tensor(make_gmem_ptr(static_cast<Element*>(p.out)), make_shape(p.Lq, p.D, p.Hq, p.B),
                    make_stride((int64_t)p.D, _1{}, (int64_t)p.Lq * p.D, (int64_t)p.Hq * p.Lq * p.D)),
        typename T::SmemLayoutO{}, Shape<_64, Int<T::kHeadDim>>{}, _1{});
  }
  auto kernel = fwd_kernel<T>;
  static_assert(T::kSmemBytes <= 227 * 1024, "shared memory of one CTA per SM");
  const int smem = T::kSmemBytes;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // Persistent: one CTA per SM (the shared memory allows no more), each looping over work
  // tiles; FLEXSPARSE_CUDA_DEBUG bit 64 launches one CTA per work tile instead (A/Bs).
  // Work tiles past the grid come from p.tile_counter (zeroed by the caller) or, without
  // it, in a static round-robin.
  const int n_work = fwd_work_tiles(p, T::kBlockM);
  // (The redo pass's work tiles are known on the device only: a full persistent grid.)
  const int ctas = (p.debug & 64) && !p.redo_pass ? n_work : std::min(n_work, sm_count());
#ifdef FLEXSPARSE_FWD_TRACE
  trace_clear(fwd_trace_mem, kTraceWords * sizeof(uint32_t), stream);
#endif
  kernel<<<dim3(std::max(ctas, 1)), T::kThreads, smem, stream>>>(kp);
  CUDA_CHECK(cudaGetLastError());
#ifdef FLEXSPARSE_FWD_TRACE
  trace_fetch(fwd_trace_mem, fwd_trace_host(), kTraceWords * sizeof(uint32_t), stream);
#endif
}

// The calls FwdTraits::kBiasTiles kernels take: a bias TMA can read by tiles, no softcap
// (as the backward's bias_tiles_call).
inline bool fwd_bias_tiles_ok(AttentionParams const& p) { return bias_tma_readable(p) && p.softcap == 0.f; }

// The calls FwdTraits::kBiasMma kernels take: 1 / scale is within 2^-12 of a 16-bit value
// (its identity tile's). True for the default scales of head dims 64 and 256 (exact) and
// 128 (bf16: 1.1e-4 off).
template <class Element>
inline bool fwd_bias_mma_ok(AttentionParams const& p) {
  const float c = 1.f / p.scale;
  return std::isfinite(c) && c > 0.f && std::fabs(float(Element(c)) - c) <= c * (1.f / 4096);
}

// The overlapped schedule where asked for and applicable (no bias, or a bias by tiles),
// else the serial one; overlapped, the plain kernel where the call allows. The TMA-store
// epilogue's staging buffer fits beside the pipeline up to head dim 128 (the bias tiles
// take its place).
// kWideRegs > 0: the plain overlapped kernel has a three-warpgroup build at that many
// consumer registers, taken where the descriptor's query blocks hold whole 192-row work
// tiles (block_q a multiple of 192, e.g. 384) or its kv lists are one row for all (the
// full mask) unless
// FLEXSPARSE_CUDA_DEBUG bit 134217728 asks for the two-warpgroup one (A/Bs).
template <class Element, int kHeadDim, int kBlockN, int kStages, int kOverlapRegs = 232, int kWideRegs = 0>
void launch_fwd_schedule(AttentionParams const& p, cudaStream_t stream, bool overlap) {
  constexpr bool kTma = kHeadDim <= 128;
  // The plain overlapped kernel where the call has no dense mask, no bitmaps and staged
  // column ranges; FLEXSPARSE_CUDA_DEBUG bit 1024: the general one (A/Bs).
  const PredicateParams& pr = p.pred;
  const bool plain = pr.dense == nullptr && pr.bits_index == nullptr &&
                     pr.n_col_ranges <= FwdTraits<Element, kHeadDim, kBlockN, kStages>::kMaxStagedRanges &&
                     !(p.debug & (4 | 1024));
  if constexpr (kWideRegs > 0) {
    // A 192-row tile straddles 128-row descriptor rows unless they all read one row.
    const bool tiles_fit = p.block_q % 192 == 0 || (p.kv_partial.row_stride == 0 && p.kv_full.row_stride == 0);
    if (overlap && p.bias == nullptr && plain && tiles_fit && !(p.debug & 134217728)) {
      launch_fwd<FwdTraits<Element, kHeadDim, kBlockN, kStages, true, kWideRegs, kTma, true, false, 3>>(p, stream);
      return;
    }
  }
  if (overlap && p.bias == nullptr && plain) {
    if constexpr (kHeadDim <= 128) {
      // Two query buffers (kQBuffers) by default at hd64, where a work tile is few key
      // tiles and its edge costs most (H200: +1% causal, +5% sliding 1024, +9% sliding
      // 256, +3% documents; docs/perf-notes.md C90, C92), FLEXSPARSE_CUDA_DEBUG bit
      // 281474976710656 the one-buffer kernel instead (A/Bs); at hd128 opt-in, bit
      // 17592186044416 (-1% full, causal and documents, +1% sliding 1024).
      const bool two_query_buffers =
          kHeadDim == 64 ? !(p.debug_high & 131072) : bool(p.debug_high & 8192);
      // At hd64 the two-buffer kernel stores O through the staging buffer and TMA (it fits
      // beside both query buffers there, ~164 KB; at hd128 the second query buffer takes its
      // place and the epilogue stores from registers): H200 +1-2% sliding, causal and
      // documents, +2% sliding 256 (docs/perf-notes.md C111). FLEXSPARSE_CUDA_DEBUG bit
      // 2^50 (bf16): the register-store epilogue instead (A/Bs).
      // Calls with a window (sliding_window's descriptors), bf16: the band kernels (H200:
      // +4-20% on windows of 64-4096 keys; docs/perf-notes.md C113); FLEXSPARSE_CUDA_DEBUG
      // bit 2^52: the staged column ranges instead (A/Bs).
      constexpr bool kBf16 = std::is_same_v<Element, cutlass::bfloat16_t>;
      const bool band = kBf16 && p.pred.window != nullptr && !(p.debug_high & (1 << 21));
      if (two_query_buffers) {
        constexpr bool kTmaStoreBuilt = kHeadDim == 64;
        constexpr bool kRegisterStoreBuilt = kHeadDim != 64 || kBf16;
        if constexpr (kTmaStoreBuilt && kBf16) {
          if (band) {
            launch_fwd<FwdTraits<Element, kHeadDim, kBlockN, kStages, true, kOverlapRegs, true, true, false, 2, 2,
                                 true>>(p, stream);
            return;
          }
        }
        if constexpr (kTmaStoreBuilt) {
          if (!kRegisterStoreBuilt || !(p.debug_high & (1 << 19))) {
            launch_fwd<FwdTraits<Element, kHeadDim, kBlockN, kStages, true, kOverlapRegs, true, true, false, 2, 2>>(
                p, stream);
            return;
          }
        }
        if constexpr (kRegisterStoreBuilt)
          launch_fwd<FwdTraits<Element, kHeadDim, kBlockN, kStages, true, kOverlapRegs, false, true, false, 2, 2>>(
              p, stream);
        return;
      }
      if constexpr (kHeadDim == 128 && kBf16) {
        if (band) {
          launch_fwd<FwdTraits<Element, kHeadDim, kBlockN, kStages, true, kOverlapRegs, kTma, true, false, 2, 1,
                               true>>(p, stream);
          return;
        }
      }
    }
    launch_fwd<FwdTraits<Element, kHeadDim, kBlockN, kStages, true, kOverlapRegs, kTma, true>>(p, stream);
    return;
  }
  if (overlap && p.bias == nullptr) {
    launch_fwd<FwdTraits<Element, kHeadDim, kBlockN, kStages, true, kOverlapRegs, kTma>>(p, stream);
    return;
  }
  if constexpr (kHeadDim <= 128) {
    // Bias tiles where the bias allows them, overlapped unless FLEXSPARSE_CUDA_DEBUG bit 32
    // asks for the serial schedule (docs/perf-notes.md C51: hd64 192 -> 261 TFLOP/s over
    // the serial one, hd128 even); bit 65536: the per-score loads instead (A/Bs; in
    // -DFLEXSPARSE_FWD_TRACE builds the bits from 16 up pick the traced work tile instead).
    using Serial = FwdTraits<Element, kHeadDim, kBlockN, kStages, false, 232, false, false, true>;
    if (fwd_bias_tiles_ok(p) && !(p.debug & 65536)) {
      if (overlap && p.redo != nullptr && fwd_bias_mma_ok<Element>(p)) {
        // The bias on the tensor cores (kBiasMma), then the serial kernel over the work
        // tiles it queued (infinite bias entries), as a second launch that ends at once
        // where none were. FLEXSPARSE_CUDA_DEBUG bit 131072: no second launch (A/Bs).
        // The plain build of it where the call allows (bit 1024: the general one): 48 B of
        // spills at hd128 against 232, and 0-10% faster (docs/perf-notes.md C54).
        if (plain)
          launch_fwd<FwdTraits<Element, kHeadDim, kBlockN, kStages, true, kOverlapRegs, false, true, true>>(p, stream);
        else
          launch_fwd<FwdTraits<Element, kHeadDim, kBlockN, kStages, true, kOverlapRegs, false, false, true>>(p, stream);
        if (!(p.debug & 131072)) {
          AttentionParams redo = p;
          redo.redo_pass = true;
          redo.tile_counter = nullptr;
          launch_fwd<Serial>(redo, stream);
        }
      } else {
        launch_fwd<Serial>(p, stream);
      }
      return;
    }
  }
  launch_fwd<FwdTraits<Element, kHeadDim, kBlockN, kStages, false, 232, kTma>>(p, stream);
}

// One head dim's forward kernels, for one element type (fwd_sm90_hd*.cu: a file per head dim
// and type, so that the build runs them in parallel). The overlapped schedule
// (docs/perf-notes.md, C14) unless FLEXSPARSE_CUDA_DEBUG bit 32 asks for the serial one
// (same-run A/Bs).
// - hd64: 240 registers per consumer thread (at 232 the overlapped loop spilled 8 B; same
//   speed, C15); three consumer warpgroups at 160 where the descriptor allows (C65).
// - hd128: 240 registers (as FlashAttention-4's Hopper forward): 2-4% over 232 in the
//   same run (C23).
// - hd256: 64-key tiles, 240 registers, the plain kernel where the call allows: 2-5% over
//   the serial schedule in the same run (C38; at 232 registers, before the plain kernel, it
//   spilled 84 B and measured 3% slower, C14).
// DType::kFloat16 in CI's compile-check build (FLEXSPARSE_COMPILE_CHECK_BF16_ONLY) launches
// nothing: its fp16 kernels would be the bf16 file's again (sm90_utils.cuh), and that build
// refuses fp16 inputs before any kernel (attention_ops.cpp).
template <DType kDType, int kHeadDim>
void launch_fwd_head_dim(AttentionParams const& p, cudaStream_t stream) {
  using Element = std::conditional_t<kDType == DType::kBFloat16, cutlass::bfloat16_t, Fp16Element>;
#ifdef FLEXSPARSE_COMPILE_CHECK_BF16_ONLY
  if constexpr (kDType == DType::kFloat16)
    throw std::logic_error("flexsparse: the compile-check build has no fp16 kernels");
  else
#endif
  {
    const bool overlap = !(p.debug & 32);
    if constexpr (kHeadDim == 64)
      launch_fwd_schedule<Element, 64, 128, 3, 240, 160>(p, stream, overlap);
    else if constexpr (kHeadDim == 128)
      launch_fwd_schedule<Element, 128, 128, 2, 240>(p, stream, overlap);
    else
      launch_fwd_schedule<Element, 256, 64, 2, 240>(p, stream, overlap);
  }
}

}  // namespace flexsparse::sm90
