// Index attention forward: per (query row, kv head) a list of W key positions
// (attn_indices), gathered from K and V (docs/design.md, "Index mode").
//
// The work is bound by the gather: every query row reads W rows of K and of V, and the G
// query heads of a kv head share them. So a warp works on (batch, kv head, query row)
// items with up to kHeads (8 or 16) of their query heads: they are the M dimension of
// m16n8k16 mma.sync tiles (rows past G are zero queries, computed and never stored; with
// kHeads = 8 the tile's rows 8-15 are zeros the softmax skips), 16 gathered keys are the
// N (scores) and K (P V) dimensions. Each gathered row is loaded once for all the heads.
//
// Gather: each warp runs its own ring of kStages shared-memory stages of 16 K rows and
// 16 V rows, filled with 16-byte cp.async copies (src-size 0 for inactive entries: the
// stage gets zeros and global memory is not touched), so kStages - 1 chunks of 16 keys
// are in flight while the warp computes on one. A warp takes a run of consecutive items
// (query rows) and its ring streams through the chunks of all of them: the next row's
// index loads, query tile and first chunks are in flight while this row finishes, so a
// short list (W = 16: one chunk per row) does not pay a round trip per row. The query
// tile of item r rides with its first chunk in slot r % kStages of its own ring (a slot
// is refilled kStages items later, after the last read of its tile). The index of the
// chunk after the next one to be issued is loaded a full iteration early, so its latency
// overlaps the math. Warps of a CTA share nothing (no block barriers); the CTA only packs
// warps onto an SM, one CTA per SM.
//
// Math per chunk: S = Q K^T (fp32 accumulators), scaled, optional softcap and bias, in
// the log2 domain; inactive keys to -inf; online softmax per head row (row max across
// the quad of lanes that holds the row); P (as the A operand, straight from the S
// accumulators) times V with ldmatrix.trans. At an item's last chunk out = O / l, lse =
// m + log l (natural log); a row with no active entry gets out 0, lse -inf.
//
// Safety: an index is used only if 0 <= idx < Lk, whatever its value (int64 indices are
// compared before narrowing); inactive entries read nothing, so a NaN stored in a row
// that is not listed (V[0] for the padding) reaches no output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "warp_mma.cuh"

