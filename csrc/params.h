// Kernel arguments of the CUDA backend, filled once on the host (attention_ops.cpp) from
// the op's tensors. Semantics of every tensor: docs/design.md ("The op").
#pragma once
#include <cstdint>

namespace flexsparse {

// One family of block lists (partial or full) read row by row: the kv lists of a query
// block (forward, dQ) or the q lists of a key block (dK/dV). count is (Bd, Hd, n_rows);
// index is either explicit (Bd, Hd, n_rows, width) or the range form
// (Bd, Hd, n_rows, ranges, 2) of half-open block ranges. Both contiguous (the host makes
// them so). Batch index b reads row b * batch_stride (0 when Bd == 1), head h reads
// h / head_div. Lists whose rows are all the same (row_stride 0: the descriptor's tensors
// expanded from one row, as the full mask's kv lists are) keep that one row per head, so
// any row reads it: a kernel may then take work tiles that straddle descriptor rows.
struct BlockListParams {
  const int32_t* count = nullptr;   // nullptr: the list is empty in every row
  const int32_t* index = nullptr;
  int64_t batch_stride = 0;         // in rows
  int64_t head_stride = 0;          // in rows
  int row_stride = 1;               // in rows: 1, or 0 where every row is the same
  int head_div = 1;
  int width = 0;                    // explicit form: entries per row; range form: 2 * ranges
  int ranges = 0;                   // 0: explicit indices, else the number of ranges per row
  int n_blocks = 0;                 // blocks along the listed dimension (bounds check)
};

// Element predicates of partial blocks; all present ones are ANDed.
struct PredicateParams {
  // dense bool mask, broadcastable (B, H, Lq, Lk); strides 0 where broadcast.
  const uint8_t* dense = nullptr;
  int64_t dense_sb = 0, dense_sh = 0, dense_sq = 0, dense_sk = 0;
  int dense_head_div = 1;
  // column ranges (Bc, Hc, Lk, 2m): key column j hides rows in [start_r, end_r).
  const int32_t* col_ranges = nullptr;
  int64_t cr_sb = 0, cr_sh = 0, cr_sk = 0;
  int cr_head_div = 1;
  int n_col_ranges = 0;
  // bitmaps of partial blocks: bits_index (Bd, Hd, nQB, nKB), bits (P, block_q, words).
  const int32_t* bits_index = nullptr;
  int64_t bi_sb = 0, bi_sh = 0, bi_sq = 0;
  int bi_head_div = 1;
  const int32_t* bits = nullptr;
  int64_t bits_sp = 0, bits_sr = 0;
  int bits_count = 0;             // P: an index outside [0, P) reads no bitmap, as -1
  // The descriptor's window hint, int32 (left, right) on the device, or null: the column
  // ranges are sliding_window(left, right)'s (query i sees key j iff i' - left <= j <=
  // i' + right, i' = i + Lk - Lq), so the forward's band kernels (kBandMasks) hide the
  // partial tiles' scores by it instead of staging the ranges (perf-notes C113), and the
  // backward takes each key's visible rows from it (C114).
  const int32_t* window = nullptr;
};

// What every attention kernel reads and writes besides its mask: query, key, value, the
// optional bias, out and lse, and the score's scale and softcap. The block kernels
// (AttentionParams) and the index kernels (IndexParams) extend it with their sizes and mask.
struct AttentionTensors {
  // query (B, Hq, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, D): last dim contiguous,
  // 16-byte aligned base and row strides (the host copies what is not).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_sb = 0, q_sh = 0, q_sm = 0;
  int64_t k_sb = 0, k_sh = 0, k_sn = 0;
  int64_t v_sb = 0, v_sh = 0, v_sn = 0;
  // out (B, Hq, Lq, D) contiguous, the query's dtype; lse (B, Hq, Lq) float32 contiguous.
  void* out = nullptr;
  float* lse = nullptr;
  // bias broadcastable to (B, Hq, Lq, Lk), the query's dtype; strides 0 where broadcast;
  // query head hq reads bias head hq / bias_head_div. nullptr: none.
  const void* bias = nullptr;
  int64_t bias_sb = 0, bias_sh = 0, bias_sq = 0, bias_sk = 0;
  int bias_head_div = 1;
  float scale = 1.f;        // softmax scale
  float softcap = 0.f;      // 0: none
};

// The block kernels (fwd_sm90, bwd_sm90): sizes as int (what their index arithmetic uses)
// and the block descriptor.
struct AttentionParams : AttentionTensors {
  int B = 0, Hq = 0, Hkv = 0, Lq = 0, Lk = 0, D = 0;
  int block_q = 128, block_k = 128;   // descriptor block sizes
  bool reverse_tiles = false;         // heaviest query tiles first (causal-like masks)
  // Persistent forward: a zeroed int that the CTAs take work tiles from (atomicAdd), in
  // work-tile order; nullptr: a static round-robin over the grid.
  int* tile_counter = nullptr;
  int debug = 0;                      // FLEXSPARSE_CUDA_DEBUG bits 0-30 (probes, see fwd_sm90.cuh)
  int debug_high = 0;                 // its bits 31 and up, shifted down by 31
  // The forward's redo queue (FwdTraits::kBiasMma kernels): work tiles whose scores came
  // out NaN, to be run again by the serial kernel. redo[0]: how many are queued;
  // redo[1 .. 1 + redo_words(...)]: one bit per work tile (queued once); the list of work
  // tiles follows. The caller zeroes the count and the bits. nullptr: no queue.
  int* redo = nullptr;
  bool redo_pass = false;             // this launch runs the queued work tiles only

