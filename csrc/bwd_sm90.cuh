// Backward attention over a block descriptor on Hopper (sm_90a).
//
// One CTA owns a 128-key tile (64 at head dim 256) of one (batch, kv head) and walks, for
// every query head of its group, the query blocks the descriptor lists for its key block
// (q lists: partial first, then full), kBlockM query rows at a time (64; 128 at head dim
// 64, as FlashAttention-3/4 do, where the descriptor's query blocks allow it). Three
// warpgroups:
//   warpgroup 0: the producer (one thread: TMA loads of the key and value tile once, then
//     of the query and dO tiles of every step through two pipelines, with a record of
//     which step each stage holds, so that the consumers walk no lists) and the dQ writer
//     (warp 1: adds each step's dQ from shared memory to a float32 accumulator in global
//     memory with bulk asynchronous reductions, cp.reduce.async.bulk, per half, and
//     takes the deterministic turns), as FlashAttention-3/4 do;
//   warpgroups 1, 2 (consumers, 64 keys each), per step:
//     S^T = K Q^T and dP^T = V dO^T (wgmma from shared memory),
//     P^T = exp2(S^T - lse) while dP^T still computes, then dS^T = P^T (dP^T - delta),
//     with the element predicates of partial tiles,
//     dV += P^T dO and dK += dS^T Q (P^T, dS^T as register operands),
//     dS^T to shared memory (stmatrix), then dQ = dS K (each warpgroup half of the head
//     dim, or at 128-row steps half of the rows), staged in shared memory for the dQ
//     writer.
// dK and dV stay in registers until the CTA is done and are written once. A preprocess
// kernel computes delta = rowsum(dO * O) - grad_lse and lse in the log2 domain and zeroes
// the dQ accumulator; a postprocess kernel scales it into dq.
// Scores are transposed (keys are the wgmma M dimension) so that P^T and dS^T are
// already the A operands of the dV and dK products: FlashAttention-2/3's layout.
// Head dim 256 (kSplitQueries): dK and dV of 128 keys would not fit the registers, nor K
// and V of 128 keys the shared memory, so a CTA owns 64 keys; the consumer warpgroups take
// half of the step's queries each for S^T and dP^T and half of the head dim each for dK,
// dV and dQ, so P^T and dS^T go through shared memory (FlashAttention-3/4's hd256 layout),
// with a single query and dO stage.
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

namespace flexsparse::sm90 {

// Timeline probe, compiled in only with -DFLEXSPARSE_BWD_TRACE (tests/gpu.sh btrace, which
// builds a separate copy): the first thread of each consumer warpgroup stamps the SM clock
// at fixed points of each of its first kBwdTraceSteps query steps, in the CTAs of key tiles
// 0, 1 and gridDim.x / 2 of (kv head 0, batch 0), into a global buffer that the host
// copies out after the launch (the op flexsparse::bwd_trace returns it to
// tests/gpu/bwd_trace.py; no printf in the kernel: a function call there makes ptxas
// serialize every wgmma, C7510, as the printing probe did until 2026-11-29). Row
// kBwdTraceSteps, warpgroup 0 of a CTA's slot: the clock and global timer (ns) at the
// consumers' first and last step (events 0-3) and the CTA's index (event 4). Events per
// step: 0 query stage ready, 1 S^T issued, 2 dO stage ready and dP^T issued, 3 S^T done,
// 4 P^T computed, 5 dP^T done, 6 dS^T computed, dV issued and dS^T stored, 7 both
// warpgroups' dS^T stored (barrier), 8 dQ issued and dV done, 9 dK issued and dQ done,
// 10 dQ handed to the writer, 11 dK done. The stamps cost registers (spills): compare the
// trace build's time with the plain build's before reading durations.
// BWD_LIFE: per key tile (up to kBwdLifeCtas, by linear tile index: the CTA's, or in the
// persistent kernel each tile it takes), one word per event of its life: 0 the SM's index
// + 1, then that SM's clock at 1 the kernel's entry (persistent: the consumers' read of
// the tile), 2 K and V in shared memory (the consumers' wait), 3 the consumers' last step
// done, 4 the epilogue's TMA stores read, 5 the dQ writer's last reduction read, 6 the
// producer's last load issued (both persistent: a CTA's last tile only); 7 the consumers'
// step count in the tile. Consecutive tiles of one SM then give the gap between one's end
// and the next one's entry (tests/gpu/bwd_trace.py, "CTA life").
#ifdef FLEXSPARSE_BWD_TRACE
using flexsparse::kBwdTraceCtas;
using flexsparse::kBwdTraceSteps;
using flexsparse::kBwdTraceEvents;
static __device__ uint32_t bwd_trace_buf[kBwdTraceCtas][kBwdTraceSteps + 1][2][kBwdTraceEvents];
__device__ __forceinline__ int bwd_trace_cta() {
  if (blockIdx.y != 0 || blockIdx.z != 0) return -1;
  return blockIdx.x < 2 ? blockIdx.x : blockIdx.x == gridDim.x / 2 ? 2 : -1;
}
static __device__ uint32_t bwd_life_buf[flexsparse::kBwdLifeCtas][flexsparse::kBwdLifeEvents];
__device__ __forceinline__ uint32_t bwd_clock() {
  uint32_t c;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(c));
  return c;
}
__device__ __forceinline__ void bwd_life(int tile, int e, uint32_t value) {
  if (tile >= 0 && tile < flexsparse::kBwdLifeCtas) bwd_life_buf[tile][e] = value;
}
__device__ __forceinline__ void bwd_trace_stamp(uint32_t* at) {
  asm volatile("{\n .reg .u32 c;\n mov.u32 c, %%clock;\n st.global.u32 [%0], c;\n}" ::"l"(at) : "memory");
}
#define BWD_TRACE(e) \
  if (trace_cta >= 0 && tid % 128 == 0 && step < kBwdTraceSteps) bwd_trace_stamp(&bwd_trace_buf[trace_cta][step][wg][e])
#define BWD_TRACE_CALIBRATE(i)                                                                 \
  if (trace_cta >= 0 && tid == 0) {                                                             \
    uint32_t c, g;                                                                              \
    asm volatile("mov.u32 %0, %%clock;\n mov.u32 %1, %%globaltimer_lo;" : "=r"(c), "=r"(g)); \
    bwd_trace_buf[trace_cta][kBwdTraceSteps][0][2 * (i)] = c;                                   \
    bwd_trace_buf[trace_cta][kBwdTraceSteps][0][2 * (i) + 1] = g;                               \
    bwd_trace_buf[trace_cta][kBwdTraceSteps][0][4] = blockIdx.x;                                \
  }
// (the key tile's linear index: the CTA's in one CTA per tile, the tile's in the persistent
// kernel, whose records then are per tile)
#define BWD_LIFE(e, value) bwd_life(n_block + n_kb * (hk + p.Hkv * b), e, value)
#else
#define BWD_TRACE(e) \
  do {               \
  } while (0)
#define BWD_LIFE(e, value) \
  do {                     \
  } while (0)
#define BWD_TRACE_CALIBRATE(i) \
  do {                         \
  } while (0)
#endif

// The persistent backward's (C118) barriers and tile ring, past a kernel's shared storage
// (bwd_kernel, kPersistent).
struct BwdTileSlots {
  uint64_t tile_full[2], tile_empty[2], kv_empty;
  int tile[2];
};

// kBlockM_: query rows per step, 64, 80 or 128. At head dim 64 a 64-row step is half the
// tensor-core work of a 128-row one for the same per-step cost (barriers, lse and delta,
// the dQ hand-off), so head dim 64 takes 128 where the descriptor's query blocks are
// multiples of 128, as FlashAttention-3/4 do. The accumulators (S^T, dP^T: 64 + 64, dK,
// dV: 32 + 32 registers per thread) fit only in the plain kernel: with the general one's
// pointers and flags live as well, ptxas spilled ~55 words per step (928 B).
// 80 (head dim 128, plain, FlashAttention-3/4's step where no mask is given; the full
// mask's kernel since C109, 3% faster than 64-row steps with C105 and C106): 25% more
// tensor work per step than 64 for the same per-step cost, with S^T and dP^T at 40 + 40
// registers beside dK and dV at 64 + 64 (128 rows would need 64 + 64). 80-row steps do
// not tile 128-row query blocks, so this kernel walks every query row in 80-row steps
// (kRowSteps): bwd_sm90 takes it only where every block list is one row for all (stride
// 0, the full mask), so the block state is one value and the q list holds every query
// block or none. dQ = dS K has 80 rows, no multiple of wgmma's 64, so it is computed
// transposed, dQ^T = K^T dS^T (each warpgroup half of the head dim as M, the 80 queries
// as N; kDqSwapAB), from dS in the keys-contiguous layout. Its shared memory (~226 KB)
// leaves no room for staged column ranges, so it takes calls without them.
// kPlain_: the kernel for calls without bias, dbias, softcap, dense mask or bitmaps, and
// with at most kMaxStagedRanges column ranges per key (bwd_sm90 picks it): the code and
// the live registers of those features are compiled out.
// kBiasTiles_: the kernel for a bias that TMA can read (keys contiguous, 16-byte aligned
// rows; bwd_sm90 checks): each step's (64 queries, 128 keys) bias tile comes through
// shared memory, and dbias goes out of the same buffer by TMA store, in place of the
// general kernel's per-score loads and stores (docs/perf-notes.md C47).
template <class Element_, int kHeadDim_, int kStages_, int kBlockM_ = 64, bool kPlain_ = false,
          bool kBiasTiles_ = false>
struct BwdTraits {
  using Element = Element_;
  static constexpr bool kPlain = kPlain_;
  static constexpr bool kBiasTiles = kBiasTiles_;
  static_assert(!kBiasTiles || (!kPlain && kHeadDim_ != 256 && kBlockM_ == 64),
                "bias tiles: the general kernel at head dims 64 and 128, 64-row steps");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;     // query rows per step
  static_assert(kBlockM == 64 || (kBlockM == 128 && kPlain_) || (kBlockM == 80 && kPlain_ && kHeadDim_ == 128),
                "query steps of 64 rows, or 128 / 80 (head dim 128) in the plain kernel (whose registers fit them)");
  // Steps over all of the query rows instead of the listed blocks; dQ transposed (above).
  static constexpr bool kRowSteps = kBlockM == 80;
  static constexpr bool kDqSwapAB = kBlockM == 80;
  // Whether the kernel stages column ranges (the 80-row kernel has no shared memory left).
  static constexpr bool kColRanges = !kRowSteps;
  // Head dim 256: 64 keys per CTA, the warpgroups split queries and head dim (see above).
  static constexpr bool kSplitQueries = kHeadDim == 256;
  static_assert(!kSplitQueries || kBlockM == 64, "head dim 256 takes 64-row query steps");
  static constexpr int kBlockN = kSplitQueries ? 64 : 128;    // keys per CTA
  static constexpr int kStages = kStages_;
  // The dS^T double buffer follows the stage index's parity, or a step counter's with one
  // stage.
  static_assert(kStages % 2 == 0 || (kSplitQueries && kStages == 1), "stages: even, or 1 at head dim 256");
  static constexpr int kMmaThreads = 256;
  static constexpr int kThreads = kMmaThreads + 128;
  // 64-row steps over 128 keys with dS^T stored queries contiguous (no bias tiles): the
  // layout whose stmatrix addresses ds_store_offset gives (below).
  static constexpr bool kDsStoreByHand = kBlockM == 64 && !kSplitQueries && !kBiasTiles;
  // 80-row steps: dS^T stored keys contiguous (stmatrix.trans) at addresses computed by hand
  // as well (ds_store_offset_keys_contiguous; docs/perf-notes.md C105). The bias-tile
  // kernels, the same layout at 64 rows, keep CuTe's stores until a GPU test has run on it.
  static constexpr bool kDsStoreTransByHand = kBlockM == 80;
  // The per-step order of the bf16 kernels whose warpgroups keep P^T and dS^T in registers
  // (not head dim 256's) and that have no bias tiles, measured kernel by kernel (same-run
  // A/Bs, docs/perf-notes.md C109): dS^T stored before the dV product is issued (kDsFirst,
  // C106) in all of them; the exponentials interleaved with dS (kDsInterleaved, C107) in
  // head dim 128's 64-row kernel only. (fp16 kernels keep the older order: one
  // instantiation each, for the build's time.)
  static constexpr bool kOrderVariants =
      std::is_same_v<Element, cutlass::bfloat16_t> && !kSplitQueries && !kBiasTiles;
  static constexpr bool kDsFirst = kOrderVariants;
  static constexpr bool kDsInterleaved = kOrderVariants && kHeadDim == 128 && kBlockM == 64;
  // The first lse pair read before the S^T wait and the first delta pair before the dP^T
  // wait (kStatsEarly = 1), so that the first exponential and the first dS do not wait on
  // a shared-memory load: in the 80-row kernel only (C110: +1-2% there, -1 to -3% in the
  // 64-row one, whose local loads and stores it adds to).
  static constexpr int kStatsEarly = kOrderVariants && kBlockM == 80 ? 1 : 0;
  // Column ranges per key staged in shared memory once per head; masks with more are read
  // from global memory per partial tile.
  static constexpr int kMaxStagedRanges = kBwdMaxStagedRanges;
  // The dQ writer adds each warpgroup half of a step's dQ to the accumulator in this many
  // bulk reductions: at head dim 256 (64 KB of dQ per step, twice hd128's per unit of work)
  // one 32 KB reduction per half kept the consumers waiting for the staging buffer; eight
  // smaller ones in flight together drain it faster (docs/perf-notes.md C37).
  static constexpr int kDqReducePieces = kSplitQueries ? 8 : 1;