namespace flexsparse {
namespace index_fwd {

constexpr int kKeys = 16;    // gathered keys per stage (one k-step of P V)
constexpr int kSmemPerSm = 227 * 1024;   // a CTA's dynamic shared memory, at most

// Stages per warp, per head dim; warps per CTA: as many as one SM's shared memory holds
// (one CTA per SM), capped where registers would run out.
template <int kD>
struct Config;
template <>
struct Config<64> {
  static constexpr int kStages = 4, kMaxWarps = 16;
};
template <>
struct Config<128> {
  static constexpr int kStages = 3, kMaxWarps = 12;
};
template <>
struct Config<256> {
  static constexpr int kStages = 2, kMaxWarps = 8;
};

template <int kD, int kHeads>
constexpr int warp_smem_bytes() {
  // query tiles + K and V stages (2-byte elements) + the keys of each stage (int32)
  return (Config<kD>::kStages * kHeads * kD + 2 * Config<kD>::kStages * kKeys * kD) * 2 +
         Config<kD>::kStages * kKeys * 4;
}

template <int kD, int kHeads>
constexpr int cta_warps() {
  return std::min(Config<kD>::kMaxWarps, kSmemPerSm / warp_smem_bytes<kD, kHeads>());
}
// FLEXSPARSE_CUDA_DEBUG bit 1073741824 (A/Bs): CTAs of half an SM's shared memory, two per SM.
template <int kD, int kHeads>
constexpr int half_cta_warps() {
  return std::max(1, std::min(Config<kD>::kMaxWarps,
                              (kSmemPerSm / 2 - 1024) / warp_smem_bytes<kD, kHeads>()));
}

using namespace warp_mma;   // cp.async, ldmatrix, Mma<T>, swizzle (warp_mma.cuh)

// One work item: (batch, kv head, head group, query row), query row fastest, and the
// walk to the next one (a division only where the query row wraps).
struct Item {
  int64_t i, h, b;
  int group;
  __device__ void set(int64_t item, int64_t Lq, int n_groups, int64_t Hkv) {
    i = item % Lq;
    int64_t rest = item / Lq;
    group = static_cast<int>(rest % n_groups);
    rest /= n_groups;
    h = rest % Hkv;
    b = rest / Hkv;
  }
  __device__ void next(int64_t item_after, int64_t Lq, int n_groups, int64_t Hkv) {
    if (++i == Lq) set(item_after, Lq, n_groups, Hkv);
  }
};

// A position in a warp's stream of chunks: the item (and its ordinal in the warp's run)
// and the chunk within it.
struct Cursor {
  Item it;
  int64_t item;
  int ord, c;
  __device__ void next(int n_chunks, int64_t Lq, int n_groups, int64_t Hkv) {
    if (++c == n_chunks) {
      c = 0;
      ++ord;
      ++item;
      it.next(item, Lq, n_groups, Hkv);
    }
  }
};

// ------------------------------------------------------------------ the kernel

template <typename T, int kD, int kHeads, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    index_fwd_kernel(const IndexParams p, const int64_t per_warp) {
  constexpr int kStages = Config<kD>::kStages;
  constexpr int kChunks = kD / 8;           // 16-byte chunks per row
  constexpr int kTile = kKeys * kD;         // elements of one K (or V) stage
  constexpr int kSteps = kD / 16;           // k-steps of Q K^T, n-tile pairs of P V
  constexpr int kHalves = kHeads / 8;       // accumulator row halves that hold heads
  // The query tile's A fragments stay in registers up to D = 128; at D = 256 they are
  // read from shared memory per k-step (64 more registers beside the 128 of O).
  constexpr bool kQInRegisters = kD <= 128;
  static_assert(kChunks >= 8, "the swizzle permutes 8 chunks within a row");
  static_assert(kHeads == 8 || kHeads == 16, "one or two 8-row halves of the MMA's M");

  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  T* s_q = reinterpret_cast<T*>(smem + warp * warp_smem_bytes<kD, kHeads>());   // [kStages][kHeads][kD]
  T* s_k = s_q + kStages * kHeads * kD;     // [kStages][kKeys][kD], swizzled rows
  T* s_v = s_k + kStages * kTile;
  int* s_keys = reinterpret_cast<int*>(s_v + kStages * kTile);   // [kStages][kKeys]

  // This warp's run of items: [first, first + count).
  const int n_groups = (p.G + kHeads - 1) / kHeads;
  const int64_t n_items = p.B * p.Hkv * n_groups * p.Lq;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * per_warp;
  if (first >= n_items) return;   // the whole warp leaves
  const int count = static_cast<int>(min(per_warp, n_items - first));
  const int n_chunks = static_cast<int>((p.W + kKeys - 1) / kKeys);
  const int64_t total = static_cast<int64_t>(count) * n_chunks;   // chunks in the stream

  const T* q_base = static_cast<const T*>(p.q);
  const T* k_base = static_cast<const T*>(p.k);
  const T* v_base = static_cast<const T*>(p.v);
  auto heads_of = [&](const Item& it) { return min(kHeads, p.G - it.group * kHeads); };
  // (its first query head: it.h * p.G + it.group * kHeads)
  auto q_row_of = [&](const Item& it) {
    return q_base + it.b * p.q_sb + (it.h * p.G + it.group * kHeads) * p.q_sh + it.i * p.q_sm;
  };

  // The key of list slot w of chunk `cur`, or -1 when the slot is past W or its entry is
  // inactive.
  const int slot = lane & (kKeys - 1);
  auto load_key = [&](const Cursor& cur) -> int {
    const int64_t w = static_cast<int64_t>(cur.c) * kKeys + slot;
    if (w >= p.W) return -1;
    const int64_t off = cur.it.b * p.idx_sb + cur.it.h * p.idx_sh + cur.it.i * p.idx_sq + w * p.idx_sw;
    const int64_t x = p.idx_int64 ? static_cast<const int64_t*>(p.idx)[off]
                                  : static_cast<int64_t>(static_cast<const int32_t*>(p.idx)[off]);
    return (x >= 0 && x < p.Lk) ? static_cast<int>(x) : -1;
  };

  // Gather chunk `cur` into `stage` (and, at an item's first chunk, its query tile into
  // slot cur.ord % kStages): lane l < 16 holds the key of the chunk's slot l (lanes 16-31
  // the same keys again); inactive slots get zero rows.
  auto issue = [&](const Cursor& cur, int key_of_lane, int stage) {
    const T* q_row = q_row_of(cur.it);
    if (cur.c == 0) {
      // Query tile: rows of the item's query heads, zeros below (src-size 0).
      const int heads = heads_of(cur.it);
      T* dq = s_q + (cur.ord % kStages) * kHeads * kD;
#pragma unroll
      for (int t = 0; t < kHeads * kChunks / 32; ++t) {
        const int e = t * 32 + lane;
        const int r = e / kChunks, c = e % kChunks;
        const bool ok = r < heads;
        cp_async_16(smem_addr(dq + swizzle<kD>(r, c)), ok ? q_row + r * p.q_sh + c * 8 : q_row,
                    ok ? 16 : 0);
      }
    }
    if (lane < kKeys) s_keys[stage * kKeys + lane] = key_of_lane;
    const T* k_head = k_base + cur.it.b * p.k_sb + cur.it.h * p.k_sh;
    const T* v_head = v_base + cur.it.b * p.v_sb + cur.it.h * p.v_sh;
    T* dk = s_k + stage * kTile;
    T* dv = s_v + stage * kTile;
#pragma unroll
    for (int t = 0; t < kKeys * kChunks / 32; ++t) {
      const int e = t * 32 + lane;
      const int r = e / kChunks, c = e % kChunks;
      const int key = __shfl_sync(0xffffffffu, key_of_lane, r);
      const bool ok = key >= 0;
      const int off = swizzle<kD>(r, c);
      // An inactive slot copies nothing; its source operand is any valid address.
      cp_async_16(smem_addr(dk + off), ok ? k_head + key * p.k_sn + c * 8 : q_row, ok ? 16 : 0);
      cp_async_16(smem_addr(dv + off), ok ? v_head + key * p.v_sn + c * 8 : q_row, ok ? 16 : 0);
    }
  };

  const float LOG2E = 1.4426950408889634f;
  const bool has_softcap = p.softcap > 0.f;
  const bool has_bias = p.bias != nullptr;
  // score in the log2 domain = score_mul * f(acc): f = tanh(acc * tanh_mul) with softcap
  const float score_mul = has_softcap ? p.softcap * LOG2E : p.scale * LOG2E;
  const float tanh_mul = has_softcap ? p.scale / p.softcap : 0.f;
  // The accumulator layout: this lane holds head rows r and r + 8, key columns
  // 2 * quad + {0, 1} of each 8-key half (m16n8 C fragment).
  const int r = lane >> 2, quad = lane & 3;

  uint32_t q_frag[kQInRegisters ? kSteps : 1][4];
  float o_acc[kD / 8][4];
  float m_run[2], l_run[2];   // running row max (log2 domain); this lane's part of the row sum
  auto reset = [&]() {
#pragma unroll
    for (int t = 0; t < kD / 8; ++t) o_acc[t][0] = o_acc[t][1] = o_acc[t][2] = o_acc[t][3] = 0.f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.f;
  };
  // An item's end: row sums over the quad, out = O / l, lse = (m + log2 l) * ln 2.
  T* out = static_cast<T*>(p.out);
  auto finish = [&](const Item& it) {
    const int heads = heads_of(it);
    const int64_t hq0 = it.h * p.G + it.group * kHeads;
#pragma unroll
    for (int rr = 0; rr < kHalves; ++rr) {
      float l = l_run[rr];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int row = r + 8 * rr;
      if (row >= heads) continue;
      const bool has = l > 0.f;
      const float inv = has ? 1.f / l : 0.f;
      const int64_t out_row = ((it.b * p.Hq + hq0 + row) * p.Lq + it.i);
      T* o = out + out_row * kD + 2 * quad;
#pragma unroll
      for (int t = 0; t < kD / 8; ++t)
        *reinterpret_cast<uint32_t*>(o + 8 * t) =
            Mma<T>::pack(o_acc[t][2 * rr] * inv, o_acc[t][2 * rr + 1] * inv);
      if (quad == 0)
        p.lse[out_row] = has ? (m_run[rr] + __log2f(l)) * 0.6931471805599453f : -INFINITY;
    }
  };
  reset();

  Cursor start;
  start.item = first;
  start.it.set(first, p.Lq, n_groups, p.Hkv);
  start.ord = start.c = 0;
  if (total == 0) {   // W = 0: every row is fully masked
    Cursor cur = start;
    for (int x = 0; x < count; ++x) {
      finish(cur.it);
      cur.next(1, p.Lq, n_groups, p.Hkv);
    }
    return;
  }

  // Prologue: chunks 0 .. kStages-2, one commit group each, then the key of the next
  // chunk to issue.
  Cursor ahead = start;   // the next chunk to issue
  int next_key = load_key(ahead);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < total) {
      issue(ahead, next_key, s);
      ahead.next(n_chunks, p.Lq, n_groups, p.Hkv);
      if (s + 1 < total) next_key = load_key(ahead);
    }
    cp_async_commit();
  }

