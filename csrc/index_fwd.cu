// Index attention forward: per (query row, kv head) a list of W key positions
// (attn_indices), gathered from K and V (docs/design.md, "Index mode").
//
// The work is bound by the gather: every query row reads W rows of K and of V, and the G
// query heads of a kv head share them. So one warp takes one (batch, kv head, query row)
// and up to 16 of its query heads: they are the M dimension of m16n8k16 mma.sync tiles
// (rows past G are zero queries, computed and never stored), 16 gathered keys are the N
// (scores) and K (P V) dimensions. Each gathered row is loaded once for all the heads.
//
// Gather: each warp runs its own ring of kStages shared-memory stages of 16 K rows and
// 16 V rows, filled with 16-byte cp.async copies (src-size 0 for inactive entries: the
// stage gets zeros and global memory is not touched). The index of the chunk after the
// next one to be issued is loaded a full iteration early, so its latency overlaps the
// math. The default has one stage per warp and twice the warps per SM (kOneStage); the
// pipelined kernel (kStages - 1 chunks in flight while a warp computes on one, bit
// 2147483648) was slower at every W measured: more rows in flight beat more chunks of
// one row (C71). Warps of a CTA share nothing (no block barriers); the CTA only packs
// several warps onto an SM. (Whole rows by cp.async.bulk instead, one instruction per
// row on a stage barrier, measured 1.3x slower: docs/perf-notes.md C70. Persistent warps
// running rows in turn with the next row's list loaded early: no faster, C72.)
//
// Math per chunk: S = Q K^T (fp32 accumulators), scaled, optional softcap and bias, in
// the log2 domain; inactive keys to -inf; online softmax per head row (row max across
// the quad of lanes that holds the row); P (as the A operand, straight from the S
// accumulators) times V with ldmatrix.trans. At the end out = O / l, lse = m + log l
// (natural log); a row with no active entry gets out 0, lse -inf.
//
// The per-chunk arithmetic is what a warp spends between its gathers (its time follows
// the instructions per chunk, docs/perf-notes.md C69, C70), so two things are skipped:
// with G <= 8 (kHalfRows) the tile's rows 8-15 are zero queries, and their scores,
// exponentials and O rescale are not computed (the MMAs still run: M is 16); and O is
// rescaled lazily, as the block forward does (fwd_sm90.cuh): a row keeps the max it
// subtracts until a chunk's max exceeds it by more than kRescaleMargin, so P stays below
// 2^8 and most chunks skip O's rescale.
// FLEXSPARSE_CUDA_DEBUG bit 536870912: all 16 rows and a rescale every chunk (A/Bs).
//
// Safety: an index is used only if 0 <= idx < Lk, whatever its value (int64 indices are
// compared before narrowing); inactive entries read nothing, so a NaN stored in a row
// that is not listed (V[0] for the padding) reaches no output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels.h"
#include "warp_mma.cuh"