  using Wg2x1 = Layout<Shape<_2, _1, _1>>;
  using Wg1x2 = Layout<Shape<_1, _2, _1>>;
  // S^T, dP^T: (keys, queries) over the head dim; split queries: a warpgroup's half.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<_64, Int<kSplitQueries ? kBlockM / 2 : kBlockM>, Int<kHeadDim>>>(),
      conditional_t<kSplitQueries, Wg1x2, Wg2x1>{}));
  // dV, dK: (keys, head dim) over the queries, A from registers; split queries: A (P^T,
  // dS^T) from shared memory, each warpgroup half of the head dim.
  using TiledMmadKV = conditional_t<kSplitQueries,
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim / 2>, Int<kBlockM>>,
                               GMMA::Major::K, GMMA::Major::MN>(),
          Wg1x2{})),
      decltype(make_tiled_mma(
          GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>,
                               GMMA::Major::K, GMMA::Major::MN>(),
          Wg2x1{}))>;
  // dQ: (queries, head dim) over the keys. 64-row steps: each warpgroup takes half of the
  // head dim. 128-row steps (head dim 64): each warpgroup takes 64 of the rows and the
  // whole head dim, one 64x64 wgmma per k-block instead of two 64x32 ones (FA3/FA4's
  // hd64 split; docs/perf-notes.md C44). 80-row steps: dQ^T = K^T dS^T, (head dim,
  // queries), each warpgroup half of the head dim (A = K^T, head dim contiguous; B = dS,
  // keys contiguous).
  static constexpr bool kDqSplitRows = kBlockM == 128;
  // dS in shared memory with keys contiguous (else queries)
  static constexpr bool kDsKeysContiguous = kBiasTiles || kDqSwapAB;
  using TiledMmadQ = conditional_t<kDqSwapAB,
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kBlockN>>,
                               GMMA::Major::MN, GMMA::Major::K>(),
          Wg2x1{})),
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, float,
                               Shape<_64, Int<kDqSplitRows ? kHeadDim : kHeadDim / 2>, Int<kBlockN>>,
                               kBiasTiles ? GMMA::Major::K : GMMA::Major::MN, GMMA::Major::MN>(),
          conditional_t<kDqSplitRows, Wg2x1, Wg1x2>{}))>;
  static_assert(!kRowSteps || decltype(size<1>(typename TiledMmaSdP::AtomShape_MNK{}))::value == kBlockM,
                "80-row steps take 64x80 wgmma atoms: define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED "
                "before the first CuTe include (bwd_sm90_hd128_m80.cu)");
  // The dQ accumulator's shape: (queries, head dim), or (head dim, queries) transposed.
  using DqShape = conditional_t<kDqSwapAB, Shape<Int<kHeadDim>, Int<kBlockM>>, Shape<Int<kBlockM>, Int<kHeadDim>>>;

  using SmemAtomK = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(
      SmemAtomK{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));      // also dO
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // also V
  // dS stored (queries, keys) with queries contiguous: the MN-major A operand of dQ.
  // kBiasTiles: keys contiguous instead (the K-major A operand), which is dbias's layout in
  // global memory, so that each buffer is also the dbias tile's TMA store source;
  // kDqSwapAB: keys contiguous too (the K-major B operand of dQ^T).
  using SmemLayoutdS = decltype(tile_to_shape(
      conditional_t<kDsKeysContiguous, GMMA::Layout_K_SW128_Atom<Element>, GMMA::Layout_MN_SW128_Atom<Element>>{},
      Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));
  // Transposed views of the same bytes.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                         Step<_2, _1, _3>{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, _2>{},
                                          Step<_2, _1, _3>{})));

  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;     // (L, D, H, B)
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                          GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{},
                                      Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  // What a stage of either pipeline receives: a query (dO) tile and its kBlockM lse2
  // (delta) values.
  static constexpr uint32_t kStageBytes = kBytesQ + kBlockM * sizeof(float);
  static constexpr uint32_t kBytesK = kBlockN * kHeadDim * sizeof(Element);

  // A step's bias (and then dbias) tile: (queries, keys), keys contiguous as in global
  // memory, in 128-byte swizzled rows; the transposed view is what the S^T fragments read
  // (ldmatrix.trans) and write (stmatrix.trans).
  using SmemLayoutBias = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutBiasT = decltype(composition(
      SmemLayoutBias{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Step<_2, _1>{})));
  static constexpr uint32_t kBytesBias = kBlockM * kBlockN * sizeof(Element);
  // Bias buffers: two where shared memory has room (head dim 64), so that the next step's
  // tile loads while this one's is read; one at head dim 128 (a second is 4.5 KB over
  // 227 KB: the column-range slots and the zero filler's bitmap would have to go).
  static constexpr int kBiasBufs = kHeadDim <= 64 ? 2 : 1;
  // (Lq, Lk, bias heads, bias batches), keys contiguous; dbias (Lq, Lk, Hq, B).
  using GmemTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)),
                                             GmemShape{}, GmemStride{}));
  // dK and dV (Lk, D, Hkv, B) by TMA stores from the key / value buffers (SmemLayoutK),
  // and the fragments' copy into them (stmatrix).
  using TmadKV = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutK{},
                                        Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using SmemCopydKV = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, TiledMmadKV{}));
  using TmaBias = conditional_t<kBiasTiles,
      decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutBias{},
                             Shape<Int<kBlockM>, Int<kBlockN>>{}, _1{})), int>;
  using TmadBias = conditional_t<kBiasTiles,
      decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutBias{},
                             Shape<Int<kBlockM>, Int<kBlockN>>{}, _1{})), int>;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;

  struct SharedStorage {
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> v;
    array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> dout;
    array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> ds;
    // P^T of the step (split queries; else a placeholder: P^T stays in registers)
    array_aligned<Element, kSplitQueries ? cosize_v<SmemLayoutdS> : 8, 1024> p;
    // dQ of one step in each consumer thread's register order (dq_slot), one half per
    // warpgroup: what the bulk reduction adds to the accumulator.
    alignas(128) float dq[kBlockM * kHeadDim];
    alignas(16) float lse2[kStages][kBlockM];    // per step, beside the query tile
    alignas(16) float delta[kStages][kBlockM];   // per step, beside the dO tile
    // The producer's record of each step it loads, read by the consumers after the step's
    // query stage is full, so that they keep no list cursor of their own (its registers
    // spilled in their loop, docs/perf-notes.md C64): 2 * m + partial (m: the kBlockM-row
    // query step), or kEndOfHead after a head's last step (a stage with no data). A ring of
    // kStages + 1: step s's slot was last read for step s - kStages - 1, which the
    // consumers released before the producer could acquire step s - 1, so the producer
    // writes it before acquiring step s (its arrive then publishes the record).
    int step_rec[kStages + 1];
    // The ring position after slot s, the same on both sides.
    static __device__ __forceinline__ int next_rec_slot(int s) { return s == kStages ? 0 : s + 1; }
    // Column ranges of the CTA's keys for the current head, as (start, length) slots: a
    // key hides query i iff unsigned(i - start) < length; unused slots are (0, 0).
    alignas(16) int2 col_ranges[kColRanges ? kBlockN : 1][kMaxStagedRanges];
    alignas(16) cutlass::arch::ClusterTransactionBarrier::ValueType barrier_kv;
    typename Pipeline::SharedStorage pipe_q;
    typename Pipeline::SharedStorage pipe_do;
    // kBiasTiles: a bias buffer is loaded (bias_full) and free again once the step has
    // read it (bias_empty).
    cutlass::arch::ClusterTransactionBarrier::ValueType bias_full[kBiasBufs];
    cutlass::arch::ClusterBarrier::ValueType bias_empty[kBiasBufs];
  };
  // kBiasTiles: the bias tiles' buffers, past SharedStorage (so that the other kernels'
  // shared memory does not grow).
  static constexpr int kBiasOffset = (sizeof(SharedStorage) + 1023) / 1024 * 1024;
  // and the dbias zero filler's bitmap of listed query blocks, kZeroBitmapWords words.
  static constexpr int kZeroBitmapWords = 128;
  static constexpr int kZeroBitmapOffset = kBiasOffset + kBiasBufs * kBytesBias;
  static constexpr int kSmemBytes = kBiasTiles ? kZeroBitmapOffset + 4 * kZeroBitmapWords
                                               : sizeof(SharedStorage);
  // The persistent kernel's BwdTileSlots after them (its launch asks for the larger size).
  static constexpr int kTileSlotsOffset = (kSmemBytes + 15) / 16 * 16;
  static constexpr int kPersistentSmemBytes = kTileSlotsOffset + sizeof(BwdTileSlots);

  struct KernelParams {
    BackwardParams bp;
    float* dq_accum;   // (B, Hq, Lq_pad / kBlockM, 2, kBlockM * D / 2): each step's dQ, dq_slot order
    const float* lse2;   // (B, Hq, Lq_pad): lse * log2(e); +inf for empty and padding rows
    const float* delta;  // (B, Hq, Lq_pad)
    int Lq_pad;
    // deterministic: per (b, h, kBlockM-row step, warpgroup half) the number of CTAs that have
    // added their dQ; CTAs add in the order of their key tiles.
    int* dq_turn;
    TmaQ tma_q;
    TmaQ tma_do;
    TmaK tma_k;
    TmaK tma_v;
    TmadBias tma_dbias;   // kBiasTiles (dbias wanted)
    TmaBias tma_bias;     // kBiasTiles
    int bias_heads = 1, bias_batches = 1;   // the bias's extents of TMA's head and batch modes
    TmadKV tma_dk{}, tma_dv{};              // launch_bwd
    int* tile_counter = nullptr;            // the persistent kernel's tiles drawn (zeroed per launch)
  };
};

// Where entry x of consumer thread t's dQ fragment sits within its warpgroup's half of a
// step (128 threads): runs of four fragment entries (two pairs of adjacent head-dim
// entries), thread-major, so that a thread stores its dQ in 16-byte pieces (8 stores per
// 64 x 64 step, as FlashAttention-3/4), without bank conflicts, and the postprocess reads
// them coalesced. kPairs: runs of two (8-byte stores, twice as many; before C87,
// FLEXSPARSE_CUDA_DEBUG bit 2^41).
template <bool kPairs>
__device__ __forceinline__ int dq_slot(int x, int t) {
  if constexpr (kPairs) return (x >> 1) * 256 + 2 * (t % 128) + (x & 1);
  else return (x >> 2) * 512 + 4 * (t % 128) + (x & 3);
}

// Deterministic dQ: a CTA's turn for the query step at query block qb is the number of
// key tiles before its own that the descriptor lists for qb (the CTAs that add before it,
// in key-tile order). One warp counts the kv-list entries of qb.
__device__ __forceinline__ int dq_turn_of(AttentionParams const& p, int b, int h, int qb,
                                          int n_block, int tiles_per_block) {
  const int lane = threadIdx.x % 32;
  int turn = 0;
  ListRow lists[2] = {ListRow(p.kv_partial, b, h, qb), ListRow(p.kv_full, b, h, qb)};
  for (int l = 0; l < 2; ++l)
    for (int t = lane; t < lists[l].count; t += 32) {
      const int e = lists[l].block_at(t);
      if (e >= 0) turn += min(max(n_block - e * tiles_per_block, 0), tiles_per_block);
    }
  #pragma unroll
  for (int s = 16; s > 0; s >>= 1) turn += __shfl_xor_sync(0xffffffff, turn, s);
  return turn;
}

// The query steps a CTA walks for one head: the q lists' blocks in list order, partial
// first (TileCursor), or with kRowSteps every kBlockM-row step of [0, Lq) where the lists
// hold any block (bwd_sm90 takes that kernel only for lists of one row for all, whose
// q list then holds every query block or none; partial if its partial list holds them).
// next(...): the next step (false: none left), m its kBlockM-row index, and whether it
// needs element predicates (p, b, h, kb and sub the same on every call).
template <class T, bool kRowSteps = T::kRowSteps>
struct QuerySteps {
  TileCursor cursor;
  __device__ __forceinline__ QuerySteps(AttentionParams const& p, int b, int h, int kb)
      : cursor(p.q_partial, b, h, kb) {}
  __device__ __forceinline__ bool next(AttentionParams const& p, int b, int h, int kb, int sub, int& m,
                                       bool& partial) {
    return cursor.next(p.q_full, b, h, kb, sub, m, partial);
  }
};

template <class T>
struct QuerySteps<T, true> {
  int next_step = 0, steps = 0;
  bool partial_steps = false;
  __device__ __forceinline__ QuerySteps(AttentionParams const& p, int b, int h, int kb) {
    const int partial = ListRow(p.q_partial, b, h, kb).count;
    const int full = ListRow(p.q_full, b, h, kb).count;
    steps = partial + full > 0 ? (p.Lq + T::kBlockM - 1) / T::kBlockM : 0;
    partial_steps = partial > 0;
  }
  __device__ __forceinline__ bool next(AttentionParams const&, int, int, int, int, int& m, bool& partial) {
    if (next_step >= steps) return false;
    m = next_step++;
    partial = partial_steps;
    return true;
  }
};

// A zero that ptxas cannot see through, the same in every lane (so that what is computed
// from it stays in uniform registers): a shared-memory base offset by it is rebuilt where
// it is used instead of hoisted out of the loop.
__device__ __forceinline__ int opaque_zero() {
  int z;
  asm volatile("mov.b32 %0, 0;" : "=r"(z));
  return __shfl_sync(0xffffffff, z, 0);
}