  // ldmatrix addresses: lane -> (row, chunk) of the 8x8 matrix it points at.
  //   Q (A operand):  heads (lane/8 % 2)*8 + lane%8, chunk 2*step + lane/16 (x4);
  //                   heads lane%8, chunk 2*step + lane/8 % 2 (x2, kHeads = 8: a[0], a[2])
  //   K (B, scores):  keys (lane/16)*8 + lane%8,     chunk 2*step + lane/8 % 2
  //   V (B, trans):   keys (lane/8 % 2)*8 + lane%8,  chunk 2*step + lane/16
  const int q_ld_row = kHeads == 16 ? ((lane >> 3) & 1) * 8 + (lane & 7) : (lane & 7);
  const int q_ld_chunk = kHeads == 16 ? lane >> 4 : (lane >> 3) & 1;
  const int k_ld_row = (lane >> 4) * 8 + (lane & 7), k_ld_chunk = (lane >> 3) & 1;
  const int v_ld_row = ((lane >> 3) & 1) * 8 + (lane & 7), v_ld_chunk = lane >> 4;
  auto load_q = [&](uint32_t (&a)[4], const T* tile, int st) {
    if constexpr (kHeads == 16) {
      ldmatrix_x4(a, smem_addr(tile + swizzle<kD>(q_ld_row, 2 * st + q_ld_chunk)));
    } else {
      uint32_t x[2];
      ldmatrix_x2(x, smem_addr(tile + swizzle<kD>(q_ld_row, 2 * st + q_ld_chunk)));
      a[0] = x[0];
      a[1] = 0u;
      a[2] = x[1];
      a[3] = 0u;
    }
  };