  BlockListParams kv_partial, kv_full;   // per query block
  BlockListParams q_partial, q_full;     // per key block (backward)
  PredicateParams pred;
};

// The forward's work tiles: query tiles of tile_m rows (128, or 192 in the three-warpgroup
// kernels), per (batch, head). The host sizes the redo queue for 128 (the most tiles).
constexpr int kFwdBlockM = 128;
inline int fwd_work_tiles(const AttentionParams& p, int tile_m = kFwdBlockM) {
  return (p.Lq + tile_m - 1) / tile_m * p.Hq * p.B;
}

// The 32-bit words of AttentionParams::redo's bitmap for n_work work tiles.
#ifdef __CUDACC__
__host__ __device__
#endif
inline int redo_words(int n_work) { return (n_work + 31) / 32; }

// The backward: gradients of out (and optionally lse) to dq, dk, dv and dbias.
struct BackwardParams {
  AttentionParams fwd;          // query, key, value, bias, descriptor as in the forward;
                                // fwd.out / fwd.lse: the forward's outputs (read only)
  const void* dout = nullptr;   // (B, Hq, Lq, D), last dim contiguous
  int64_t do_sb = 0, do_sh = 0, do_sm = 0;
  const float* grad_lse = nullptr;   // nullptr or (B, Hq, Lq) contiguous
  void* dq = nullptr;           // (B, Hq, Lq, D) contiguous, the query's dtype
  void* dk = nullptr;           // (B, Hkv, Lk, D) contiguous
  void* dv = nullptr;           // (B, Hkv, Lk, D) contiguous
  void* dbias = nullptr;        // nullptr, or the bias's shape, contiguous, its dtype
  int64_t dbias_sb = 0, dbias_sh = 0, dbias_sq = 0, dbias_sk = 0;   // 0 where broadcast
  void* workspace = nullptr;    // bwd_sm90_workspace_bytes(...) bytes, uninitialised
  bool deterministic = false;   // bitwise reproducible dq, dk, dv, dbias
};

// Index attention (attn_indices, docs/design.md "Index mode"): for each query row and kv
// head a list of W key positions; entries < 0 or >= Lk are inactive and read nothing, a
// position listed twice counts twice. The G = Hq / Hkv query heads of a kv head share the
// list.
struct IndexParams : AttentionTensors {
  // attn_indices (Bi, Hi, Lq, W), int32 or int64, any strides; 0 where broadcast.
  const void* idx = nullptr;
  bool idx_int64 = false;
  int64_t idx_sb = 0, idx_sh = 0, idx_sq = 0, idx_sw = 0;

  int64_t B = 0, Hq = 0, Hkv = 0, Lq = 0, Lk = 0, W = 0;
  int D = 0;
  int G = 1;                // Hq / Hkv
  int debug = 0;            // FLEXSPARSE_CUDA_DEBUG bits 0-30 (index_fwd.cu)
  int debug_high = 0;       // its bits 31 and up, shifted down by 31 (the index kernels)
};

// The index backward (index_bwd.cu): gradients of out (and optionally lse) to dq, dk, dv
// for index masks. No dbias (the op routes calls that want one to the Triton backward).
struct IndexBackwardParams {
  IndexParams fwd;              // query, key, value, lists, bias, sizes as in the forward;
                                // fwd.out (B, Hq, Lq, D) contiguous and fwd.lse: the
                                // forward's outputs (read only)
  const void* dout = nullptr;   // (B, Hq, Lq, D), last dim contiguous, 16-byte aligned rows
  int64_t do_sb = 0, do_sh = 0, do_sm = 0;
  const float* grad_lse = nullptr;   // nullptr or (B, Hq, Lq) contiguous
  void* dq = nullptr;           // (B, Hq, Lq, D) contiguous, the query's dtype
  void* dk = nullptr;           // (B, Hkv, Lk, D) contiguous
  void* dv = nullptr;           // (B, Hkv, Lk, D) contiguous
  int64_t Bi = 1, Hi = 1;       // attn_indices' batch and head extents (1 or B, 1 or Hkv)
  void* workspace = nullptr;    // index_bwd_workspace_bytes(...) bytes, uninitialised
};

// flexsparse::topk_rows (topk.cu): per row of scores, the positions of its k largest
// scores (not -inf, not NaN), ascending, then -1.
struct TopkParams {
  const void* scores = nullptr;       // (lead, rows, Lk) bf16 / fp16 (or, wide, fp32) scores
  bool wide = false;                  // fp32 scores
  int64_t s_lead = 0, s_row = 0, s_col = 1;
  int32_t* out = nullptr;             // (lead, rows, k)
  int64_t o_lead = 0, o_row = 0;
  int64_t rows = 0, n_rows = 0;       // rows per lead index; lead * rows
  int Lk = 0, k = 0;
  bool causal = false;                // row r is query row0 + r: keys j <= row0 + r + off
  int64_t row0 = 0, off = 0;
  uint32_t inf_bits = 0;              // +inf's bits without the sign: 0x7F80 (bf16), 0x7C00 (fp16)
  int warps_per_row = 0;              // 1, 4, 8 or 16; 0: by Lk (topk_rows_cuda)
  int smem_keys_per_warp = 0;         // (set by topk_rows_cuda)
};
constexpr int kTopkMaxKeys = 64 * 1024;   // a row's keys in shared memory

}  // namespace flexsparse