// threadIdx.x read where it is used: held across the step loop, what the consumers
// derive from it (the lse/delta column, the dS^T addresses) was spilled and reloaded from
// local memory every step, the first use waiting on the load (docs/perf-notes.md C86).
__device__ __forceinline__ uint32_t thread_index_here() {
  uint32_t t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// Byte offset of consumer thread `t`'s first stmatrix row in one dS^T buffer of the
// kDsStoreByHand layout, (64 queries, 128 keys), queries contiguous, 128-byte swizzle:
// stmatrix x4 matrix lane / 8 holds keys 8 ((lane / 8) % 2) + 0..7 of the warp's 16 and
// queries 8 (lane / 16) + 0..7; the swizzle XORs the 16-byte chunk index with key % 8.
// The thread's k-th of its four stores (queries + 16 k) is at this offset XOR 32 k, and
// the second buffer 16 KB on (both beyond the swizzle's bits). Checked against CuTe's
// partition for every thread (tests/cpu_ops/ds_store_layout.cu).
__host__ __device__ __forceinline__ uint32_t ds_store_offset(uint32_t t) {
  const uint32_t lane = t & 31;
  const uint32_t key = 16 * (t >> 5) + 8 * ((lane >> 3) & 1) + (lane & 7);
  return (16 * (lane >> 4) + 128 * key) ^ ((key & 7) << 4);
}

__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// The same for dS^T stored transposed, keys contiguous (kDsStoreTransByHand): (kBlockM
// queries, 128 keys) in 8 x 64 atoms of 128-byte rows, 128-byte swizzle, the atoms of keys
// 64-127 kBlockM * 128 bytes on. Lane l of warp w (of its warpgroup g) gives the row of
// stmatrix.trans matrix l / 8: query (l % 8) + 8 (l / 16), keys 64 g + 16 w + 8 ((l / 8) % 2)
// + 0..7, i.e. 16-byte chunk 2 w + (l / 8) % 2 of the row, XORed with query % 8. The k-th
// store (queries + 16 k) is 2048 bytes on (16 rows: past the swizzle's bits), the second
// buffer kBlockM * 256. Checked against CuTe's partition for every thread
// (tests/cpu_ops/ds_store_layout.cu).
template <int kBlockM>
__host__ __device__ __forceinline__ uint32_t ds_store_offset_keys_contiguous(uint32_t t) {
  const uint32_t lane = t & 31, warp = (t >> 5) & 3;
  const uint32_t query = (lane & 7) + 8 * (lane >> 4);
  const uint32_t chunk = (2 * warp + ((lane >> 3) & 1)) ^ (query & 7);
  return (t >> 7) * (kBlockM * 128) + 128 * query + 16 * chunk;
}

__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// Spin until *flag == value (bounded: a descriptor whose q and kv lists disagree would
// otherwise hang the kernel; past the bound the order is simply not enforced).
__device__ __forceinline__ void wait_turn(const int* flag, int value) {
  for (int it = 0; it < (1 << 22); ++it) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
    if (v == value) return;
    __nanosleep(64);
  }
}

// The step records (SharedStorage::step_rec): plain shared-memory accesses that the compiler
// keeps in place relative to the barrier operations (whose inline asm has no memory clobber).
constexpr int kEndOfHead = -1;
__device__ __forceinline__ void store_step_rec(int* at, int rec) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(cute::cast_smem_ptr_to_uint(at)), "r"(rec) : "memory");
}
__device__ __forceinline__ int load_step_rec(const int* at) {
  int rec;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(rec) : "r"(cute::cast_smem_ptr_to_uint(at)) : "memory");
  return rec;
}

__device__ __forceinline__ void bulk_reduce_add(float* gmem, const float* smem, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               :: "l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes) : "memory");
}

// 16 bytes of zeros, streamed (evict-first in L1 and L2: written once, never read here).
__device__ __forceinline__ void store_zeros_streaming(void* at) {
  asm volatile("st.global.cs.v4.b32 [%0], {%1, %1, %1, %1};" ::"l"(at), "r"(0) : "memory");
}

// dbias zeroes where the descriptor lists no block: one warp writes, for each query head of
// the CTA's group, zeros over the CTA's keys in the rows of every query block that neither
// q list of its key block holds (the kernel's steps write the listed blocks by TMA), so
// that dbias needs no zero fill before the kernel. Rows stop at Lq and columns at Lk. The
// listed blocks are marked in a shared-memory bitmap, kZeroBitmapWords * 32 query blocks
// at a time. The zeros go out as plain 16-byte streaming stores, the whole warp on one
// block at a time: lane % 16 is the 16-byte piece of a 256-byte row, lane / 16 the row's
// parity. (TMA stores of an 8 KB tile of zeros measured the same and took 8 KB of shared
// memory, perf-notes C56; an earlier plain-store version spent ~20 instructions per store,
// C50.)
template <class T>
__device__ void zero_unlisted_dbias(typename T::KernelParams const& kp, int b, int hk, int kb,
                                    int n_block, uint32_t* bitmap) {
  BackwardParams const& bp = kp.bp;
  AttentionParams const& p = bp.fwd;
  constexpr int kChunk = 32 * T::kZeroBitmapWords;   // query blocks per bitmap
  const int lane = threadIdx.x % 32;
  const int group = p.Hq / p.Hkv;
  const int n_qb = (p.Lq + p.block_q - 1) / p.block_q;
  const int64_t row_bytes = bp.dbias_sq * (int64_t)sizeof(typename T::Element);
  const bool lane_cols = n_block * T::kBlockN + (lane % 16) * 8 < p.Lk;   // (Lk % 8 == 0: tma_tileable)
  for (int g = 0; g < group; ++g) {
    const int h = hk * group + g;
    char* head_base = static_cast<char*>(bp.dbias) +
                      ((int64_t)b * bp.dbias_sb + (int64_t)h * bp.dbias_sh + (int64_t)n_block * T::kBlockN) *
                          (int64_t)sizeof(typename T::Element) + (lane % 16) * 16;
    for (int c0 = 0; c0 < n_qb; c0 += kChunk) {
      for (int w = lane; w < T::kZeroBitmapWords; w += 32) bitmap[w] = 0;
      __syncwarp();
      // (the lists' rows read again per chunk, more than one only past 4096 query blocks:
      // held across the stores below they spilled at this warp's 24 registers)
      ListRow lists[2] = {ListRow(p.q_partial, b, h, kb), ListRow(p.q_full, b, h, kb)};
      for (int l = 0; l < 2; ++l)
        for (int t = lane; t < lists[l].count; t += 32) {
          const int e = lists[l].block_at(t);
          if (e >= c0 && e < c0 + kChunk) atomicOr(bitmap + (e - c0) / 32, 1u << ((e - c0) % 32));
        }
      __syncwarp();
      const int c1 = min(n_qb, c0 + kChunk);
      for (int qb = c0; qb < c1; ++qb) {
        if (!lane_cols || (bitmap[(qb - c0) / 32] >> ((qb - c0) % 32)) & 1u) continue;
        const int rows = min(p.block_q, p.Lq - qb * p.block_q);
        char* at = head_base + ((int64_t)qb * p.block_q + lane / 16) * row_bytes;
        int r = lane / 16;
        #pragma unroll 1
        for (; r + 6 < rows; r += 8, at += 8 * row_bytes) {
          store_zeros_streaming(at);
          store_zeros_streaming(at + 2 * row_bytes);
          store_zeros_streaming(at + 4 * row_bytes);
          store_zeros_streaming(at + 6 * row_bytes);
        }
        for (; r < rows; r += 2, at += 2 * row_bytes) store_zeros_streaming(at);
      }
      __syncwarp();
    }
  }
}

// kCuteDsStore: the dS^T stores and the lse/delta columns through CuTe's partitions even
// where T::kDsStoreByHand or T::kDsStoreTransByHand (the code before C86 and C105;
// FLEXSPARSE_CUDA_DEBUG bit 2^40, A/Bs).
// kDqPairs: dQ staged in 8-byte pieces (dq_slot<true>, before C87; bit 2^41).
// kDsFirst: dS^T stored before the dV product is issued, not after (FlashAttention-3/4's
// order), so that the stores complete while dV issues instead of under the fence before
// the dS barrier (docs/perf-notes.md C106).
// kDsInterleaved: the dP^T wait after a quarter of the exponentials, the rest of them
// interleaved with dS (FlashAttention-4's SASS order; C107).
// kStatsEarly: how many of the thread's lse pairs are read from shared memory before the
// S^T wait, and of its delta pairs before the dP^T wait (0: all after them; C110).
// They default to the kernel's own (BwdTraits); bits 2^46, 2^47 and 2^49 run the other
// choice (launch_bwd).
template <class T, bool kCuteDsStore = false, bool kDqPairs = false, bool kDsFirst = T::kDsFirst,
          bool kDsInterleaved = T::kDsInterleaved, int kStatsEarly = T::kStatsEarly, bool kPersistent = false>