  const T* bias_rows[2] = {nullptr, nullptr};
  Cursor cur = start;   // the chunk computed
  for (int64_t g = 0; g < total; ++g) {
    // Refill the stage that the previous iteration finished with.
    const int64_t ahead_g = g + kStages - 1;
    if (ahead_g < total) {
      issue(ahead, next_key, static_cast<int>(ahead_g % kStages));
      ahead.next(n_chunks, p.Lq, n_groups, p.Hkv);
      if (ahead_g + 1 < total) next_key = load_key(ahead);
    }
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncwarp();

    const int stage = static_cast<int>(g % kStages);
    const T* q_s = s_q + (cur.ord % kStages) * kHeads * kD;
    const T* k_s = s_k + stage * kTile;
    const T* v_s = s_v + stage * kTile;
    if (cur.c == 0) {
      if constexpr (kQInRegisters) {
#pragma unroll
        for (int st = 0; st < kSteps; ++st) load_q(q_frag[st], q_s, st);
      }
      if (has_bias) {
        const int heads = heads_of(cur.it);
        const int64_t hq0 = cur.it.h * p.G + cur.it.group * kHeads;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int row = r + 8 * rr;
          bias_rows[rr] = rr < kHalves && row < heads
              ? static_cast<const T*>(p.bias) + cur.it.b * p.bias_sb +
                    ((hq0 + row) / p.bias_head_div) * p.bias_sh + cur.it.i * p.bias_sq
              : nullptr;
        }
      }
    }
    // The keys of this lane's four score columns (-1: inactive).
    const int2 keys_lo = *reinterpret_cast<const int2*>(s_keys + stage * kKeys + 2 * quad);
    const int2 keys_hi = *reinterpret_cast<const int2*>(s_keys + stage * kKeys + 8 + 2 * quad);
    const int col_key[2][2] = {{keys_lo.x, keys_lo.y}, {keys_hi.x, keys_hi.y}};
    // Bias loads first, so that their latency overlaps the score MMAs.
    float bias_val[2][4];
    if (has_bias) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = col_key[j][e & 1];
          const T* row = bias_rows[e >> 1];
          bias_val[j][e] = (row != nullptr && key >= 0) ? to_float(row[key * p.bias_sk]) : 0.f;
        }
    }

    // S = Q K^T over 16 keys: two m16n8 tiles (keys 0-7, 8-15).
    float s_acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      uint32_t a[4];
      if constexpr (kQInRegisters) {
#pragma unroll
        for (int x = 0; x < 4; ++x) a[x] = q_frag[st][x];
      } else {
        load_q(a, q_s, st);
      }
      uint32_t kb[4];
      ldmatrix_x4(kb, smem_addr(k_s + swizzle<kD>(k_ld_row, 2 * st + k_ld_chunk)));
      Mma<T>::run(s_acc[0], a, kb[0], kb[1]);
      Mma<T>::run(s_acc[1], a, kb[2], kb[3]);
    }

    // Scores (log2 domain), inactive keys to -inf, row max over the quad; the row half
    // past kHeads (zero queries) gets P = 0 without exponentials.
    float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if ((e >> 1) >= kHalves) continue;
        float s = s_acc[j][e];
        s = has_softcap ? score_mul * tanhf(s * tanh_mul) : score_mul * s;
        if (has_bias) s += LOG2E * bias_val[j][e];
        if (col_key[j][e & 1] < 0) s = -INFINITY;
        s_acc[j][e] = s;
        row_max[e >> 1] = fmaxf(row_max[e >> 1], s);
      }
    float alpha[2], m_use[2];