namespace flexsparse {
namespace index_fwd {

using namespace warp_mma;   // cp.async, ldmatrix, Mma<T>, swizzle (warp_mma.cuh)

constexpr int kKeys = 16;    // gathered keys per stage (one k-step of P V)
constexpr int kHeads = 16;   // query heads per warp (the MMA's M); more heads: more warps

// Stages per warp and warps per CTA, per head dim. Shared memory per warp: the query
// tile (16 x D) and kStages x 16 rows of K and of V.
// kOneStage (the default, C71): one stage and the query tile read from shared memory,
// so that twice the warps fit an SM (registers capped by kMinBlocks) and twice the rows'
// gathers are in flight; that beats the stages' overlap within a row. D=64: 6 KB/warp,
// 3 x 8 warps per SM; D=128: 12 KB/warp, 2 x 8 warps; D=256: 24 KB/warp, 2 x 4 warps.
// The pipelined kernel (bit 2147483648): D=64: 18 KB/warp, three CTAs of 4 warps per SM;
// D=128: 28 KB/warp, two CTAs; D=256: 40 KB/warp, one CTA.
// kTwoRows (the default where it applies, perf-notes C79; one stage, G <= 8, D <= 128;
// bit 4294967296 takes the one-row kernel): two query rows per warp, K and V of both in
// shared memory: D=64: 10 KB/warp, 3 x 4 warps per SM; D=128: 20 KB/warp, 2 x 4 warps
// (the rows in flight per SM of the one-row kernel, with half the warps). (D=256:
// 40 KB/warp, 2 x 2 warps; not launched.)
template <int kD, bool kOneStage = false, bool kTwoRows = false>
struct Config {
  static_assert(kD == 64 || kD == 128 || kD == 256, "head dim 64, 128 or 256");
  static_assert(!kTwoRows || kOneStage, "two rows per warp: one stage");
  static constexpr int kStages = kOneStage ? 1 : (kD == 64 ? 4 : kD == 128 ? 3 : 2);
  static constexpr int kRows = kTwoRows ? 2 : 1;   // query rows per warp
  static constexpr int kWarps = kTwoRows ? (kD == 256 ? 2 : 4) : kOneStage && kD <= 128 ? 8 : 4;
  // __launch_bounds__' minimum CTAs per SM (0: none, the default kernels' bound)
  static constexpr int kMinBlocks =
      kTwoRows ? (kD == 64 ? 3 : 2) : !kOneStage ? 0 : (kD == 64 ? 3 : 2);
};

template <int kD, bool kOneStage, bool kTwoRows = false>
constexpr int warp_smem_bytes() {
  // query tile + K and V stages of each row (2-byte elements) + the keys of each stage
  using C = Config<kD, kOneStage, kTwoRows>;
  return (kHeads * kD + 2 * C::kStages * C::kRows * kKeys * kD) * 2 +
         C::kStages * C::kRows * kKeys * 4;
}

template <int kD, bool kOneStage, bool kTwoRows = false>
constexpr int cta_smem_bytes() {
  return Config<kD, kOneStage, kTwoRows>::kWarps * warp_smem_bytes<kD, kOneStage, kTwoRows>();
}

// ------------------------------------------------------------------ the kernel

// kTwoRows (C79; G <= 8): the warp takes query rows A = i and B = i + 1
// (i even), A's heads as the tile's rows 0-7 and B's as rows 8-15, each row with its own
// gathered keys. S_A = Q K_A^T keeps rows 0-7 and S_B = Q K_B^T rows 8-15; P is one A
// operand (A's rows, then B's); O_A += P V_A keeps the C fragments' rows 0-7 and O_B +=
// P V_B rows 8-15, the other half of each a zero temporary thrown away. So a row's output
// never sums another row's keys (no 0 x Inf from a V row that only the other row lists),
// every output element is the one-row kernel's arithmetic in its order, and the decode,
// the query tile and the set-up are paid once per two rows.
template <typename T, int kD, bool kHalfRows, bool kNarrowAddr, bool kOneStage,
          bool kTwoRows = false>
__global__ void __launch_bounds__(Config<kD, kOneStage, kTwoRows>::kWarps * 32,
                                  Config<kD, kOneStage, kTwoRows>::kMinBlocks)
    index_fwd_kernel(const IndexParams p) {
  static_assert(!kTwoRows || (kHalfRows && kNarrowAddr), "two rows: G <= 8, 32-bit rows");
  // accumulator row halves that hold heads (two rows: A's and B's)
  constexpr int kHalves = kHalfRows && !kTwoRows ? 1 : 2;
  constexpr float kRescaleMargin = 8.f;
  const bool eager_rescale = p.debug & 536870912;
  const float rescale_margin = eager_rescale ? 0.f : kRescaleMargin;
  constexpr int kStages = Config<kD, kOneStage, kTwoRows>::kStages;
  constexpr int kWarps = Config<kD, kOneStage, kTwoRows>::kWarps;
  constexpr int kRows = Config<kD, kOneStage, kTwoRows>::kRows;
  constexpr int kChunks = kD / 8;           // 16-byte chunks per row
  constexpr int kTile = kKeys * kD;         // elements of one K (or V) stage
  constexpr int kSteps = kD / 16;           // k-steps of Q K^T, n-tile pairs of P V
  // The query tile's A fragments stay in registers up to D = 128; at D = 256 they are
  // read from shared memory per k-step (64 more registers beside the 128 of O), and so
  // are they in the one-stage kernel (registers for more warps per SM).
  constexpr bool kQInRegisters = kD <= 128 && !kOneStage;
  static_assert(kChunks >= 8, "the swizzle permutes 8 chunks within a row");

  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  T* s_q = reinterpret_cast<T*>(smem + warp * warp_smem_bytes<kD, kOneStage, kTwoRows>());
  T* s_k = s_q + kHeads * kD;               // [kStages][kRows][kKeys][kD], swizzled rows
  T* s_v = s_k + kStages * kRows * kTile;
  int* s_keys = reinterpret_cast<int*>(s_v + kStages * kRows * kTile);   // [kStages][kRows * kKeys]

  // This warp's work item: (batch, kv head, head group, query row), query row fastest.
  const int n_groups = (p.G + kHeads - 1) / kHeads;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  // An item is a query row i, or with two rows the rows i and i + 1 (i even).
  if constexpr (kTwoRows) {
    if (item >= p.B * p.Hkv * n_groups * ((p.Lq + 1) / 2)) return;
  } else {
    if (item >= p.B * p.Hkv * n_groups * p.Lq) return;   // the whole warp leaves
  }
  const int64_t i = kTwoRows ? item % ((p.Lq + 1) / 2) * 2 : item % p.Lq;
  int64_t rest = kTwoRows ? item / ((p.Lq + 1) / 2) : item / p.Lq;
  const int group = static_cast<int>(rest % n_groups);
  rest /= n_groups;
  const int64_t h = rest % p.Hkv;
  const int64_t b = rest / p.Hkv;
  const int heads = min(kHeads, p.G - group * kHeads);     // query heads this warp stores
  const int64_t hq0 = h * p.G + group * kHeads;            // its first query head

  const T* q_row = static_cast<const T*>(p.q) + b * p.q_sb + hq0 * p.q_sh + i * p.q_sm;
  const T* k_head = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh;
  const T* v_head = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh;
  // Two rows: row B exists unless it would be row Lq; lanes 16-31 read row B's list.
  const bool has_b = kTwoRows && i + 1 < p.Lq;
  const int64_t idx_off =
      b * p.idx_sb + h * p.idx_sh + (kTwoRows ? i + (lane >= kKeys ? 1 : 0) : i) * p.idx_sq;
  const int32_t* idx32 = static_cast<const int32_t*>(p.idx) + idx_off;
  const int64_t* idx64 = static_cast<const int64_t*>(p.idx) + idx_off;

  // The key of list slot w, or -1 when the slot is past W or its entry is inactive.
  auto load_key = [&](int64_t w) -> int {
    if (w >= p.W) return -1;
    if constexpr (kTwoRows) {
      if (lane >= kKeys && !has_b) return -1;
    }
    const int64_t x =
        p.idx_int64 ? idx64[w * p.idx_sw] : static_cast<int64_t>(idx32[w * p.idx_sw]);
    return (x >= 0 && x < p.Lk) ? static_cast<int>(x) : -1;
  };

  // Query tile: rows of the `heads` query heads, zeros below (src-size 0).
#pragma unroll
  for (int t = 0; t < kHeads * kChunks / 32; ++t) {
    const int e = t * 32 + lane;
    const int r = e / kChunks, c = e % kChunks;
    if constexpr (kTwoRows) {   // row A's heads in rows 0-7, row B's in rows 8-15
      const int head = r & 7;
      const bool ok = head < heads && (r < 8 || has_b);
      cp_async_16(smem_addr(s_q + swizzle<kD>(r, c)),
                  ok ? q_row + head * p.q_sh + (r < 8 ? 0 : p.q_sm) + c * 8 : q_row, ok ? 16 : 0);
    } else {
      const bool ok = r < heads;
      cp_async_16(smem_addr(s_q + swizzle<kD>(r, c)), ok ? q_row + r * p.q_sh + c * 8 : q_row,
                  ok ? 16 : 0);
    }
  }

  // Gather one chunk into `stage`: lane l < 16 holds the key of the chunk's slot l (lanes
  // 16-31 the same keys again); inactive slots get zero rows.
  // kNarrowAddr (the default where the strides fit; bit 1073741824 opts out): this lane's
  // 16-byte piece of every row it copies (c = lane % kChunks: 32 lanes cover whole rows)
  // and the row strides in bytes as 32-bit values (the launch checks they fit), so that a
  // row's address is one 32 x 32 + 64-bit multiply-add instead of a 64-bit multiply, a
  // scale and selects per copy (SASS per chunk at hd128: 710 -> 494 instructions). An
  // inactive slot reads row 0 with the copy's ignore-src set (zeros written, nothing
  // read; with Lk = 0 the address is the query row's, which exists).
  static_assert(32 % kChunks == 0 || kChunks % 32 == 0,
                "a lane's piece is the same in every row");
  const char* k_piece = p.Lk > 0 ? reinterpret_cast<const char*>(k_head + (lane % kChunks) * 8)
                                 : reinterpret_cast<const char*>(q_row);
  const char* v_piece = p.Lk > 0 ? reinterpret_cast<const char*>(v_head + (lane % kChunks) * 8)
                                 : reinterpret_cast<const char*>(q_row);
  const uint32_t k_row_bytes = static_cast<uint32_t>(p.k_sn * 2);
  const uint32_t v_row_bytes = static_cast<uint32_t>(p.v_sn * 2);
  // Two rows: lanes 0-15 hold row A's keys (copied into the stage's first K and V tiles),
  // lanes 16-31 row B's (into the second).
  auto issue = [&](int key_of_lane, int stage) {
    if (kTwoRows || lane < kKeys) s_keys[stage * kRows * kKeys + lane] = key_of_lane;
#pragma unroll
    for (int which = 0; which < kRows; ++which) {
    T* dk = s_k + (stage * kRows + which) * kTile;
    T* dv = s_v + (stage * kRows + which) * kTile;
#pragma unroll
    for (int t = 0; t < kKeys * kChunks / 32; ++t) {
      const int e = t * 32 + lane;
      const int r = e / kChunks, c = e % kChunks;
      const int key = __shfl_sync(0xffffffffu, key_of_lane, which * kKeys + r);
      const int off = swizzle<kD>(r, c);
      if constexpr (kNarrowAddr) {
        const uint64_t row = static_cast<uint32_t>(max(key, 0));
        cp_async_16_or_zeros(smem_addr(dk + off), k_piece + row * k_row_bytes, key < 0);
        cp_async_16_or_zeros(smem_addr(dv + off), v_piece + row * v_row_bytes, key < 0);
      } else {
        const bool ok = key >= 0;
        // An inactive slot copies nothing; its source operand is any valid address.
        cp_async_16(smem_addr(dk + off), ok ? k_head + key * p.k_sn + c * 8 : q_row, ok ? 16 : 0);
        cp_async_16(smem_addr(dv + off), ok ? v_head + key * p.v_sn + c * 8 : q_row, ok ? 16 : 0);
      }
    }
    }
  };

  const int n_chunks = static_cast<int>((p.W + kKeys - 1) / kKeys);
  const int slot = lane & (kKeys - 1);
  // Prologue: chunks 0 .. kStages-2, one commit group each (the query tile rides with
  // chunk 0), then the key of the next chunk to issue.
  int next_key = load_key(slot);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_chunks) issue(next_key, s);
    cp_async_commit();
    next_key = load_key(static_cast<int64_t>(s + 1) * kKeys + slot);
  }