__global__ void __launch_bounds__(T::kThreads, 1)
bwd_kernel(CUTE_GRID_CONSTANT typename T::KernelParams const kp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kHeadDim = T::kHeadDim;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;

  extern __shared__ char smem_raw[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  BackwardParams const& bp = kp.bp;
  AttentionParams const& p = bp.fwd;

  // The CTA's key tile: n_block of kv head hk, batch b, its place in the grid; with
  // kPersistent (C118) the grid is one CTA per SM, each taking the tiles its producer draws
  // from kp.tile_counter, the first one too (a tile t is (t % n_kb, t / n_kb % Hkv, t /
  // (n_kb Hkv)): the order in which the non-persistent grid's CTAs start). So a tile is
  // drawn only by a running CTA after every lower one was: the deterministic dQ turns,
  // which wait for lower key tiles, wait only for tiles that are being run or done.
  static_assert(!(kPersistent && T::kBiasTiles), "the persistent backward has no bias-tile roles");
  const int n_kb = (p.Lk + kBlockN - 1) / kBlockN, n_tiles = n_kb * p.Hkv * p.B;
  int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int group = p.Hq / p.Hkv;
#ifdef FLEXSPARSE_BWD_TRACE
  // entry: the kernel's, or in the persistent kernel the consumers' read of each tile
  auto life_entry = [&] {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    BWD_LIFE(0, sm + 1);
    BWD_LIFE(1, bwd_clock());
  };
  if (!kPersistent && threadIdx.x == 0) life_entry();
#endif
  int kb = n_block * kBlockN / p.block_k;    // the descriptor's key block
  const int sub = p.block_q / kBlockM;
  auto set_tile = [&](int t) {
    n_block = t % n_kb;
    hk = t / n_kb % p.Hkv;
    b = t / (n_kb * p.Hkv);
    kb = n_block * kBlockN / p.block_k;
  };
  // dK or dV of the current key tile from a SmemLayoutK tile in shared memory, by one TMA
  // store (rows past Lk clipped by the tensor map); the caller commits the bulk group.
  auto store_key_tile = [&](auto const& tma, auto const& smem) {
    Tensor mdKV = tma.get_tma_tensor(make_shape(p.Lk, p.D, p.Hkv, p.B));
    Tensor gdKV = local_tile(mdKV(_, _, hk, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
    auto cta = tma.get_slice(0);
    copy(tma, cta.partition_S(smem), cta.partition_D(gdKV));
  };
  // kPersistent: the tile of the CTA's k-th iteration goes from the producer to the
  // consumers' warps and the dQ writer through ring slot k & 1 (its (k >> 1)-th use):
  // tile_full when written, tile_empty once each of the kTileReaders warps has read it.
  // kv_empty: the consumers' epilogue has stored dK / dV out of the key / value buffers.
  auto& slots = *reinterpret_cast<BwdTileSlots*>(smem_raw + T::kTileSlotsOffset);
  constexpr int kTileReaders = T::kMmaThreads / 32 + 1;

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int warp_in_group = cutlass::canonical_warp_idx_sync() % 4;
  const bool lane_leader = cute::elect_one_sync();
  // L2 policies of the bias-tile kernels, whose bias, dbias and zeros stream ~6 GB per
  // causal 8K call through L2: query and dO tiles, which every key tile of their head
  // reads again, evict-last; bias tiles (read once) and dbias tiles (written once)
  // evict-first (the zeros are streaming stores of their own, zero_unlisted_dbias). 4-10% on
  // the H100's bias rows (docs/perf-notes.md C55). FLEXSPARSE_CUDA_DEBUG bit 16384: the
  // loads without hints, bit 2097152: the dbias tile stores without (A/Bs).
  const bool l2_hints = T::kBiasTiles && !(p.debug & 16384);
  const bool store_hints = T::kBiasTiles && !(p.debug & 2097152);
  const auto reused = l2_hints ? TMA::CacheHintSm90::EVICT_LAST : TMA::CacheHintSm90::EVICT_NORMAL;
  const auto streamed = l2_hints ? TMA::CacheHintSm90::EVICT_FIRST : TMA::CacheHintSm90::EVICT_NORMAL;
  // Named barriers (0 is __syncthreads): 1 both consumer warpgroups (dS); 2, 3 and 4, 5 a
  // consumer warpgroup with the dQ writer warp (its half of sdQ free / filled).
  constexpr int kBarrierdQEmpty = 2, kBarrierdQFull = 4;

  typename T::Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = T::kStageBytes;
  pipe_params.role = warpgroup == 0 ? T::Pipeline::ThreadCategory::Producer
                                    : T::Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x % 128 == 0;
  pipe_params.num_consumers = T::kMmaThreads;
  if (threadIdx.x == 0) Barrier::init(&ss.barrier_kv, 1);
  if constexpr (kPersistent) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < 2; ++i) {
        cutlass::arch::ClusterBarrier::init(&slots.tile_full[i], 1);
        cutlass::arch::ClusterBarrier::init(&slots.tile_empty[i], kTileReaders);
      }
      cutlass::arch::ClusterBarrier::init(&slots.kv_empty, 1);
    }
  }
  if (T::kBiasTiles && threadIdx.x == 0) {
    for (int i = 0; i < T::kBiasBufs; ++i) {
      Barrier::init(&ss.bias_full[i], 1);
      cutlass::arch::ClusterBarrier::init(&ss.bias_empty[i], 1);
    }
  }
  typename T::Pipeline pipe_q(ss.pipe_q, pipe_params, Shape<_1, _1, _1>{});
  typename T::Pipeline pipe_do(ss.pipe_do, pipe_params, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data()), typename T::SmemLayoutdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data()), typename T::SmemLayoutdSt{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.p.data()), typename T::SmemLayoutdSt{});   // split queries
  Element* bias_smem = reinterpret_cast<Element*>(smem_raw + T::kBiasOffset);   // kBiasTiles
  // The bias tile of step s is in buffer s & (bufs - 1), its (s >> bias_shift)-th load there.
  // FLEXSPARSE_CUDA_DEBUG bit 1048576: one buffer at head dim 64 too (A/Bs).
  const int bias_shift = (T::kBiasBufs == 2 && !(p.debug & 1048576)) ? 1 : 0;
  const int bias_mask = (1 << bias_shift) - 1;
  // kPersistent: a reader warp's tile of iteration k (every lane calls it); false when the
  // producer has drawn past the last tile.
  auto read_tile = [&](int k) {
    const int slot = k & 1;
    cutlass::arch::ClusterBarrier::wait(&slots.tile_full[slot], (k >> 1) & 1);
    // Lane 0 alone reads the slot and frees it: its own arrive orders its read before the
    // producer's next write (racecheck does not count __syncwarp plus one lane's arrive as
    // ordering the other lanes' reads).
    int t = 0;
    if (threadIdx.x % 32 == 0) {
      t = slots.tile[slot];
      cutlass::arch::ClusterBarrier::arrive(&slots.tile_empty[slot]);
    }
    t = __shfl_sync(0xffffffffu, t, 0);
    if (t >= n_tiles) return false;
    set_tile(t);
#ifdef FLEXSPARSE_BWD_TRACE
    if (threadIdx.x == 128) life_entry();
#endif
    return true;
  };

  if (warpgroup == 0) {
    // ------------------------------------------------------------------ producer
    cutlass::arch::warpgroup_reg_dealloc<24>();
    // FLEXSPARSE_CUDA_DEBUG bit 4194304 (a timing probe; wrong results): the dbias zero
    // filler runs alone, every other warp leaves (after setmaxnreg, which needs them all).
    const bool zeros_only = T::kBiasTiles && (p.debug & 4194304);
    if (zeros_only && warp_in_group != 3) return;
    if (warp_in_group == 0 && lane_leader) {
      Tensor mK = kp.tma_k.get_tma_tensor(make_shape(p.Lk, p.D, p.Hkv, p.B));
      Tensor mV = kp.tma_v.get_tma_tensor(make_shape(p.Lk, p.D, p.Hkv, p.B));
      auto tile_kv = Shape<Int<kBlockN>, Int<kHeadDim>>{};
      auto cta_k = kp.tma_k.get_slice(0);
      auto cta_v = kp.tma_v.get_slice(0);
      auto load_kv = [&] {
        Barrier::arrive_and_expect_tx(&ss.barrier_kv, 2 * T::kBytesK);
        copy(kp.tma_k.with(ss.barrier_kv, 0),
             cta_k.partition_S(local_tile(mK(_, _, hk, b), tile_kv, make_coord(n_block, 0))),
             cta_k.partition_D(sK));
        copy(kp.tma_v.with(ss.barrier_kv, 0),
             cta_v.partition_S(local_tile(mV(_, _, hk, b), tile_kv, make_coord(n_block, 0))),
             cta_v.partition_D(sV));
      };
      if constexpr (!kPersistent) load_kv();

      Tensor mQ = kp.tma_q.get_tma_tensor(make_shape(p.Lq, p.D, p.Hq, p.B));
      Tensor mdO = kp.tma_do.get_tma_tensor(make_shape(p.Lq, p.D, p.Hq, p.B));
      auto cta_q = kp.tma_q.get_slice(0);
      auto cta_do = kp.tma_do.get_slice(0);
      Tensor tQsQ = cta_q.partition_D(sQ);
      Tensor tdOsdO = cta_do.partition_D(sdO);
      auto tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
      auto write = cutlass::make_producer_start_state<typename T::Pipeline>();
      int rec_slot = 0;   // step_rec's ring position
      auto record = [&](int rec) {
        store_step_rec(&ss.step_rec[rec_slot], rec);
        rec_slot = T::SharedStorage::next_rec_slot(rec_slot);
      };
      // kPersistent: a tile's K and V load after its first stage is issued (a query step's,
      // which may then load while the consumers finish the previous tile, or a head's end),
      // once the previous tile's dK / dV have left the key / value buffers. Not later: the
      // consumers wait for K and V before they read any stage, so with the pipeline's
      // kStages stages issued and K / V not, the producer would wait for a free stage
      // forever (a tile no head of a GQA group sees issues only end stages).
      bool kv_loaded = !kPersistent;
      int iter = 0;
      auto load_kv_once = [&] {
        if (!kv_loaded) {
          if (iter > 0) cutlass::arch::ClusterBarrier::wait(&slots.kv_empty, (iter - 1) & 1);
          load_kv();
          kv_loaded = true;
        }
      };
      // kPersistent: draw the tile of iteration k and publish it in ring slot k & 1 once that
      // slot's last readers are done; false past the last tile.
      auto draw_tile = [&](int k) {
        const int t = atomicAdd(kp.tile_counter, 1), slot = k & 1, use = k >> 1;
        if (use >= 1) cutlass::arch::ClusterBarrier::wait(&slots.tile_empty[slot], (use - 1) & 1);
        slots.tile[slot] = t;
        cutlass::arch::ClusterBarrier::arrive(&slots.tile_full[slot]);
        if (t >= n_tiles) return false;
        set_tile(t);
        return true;
      };
      bool have_tile = true;
      if constexpr (kPersistent) have_tile = draw_tile(0);
      for (; have_tile; ++iter) {
        for (int g = 0; g < group; ++g) {
          const int h = hk * group + g;
          QuerySteps<T> walk(p, b, h, kb);
          Tensor tQgQ = cta_q.partition_S(local_tile(mQ(_, _, h, b), tile_q, make_coord(_, 0)));
          Tensor tdOgdO = cta_do.partition_S(local_tile(mdO(_, _, h, b), tile_q, make_coord(_, 0)));
          int m;
          bool partial;
          while (walk.next(p, b, h, kb, sub, m, partial)) {
            if (m * kBlockM >= p.Lq) continue;
            const int64_t rows = ((int64_t)b * p.Hq + h) * kp.Lq_pad + m * kBlockM;
            record(2 * m + (partial ? 1 : 0));
            pipe_q.producer_acquire(write);
            auto* bar_q = pipe_q.producer_get_barrier(write);
            copy(kp.tma_q.with(*bar_q, 0, reused), tQgQ(_, _, _, m), tQsQ(_, _, _, write.index()));
            SM90_BULK_COPY_G2S::copy(kp.lse2 + rows, bar_q, ss.lse2[write.index()], kBlockM * sizeof(float));
            pipe_do.producer_acquire(write);
            auto* bar_do = pipe_do.producer_get_barrier(write);
            copy(kp.tma_do.with(*bar_do, 0, reused), tdOgdO(_, _, _, m), tdOsdO(_, _, _, write.index()));
            SM90_BULK_COPY_G2S::copy(kp.delta + rows, bar_do, ss.delta[write.index()], kBlockM * sizeof(float));
            ++write;
            if constexpr (kPersistent) load_kv_once();
          }
          // The head's end: a stage of both pipelines that carries no data (its expected bytes
          // completed here), whose record tells the consumers to go on to the next head.
          record(kEndOfHead);
          pipe_q.producer_acquire(write);
          Barrier::complete_transaction(pipe_q.producer_get_barrier(write), 0, T::kStageBytes);
          pipe_do.producer_acquire(write);
          Barrier::complete_transaction(pipe_do.producer_get_barrier(write), 0, T::kStageBytes);
          ++write;
          if constexpr (kPersistent) load_kv_once();
        }
        if constexpr (!kPersistent) {
          break;
        } else {
          if (!draw_tile(iter + 1)) break;
          kv_loaded = false;
        }
      }
      BWD_LIFE(6, bwd_clock());
    } else if (warp_in_group == 1) {
      // dQ writer: per step, tell each consumer warpgroup that its half of sdQ is free once
      // the last reduction has read it, wait until it is filled, add it to dq_accum.
      const int lane = threadIdx.x % 32;
      // sdQ's halves free for the consumer warpgroups: each once the reductions that read
      // it are done (the older first), each consumer warpgroup waiting on its own barrier.
      auto release_sdq = [&] {
        if (lane == 0) tma_store_wait<1>();
        __syncwarp();
        cutlass::arch::NamedBarrier::arrive(128 + 32, kBarrierdQEmpty);
        if (lane == 0) tma_store_wait<0>();
        __syncwarp();
        cutlass::arch::NamedBarrier::arrive(128 + 32, kBarrierdQEmpty + 1);
      };
      bool have_tile = true;
      if constexpr (kPersistent) have_tile = read_tile(0);
      for (int iter = 0; have_tile; ++iter) {
        for (int g = 0; g < group; ++g) {
          const int h = hk * group + g;
          QuerySteps<T> walk(p, b, h, kb);
          const int64_t row0 = ((int64_t)b * p.Hq + h) * kp.Lq_pad;
          int m;
          bool partial;
          while (walk.next(p, b, h, kb, sub, m, partial)) {
            if (m * kBlockM >= p.Lq) continue;   // (the consumers skip the same tiles)
            const int i0 = m * kBlockM;
            const int turn = bp.deterministic
                ? dq_turn_of(p, b, h, i0 / p.block_q, n_block, p.block_k / kBlockN) : 0;
            release_sdq();
            for (int w = 0; w < 2; ++w) {
              cutlass::arch::NamedBarrier::sync(128 + 32, kBarrierdQFull + w);
              if (lane == 0) {
                int* flag = bp.deterministic ? kp.dq_turn + ((row0 + i0) / kBlockM) * 2 + w : nullptr;
                if (flag != nullptr) wait_turn(flag, turn);
                // FLEXSPARSE_CUDA_DEBUG bit 2048: no dQ reduction (wrong dq; timing probes only).
                float* acc = kp.dq_accum + (row0 + i0) * kHeadDim + w * (kBlockM * kHeadDim / 2);
                const float* half = ss.dq + w * (kBlockM * kHeadDim / 2);
                constexpr int kPiece = kBlockM * kHeadDim / 2 / T::kDqReducePieces;   // floats
                if (!(p.debug & 2048)) {
                  CUTLASS_PRAGMA_UNROLL
                  for (int e = 0; e < T::kDqReducePieces; ++e)
                    bulk_reduce_add(acc + e * kPiece, half + e * kPiece, kPiece * sizeof(float));
                }
                tma_store_arrive();
                if (flag != nullptr) {
                  // The addition is complete (not only its shared-memory read) before the
                  // next CTA's turn.
                  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
                  __threadfence();
                  atomicAdd(flag, 1);
                }
              }
              __syncwarp();
            }
          }
        }
        if constexpr (kPersistent) {
          // The consumers' epilogue writes dK and dV through sdQ, as one more step without
          // a reduction: both halves free (the epilogue waits on kBarrierdQEmpty), then
          // the epilogue done with sdQ (it arrives on kBarrierdQFull), so that this warp's
          // next arrives, the next tile's, come after the epilogue's waits (a second
          // arrive on a named barrier before its generation completes would miscount).
          release_sdq();
          cutlass::arch::NamedBarrier::sync(128 + 32, kBarrierdQFull);
          cutlass::arch::NamedBarrier::sync(128 + 32, kBarrierdQFull + 1);
        }
        if constexpr (!kPersistent) break;
        else if (!read_tile(iter + 1)) break;
      }
      if (lane == 0) tma_store_wait<0>();       // shared memory outlives the reductions
      if (lane == 0) BWD_LIFE(5, bwd_clock());
    } else if (T::kBiasTiles && warp_in_group == 2) {
      // bias tiles: one per step, into buffer (load & bias_mask) once the step that read it
      // last is done with it
      if constexpr (T::kBiasTiles) {
        if (lane_leader) {
          Tensor mB = kp.tma_bias.get_tma_tensor(make_shape(p.Lq, p.Lk, kp.bias_heads, kp.bias_batches));
          auto cta_b = kp.tma_bias.get_slice(0);
          auto tile_b = Shape<Int<kBlockM>, Int<kBlockN>>{};
          const int bb = kp.bias_batches == 1 ? 0 : b;
          int loads = 0;
          for (int g = 0; g < group; ++g) {
            const int h = hk * group + g;
            Tensor tBgB = cta_b.partition_S(
                local_tile(mB(_, _, h / p.bias_head_div, bb), tile_b, make_coord(_, n_block)));
            QuerySteps<T> walk(p, b, h, kb);
            int m;
            bool partial;
            while (walk.next(p, b, h, kb, sub, m, partial)) {
              if (m * kBlockM >= p.Lq) continue;   // (the consumers skip the same tiles)
              const int buf = loads & bias_mask;
              if (loads > bias_mask)
                cutlass::arch::ClusterBarrier::wait(&ss.bias_empty[buf], ((loads >> bias_shift) - 1) & 1);
              Barrier::arrive_and_expect_tx(&ss.bias_full[buf], T::kBytesBias);
              Tensor sBias = make_tensor(make_smem_ptr(bias_smem + buf * kBlockM * kBlockN),
                                         typename T::SmemLayoutBias{});
              copy(kp.tma_bias.with(ss.bias_full[buf], 0, streamed), tBgB(_, _, _, m),
                   cta_b.partition_D(sBias));
              ++loads;
            }
          }
        }
      }
    } else if (T::kBiasTiles && warp_in_group == 3) {
      if constexpr (T::kBiasTiles) {
        // FLEXSPARSE_CUDA_DEBUG bit 32768: no zeros (wrong dbias outside the listed blocks;
        // a timing probe of the zero fill only).
        if (bp.dbias != nullptr && !(p.debug & 32768))
          zero_unlisted_dbias<T>(kp, b, hk, kb, n_block,
                                 reinterpret_cast<uint32_t*>(smem_raw + T::kZeroBitmapOffset));
      }
    }
  } else {
    // ------------------------------------------------------------------ consumers
    cutlass::arch::warpgroup_reg_alloc<240>();
    if (T::kBiasTiles && (p.debug & 4194304)) return;   // the zeros-only probe (above)
    const int tid = threadIdx.x - 128;
    typename T::TiledMmaSdP mma_sdp;
    typename T::TiledMmadKV mma_dkv;
    typename T::TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(tid);
    auto thr_dkv = mma_dkv.get_thread_slice(tid);
    // Shared-memory operand descriptors from the warpgroup's first thread, the warpgroup
    // index warp-uniform (a shuffle): ptxas keeps them in uniform registers instead of
    // moving them with R2UR before every wgmma (docs/perf-notes.md, C24).
    const int wg_first = (warpgroup - 1) * 128;
    auto wg_sdp = mma_sdp.get_thread_slice(wg_first);
    auto wg_dkv = mma_dkv.get_thread_slice(wg_first);
    auto wg_dq = mma_dq.get_thread_slice(wg_first);
    Tensor tSrK = wg_sdp.partition_fragment_A(sK);
    Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);
    Tensor tdPrV = wg_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = wg_sdp.partition_fragment_B(sdO);
    Tensor tdVrdO = wg_dkv.partition_fragment_B(sdOt);
    Tensor tdKrQ = wg_dkv.partition_fragment_B(sQt);
    // dQ's operands: dS and K^T, or (kDqSwapAB) K^T and dS.
    auto tdQrdS = [&] {
      if constexpr (T::kDqSwapAB) return wg_dq.partition_fragment_B(sdS);
      else return wg_dq.partition_fragment_A(sdS);
    }();
    auto tdQrK = [&] {
      if constexpr (T::kDqSwapAB) return wg_dq.partition_fragment_A(sKt);
      else return wg_dq.partition_fragment_B(sKt);
    }();
    // Split queries: P^T and dS^T as the A operands of dV and dK, from shared memory.
    auto tdVrPt = [&] {
      if constexpr (T::kSplitQueries) return wg_dkv.partition_fragment_A(sPt);
      else return 0;
    }();
    auto tdKrdSt = [&] {
      if constexpr (T::kSplitQueries) return wg_dkv.partition_fragment_A(sdSt);
      else return 0;
    }();
    // dS^T to shared memory with stmatrix: a key row's adjacent queries are contiguous in
    // the MN-major dS layout, so the untransposed 8x8 matrices of the accumulator fit
    // (kBiasTiles, kDqSwapAB: keys contiguous, stmatrix.trans).
    auto smem_copy_ds = [&] {
      if constexpr (T::kDsKeysContiguous) return make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, mma_sdp);
      else return make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    }();
    auto thr_copy_ds = smem_copy_ds.get_thread_slice(tid);
    Tensor tdSsdS = thr_copy_ds.partition_D(sdSt);   // where this thread's dS^T goes
    Tensor tPsP = thr_copy_ds.partition_D(sPt);      // and its P^T (split queries)
    // kBiasTiles: the step's bias tile read as S^T fragments (ldmatrix.trans). Its dbias is
    // dS itself: the TMA store reads it from the step's dS buffer (kBiasTiles' layout).
    auto s2r_bias = [&] {
      if constexpr (T::kBiasTiles) return make_tiled_copy_C(Copy_Atom<SM75_U16x8_LDSM_T, Element>{}, mma_sdp);
      else return 0;
    }();
    const bool store_dbias = T::kBiasTiles && bp.dbias != nullptr;
    Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    clear(tdVrdV);
    clear(tdKrdK);

    // (key, query) of every score this thread holds, within the tile.
    Tensor cS = make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor tScS = thr_sdp.partition_C(cS);
    Tensor coord = make_tensor(tScS.data(), rowcol(tScS.layout()));
    constexpr int kRows = decltype(size<0>(coord))::value;
    constexpr int kCols = decltype(size<1>(coord))::value;
    static_assert(kRows == 2 && kCols == (T::kSplitQueries ? kBlockM / 2 : kBlockM) / 4,
                  "GMMA C fragment: 2 rows, N / 4 columns");
    // Rows (keys) row_base + 8 r, columns (queries) col_base + 8 (c / 2) + c % 2.
    const int row_base = get<0>(coord(0, 0));
    const int col_base = get<1>(coord(0, 0));
    constexpr int kBarrierdS = 1;
    // consumer warpgroup: its keys, its dQ half (warp-uniform, so that the dQ wgmma's
    // descriptors are computed in uniform registers)
    const int wg = warpgroup - 1;
    float* sdQ = ss.dq + wg * (kBlockM * kHeadDim / 2);

    const float LOG2E = 1.4426950408889634f;
    constexpr bool kPlain = T::kPlain;
    const bool has_bias = !kPlain && p.bias != nullptr;
    const bool has_softcap = !kPlain && p.softcap > 0.f;
    const bool log2_scores = has_bias || has_softcap;
    const PredicateParams& pr = p.pred;
    typename T::PipelineState read;
    int step = 0;   // steps done: the P^T / dS^T buffer's parity with one stage
    int rec_slot = 0;   // step_rec's ring position
    // One key tile per iteration (kPersistent: until the producer draws past the last).
    bool have_tile = true;
    if constexpr (kPersistent) have_tile = read_tile(0);
    for (int iter = 0; have_tile; ++iter) {
      const int j0 = n_block * kBlockN;
      const int jr[kRows] = {j0 + row_base, j0 + row_base + 8};   // this thread's keys

      Barrier::wait(&ss.barrier_kv, iter & 1);
      if (tid == 0) BWD_LIFE(2, bwd_clock());
#ifdef FLEXSPARSE_BWD_TRACE
      const int trace_cta = bwd_trace_cta();
      BWD_TRACE_CALIBRATE(0);
      const int tile_first_step = step;   // (the persistent kernel's step count runs on across tiles)
#endif
      for (int g = 0; g < group; ++g) {
        const int h = hk * group + g;
        const int64_t row0 = ((int64_t)b * p.Hq + h) * kp.Lq_pad;   // (b, h) in lse2/delta/dq_accum
        const Element* bias = static_cast<const Element*>(p.bias);
        if (has_bias) bias += b * p.bias_sb + (h / p.bias_head_div) * p.bias_sh;
        Element* dbias = kPlain || T::kBiasTiles ? nullptr : static_cast<Element*>(bp.dbias);
        if (dbias != nullptr) dbias += b * bp.dbias_sb + h * bp.dbias_sh;
        const int32_t* cr_base = pr.col_ranges == nullptr ? nullptr
            : pr.col_ranges + b * pr.cr_sb + (h / pr.cr_head_div) * pr.cr_sh;
        const uint8_t* dense = kPlain || pr.dense == nullptr ? nullptr
            : pr.dense + b * pr.dense_sb + (h / pr.dense_head_div) * pr.dense_sh;
        const int32_t* bits_head = kPlain || pr.bits_index == nullptr ? nullptr
            : pr.bits_index + b * pr.bi_sb + (h / pr.bi_head_div) * pr.bi_sh;
        // A window (sliding_window's descriptors, PredicateParams::window): key j shows the
        // rows j + a <= i < j + b (window_band), this thread's two keys' visible intervals
        // straight from it, nothing staged (C114).
        // FLEXSPARSE_CUDA_DEBUG bit 2^52: the staged ranges instead (A/Bs).
        const bool band = T::kColRanges && cr_base != nullptr && pr.window != nullptr && !(p.debug_high & (1 << 21));
        // Otherwise the keys are the CTA's for the whole walk: their column ranges are read
        // once.
        const bool staged = !band && T::kColRanges && cr_base != nullptr &&
                            (kPlain || pr.n_col_ranges <= T::kMaxStagedRanges);
        if (staged) {
          cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierdS);   // last head's readers
          for (int e = tid; e < kBlockN * T::kMaxStagedRanges; e += T::kMmaThreads) {
            const int key = e / T::kMaxStagedRanges, slot = e % T::kMaxStagedRanges;
            const int j = j0 + key;
            int2 v = make_int2(0, 0);
            if (j < p.Lk && slot < pr.n_col_ranges) {
              const int32_t* cr = cr_base + (int64_t)j * pr.cr_sk + 2 * slot;
              const int lo = __ldg(cr), hi = __ldg(cr + 1);
              v = make_int2(lo, max(hi - lo, 0));
            }
            ss.col_ranges[key][slot] = v;
          }
          cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierdS);
        }
        // With at most 2 ranges per key, this thread's two keys as visible intervals of
        // queries where they are (visible_interval): one compare per score instead of one per
        // range slot. FLEXSPARSE_CUDA_DEBUG bit 8: the range tests instead (A/Bs).
        int2 vis[kRows];
        bool interval = band || (staged && pr.n_col_ranges <= 2 && !(p.debug & 8));
        if (band) {
          const int2 ab = window_band(pr.window, p.Lq, p.Lk);
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < kRows; ++r) vis[r] = band_rows(jr[r], ab.x, ab.y, p.Lq);
        } else if (interval) {
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < kRows; ++r) {
            const int2* slots = ss.col_ranges[row_base + 8 * r];
            interval = visible_interval(slots[0], slots[1], p.Lq, vis[r]) && interval;
          }
        }

        for (;;) {
          // The step the producer loaded into this stage (its record), or the head's end.
          pipe_q.consumer_wait(read);
          const int rec = load_step_rec(&ss.step_rec[rec_slot]);
          rec_slot = T::SharedStorage::next_rec_slot(rec_slot);
          if (rec == kEndOfHead) {
            pipe_do.consumer_wait(read);
            pipe_q.consumer_release(read);
            pipe_do.consumer_release(read);
            ++read;
            break;
          }
          const int m = rec >> 1;
          const bool partial = rec & 1;
          const int i0 = m * kBlockM;
          BWD_TRACE(0);

          Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
          Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
          // The A operands from K and V (and K^T): the fragments made before the loop, or in
          // the 80-row kernel rebuilt per step from a base offset by an opaque zero (held
          // across the loop, its 16 + 8 loop-invariant descriptors of K, V and K^T were
          // spilled and reloaded every step, docs/perf-notes.md C68).
          const int kv_zero = T::kRowSteps ? opaque_zero() : 0;
          auto a_operand = [&](auto const& before_loop, auto const& slice, Element* base, auto layout) {
            if constexpr (T::kRowSteps) return slice.partition_fragment_A(make_tensor(make_smem_ptr(base + kv_zero), layout));
            else return before_loop;
          };
          gemm<true, -1>(mma_sdp, a_operand(tSrK, wg_sdp, ss.k.data(), typename T::SmemLayoutK{}),
                         tSrQ(_, _, _, read.index()), tSrS);
          BWD_TRACE(1);
          pipe_do.consumer_wait(read);
          gemm<true, -1>(mma_sdp, a_operand(tdPrV, wg_sdp, ss.v.data(), typename T::SmemLayoutK{}),
                         tdPrdO(_, _, _, read.index()), tdPrdP);
          BWD_TRACE(2);

          // lse (log2 domain) and delta of the step's queries, loaded with its tiles; the
          // padding past Lq holds +inf and 0, so those columns get P = 0.
          constexpr bool kByHand = T::kDsStoreByHand && !kCuteDsStore;
          const int cols = kByHand ? 2 * (thread_index_here() & 3) : col_base;   // == col_base
          const float* lse2 = ss.lse2[read.index()] + cols;
          const float* delta = ss.delta[read.index()] + cols;
          // (zeros never read: they keep the front end from warning that the lambdas below
          // read delta_early before it is set, which they do not)
          constexpr int kEarlyPairs = kStatsEarly > 0 ? kStatsEarly : 1;
          float2 lse_early[kEarlyPairs] = {}, delta_early[kEarlyPairs] = {};
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < kStatsEarly; ++e) lse_early[e] = *reinterpret_cast<const float2*>(lse2 + 8 * e);
          warpgroup_wait<1>();
          warpgroup_fence_operand(tSrS);
          BWD_TRACE(3);
          Tensor S = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
          // Element predicates of partial tiles: hidden scores become -inf (raw).
          if (partial) {
            if (interval) {
              CUTLASS_PRAGMA_UNROLL
              for (int r = 0; r < kRows; ++r) {
                CUTLASS_PRAGMA_UNROLL
                for (int c = 0; c < kCols; ++c) {
                  const int i = i0 + col_base + 8 * (c / 2) + (c & 1);
                  S(r, c) = unsigned(i - vis[r].x) < unsigned(vis[r].y) ? S(r, c) : -INFINITY;
                }
              }
            } else if (staged) {
              CUTLASS_PRAGMA_UNROLL
              for (int r = 0; r < kRows; ++r) {
                const int4* slots = reinterpret_cast<const int4*>(ss.col_ranges[row_base + 8 * r]);
                const int4 a = slots[0];
                const int4 z = pr.n_col_ranges > 2 ? slots[1] : make_int4(0, 0, 0, 0);
                CUTLASS_PRAGMA_UNROLL
                for (int c = 0; c < kCols; ++c) {
                  const int i = i0 + col_base + 8 * (c / 2) + (c & 1);
                  const bool hidden = unsigned(i - a.x) < unsigned(a.y) || unsigned(i - a.z) < unsigned(a.w) ||
                                      unsigned(i - z.x) < unsigned(z.y) || unsigned(i - z.z) < unsigned(z.w);
                  S(r, c) = hidden ? -INFINITY : S(r, c);
                }
              }
            } else if (!kPlain && cr_base != nullptr) {
              CUTLASS_PRAGMA_UNROLL
              for (int r = 0; r < kRows; ++r) {
                const int32_t* cr = cr_base + (int64_t)min(jr[r], p.Lk - 1) * pr.cr_sk;
                for (int x = 0; x < pr.n_col_ranges; ++x) {
                  const int lo = __ldg(cr + 2 * x), hi = __ldg(cr + 2 * x + 1);
                  CUTLASS_PRAGMA_UNROLL
                  for (int c = 0; c < kCols; ++c) {
                    const int i = i0 + col_base + 8 * (c / 2) + (c & 1);
                    S(r, c) = unsigned(i - lo) < unsigned(max(hi - lo, 0)) ? -INFINITY : S(r, c);
                  }
                }
              }
            }
            if (bits_head != nullptr) {
              const int qblock = i0 / p.block_q;
              const int idx = __ldg(bits_head + (int64_t)qblock * pr.bi_sq + kb);
              if (idx >= 0 && idx < pr.bits_count) {
                // Both of this thread's keys sit in one 32-bit word of a bitmap row; the
                // step's queries sit in one query block (block_q is a multiple of kBlockM).
                const int word = (jr[0] - kb * p.block_k) >> 5;
                const int32_t* bits_rows = pr.bits + idx * pr.bits_sp +
                                           (i0 - qblock * p.block_q + col_base) * pr.bits_sr + word;
                CUTLASS_PRAGMA_UNROLL
                for (int c = 0; c < kCols; ++c) {
                  const uint32_t w = static_cast<uint32_t>(__ldg(bits_rows + (8 * (c / 2) + (c & 1)) * pr.bits_sr));
                  CUTLASS_PRAGMA_UNROLL
                  for (int r = 0; r < kRows; ++r)
                    S(r, c) = (w >> (jr[r] & 31)) & 1u ? S(r, c) : -INFINITY;
                }
              }
            }
            if (dense != nullptr) {
              CUTLASS_PRAGMA_UNROLL
              for (int c = 0; c < kCols; ++c) {
                const int i = min(i0 + col_base + 8 * (c / 2) + (c & 1), p.Lq - 1);
                CUTLASS_PRAGMA_UNROLL
                for (int r = 0; r < kRows; ++r) {
                  const int j = min(jr[r], p.Lk - 1);
                  const bool d = __ldg(dense + i * pr.dense_sq + j * pr.dense_sk) != 0;
                  S(r, c) = d ? S(r, c) : -INFINITY;
                }
              }
            }
          }
          Tensor dP = make_tensor(tdPrdP.data(), rowcol(tdPrdP.layout()));
          // P^T into S, dS^T (the gradient of the raw product Q K^T, unscaled) into dP.
          // Columns c, c + 1 are adjacent queries: their lse2 and delta are read in pairs.
          // Issue order after FlashAttention-3: dV, then (dS^T in shared memory from both
          // warpgroups) dQ, then dK; dQ goes to shared memory while dK runs.
          const float scale_log2 = p.scale * LOG2E;
          if (T::kBiasTiles || (!log2_scores && dbias == nullptr)) {
            // P^T while the dP^T product still runs, so that the exponentials overlap the
            // tensor cores; then dS^T. kBiasTiles (no softcap): the bias from the step's tile
            // in shared memory, and dbias (= dS^T before the softmax scale) back into it.
            Tensor tBrB = make_tensor<Element>(tSrS.layout());   // kBiasTiles: the bias
            Tensor Bias = make_tensor(tBrB.data(), rowcol(tBrB.layout()));
            if constexpr (T::kBiasTiles) {
              // FLEXSPARSE_CUDA_DEBUG bit 8192: the bias tile is read without waiting for it (one
              // thread waits at the step's end; wrong results, a probe of its latency only).
              const int bias_buf = step & bias_mask;
              if (!(p.debug & 8192)) Barrier::wait(&ss.bias_full[bias_buf], (step >> bias_shift) & 1);
              auto thr = s2r_bias.get_thread_slice(tid);
              Tensor sBiasT = make_tensor(make_smem_ptr(bias_smem + bias_buf * kBlockM * kBlockN),
                                          typename T::SmemLayoutBiasT{});
              copy(s2r_bias, thr.partition_S(sBiasT), thr.retile_D(tBrB));
            }
            // kDsInterleaved: only the first kEarly columns' exponentials before the dP^T
            // wait, then each column pair's dS^T right after the exponentials of a later pair.
            constexpr int kEarly = kDsInterleaved && !T::kBiasTiles ? (kCols / 8) * 2 : kCols;
            // P^T of columns c, c + 1 (adjacent queries: their lse2 read as a pair)
            auto exp_pair = [&](int c) {
              const float2 l = c / 2 < kStatsEarly ? lse_early[c / 2]
                                                   : *reinterpret_cast<const float2*>(lse2 + 8 * (c / 2));
              CUTLASS_PRAGMA_UNROLL
              for (int r = 0; r < kRows; ++r) {
                if constexpr (T::kBiasTiles) {
                  // (a hidden score stays hidden whatever its bias)
                  const float s0 = S(r, c) == -INFINITY ? -INFINITY
                      : fmaf(S(r, c), scale_log2, LOG2E * static_cast<float>(Bias(r, c)));
                  const float s1 = S(r, c + 1) == -INFINITY ? -INFINITY
                      : fmaf(S(r, c + 1), scale_log2, LOG2E * static_cast<float>(Bias(r, c + 1)));
                  S(r, c) = exp2f(s0 - l.x);
                  S(r, c + 1) = exp2f(s1 - l.y);
                } else {
                  S(r, c) = exp2f(S(r, c) * scale_log2 - l.x);
                  S(r, c + 1) = exp2f(S(r, c + 1) * scale_log2 - l.y);
                }
              }
            };
            auto ds_pair = [&](int c) {
              const float2 d = c / 2 < kStatsEarly ? delta_early[c / 2]
                                                   : *reinterpret_cast<const float2*>(delta + 8 * (c / 2));
              CUTLASS_PRAGMA_UNROLL
              for (int r = 0; r < kRows; ++r) {
                dP(r, c) = S(r, c) * (dP(r, c) - d.x);
                dP(r, c + 1) = S(r, c + 1) * (dP(r, c + 1) - d.y);
              }
            };
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < kEarly; c += 2) exp_pair(c);
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < kStatsEarly; ++e) delta_early[e] = *reinterpret_cast<const float2*>(delta + 8 * e);
            BWD_TRACE(4);
            warpgroup_wait<0>();                  // dP^T done
            warpgroup_fence_operand(tdPrdP);
            BWD_TRACE(5);
            if constexpr (kEarly < kCols) {
              CUTLASS_PRAGMA_UNROLL
              for (int c = 0; c < kCols; c += 2) {
                if (c + kEarly < kCols) exp_pair(c + kEarly);
                ds_pair(c);
              }
            } else {
              CUTLASS_PRAGMA_UNROLL
              for (int c = 0; c < kCols; c += 2) ds_pair(c);
            }
          } else if constexpr (!T::kBiasTiles) {
            // bias, softcap or dbias: P^T and dS^T in one pass once dP^T is done
            warpgroup_wait<0>();
            warpgroup_fence_operand(tdPrdP);
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < kCols; ++c) {
              const int i = i0 + col_base + 8 * (c / 2) + (c & 1);
              const int ic = 8 * (c / 2) + (c & 1);
              CUTLASS_PRAGMA_UNROLL
              for (int r = 0; r < kRows; ++r) {
                const float raw = S(r, c);
                float s, dtanh = 1.f;
                if (has_softcap) {
                  const float th = tanhf(raw * p.scale / p.softcap);
                  s = p.softcap * th;
                  dtanh = 1.f - th * th;
                } else {
                  s = raw * p.scale;
                }
                s *= LOG2E;
                if (has_bias)
                  s += LOG2E * static_cast<float>(
                      bias[min(i, p.Lq - 1) * p.bias_sq + min(jr[r], p.Lk - 1) * p.bias_sk]);
                s = raw == -INFINITY ? -INFINITY : s;
                const float pv = exp2f(s - lse2[ic]);
                const float ds = pv * (dP(r, c) - delta[ic]);
                if (dbias != nullptr && i < p.Lq && jr[r] < p.Lk)
                  dbias[i * bp.dbias_sq + jr[r] * bp.dbias_sk] = static_cast<Element>(ds);
                S(r, c) = pv;
                dP(r, c) = ds * dtanh;
              }
            }
          }
          Tensor tdVrP_ = convert_type<Element>(tSrS);
          Tensor tdKrdS_ = convert_type<Element>(tdPrdP);
          // dS^T buffer: the step count's parity (not the pipeline stage's: the head's end
          // takes a stage, and the buffers must alternate between consecutive steps, whose
          // dQ products read both warpgroups' dS^T), made warp-uniform with a shuffle so that
          // ptxas keeps the dQ product's descriptors in uniform registers.
          const int buf = __shfl_sync(0xffffffff, step, 0) & 1;
          Tensor tdQrdQ = partition_fragment_C(mma_dq, typename T::DqShape{});
          if constexpr (T::kSplitQueries) {
            // Both warpgroups' halves of P^T and dS^T to shared memory, then dV, dQ and dK
            // over all of the step's queries. (The buffer written here was last read by the
            // wgmmas of two steps ago, which both warpgroups waited for before the last step's
            // barrier.)
            copy(smem_copy_ds, thr_copy_ds.retile_S(tdVrP_), tPsP(_, _, _, buf));
            copy(smem_copy_ds, thr_copy_ds.retile_S(tdKrdS_), tdSsdS(_, _, _, buf));
            cutlass::arch::fence_view_async_shared();
            cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierdS);
            gemm<false, -1>(mma_dkv, tdVrPt(_, _, _, buf), tdVrdO(_, _, _, read.index()), tdVrdV);
            gemm<true, 1>(mma_dq, tdQrdS(_, _, _, buf), tdQrK, tdQrdQ);     // dV done
            pipe_do.consumer_release(read);
            gemm<false, 1>(mma_dkv, tdKrdSt(_, _, _, buf), tdKrQ(_, _, _, read.index()), tdKrdK);   // dQ done
          } else {
            Tensor tdVrP = make_tensor(tdVrP_.data(), accumulator_as_a(tSrS.layout()));
            if constexpr (!kDsFirst) gemm<false, -1>(mma_dkv, tdVrP, tdVrdO(_, _, _, read.index()), tdVrdV);
            Tensor tdKrdS = make_tensor(tdKrdS_.data(), accumulator_as_a(tdPrdP.layout()));
            if constexpr (kByHand) {
              // CuTe's copy computed the four swizzled addresses on a 64-bit pointer every
              // step (~35 instructions and a spilled offset, C86): one 32-bit base instead.
              const uint32_t at = cute::cast_smem_ptr_to_uint(ss.ds.data()) + buf * (kBlockM * kBlockN * sizeof(Element)) +
                                  ds_store_offset(thread_index_here() - 128);
              Tensor src = thr_copy_ds.retile_S(tdKrdS_);   // ((8, 4), 1, 1): 8 values per store
              CUTLASS_PRAGMA_UNROLL
              for (int k = 0; k < 4; ++k) {
                Tensor r = recast<uint32_t>(src(make_coord(_, k), 0, 0));
                stmatrix_x4(at ^ (32 * k), r(0), r(1), r(2), r(3));
              }
            } else if constexpr (T::kDsStoreTransByHand && !kCuteDsStore) {
              // (the stores at CuTe's addresses took ~30 instructions of 64-bit swizzle
              // arithmetic per step on the path to the dS barrier, C105)
              const uint32_t at = cute::cast_smem_ptr_to_uint(ss.ds.data()) + buf * (kBlockM * kBlockN * sizeof(Element)) +
                                  ds_store_offset_keys_contiguous<kBlockM>(thread_index_here() - 128);
              Tensor src = thr_copy_ds.retile_S(tdKrdS_);   // ((8, kBlockM / 16), 1, 1)
              CUTLASS_PRAGMA_UNROLL
              for (int k = 0; k < kBlockM / 16; ++k) {
                Tensor r = recast<uint32_t>(src(make_coord(_, k), 0, 0));
                stmatrix_x4_trans(at + 2048 * k, r(0), r(1), r(2), r(3));
              }
            } else {
              copy(smem_copy_ds, thr_copy_ds.retile_S(tdKrdS_), tdSsdS(_, _, _, buf));
            }
            if constexpr (kDsFirst) gemm<false, -1>(mma_dkv, tdVrP, tdVrdO(_, _, _, read.index()), tdVrdV);
            cutlass::arch::fence_view_async_shared();
            BWD_TRACE(6);
            // kBiasTiles: the last step's dbias store has read its dS buffer before anyone
            // passes this barrier (the next step writes that buffer).
            if constexpr (T::kBiasTiles) {
              if (store_dbias && tid == 0) tma_store_wait<0>();
            }
            cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierdS);
            BWD_TRACE(7);
            if constexpr (T::kBiasTiles) {
              if (tid == 0) {
                // FLEXSPARSE_CUDA_DEBUG bit 4096: no dbias store (wrong dbias; timing probes only).
                if (store_dbias && !(p.debug & 4096)) {   // the step's dbias tile, clipped to (Lq, Lk) by TMA
                  Tensor sdB = make_tensor(make_smem_ptr(ss.ds.data() + buf * T::kBlockM * T::kBlockN),
                                           typename T::SmemLayoutBias{});
                  Tensor mdB = kp.tma_dbias.get_tma_tensor(make_shape(p.Lq, p.Lk, p.Hq, p.B));
                  auto cta_db = kp.tma_dbias.get_slice(0);
                  tma_store(kp.tma_dbias, cta_db.partition_S(sdB),
                            cta_db.partition_D(local_tile(mdB(_, _, h, b), Shape<Int<kBlockM>, Int<kBlockN>>{},
                                                          make_coord(m, n_block))),
                            store_hints);
                  tma_store_arrive();
                }
                // The bias buffer is free: every thread has used its bias registers (the
                // barrier), so the next step's tile loads while this one's products run.
                if (p.debug & 8192) Barrier::wait(&ss.bias_full[step & bias_mask], (step >> bias_shift) & 1);
                cutlass::arch::ClusterBarrier::arrive(&ss.bias_empty[step & bias_mask]);
              }
            }
            // dQ = dS K over this CTA's keys, this warpgroup's half of it (TiledMmadQ).
            if constexpr (T::kDqSwapAB)
              gemm<true, 1>(mma_dq, a_operand(tdQrK, wg_dq, ss.k.data(), typename T::SmemLayoutKt{}),
                            tdQrdS(_, _, _, buf), tdQrdQ);
            else gemm<true, 1>(mma_dq, tdQrdS(_, _, _, buf), tdQrK, tdQrdQ);     // dV done
            BWD_TRACE(8);
            pipe_do.consumer_release(read);
            gemm<false, 1>(mma_dkv, tdKrdS, tdKrQ(_, _, _, read.index()), tdKrdK);   // dQ done
            BWD_TRACE(9);
          }
          warpgroup_fence_operand(tdQrdQ);
          // dQ to shared memory for the dQ writer warp, once it has freed this half.
          cutlass::arch::NamedBarrier::sync(128 + 32, kBarrierdQEmpty + wg);
          if constexpr (kDqPairs) {
            CUTLASS_PRAGMA_UNROLL
            for (int x = 0; x < size(tdQrdQ); x += 2)
              *reinterpret_cast<float2*>(sdQ + dq_slot<true>(x, tid)) = make_float2(tdQrdQ(x), tdQrdQ(x + 1));
          } else {
            static_assert(decltype(size(tdQrdQ))::value % 4 == 0, "dQ in runs of four entries");
            CUTLASS_PRAGMA_UNROLL
            for (int x = 0; x < size(tdQrdQ); x += 4)
              *reinterpret_cast<float4*>(sdQ + dq_slot<false>(x, tid)) =
                  make_float4(tdQrdQ(x), tdQrdQ(x + 1), tdQrdQ(x + 2), tdQrdQ(x + 3));
          }
          cutlass::arch::fence_view_async_shared();
          cutlass::arch::NamedBarrier::arrive(128 + 32, kBarrierdQFull + wg);
          BWD_TRACE(10);
          warpgroup_wait<0>();                    // dK done
          warpgroup_fence_operand(tdVrdV);
          warpgroup_fence_operand(tdKrdK);
          BWD_TRACE(11);
          pipe_q.consumer_release(read);
          ++read;
          ++step;
        }
      }