#pragma unroll
    for (int rr = 0; rr < kHalves; ++rr) {
      row_max[rr] = fmaxf(row_max[rr], __shfl_xor_sync(0xffffffffu, row_max[rr], 1));
      row_max[rr] = fmaxf(row_max[rr], __shfl_xor_sync(0xffffffffu, row_max[rr], 2));
      const float m_new = fmaxf(m_run[rr], row_max[rr]);
      // A row with no active key so far keeps max -inf; exponents then use 0 (all -inf
      // scores give p = 0, and alpha = 0 rescales an O that is still 0).
      m_use[rr] = m_new == -INFINITY ? 0.f : m_new;
      alpha[rr] = exp2f(m_run[rr] - m_use[rr]);
      m_run[rr] = m_new;
      l_run[rr] *= alpha[rr];
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
#pragma unroll
    for (int t = 0; t < kD / 8; ++t) {
      o_acc[t][0] *= alpha[0];
      o_acc[t][1] *= alpha[0];
      if constexpr (kHalves == 2) {
        o_acc[t][2] *= alpha[1];
        o_acc[t][3] *= alpha[1];
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
      Mma<T>::run(o_acc[2 * st], pa, vb[0], vb[1]);
      Mma<T>::run(o_acc[2 * st + 1], pa, vb[2], vb[3]);
    }
    if (cur.c == n_chunks - 1) {
      finish(cur.it);
      reset();
    }
    // Every lane is done reading this stage (and the item's query tile) before any lane
    // refills it.
    __syncwarp();
    cur.next(n_chunks, p.Lq, n_groups, p.Hkv);
  }
  cp_async_wait<0>();   // nothing left in flight when the warp ends
}

// Items (query rows) per warp: a run long enough that the grid is about one CTA per SM
// (each warp's ring streams through its run); FLEXSPARSE_CUDA_DEBUG bit 536870912: one
// item per warp (the kernel before the runs, for A/Bs).
inline int64_t items_per_warp(int64_t items, int warps, bool one) {
  if (one) return 1;
  int dev = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t slots = static_cast<int64_t>(sms) * warps;
  return std::max<int64_t>(1, (items + slots - 1) / slots);
}

template <typename T, int kD, int kHeads, int kWarps>
void launch_warps(IndexParams const& p, cudaStream_t stream) {
  constexpr int smem = kWarps * warp_smem_bytes<kD, kHeads>();
  const int64_t n_groups = (p.G + kHeads - 1) / kHeads;
  const int64_t items = p.B * p.Hkv * n_groups * p.Lq;
  if (items == 0) return;
  const int64_t per_warp = items_per_warp(items, kWarps, p.debug & 536870912);
  const int64_t warps = (items + per_warp - 1) / per_warp;
  const int64_t blocks = (warps + kWarps - 1) / kWarps;
  if (blocks > 0x7fffffff)
    throw std::invalid_argument("flexsparse CUDA index forward: too many query rows for one grid");
  auto kernel = index_fwd_kernel<T, kD, kHeads, kWarps>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<static_cast<unsigned>(blocks), kWarps * 32, smem, stream>>>(p, per_warp);
  CUDA_CHECK(cudaGetLastError());
}

template <typename T, int kD, int kHeads>
void launch(IndexParams const& p, cudaStream_t stream) {
  if (p.debug & 1073741824) launch_warps<T, kD, kHeads, half_cta_warps<kD, kHeads>()>(p, stream);
  else launch_warps<T, kD, kHeads, cta_warps<kD, kHeads>()>(p, stream);
}

// G <= 8 query heads per kv head (the usual GQA) fit one 8-row half of the MMA's M.
template <int kD>
void launch_dtype(IndexParams const& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::kBFloat16) {
    if (p.G <= 8) launch<__nv_bfloat16, kD, 8>(p, stream);
    else launch<__nv_bfloat16, kD, 16>(p, stream);
  } else {
    if (p.G <= 8) launch<__half, kD, 8>(p, stream);
    else launch<__half, kD, 16>(p, stream);
  }
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