  const float LOG2E = 1.4426950408889634f;
  const bool has_softcap = p.softcap > 0.f;
  const bool has_bias = p.bias != nullptr;
  // score in the log2 domain = score_mul * f(acc): f = tanh(acc * tanh_mul) with softcap
  const float score_mul = has_softcap ? p.softcap * LOG2E : p.scale * LOG2E;
  const float tanh_mul = has_softcap ? p.scale / p.softcap : 0.f;
  // The accumulator layout: this lane holds head rows r and r + 8, key columns
  // 2 * quad + {0, 1} of each 8-key half (m16n8 C fragment).
  const int r = lane >> 2, quad = lane & 3;
  // This lane's accumulator rows r and r + 8 are query heads r and r + 8 of row i, or
  // (two rows) head r of rows i and i + 1.
  const T* bias_rows[2] = {nullptr, nullptr};
  if (has_bias) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = kTwoRows ? r : r + 8 * rr;
      if (row < heads && (!kTwoRows || rr == 0 || has_b))
        bias_rows[rr] = static_cast<const T*>(p.bias) + b * p.bias_sb +
                        ((hq0 + row) / p.bias_head_div) * p.bias_sh +
                        (kTwoRows ? i + rr : i) * p.bias_sq;
    }
  }

  uint32_t q_frag[kQInRegisters ? kSteps : 1][4];
  float o_acc[kD / 8][4];