#ifdef FLEXSPARSE_BWD_TRACE
      BWD_TRACE_CALIBRATE(1);
      if (tid == 0) {
        BWD_LIFE(3, bwd_clock());
        BWD_LIFE(7, step - tile_first_step);
      }
#endif
      // kBiasTiles: the last dbias store has read its dS buffer before the epilogue reuses
      // shared memory (and before the CTA's shared memory goes).
      if constexpr (T::kBiasTiles) {
        if (store_dbias && tid == 0) tma_store_wait<0>();
      }

      // ------------------------------------------------------------------ epilogue
      // dK gets the softmax scale here (dQ gets it in the postprocess kernel). dK and dV go
      // through the key and value buffers (free once every wgmma is done), in the layout the
      // tiles arrived in, then out by one TMA store each (rows past Lk clipped by the tensor
      // map), as FlashAttention-3/4's epilogue: no loop of 16-byte stores and no waits for
      // them in the consumers (docs/perf-notes.md C28, C116). The persistent kernel's goes
      // through the dQ buffer instead (C118), so that the next tile's K and V can load.
      if constexpr (kPersistent) {
        typename T::SmemCopydKV smem_copy_dkv;
        auto thr_copy_dkv = smem_copy_dkv.get_thread_slice(tid);
        CUTLASS_PRAGMA_UNROLL
        for (int x = 0; x < size(tdKrdK); ++x) tdKrdK(x) *= p.scale;
        Tensor rdK = convert_type<Element>(tdKrdK);
        Tensor rdV = convert_type<Element>(tdVrdV);
        // kPersistent: K and V are free once every wgmma is done, so the next tile's load
        // there while dK and dV go out through the dQ buffer (one bf16 key tile: 128 x 128
        // x 2 bytes = 64 x 128 floats), one after the other.
        static_assert(cosize_v<typename T::SmemLayoutK> * sizeof(Element) <= kBlockM * kHeadDim * sizeof(float),
                      "a dK / dV tile fits the dQ buffer");
        static_assert(offsetof(typename T::SharedStorage, dq) % 1024 == 0, "the dQ buffer takes SmemLayoutK's swizzle");
        Tensor sdKV = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(ss.dq)), typename T::SmemLayoutK{});
        auto store = [&](auto const& tma) {
          store_key_tile(tma, sdKV);
          tma_store_arrive();
          tma_store_wait<0>();   // the dQ buffer's next writer waits for these reads
        };
        cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierdS);   // every wgmma is done
        if (tid == 0) cutlass::arch::ClusterBarrier::arrive(&slots.kv_empty);
        cutlass::arch::NamedBarrier::sync(128 + 32, kBarrierdQEmpty + wg);   // the dQ writer is done with sdQ
        cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierdS);       // (both halves)
        copy(smem_copy_dkv, thr_copy_dkv.retile_S(rdK), thr_copy_dkv.partition_D(sdKV));
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierdS);
        if (tid == 0) store(kp.tma_dk);
        cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierdS);   // dK read out of sdQ
        copy(smem_copy_dkv, thr_copy_dkv.retile_S(rdV), thr_copy_dkv.partition_D(sdKV));
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierdS);
        if (tid == 0) {
          store(kp.tma_dv);
          BWD_LIFE(4, bwd_clock());
        }
        cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierdS);   // dV read out of sdQ
        cutlass::arch::NamedBarrier::arrive(128 + 32, kBarrierdQFull + wg);   // sdQ free (the dQ writer)
        if (!read_tile(iter + 1)) break;
        clear(tdVrdV);
        clear(tdKrdK);
        continue;
      }
      typename T::SmemCopydKV smem_copy_dkv;
      auto thr_copy_dkv = smem_copy_dkv.get_thread_slice(tid);
      Tensor sdK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
      Tensor sdV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutK{});
      CUTLASS_PRAGMA_UNROLL
      for (int x = 0; x < size(tdKrdK); ++x) tdKrdK(x) *= p.scale;
      Tensor rdK = convert_type<Element>(tdKrdK);
      Tensor rdV = convert_type<Element>(tdVrdV);
      cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierdS);   // every wgmma is done
      copy(smem_copy_dkv, thr_copy_dkv.retile_S(rdK), thr_copy_dkv.partition_D(sdK));
      copy(smem_copy_dkv, thr_copy_dkv.retile_S(rdV), thr_copy_dkv.partition_D(sdV));
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierdS);
      if (tid == 0) {
        store_key_tile(kp.tma_dk, sdK);
        store_key_tile(kp.tma_dv, sdV);
        tma_store_arrive();
        tma_store_wait<0>();   // shared memory outlives the stores' reads
        BWD_LIFE(4, bwd_clock());
      }
      break;   // (one tile per CTA)
    }
  }
#endif
}

// delta = rowsum(dO * O) - grad_lse and lse2 = lse * log2(e) (+inf for rows with no
// visible key and for the padding up to Lq_pad), one warp per row; zeroes dq_accum and
// the persistent backward's tile counter.
template <class Element>
__global__ void bwd_preprocess(BackwardParams const bp, float* dq_accum, float* lse2,
                               float* delta, int* dq_turn, int Lq_pad, int* tile_counter) {
  AttentionParams const& p = bp.fwd;
  if (blockIdx.x + blockIdx.y + blockIdx.z + threadIdx.x == 0) *tile_counter = 0;
  const int warps = blockDim.x / 32;
  const int i = blockIdx.x * warps + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = blockIdx.y, b = blockIdx.z;
  if (i >= Lq_pad) return;
  const int64_t row = ((int64_t)b * p.Hq + h) * Lq_pad + i;
  // Four head-dim entries per lane and access (the backward's head dims are multiples of
  // 4; out is contiguous and dout TMA-aligned, so the 8-byte loads are aligned).
  float* acc = dq_accum + row * p.D;
  for (int d = 4 * lane; d < p.D; d += 128) *reinterpret_cast<float4*>(acc + d) = make_float4(0.f, 0.f, 0.f, 0.f);
  if (dq_turn != nullptr && i % 64 == 0 && lane < 2) dq_turn[(row / 64) * 2 + lane] = 0;
  float sum = 0.f;
  float l2 = INFINITY;
  if (i < p.Lq) {
    const Element* o = static_cast<const Element*>(p.out) + (((int64_t)b * p.Hq + h) * p.Lq + i) * p.D;
    const Element* dout = static_cast<const Element*>(bp.dout) + b * bp.do_sb + h * bp.do_sh + i * bp.do_sm;
    using Quad = cutlass::Array<Element, 4>;
    for (int d = 4 * lane; d < p.D; d += 128) {
      const Quad x = *reinterpret_cast<const Quad*>(o + d);
      const Quad y = *reinterpret_cast<const Quad*>(dout + d);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 4; ++e) sum += static_cast<float>(x[e]) * static_cast<float>(y[e]);
    }
    const float l = p.lse[((int64_t)b * p.Hq + h) * p.Lq + i];
    l2 = l == -INFINITY ? INFINITY : l * 1.4426950408889634f;
  }
  #pragma unroll
  for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, s);
  if (lane == 0) {
    if (bp.grad_lse != nullptr && i < p.Lq) sum -= bp.grad_lse[((int64_t)b * p.Hq + h) * p.Lq + i];
    delta[row] = sum;
    lse2[row] = l2;
  }
}