#pragma unroll
  for (int t = 0; t < kD / 8; ++t) o_acc[t][0] = o_acc[t][1] = o_acc[t][2] = o_acc[t][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};   // running row max (log2 domain)
  float l_run[2] = {0.f, 0.f};               // this lane's part of the row sum

  // ldmatrix addresses: lane -> (row, chunk) of the 8x8 matrix it points at.
  //   Q (A operand):  heads (lane/8 % 2)*8 + lane%8, chunk 2*step + lane/16
  //   K (B, scores):  keys (lane/16)*8 + lane%8,     chunk 2*step + lane/8 % 2
  //   V (B, trans):   keys (lane/8 % 2)*8 + lane%8,  chunk 2*step + lane/16
  const int q_ld_row = ((lane >> 3) & 1) * 8 + (lane & 7), q_ld_chunk = lane >> 4;
  const int k_ld_row = (lane >> 4) * 8 + (lane & 7), k_ld_chunk = (lane >> 3) & 1;
  const int v_ld_row = q_ld_row, v_ld_chunk = q_ld_chunk;

  for (int chunk = 0; chunk < n_chunks; ++chunk) {
    // Refill the stage that the previous iteration finished with.
    const int ahead = chunk + kStages - 1;
    if (ahead < n_chunks) issue(next_key, ahead % kStages);
    cp_async_commit();
    next_key = load_key(static_cast<int64_t>(ahead + 1) * kKeys + slot);
    cp_async_wait<kStages - 1>();
    __syncwarp();

    const int stage = chunk % kStages;
    const T* k_s = s_k + stage * kRows * kTile;   // two rows: row B's tiles follow A's
    const T* v_s = s_v + stage * kRows * kTile;
    if constexpr (kQInRegisters) {
      if (chunk == 0) {
#pragma unroll
        for (int st = 0; st < kSteps; ++st)
          ldmatrix_x4(q_frag[st], smem_addr(s_q + swizzle<kD>(q_ld_row, 2 * st + q_ld_chunk)));
      }
    }
    // The keys of this lane's four score columns (-1: inactive).
    const int* stage_keys = s_keys + stage * kRows * kKeys;
    const int2 keys_lo = *reinterpret_cast<const int2*>(stage_keys + 2 * quad);
    const int2 keys_hi = *reinterpret_cast<const int2*>(stage_keys + 8 + 2 * quad);
    const int col_key[2][2] = {{keys_lo.x, keys_lo.y}, {keys_hi.x, keys_hi.y}};
    // two rows: row B's keys, for the accumulator rows 8-15
    int col_key_b[2][2] = {{-1, -1}, {-1, -1}};
    if constexpr (kTwoRows) {
      const int* keys_b = stage_keys + kKeys;
      const int2 lo = *reinterpret_cast<const int2*>(keys_b + 2 * quad);
      const int2 hi = *reinterpret_cast<const int2*>(keys_b + 8 + 2 * quad);
      col_key_b[0][0] = lo.x;
      col_key_b[0][1] = lo.y;
      col_key_b[1][0] = hi.x;
      col_key_b[1][1] = hi.y;
    }
    // Bias loads first, so that their latency overlaps the score MMAs.
    float bias_val[2][4];
    if (has_bias) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = kTwoRows && (e >> 1) ? col_key_b[j][e & 1] : col_key[j][e & 1];
          const T* row = bias_rows[e >> 1];
          bias_val[j][e] = (row != nullptr && key >= 0) ? to_float(row[key * p.bias_sk]) : 0.f;
        }
    }

    // S = Q K^T over 16 keys: two m16n8 tiles (keys 0-7, 8-15).
    float s_acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float s_acc_b[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};   // two rows: S_B
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      uint32_t a[4];
      if constexpr (kQInRegisters) {
#pragma unroll
        for (int x = 0; x < 4; ++x) a[x] = q_frag[st][x];
      } else {
        ldmatrix_x4(a, smem_addr(s_q + swizzle<kD>(q_ld_row, 2 * st + q_ld_chunk)));
      }
      uint32_t kb[4];
      ldmatrix_x4(kb, smem_addr(k_s + swizzle<kD>(k_ld_row, 2 * st + k_ld_chunk)));
      Mma<T>::run(s_acc[0], a, kb[0], kb[1]);
      Mma<T>::run(s_acc[1], a, kb[2], kb[3]);
      if constexpr (kTwoRows) {
        ldmatrix_x4(kb, smem_addr(k_s + kTile + swizzle<kD>(k_ld_row, 2 * st + k_ld_chunk)));
        Mma<T>::run(s_acc_b[0], a, kb[0], kb[1]);
        Mma<T>::run(s_acc_b[1], a, kb[2], kb[3]);
      }
    }
    if constexpr (kTwoRows) {   // rows 8-15 (row B's heads) from S_B
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        s_acc[j][2] = s_acc_b[j][2];
        s_acc[j][3] = s_acc_b[j][3];
      }
    }

    // Scores (log2 domain), inactive keys to -inf, row max over the quad.
    float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if ((e >> 1) >= kHalves) continue;
        float s = s_acc[j][e];
        s = has_softcap ? score_mul * tanhf(s * tanh_mul) : score_mul * s;
        if (has_bias) s += LOG2E * bias_val[j][e];
        if ((kTwoRows && (e >> 1) ? col_key_b[j][e & 1] : col_key[j][e & 1]) < 0) s = -INFINITY;
        s_acc[j][e] = s;
        row_max[e >> 1] = fmaxf(row_max[e >> 1], s);
      }
    float alpha[2] = {1.f, 1.f}, m_use[2] = {0.f, 0.f};
    bool moved = eager_rescale;