// The same, with kHeadDim / 8 threads per row, each reading 16 bytes of O and of dO and
// zeroing 32 bytes of dq_accum (the one-warp-per-row version above moves 8 bytes per lane
// and ran at ~2.5 TB/s: 102 us of a sliding-window backward's ~950, docs/perf-notes.md
// C28). Lq_pad is a multiple of 128 or of 80, so every CTA's rows exist (16 to 32 per CTA);
// rows past Lq are padding.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(256)
bwd_preprocess_wide(BackwardParams const bp, float* dq_accum, float* lse2, float* delta,
                    int* dq_turn, int Lq_pad, bool zero_accum, int* tile_counter) {
  if (blockIdx.x + blockIdx.y + blockIdx.z + threadIdx.x == 0) *tile_counter = 0;
  constexpr int kThreadsPerRow = kHeadDim / 8;     // 8, 16 or 32
  constexpr int kRowsPerCta = 256 / kThreadsPerRow;
  static_assert(sizeof(Element) == 2 && kThreadsPerRow <= 32 && 128 % kRowsPerCta == 0, "16-bit, hd <= 256");
  AttentionParams const& p = bp.fwd;
  const int part = threadIdx.x % kThreadsPerRow;
  const int i = blockIdx.x * kRowsPerCta + threadIdx.x / kThreadsPerRow;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t row = ((int64_t)b * p.Hq + h) * Lq_pad + i;
  float sum = 0.f;
  float l2 = INFINITY;
  if (i < p.Lq) {
    const Element* o = static_cast<const Element*>(p.out) + (((int64_t)b * p.Hq + h) * p.Lq + i) * kHeadDim;
    const Element* dout = static_cast<const Element*>(bp.dout) + b * bp.do_sb + h * bp.do_sh + i * bp.do_sm;
    using Eight = cutlass::Array<Element, 8>;
    const Eight x = *reinterpret_cast<const Eight*>(o + 8 * part);
    const Eight y = *reinterpret_cast<const Eight*>(dout + 8 * part);
    const float l = p.lse[((int64_t)b * p.Hq + h) * p.Lq + i];
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 8; ++e) sum += static_cast<float>(x[e]) * static_cast<float>(y[e]);
    l2 = l == -INFINITY ? INFINITY : l * 1.4426950408889634f;
  }
  if (zero_accum) {
    float4* acc = reinterpret_cast<float4*>(dq_accum + row * kHeadDim);
    acc[part] = make_float4(0.f, 0.f, 0.f, 0.f);
    acc[part + kThreadsPerRow] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (dq_turn != nullptr && i % 64 == 0 && part < 2) dq_turn[(row / 64) * 2 + part] = 0;
  CUTLASS_PRAGMA_UNROLL
  for (int s = kThreadsPerRow / 2; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, s);
  if (part == 0) {
    if (bp.grad_lse != nullptr && i < p.Lq) sum -= bp.grad_lse[((int64_t)b * p.Hq + h) * p.Lq + i];
    delta[row] = sum;
    lse2[row] = l2;
  }
}