#pragma unroll
    for (int rr = 0; rr < kHalves; ++rr) {
      row_max[rr] = fmaxf(row_max[rr], __shfl_xor_sync(0xffffffffu, row_max[rr], 1));
      row_max[rr] = fmaxf(row_max[rr], __shfl_xor_sync(0xffffffffu, row_max[rr], 2));
      // From -inf to a finite max always moves, with alpha = 0 (O and the sum are 0 then);
      // a row still without an active key (both -inf) does not.
      const bool moves = row_max[rr] - m_run[rr] > rescale_margin;
      if (moves) {
        alpha[rr] = exp2f(m_run[rr] - row_max[rr]);
        m_run[rr] = row_max[rr];
        l_run[rr] *= alpha[rr];
      }
      moved |= moves;
      // A row with no active key so far keeps max -inf; exponents then use 0 (all -inf
      // scores give p = 0).
      m_use[rr] = m_run[rr] == -INFINITY ? 0.f : m_run[rr];
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if ((e >> 1) >= kHalves) {
          s_acc[j][e] = 0.f;
          continue;
        }
        const float pe = exp2f(s_acc[j][e] - m_use[e >> 1]);
        s_acc[j][e] = pe;
        l_run[e >> 1] += pe;
      }
    // O *= alpha where a row of this warp moved its max (a warp-uniform branch).
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int t = 0; t < kD / 8; ++t) {
        o_acc[t][0] *= alpha[0];
        o_acc[t][1] *= alpha[0];
        if constexpr (kHalves == 2) {
          o_acc[t][2] *= alpha[1];
          o_acc[t][3] *= alpha[1];
        }
      }
    }

    // O += P V: P's A fragment is the two score tiles (keys 0-7 then 8-15).
    uint32_t pa[4];
    pa[0] = Mma<T>::pack(s_acc[0][0], s_acc[0][1]);
    pa[1] = Mma<T>::pack(s_acc[0][2], s_acc[0][3]);
    pa[2] = Mma<T>::pack(s_acc[1][0], s_acc[1][1]);
    pa[3] = Mma<T>::pack(s_acc[1][2], s_acc[1][3]);
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, smem_addr(v_s + swizzle<kD>(v_ld_row, 2 * st + v_ld_chunk)));
      if constexpr (!kTwoRows) {
        Mma<T>::run(o_acc[2 * st], pa, vb[0], vb[1]);
        Mma<T>::run(o_acc[2 * st + 1], pa, vb[2], vb[3]);
      } else {
        // O_A += P V_A in rows 0-7, then O_B += P V_B in rows 8-15; the other rows of
        // each product land in zero temporaries and are dropped.
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          float c[4] = {o_acc[2 * st + n][0], o_acc[2 * st + n][1], 0.f, 0.f};
          Mma<T>::run(c, pa, vb[2 * n], vb[2 * n + 1]);
          o_acc[2 * st + n][0] = c[0];
          o_acc[2 * st + n][1] = c[1];
        }
        ldmatrix_x4_trans(vb, smem_addr(v_s + kTile + swizzle<kD>(v_ld_row, 2 * st + v_ld_chunk)));
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          float c[4] = {0.f, 0.f, o_acc[2 * st + n][2], o_acc[2 * st + n][3]};
          Mma<T>::run(c, pa, vb[2 * n], vb[2 * n + 1]);
          o_acc[2 * st + n][2] = c[2];
          o_acc[2 * st + n][3] = c[3];
        }
      }
    }
    // Every lane is done reading this stage before any lane refills it.
    __syncwarp();
  }
  cp_async_wait<0>();   // nothing left in flight when the warp ends (e.g. W = 0)

  // Epilogue: row sums over the quad, out = O / l, lse = (m + log2 l) * ln 2.
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int rr = 0; rr < kHalves; ++rr) {
    float l = l_run[rr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = kTwoRows ? r : r + 8 * rr;
    if (row >= heads || (kTwoRows && rr == 1 && !has_b)) continue;
    const bool has = l > 0.f;
    const float inv = has ? 1.f / l : 0.f;
    const int64_t out_row = ((b * p.Hq + hq0 + row) * p.Lq + (kTwoRows ? i + rr : i));
    T* o = out + out_row * kD + 2 * quad;
#pragma unroll
    for (int t = 0; t < kD / 8; ++t)
      *reinterpret_cast<uint32_t*>(o + 8 * t) =
          Mma<T>::pack(o_acc[t][2 * rr] * inv, o_acc[t][2 * rr + 1] * inv);
    if (quad == 0)
      p.lse[out_row] = has ? (m_run[rr] + __log2f(l)) * 0.6931471805599453f : -INFINITY;
  }
}