// dq = scale * dq_accum, one kBlockM-row step per CTA of 256 threads: thread t reads the
// entries consumer thread t wrote (dq_slot, coalesced) and finds their (row, column) as the
// dQ product's thread slice t holds them; the converted tile goes through shared memory so
// that dq is written in 16-byte pieces of whole rows. (Stored from the fragments directly,
// each warp store covered 8 rows x 16 bytes, and the kernel moved 1 TB/s: 207 us of a
// 1.1 ms sliding-window backward; docs/perf-notes.md C28.)
template <class T, bool kDqPairs = false>
__global__ void __launch_bounds__(256)
bwd_postprocess(BackwardParams const bp, const float* dq_accum, int Lq_pad) {
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM, kHeadDim = T::kHeadDim;
  // Rows padded by 16 bytes: a warp's 4-byte stores (8 rows x 4 column pairs) hit 32
  // different banks.
  constexpr int kRowStride = kHeadDim + 16 / sizeof(Element);
  __shared__ __align__(16) uint16_t tile_raw[kBlockM * kRowStride];   // 16-bit elements
  static_assert(sizeof(Element) == 2, "fp16 / bf16");
  Element* tile = reinterpret_cast<Element*>(tile_raw);
  AttentionParams const& p = bp.fwd;
  const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  typename T::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(typename T::DqShape{}));
  const float* acc = dq_accum + (((int64_t)b * p.Hq + h) * Lq_pad + m * kBlockM) * kHeadDim +
                     (tid / 128) * (kBlockM * kHeadDim / 2);
  // entries x, x + 1 (a pair of adjacent head-dim entries) into the tile
  auto put = [&](int x, float a, float c) {
    if constexpr (T::kDqSwapAB) {
      // entries x, x + 1: (d, i) and (d, i + 1)
      const int d = get<0>(tdQcdQ(x)), i = get<1>(tdQcdQ(x));
      tile[i * kRowStride + d] = static_cast<Element>(a * p.scale);
      tile[(i + 1) * kRowStride + d] = static_cast<Element>(c * p.scale);
    } else {
      const int i = get<0>(tdQcdQ(x)), d = get<1>(tdQcdQ(x));
      cutlass::NumericArrayConverter<Element, float, 2> cvt;
      *reinterpret_cast<cutlass::Array<Element, 2>*>(tile + i * kRowStride + d) =
          cvt(cutlass::Array<float, 2>{{a * p.scale, c * p.scale}});
    }
  };
  if constexpr (kDqPairs) {
    CUTLASS_PRAGMA_UNROLL
    for (int x = 0; x < size(tdQcdQ); x += 2) {
      const float2 v = *reinterpret_cast<const float2*>(acc + dq_slot<true>(x, tid));
      put(x, v.x, v.y);
    }
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int x = 0; x < size(tdQcdQ); x += 4) {
      const float4 v = *reinterpret_cast<const float4*>(acc + dq_slot<false>(x, tid));
      put(x, v.x, v.y);
      put(x + 2, v.z, v.w);
    }
  }
  __syncthreads();
  constexpr int kChunksPerRow = kHeadDim * sizeof(Element) / 16;
  static_assert(kChunksPerRow * 16 == kHeadDim * sizeof(Element), "rows of 16-byte pieces");
  const int rows = min(kBlockM, p.Lq - m * kBlockM);
  Element* dq = static_cast<Element*>(bp.dq) + (((int64_t)b * p.Hq + h) * p.Lq + m * kBlockM) * kHeadDim;
  for (int c = tid; c < rows * kChunksPerRow; c += 256) {
    const int i = c / kChunksPerRow, k = c % kChunksPerRow;
    *reinterpret_cast<uint4*>(dq + (int64_t)i * kHeadDim + k * (16 / sizeof(Element))) =
        *reinterpret_cast<const uint4*>(tile + i * kRowStride + k * (16 / sizeof(Element)));
  }
}

template <class T>
void launch_bwd(BackwardParams const& bp, cudaStream_t stream) {
  using Element = typename T::Element;
  AttentionParams const& p = bp.fwd;
  const int Lq_pad = bwd_lq_pad(p, T::kBlockM);
  const int64_t rows = (int64_t)p.B * p.Hq * Lq_pad;
  float* dq_accum = static_cast<float*>(bp.workspace);
  float* lse2 = dq_accum + rows * p.D;
  float* delta = lse2 + rows;
  int* dq_turn = bp.deterministic ? reinterpret_cast<int*>(delta + rows) : nullptr;
  // The persistent kernel's tile counter (below): the workspace's last word, zeroed by the
  // preprocess on every launch (one store).
  int* tile_counter = reinterpret_cast<int*>(static_cast<char*>(bp.workspace) + bwd_sm90_workspace_bytes(bp)) - 1;

  // FLEXSPARSE_CUDA_DEBUG bit 33554432: the one-warp-per-row preprocess; bit 67108864:
  // dq_accum zeroed by cudaMemsetAsync instead of in the (wide) preprocess (A/Bs).
  if (p.debug & 33554432) {
    bwd_preprocess<Element><<<dim3((Lq_pad + 7) / 8, p.Hq, p.B), 256, 0, stream>>>(
        bp, dq_accum, lse2, delta, dq_turn, Lq_pad, tile_counter);
  } else {
    const bool memset_accum = p.debug & 67108864;
    if (memset_accum)
      CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, rows * p.D * sizeof(float), stream));
    constexpr int kRowsPerCta = 256 / (T::kHeadDim / 8);
    bwd_preprocess_wide<Element, T::kHeadDim><<<dim3(Lq_pad / kRowsPerCta, p.Hq, p.B), 256, 0, stream>>>(
        bp, dq_accum, lse2, delta, dq_turn, Lq_pad, !memset_accum, tile_counter);
  }
  CUDA_CHECK(cudaGetLastError());

  auto gmem = [&](const void* ptr, int L, int H, int64_t sl, int64_t sh, int64_t sb) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                       make_shape(L, p.D, H, p.B), make_stride(sl, _1{}, sh, sb));
  };
  auto tile_q = Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{};
  auto tile_k = Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{};
  typename T::KernelParams kp{
      bp, dq_accum, lse2, delta, Lq_pad, dq_turn,
      make_tma_copy(SM90_TMA_LOAD{}, gmem(p.q, p.Lq, p.Hq, p.q_sm, p.q_sh, p.q_sb),
                    take<0, 2>(typename T::SmemLayoutQ{}), tile_q, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gmem(bp.dout, p.Lq, p.Hq, bp.do_sm, bp.do_sh, bp.do_sb),
                    take<0, 2>(typename T::SmemLayoutQ{}), tile_q, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gmem(p.k, p.Lk, p.Hkv, p.k_sn, p.k_sh, p.k_sb),
                    typename T::SmemLayoutK{}, tile_k, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gmem(p.v, p.Lk, p.Hkv, p.v_sn, p.v_sh, p.v_sb),
                    typename T::SmemLayoutK{}, tile_k, _1{}),
      {}, {}, {}};   // the bias's TMAs and the dK / dV stores: below
  {   // dK and dV (B, Hkv, Lk, D), contiguous (the op allocates them), by TMA stores
    auto gmem_out = [&](void* ptr) {
      return make_tensor(make_gmem_ptr(static_cast<Element*>(ptr)), make_shape(p.Lk, p.D, p.Hkv, p.B),
                         make_stride((int64_t)p.D, _1{}, (int64_t)p.Lk * p.D, (int64_t)p.Hkv * p.Lk * p.D));
    };
    kp.tma_dk = make_tma_copy(SM90_TMA_STORE{}, gmem_out(bp.dk), typename T::SmemLayoutK{}, tile_k, _1{});
    kp.tma_dv = make_tma_copy(SM90_TMA_STORE{}, gmem_out(bp.dv), typename T::SmemLayoutK{}, tile_k, _1{});
  }
  if constexpr (T::kBiasTiles) {
    auto tile_b = Shape<Int<T::kBlockM>, Int<T::kBlockN>>{};
    kp.tma_bias = make_bias_tma<Element>(p, typename T::SmemLayoutBias{}, tile_b, kp.bias_heads,
                                         kp.bias_batches);
    if (bp.dbias != nullptr) {
      // dbias (Lq, Lk, Hq, B): the steps' tiles (zero_unlisted_dbias writes the rest)
      auto dbias = make_tensor(make_gmem_ptr(static_cast<Element*>(bp.dbias)), make_shape(p.Lq, p.Lk, p.Hq, p.B),
                               make_stride(bp.dbias_sq, _1{}, bp.dbias_sh, bp.dbias_sb));
      kp.tma_dbias = make_tma_copy(SM90_TMA_STORE{}, dbias, typename T::SmemLayoutBias{}, tile_b, _1{});
    }
  }
  // FLEXSPARSE_CUDA_DEBUG bit 2^40: CuTe's dS^T stores (before C86); 2^41: dQ staged in
  // 8-byte pieces (before C87). A/Bs.
  const bool dq_pairs = p.debug_high & 1024;
  auto kernel = dq_pairs ? bwd_kernel<T, false, true> : bwd_kernel<T>;
  if constexpr (T::kDsStoreByHand || T::kDsStoreTransByHand) {
    if (p.debug_high & 512) kernel = dq_pairs ? bwd_kernel<T, true, true> : bwd_kernel<T, true>;
  }
  // bit 2^46: the other place for the dS^T stores than the kernel's kDsFirst (C106); 2^47:
  // the other exponentials' order than its kDsInterleaved (C107). A/Bs, in the kernels
  // that have the variants (BwdTraits::kOrderVariants).
  if constexpr (T::kOrderVariants) {
    const bool ds_first = T::kDsFirst != bool(p.debug_high & (1 << 15));
    const bool interleaved = T::kDsInterleaved != bool(p.debug_high & (1 << 16));
    if (ds_first != T::kDsFirst || interleaved != T::kDsInterleaved) {
      if (ds_first && interleaved) kernel = bwd_kernel<T, false, false, true, true>;
      else if (ds_first) kernel = bwd_kernel<T, false, false, true, false>;
      else if (interleaved) kernel = bwd_kernel<T, false, false, false, true>;
      else kernel = bwd_kernel<T, false, false, false, false>;
    }
  }
  // bit 2^49 (bf16 head dim 128 without bias tiles): the kernel's own order with the other
  // of 0 and 1 lse and delta pairs read before the waits than its kStatsEarly (C110).
  if constexpr (T::kHeadDim == 128 && !T::kBiasTiles && std::is_same_v<Element, cutlass::bfloat16_t>) {
    if (p.debug_high & (1 << 18))
      kernel = bwd_kernel<T, false, false, T::kDsFirst, T::kDsInterleaved, T::kStatsEarly == 1 ? 0 : 1>;
  }
  static_assert(T::kSmemBytes <= 227 * 1024, "shared memory of one CTA per SM");
  int smem = T::kSmemBytes;
  dim3 grid((p.Lk + T::kBlockN - 1) / T::kBlockN, p.Hkv, p.B);
  // The persistent backward (C118): one CTA per SM drawing key tiles from the counter, in
  // the bf16 hd128 64-row general kernel (sliding windows, documents, causal, prefix-LM,
  // shared-question; +1-3% there against one CTA per key tile, docs/perf-notes.md C118),
  // where no A/B variant above was asked for. FLEXSPARSE_CUDA_DEBUG bit 2^53 takes one CTA
  // per key tile. (hd64's 128-row kernel made persistent the same way measured even, C120.)
  constexpr bool kHasPersistent = !T::kBiasTiles && std::is_same_v<Element, cutlass::bfloat16_t> &&
                                  T::kHeadDim == 128 && T::kBlockM == 64;
  if constexpr (kHasPersistent) {
    const bool persistent = kernel == bwd_kernel<T> && !(p.debug_high & (1 << 22));
    if (persistent) {
      static_assert(T::kPersistentSmemBytes <= 227 * 1024, "shared memory of one CTA per SM");
      kernel = bwd_kernel<T, false, false, T::kDsFirst, T::kDsInterleaved, T::kStatsEarly, true>;
      smem = T::kPersistentSmemBytes;
      kp.tile_counter = tile_counter;
      const int tiles = grid.x * grid.y * grid.z;
      grid = dim3(std::min(tiles, sm_count()));
    }
  }
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
#ifdef FLEXSPARSE_BWD_TRACE
  trace_clear(bwd_trace_buf, sizeof(bwd_trace_buf), stream);
  trace_clear(bwd_life_buf, sizeof(bwd_life_buf), stream);
#endif
  kernel<<<grid, T::kThreads, smem, stream>>>(kp);
  CUDA_CHECK(cudaGetLastError());
#ifdef FLEXSPARSE_BWD_TRACE
  trace_fetch(bwd_trace_buf, bwd_trace_host(), sizeof(bwd_trace_buf), stream);
  trace_fetch(bwd_life_buf, bwd_life_host(), sizeof(bwd_life_buf), stream);
#endif

  auto postprocess = dq_pairs ? bwd_postprocess<T, true> : bwd_postprocess<T>;
  postprocess<<<dim3(Lq_pad / T::kBlockM, p.Hq, p.B), 256, 0, stream>>>(bp, dq_accum, Lq_pad);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace flexsparse::sm90