template <typename T, int kD, bool kHalfRows, bool kNarrowAddr, bool kOneStage,
          bool kTwoRows = false>
void launch(IndexParams const& p, cudaStream_t stream) {
  constexpr int kWarps = Config<kD, kOneStage, kTwoRows>::kWarps;
  constexpr int smem = cta_smem_bytes<kD, kOneStage, kTwoRows>();
  const int64_t n_groups = (p.G + kHeads - 1) / kHeads;
  const int64_t items = p.B * p.Hkv * n_groups * (kTwoRows ? (p.Lq + 1) / 2 : p.Lq);
  if (items == 0) return;
  const int64_t blocks = (items + kWarps - 1) / kWarps;
  if (blocks > 0x7fffffff)
    throw std::invalid_argument("flexsparse CUDA index forward: too many query rows for one grid");
  auto kernel = index_fwd_kernel<T, kD, kHalfRows, kNarrowAddr, kOneStage, kTwoRows>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<static_cast<unsigned>(blocks), kWarps * 32, smem, stream>>>(p);
  CUDA_CHECK(cudaGetLastError());
}

// The one-stage kernel (kOneStage) at every W: twice the warps per SM beat the pipelined
// kernel's stages at W = 16, 64 and 256 (perf-notes C71). FLEXSPARSE_CUDA_DEBUG bit
// 2147483648 (debug_high bit 0) takes the pipelined kernel, for A/B runs.
// Two query rows per warp where G <= 8 with 32-bit row addressing, at D = 64 and 128 (at
// 256 its O registers spill): 1-12% faster than one row per warp at 8K and 32K, W = 16-256
// (C79, H200). Bit 4294967296 (debug_high bit 1) takes the one-row kernel, for A/B runs.
template <typename T, int kD, bool kHalfRows, bool kNarrowAddr>
void launch_stages(IndexParams const& p, cudaStream_t stream) {
  if (p.debug_high & 1) launch<T, kD, kHalfRows, kNarrowAddr, false>(p, stream);
  else if (kHalfRows && kNarrowAddr && kD <= 128 && !(p.debug_high & 2))
    launch<T, kD, kHalfRows, kNarrowAddr, true, kHalfRows && kNarrowAddr && kD <= 128>(p, stream);
  else launch<T, kD, kHalfRows, kNarrowAddr, true>(p, stream);
}

// G <= 8 query heads (the usual GQA) fill at most the tile's first 8 rows. 32-bit row
// addressing (kNarrowAddr) wherever the K and V row strides fit in it; bit 1073741824
// takes 64-bit addressing, for A/B runs.
template <typename T, int kD, bool kHalfRows>
void launch_addr(IndexParams const& p, cudaStream_t stream) {
  constexpr int64_t kMaxStride = int64_t{1} << 31;   // elements: 2 * stride < 2^32 bytes
  const bool narrow = !(p.debug & 1073741824) && p.k_sn >= 0 && p.k_sn < kMaxStride &&
                      p.v_sn >= 0 && p.v_sn < kMaxStride;
  if (narrow) launch_stages<T, kD, kHalfRows, true>(p, stream);
  else launch_stages<T, kD, kHalfRows, false>(p, stream);
}

template <typename T, int kD>
void launch_rows(IndexParams const& p, cudaStream_t stream) {
  if (p.G <= 8 && !(p.debug & 536870912)) launch_addr<T, kD, true>(p, stream);
  else launch_addr<T, kD, false>(p, stream);
}

template <int kD>
void launch_dtype(IndexParams const& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::kBFloat16)
    launch_rows<__nv_bfloat16, kD>(p, stream);
  else
    launch_rows<__half, kD>(p, stream);
}

}  // namespace index_fwd

void index_fwd_sm90(IndexParams const& p, DType dtype, cudaStream_t stream) {
  switch (p.D) {
    case 64: index_fwd::launch_dtype<64>(p, dtype, stream); break;
    case 128: index_fwd::launch_dtype<128>(p, dtype, stream); break;
    case 256: index_fwd::launch_dtype<256>(p, dtype, stream); break;
    default:
      throw std::invalid_argument("flexsparse CUDA index forward: head dim must be 64, 128 or 256");
  }
}

}  // namespace flexsparse
