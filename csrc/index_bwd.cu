// Index attention backward (issue 17): dq, dk, dv of index masks (per-query key lists,
// docs/design.md "Index mode") with no float atomics, bitwise deterministic by
// construction. Measurements: docs/benchmarks.md, docs/perf-notes.md (C73, C74, C77).
//
// Four steps on the stream, no host sync:
//  1. prep: per (b, query head, row) the pair (lse2, delta): lse2 = lse * log2(e) (0 for
//     lse = -inf rows: they have no active entry, or only entries whose score is -inf, so
//     every p below is 0 and their gradients are 0) and delta = rowsum(dO * O) - grad_lse;
//     one 8-byte load per (row, head) in the passes below.
//  2. dQ, query-major (the forward's layout): one warp per (b, kv head, 16-head group,
//     query row), its G query heads as the M rows of m16n8k16 mma.sync tiles; 16 gathered
//     keys per stage (cp.async ring, as index_fwd.cu). Per stage S = Q K^T, dP = dO V^T,
//     P = exp2(S' - lse2), dS = P (dP - delta) (softcap: times 1 - tanh^2), scaled;
//     dQ += dS K (K through ldmatrix.trans). dQ stays in registers; one store per row.
//  3. transposed lists (CSR), per list (bi, hi): every entry gets the sort key
//     list * (Lk + 1) + key (inactive entries: key Lk, a bucket nobody reads) and the value
//     of its query row; integer atomics count the entries per bucket, cub's exclusive scan
//     gives each bucket's start, cub's radix sort (stable, deterministic) orders the
//     values by key. A key's segment thus lists its query rows in (row, slot) order, a
//     duplicate once per occurrence.
//  4. dK/dV, key-major: one warp per (b, kv head, key), walking its segment's (query row,
//     query head) pairs, e-major: groups of D/8 lanes (8 columns, one 16-byte load per
//     row per lane; 4 groups at D=64, 2 at 128, 1 at 256), each group one pair at a time,
//     4 steps' loads issued together; dot products over the group's lanes by shuffles,
//     then dV += P dO, dK += dS Q in fp32 registers; the groups' sums are added in a
//     fixed shuffle order at the end. CUDA-core FMA (dkdv_kernel, now under bit
//     17179869184), bound by its instructions (~94 warp instructions per pair at hd128;
//     its rows mostly come from L2, C77). The default (C78): the same pass on the tensor
//     cores, 16 pairs per warp step (dkdv_mma_kernel below), twice as fast.
//
// Determinism: every output element is written by one warp, whose summation order
// depends only on the lists (the sort is stable, the scan exact); no float atomics.
//
// Safety as in the forward: an entry is used only if 0 <= idx < Lk; inactive entries read
// nothing. Keys that no list names get dk = dv = 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cub/cub.cuh>
#include <map>
#include <mutex>

#include "kernels.h"
#include "warp_mma.cuh"

namespace flexsparse {
namespace index_bwd {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kKeys = 16;    // gathered keys per stage
constexpr int kHeads = 16;   // query heads per warp (the MMA's M)

// dQ pass: stages per warp, warps per CTA and the minimum CTAs per SM of
// __launch_bounds__ (0: none). Shared memory per warp: Q and dO tiles (2 x 16 x D) and
// kStages x 16 rows of K and of V. The default (kOneStage) has one stage, so more warps fit
// an SM (more gathers in flight than a deeper pipeline per warp gave; perf-notes C74):
// D=64 8 KB/warp, 2 x 8 warps (128 registers); D=128 16 KB/warp, 3 x 4 warps (170
// registers); D=256 32 KB/warp, 2 x 3. The pipelined kernel (FLEXSPARSE_CUDA_DEBUG bit
// 34359738368, kept for A/Bs): D=64 20 KB/warp (4 warps, 2 CTAs per SM); D=128 32 KB/warp
// (3 warps, 2 CTAs per SM); D=256 48 KB/warp (4 warps, 1 CTA).
template <int kD, bool kOneStage = false>
struct Config;
template <bool kOneStage>
struct Config<64, kOneStage> {
  static constexpr int kStages = kOneStage ? 1 : 4, kWarps = kOneStage ? 8 : 4;
  static constexpr int kMinBlocks = kOneStage ? 2 : 0;
};
template <bool kOneStage>
struct Config<128, kOneStage> {
  static constexpr int kStages = kOneStage ? 1 : 3, kWarps = kOneStage ? 4 : 3;
  static constexpr int kMinBlocks = kOneStage ? 3 : 0;
};
template <bool kOneStage>
struct Config<256, kOneStage> {
  static constexpr int kStages = kOneStage ? 1 : 2, kWarps = kOneStage ? 3 : 4;
  static constexpr int kMinBlocks = 0;
};

template <int kD, bool kOneStage>
constexpr int warp_smem_bytes() {
  return (2 * kHeads * kD + 2 * Config<kD, kOneStage>::kStages * kKeys * kD) * 2 +
         Config<kD, kOneStage>::kStages * kKeys * 4;
}

using namespace warp_mma;   // cp.async, ldmatrix, Mma<T>, swizzle (warp_mma.cuh)

// The key of list slot w of a row's list, or -1 (past W, or inactive).
__device__ __forceinline__ int load_key(const IndexParams& p, int64_t idx_off, int64_t w) {
  if (w >= p.W) return -1;
  const int64_t x = p.idx_int64
                        ? static_cast<const int64_t*>(p.idx)[idx_off + w * p.idx_sw]
                        : static_cast<int64_t>(static_cast<const int32_t*>(p.idx)[idx_off + w * p.idx_sw]);
  return (x >= 0 && x < p.Lk) ? static_cast<int>(x) : -1;
}

// ------------------------------------------------------------------ 1. prep

// One warp per (b, query head, row): delta and lse2 (see the top of the file).
template <typename T>
__global__ void __launch_bounds__(256) prep_kernel(const IndexBackwardParams p, float2* rowstat) {
  const IndexParams& f = p.fwd;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (row >= f.B * f.Hq * f.Lq) return;
  const int64_t i = row % f.Lq;
  const int64_t bh = row / f.Lq;
  const int64_t hq = bh % f.Hq, b = bh / f.Hq;
  const T* o = static_cast<const T*>(f.out) + row * f.D;
  const T* dout = static_cast<const T*>(p.dout) + b * p.do_sb + hq * p.do_sh + i * p.do_sm;
  float acc = 0.f;
  for (int d = lane; d < f.D; d += 32) acc += to_float(o[d]) * to_float(dout[d]);
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (lane == 0) {
    const float l = f.lse[row];
    rowstat[row] = make_float2((l == -INFINITY ? 0.f : l) * kLog2e,
                               acc - (p.grad_lse != nullptr ? p.grad_lse[row] : 0.f));
  }
}

// The same with 16-byte loads (the default where out is 16-byte aligned; perf-notes C81):
// D/8 lanes per row, 256/D rows per warp, the row's sum by shuffles within its lane
// group. The warp-per-row kernel above reads 2 bytes per lane per load (~2 TB/s). Not
// bitwise the kernel above (another summation order of delta); FLEXSPARSE_CUDA_DEBUG bit
// 137438953472 takes that one, for A/B runs.
template <typename T, int kD>
__global__ void __launch_bounds__(256) prep_vec_kernel(const IndexBackwardParams p, float2* rowstat) {
  constexpr int kLanes = kD / 8;            // lanes per row
  constexpr int kRowsPerWarp = 32 / kLanes;
  const IndexParams& f = p.fwd;
  const int lane = threadIdx.x & 31;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5)) * kRowsPerWarp +
                      lane / kLanes;
  const int sub = lane % kLanes;
  const bool active = row < f.B * f.Hq * f.Lq;
  float acc = 0.f;
  if (active) {
    const int64_t i = row % f.Lq;
    const int64_t bh = row / f.Lq;
    const int64_t hq = bh % f.Hq, b = bh / f.Hq;
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const T*>(f.out) + row * kD + sub * 8);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + b * p.do_sb +
                                                    hq * p.do_sh + i * p.do_sm + sub * 8);
    const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 a = Mma<T>::unpack(ow[e]), c = Mma<T>::unpack(dw[e]);
      acc += a.x * c.x + a.y * c.y;
    }
  }
#pragma unroll
  for (int s = kLanes / 2; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (active && sub == 0) {
    const float l = f.lse[row];
    rowstat[row] = make_float2((l == -INFINITY ? 0.f : l) * kLog2e,
                               acc - (p.grad_lse != nullptr ? p.grad_lse[row] : 0.f));
  }
}

// ------------------------------------------------------------------ 2. dQ

template <typename T, int kD, bool kOneStage>
__global__ void __launch_bounds__(Config<kD, kOneStage>::kWarps * 32,
                                  Config<kD, kOneStage>::kMinBlocks)
    dq_kernel(const IndexBackwardParams bp, const float2* rowstat) {
  const IndexParams& p = bp.fwd;
  constexpr int kStages = Config<kD, kOneStage>::kStages;
  constexpr int kWarps = Config<kD, kOneStage>::kWarps;
  constexpr int kChunks = kD / 8;
  constexpr int kTile = kKeys * kD;
  constexpr int kSteps = kD / 16;
  static_assert(kChunks >= 8, "the swizzle permutes 8 chunks within a row");

  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  T* s_q = reinterpret_cast<T*>(smem + warp * warp_smem_bytes<kD, kOneStage>());
  T* s_do = s_q + kHeads * kD;
  T* s_k = s_do + kHeads * kD;
  T* s_v = s_k + kStages * kTile;
  int* s_keys = reinterpret_cast<int*>(s_v + kStages * kTile);

  const int n_groups = (p.G + kHeads - 1) / kHeads;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (item >= p.B * p.Hkv * n_groups * p.Lq) return;
  const int64_t i = item % p.Lq;
  int64_t rest = item / p.Lq;
  const int group = static_cast<int>(rest % n_groups);
  rest /= n_groups;
  const int64_t h = rest % p.Hkv;
  const int64_t b = rest / p.Hkv;
  const int heads = min(kHeads, p.G - group * kHeads);
  const int64_t hq0 = h * p.G + group * kHeads;

  const T* q_row = static_cast<const T*>(p.q) + b * p.q_sb + hq0 * p.q_sh + i * p.q_sm;
  const T* do_row = static_cast<const T*>(bp.dout) + b * bp.do_sb + hq0 * bp.do_sh + i * bp.do_sm;
  const T* k_head = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh;
  const T* v_head = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh;
  const int64_t idx_off = b * p.idx_sb + h * p.idx_sh + i * p.idx_sq;

  // Q and dO tiles: rows of the `heads` query heads, zeros below.
#pragma unroll
  for (int t = 0; t < kHeads * kChunks / 32; ++t) {
    const int e = t * 32 + lane;
    const int r = e / kChunks, c = e % kChunks;
    const bool ok = r < heads;
    cp_async_16(smem_addr(s_q + swizzle<kD>(r, c)), ok ? q_row + r * p.q_sh + c * 8 : q_row,
                ok ? 16 : 0);
    cp_async_16(smem_addr(s_do + swizzle<kD>(r, c)), ok ? do_row + r * bp.do_sh + c * 8 : q_row,
                ok ? 16 : 0);
  }

  auto issue = [&](int key_of_lane, int stage) {
    if (lane < kKeys) s_keys[stage * kKeys + lane] = key_of_lane;
    T* dk = s_k + stage * kTile;
    T* dv = s_v + stage * kTile;
#pragma unroll
    for (int t = 0; t < kKeys * kChunks / 32; ++t) {
      const int e = t * 32 + lane;
      const int r = e / kChunks, c = e % kChunks;
      const int key = __shfl_sync(0xffffffffu, key_of_lane, r);
      const bool ok = key >= 0;
      const int off = swizzle<kD>(r, c);
      cp_async_16(smem_addr(dk + off), ok ? k_head + key * p.k_sn + c * 8 : q_row, ok ? 16 : 0);
      cp_async_16(smem_addr(dv + off), ok ? v_head + key * p.v_sn + c * 8 : q_row, ok ? 16 : 0);
    }
  };

  const int n_chunks = static_cast<int>((p.W + kKeys - 1) / kKeys);
  const int slot = lane & (kKeys - 1);
  int next_key = load_key(p, idx_off, slot);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_chunks) issue(next_key, s);
    cp_async_commit();
    next_key = load_key(p, idx_off, static_cast<int64_t>(s + 1) * kKeys + slot);
  }

  const bool has_softcap = p.softcap > 0.f;
  const bool has_bias = p.bias != nullptr;
  const float tanh_mul = has_softcap ? p.scale / p.softcap : 0.f;
  const int r = lane >> 2, quad = lane & 3;
  // This lane's two head rows (r, r + 8): their lse2 and delta (0 past `heads`: those
  // rows are zero queries, never stored).
  float row_lse2[2] = {0.f, 0.f}, row_delta[2] = {0.f, 0.f};
  const T* bias_rows[2] = {nullptr, nullptr};
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = r + 8 * rr;
    if (row < heads) {
      const int64_t g_row = (b * p.Hq + hq0 + row) * p.Lq + i;
      const float2 st = rowstat[g_row];
      row_lse2[rr] = st.x;
      row_delta[rr] = st.y;
      if (has_bias)
        bias_rows[rr] = static_cast<const T*>(p.bias) + b * p.bias_sb +
                        ((hq0 + row) / p.bias_head_div) * p.bias_sh + i * p.bias_sq;
    }
  }

  float dq_acc[kD / 8][4];
#pragma unroll
  for (int t = 0; t < kD / 8; ++t) dq_acc[t][0] = dq_acc[t][1] = dq_acc[t][2] = dq_acc[t][3] = 0.f;

  // ldmatrix lanes: A operands (Q, dO) and trans B (K for dS K) as the forward's Q and V;
  // non-trans B (K for S, V for dP) as the forward's K.
  const int a_ld_row = ((lane >> 3) & 1) * 8 + (lane & 7), a_ld_chunk = lane >> 4;
  const int b_ld_row = (lane >> 4) * 8 + (lane & 7), b_ld_chunk = (lane >> 3) & 1;

  for (int chunk = 0; chunk < n_chunks; ++chunk) {
    const int ahead = chunk + kStages - 1;
    if (ahead < n_chunks) issue(next_key, ahead % kStages);
    cp_async_commit();
    next_key = load_key(p, idx_off, static_cast<int64_t>(ahead + 1) * kKeys + slot);
    cp_async_wait<kStages - 1>();
    __syncwarp();

    const int stage = chunk % kStages;
    const T* k_s = s_k + stage * kTile;
    const T* v_s = s_v + stage * kTile;
    const int2 keys_lo = *reinterpret_cast<const int2*>(s_keys + stage * kKeys + 2 * quad);
    const int2 keys_hi = *reinterpret_cast<const int2*>(s_keys + stage * kKeys + 8 + 2 * quad);
    const int col_key[2][2] = {{keys_lo.x, keys_lo.y}, {keys_hi.x, keys_hi.y}};
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

    // S = Q K^T and dP = dO V^T over 16 keys (two m16n8 tiles each).
    float s_acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float dp_acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      uint32_t qa[4], da[4], kb[4], vb[4];
      ldmatrix_x4(qa, smem_addr(s_q + swizzle<kD>(a_ld_row, 2 * st + a_ld_chunk)));
      ldmatrix_x4(da, smem_addr(s_do + swizzle<kD>(a_ld_row, 2 * st + a_ld_chunk)));
      ldmatrix_x4(kb, smem_addr(k_s + swizzle<kD>(b_ld_row, 2 * st + b_ld_chunk)));
      ldmatrix_x4(vb, smem_addr(v_s + swizzle<kD>(b_ld_row, 2 * st + b_ld_chunk)));
      Mma<T>::run(s_acc[0], qa, kb[0], kb[1]);
      Mma<T>::run(s_acc[1], qa, kb[2], kb[3]);
      Mma<T>::run(dp_acc[0], da, vb[0], vb[1]);
      Mma<T>::run(dp_acc[1], da, vb[2], vb[3]);
    }

    // dS (scaled, the gradient of the raw product q.k); inactive keys 0.
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float acc = s_acc[j][e];
        float t = 0.f, s;
        if (has_softcap) {
          t = tanhf(acc * tanh_mul);
          s = p.softcap * t;
        } else {
          s = acc * p.scale;
        }
        if (has_bias) s += bias_val[j][e];
        const float pe = col_key[j][e & 1] >= 0 ? exp2f(s * kLog2e - row_lse2[e >> 1]) : 0.f;
        float ds = pe * (dp_acc[j][e] - row_delta[e >> 1]);
        if (has_softcap) ds *= 1.f - t * t;
        s_acc[j][e] = ds * p.scale;
      }

    // dQ += dS K: dS as the A operand (keys 0-7 then 8-15), K rows through ldmatrix.trans.
    uint32_t dsa[4];
    dsa[0] = Mma<T>::pack(s_acc[0][0], s_acc[0][1]);
    dsa[1] = Mma<T>::pack(s_acc[0][2], s_acc[0][3]);
    dsa[2] = Mma<T>::pack(s_acc[1][0], s_acc[1][1]);
    dsa[3] = Mma<T>::pack(s_acc[1][2], s_acc[1][3]);
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      uint32_t kb[4];
      ldmatrix_x4_trans(kb, smem_addr(k_s + swizzle<kD>(a_ld_row, 2 * st + a_ld_chunk)));
      Mma<T>::run(dq_acc[2 * st], dsa, kb[0], kb[1]);
      Mma<T>::run(dq_acc[2 * st + 1], dsa, kb[2], kb[3]);
    }
    __syncwarp();
  }
  cp_async_wait<0>();

  T* dq = static_cast<T*>(bp.dq);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = r + 8 * rr;
    if (row >= heads) continue;
    T* o = dq + ((b * p.Hq + hq0 + row) * p.Lq + i) * kD + 2 * quad;
#pragma unroll
    for (int t = 0; t < kD / 8; ++t)
      *reinterpret_cast<uint32_t*>(o + 8 * t) = Mma<T>::pack(dq_acc[t][2 * rr], dq_acc[t][2 * rr + 1]);
  }
}

// ------------------------------------------------------------------ 3. transposed lists

// Per entry (list nb = bi * Hi + hi, row i, slot w), flattened in that order: its sort key
// nb * (Lk + 1) + key (key Lk for an inactive entry), its value i, and one count.
__global__ void __launch_bounds__(256) csr_keys_kernel(const IndexBackwardParams bp,
                                                       uint32_t* keys, int32_t* vals,
                                                       int32_t* counts) {
  const IndexParams& p = bp.fwd;
  const int64_t n = bp.Bi * bp.Hi * p.Lq * p.W;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  const int64_t w = e % p.W;
  int64_t rest = e / p.W;
  const int64_t i = rest % p.Lq;
  rest /= p.Lq;
  const int64_t hi = rest % bp.Hi, bi = rest / bp.Hi;
  const int key = load_key(p, bi * p.idx_sb + hi * p.idx_sh + i * p.idx_sq, w);
  const int64_t bucket = rest * (p.Lk + 1) + (key >= 0 ? key : p.Lk);
  keys[e] = static_cast<uint32_t>(bucket);
  vals[e] = static_cast<int32_t>(i);
  atomicAdd(counts + bucket, 1);
}

// ------------------------------------------------------------------ 4. dK, dV

template <int kD>
struct KvConfig {
  static constexpr int kElems = 8;             // columns per lane: one 16-byte load per row
  static constexpr int kLanes = kD / kElems;   // lanes per (query row, head) pair: 8, 16, 32
  static constexpr int kGroups = 32 / kLanes;  // pairs per warp step: 4, 2, 1
  static constexpr int kUnroll = 4;            // steps whose loads are issued together
  static constexpr int kWarps = 8;
};

// 8 elements (16 bytes) as 8 floats.
template <typename T>
__device__ __forceinline__ void unpack8(float (&x)[8], uint4 raw) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const float2 f = Mma<T>::unpack(words[u]);
    x[2 * u] = f.x;
    x[2 * u + 1] = f.y;
  }
}

__device__ __forceinline__ uint4 load16(const void* src, bool ok) {
  return ok ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
}

// One (query row, head) pair's share of dK and dV, for this lane's kE columns: the score
// and dP dot products (reduced over the pair's kLanes lanes), the probability and dS, then
// dV += p dO and dK += dS Q. (A function of its own so that variants of the pass share
// the arithmetic bit for bit, as C73's and C77's did.)
template <typename T, int kLanes, int kE>
__device__ __forceinline__ void accumulate_pair(const float (&kf)[kE], const float (&vf)[kE],
                                                uint4 q_raw, uint4 do_raw, float l2, float dl,
                                                float bv, bool ok, const IndexParams& p,
                                                bool has_softcap, float tanh_mul,
                                                float (&dk)[kE], float (&dv)[kE]) {
  float qx[kE], dox[kE];
  unpack8<T>(qx, q_raw);
  unpack8<T>(dox, do_raw);
  float s = 0.f, dp = 0.f;
#pragma unroll
  for (int c = 0; c < kE; ++c) {
    s = fmaf(qx[c], kf[c], s);
    dp = fmaf(dox[c], vf[c], dp);
  }
#pragma unroll
  for (int x = 1; x < kLanes; x <<= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, x);
    dp += __shfl_xor_sync(0xffffffffu, dp, x);
  }
  float t = 0.f;
  if (has_softcap) {
    t = tanhf(s * tanh_mul);
    s = p.softcap * t;
  } else {
    s *= p.scale;
  }
  s += bv;
  const float pe = ok ? exp2f(s * kLog2e - l2) : 0.f;
  float ds = pe * (dp - dl);
  if (has_softcap) ds *= 1.f - t * t;
  ds *= p.scale;
#pragma unroll
  for (int c = 0; c < kE; ++c) {
    dv[c] = fmaf(pe, dox[c], dv[c]);
    dk[c] = fmaf(ds, qx[c], dk[c]);
  }
}

// A dK/dV warp's key: j of kv head h of batch b (bh = b * Hkv + h), its segment of the
// transposed lists (starting at seg, n_rows (query row, head) pairs), from its work item.
struct KeySegment {
  int64_t j, bh, h, b, seg, n_rows;
};
__device__ __forceinline__ KeySegment key_segment(const IndexBackwardParams& bp, int64_t item,
                                                  const int32_t* counts, const int32_t* starts) {
  const IndexParams& p = bp.fwd;
  KeySegment k;
  k.j = item % p.Lk;
  k.bh = item / p.Lk;
  k.h = k.bh % p.Hkv;
  k.b = k.bh / p.Hkv;
  const int64_t nb = (bp.Bi == 1 ? 0 : k.b) * bp.Hi + (bp.Hi == 1 ? 0 : k.h);
  const int64_t bucket = nb * (p.Lk + 1) + k.j;
  k.seg = starts[bucket];
  k.n_rows = static_cast<int64_t>(counts[bucket]) * p.G;
  return k;
}

// A warp per key: the key's transposed list (the query rows that list it, from the sort),
// each row times the G query heads of the key's kv head, kGroups pairs per warp step. The
// pass is bound by its instructions per pair, not by its loads (perf-notes C77).
template <typename T, int kD>
__global__ void __launch_bounds__(KvConfig<kD>::kWarps * 32, 2)
    dkdv_kernel(const IndexBackwardParams bp, const float2* rowstat, const int32_t* counts,
                const int32_t* starts, const int32_t* qrows) {
  using C = KvConfig<kD>;
  constexpr int kE = C::kElems, kU = C::kUnroll, kGroups = C::kGroups;
  const IndexParams& p = bp.fwd;
  const int lane = threadIdx.x & 31;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * C::kWarps + (threadIdx.x >> 5);
  if (item >= p.B * p.Hkv * p.Lk) return;
  const KeySegment key = key_segment(bp, item, counts, starts);
  const int64_t j = key.j, bh = key.bh, h = key.h, b = key.b, seg = key.seg, n_rows = key.n_rows;
  const int grp = lane / C::kLanes, col = (lane % C::kLanes) * kE;

  float kf[kE], vf[kE], dk[kE], dv[kE];
  static_assert(kE == 8, "one 16-byte load per row and lane");
  unpack8<T>(kf, load16(static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + j * p.k_sn + col, true));
  unpack8<T>(vf, load16(static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh + j * p.v_sn + col, true));
#pragma unroll
  for (int c = 0; c < kE; ++c) dk[c] = dv[c] = 0.f;

  const bool has_softcap = p.softcap > 0.f;
  const bool has_bias = p.bias != nullptr;
  const float tanh_mul = has_softcap ? p.scale / p.softcap : 0.f;
  const T* q_base = static_cast<const T*>(p.q) + b * p.q_sb + col;
  const T* do_base = static_cast<const T*>(bp.dout) + b * bp.do_sb + col;
  auto bias_at = [&](int64_t hq, int64_t qi) {
    return to_float(static_cast<const T*>(p.bias)[b * p.bias_sb + (hq / p.bias_head_div) * p.bias_sh +
                                                  qi * p.bias_sq + j * p.bias_sk]);
  };

  for (int64_t r0 = 0; r0 < n_rows; r0 += kGroups * kU) {
    uint4 q_raw[kU], do_raw[kU];   // raw rows: converted in the math, fewer registers
    float l2[kU], dl[kU], bv[kU];
    bool ok[kU];
    // Loads of kU pairs first (their latencies overlap), then the math.
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t rr = r0 + u * kGroups + grp;   // pair: entry rr / G, head rr % G
      ok[u] = rr < n_rows;
      const int64_t e = rr / p.G;
      const int64_t hq = h * p.G + (rr - e * p.G);
      const int64_t qi = ok[u] ? qrows[seg + e] : 0;
      q_raw[u] = load16(q_base + hq * p.q_sh + qi * p.q_sm, ok[u]);
      do_raw[u] = load16(do_base + hq * bp.do_sh + qi * bp.do_sm, ok[u]);
      const int64_t g_row = (b * p.Hq + hq) * p.Lq + qi;
      const float2 st = ok[u] ? rowstat[g_row] : make_float2(0.f, 0.f);
      l2[u] = st.x;
      dl[u] = st.y;
      bv[u] = (has_bias && ok[u]) ? bias_at(hq, qi) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
      accumulate_pair<T, C::kLanes>(kf, vf, q_raw[u], do_raw[u], l2[u], dl[u], bv[u], ok[u], p,
                                    has_softcap, tanh_mul, dk, dv);
  }
  // The groups' partial sums, in a fixed order (xor 8 then 16: every lane ends with the
  // same total, computed the same way every run).
#pragma unroll
  for (int x = C::kLanes; x < 32; x <<= 1)
#pragma unroll
    for (int c = 0; c < kE; ++c) {
      dk[c] += __shfl_xor_sync(0xffffffffu, dk[c], x);
      dv[c] += __shfl_xor_sync(0xffffffffu, dv[c], x);
    }
  if (grp == 0) {
    const int64_t out_row = (bh * p.Lk + j) * kD + col;
    T* dk_out = static_cast<T*>(bp.dk) + out_row;
    T* dv_out = static_cast<T*>(bp.dv) + out_row;
#pragma unroll
    for (int c = 0; c < kE / 8; ++c) {
      uint4 a, v;
      a.x = Mma<T>::pack(dk[8 * c + 0], dk[8 * c + 1]);
      a.y = Mma<T>::pack(dk[8 * c + 2], dk[8 * c + 3]);
      a.z = Mma<T>::pack(dk[8 * c + 4], dk[8 * c + 5]);
      a.w = Mma<T>::pack(dk[8 * c + 6], dk[8 * c + 7]);
      v.x = Mma<T>::pack(dv[8 * c + 0], dv[8 * c + 1]);
      v.y = Mma<T>::pack(dv[8 * c + 2], dv[8 * c + 3]);
      v.z = Mma<T>::pack(dv[8 * c + 4], dv[8 * c + 5]);
      v.w = Mma<T>::pack(dv[8 * c + 6], dv[8 * c + 7]);
      *reinterpret_cast<uint4*>(dk_out + 8 * c) = a;
      *reinterpret_cast<uint4*>(dv_out + 8 * c) = v;
    }
  }
}

// dK/dV on the tensor cores (the default; perf-notes C78). A
// warp per key, as above, but 16 (query row, head) pairs per step: their Q and dO rows are
// gathered into shared tiles (cp.async, one step ahead), and both products are m16n8k16
// mma.sync with the key on the N side, where only one or two of the 8 columns are used:
//  - [s dp] (16 pairs x 2) = [Q | dO] (16 x 2D) [[k 0] [0 v]] (2D x 8): one chain over
//    2D, K's column 0 and V's column 1 (the B fragments, zero elsewhere, stay in
//    registers for the whole key);
//  - [dK dV] (D x 2) += [Q^T | dO^T] (D x 32) [[dS 0] [0 P]] (32 x 8): one chain of two
//    k-steps per 16 dimensions, Q and dO through ldmatrix.trans, dS and P rounded to 16
//    bits (as every flash backward's dS and P).
// Unused columns cost tensor-core time, which this pass has to spare; it saves the
// per-pair instructions the FMA kernel is bound by (~94 per pair there, measured; here
// ~26 by a count of the SASS). Deterministic: one warp per key, fixed order. Not bitwise
// the FMA kernel's results (16-bit dS and P, mma summation order).
template <int kD>
struct KvMmaConfig;
template <>
struct KvMmaConfig<64> {
  static constexpr int kWarps = 8, kMinBlocks = 2;
};
template <>
struct KvMmaConfig<128> {
  static constexpr int kWarps = 4, kMinBlocks = 3;
};
template <>
struct KvMmaConfig<256> {
  static constexpr int kWarps = 3, kMinBlocks = 2;
};
constexpr int kPairs = 16;   // (query row, head) pairs per warp step: the MMA's M
constexpr int kKvStages = 2;
// Per warp and stage: the Q and dO tiles, then per pair 16 bytes of row pointers (Q, dO;
// null: no pair) and 16 of (lse2, delta, bias, unused).
template <int kD>
constexpr int kv_mma_stage_bytes() {
  return 2 * kPairs * kD * 2 + kPairs * 16 + kPairs * 16;
}

// kShortChains (the default; perf-notes C80; FLEXSPARSE_CUDA_DEBUG bit 68719476736 takes
// the one-chain kernel, for A/B runs): the same arithmetic with shorter dependency chains. [s dp] in four accumulators (Q's and
// dO's products, even and odd k-steps) summed at the end, instead of one chain of 2 D/16
// dependent MMAs (16 at hd128, ~33 cycles each); and the gather's row pointers all read
// from shared memory before its first cp.async (whose "memory" clobber otherwise keeps
// each pointer's load right before its copy, one shared-memory latency per copy pair).
// Not bitwise the default: the [s dp] sums are added in another order.
template <typename T, int kD, bool kShortChains = false>
__global__ void __launch_bounds__(KvMmaConfig<kD>::kWarps * 32, KvMmaConfig<kD>::kMinBlocks)
    dkdv_mma_kernel(const IndexBackwardParams bp, const float2* rowstat, const int32_t* counts,
                    const int32_t* starts, const int32_t* qrows) {
  constexpr int kWarps = KvMmaConfig<kD>::kWarps;
  constexpr int kChunks = kD / 8;
  constexpr int kSteps = kD / 16;
  constexpr int kStageBytes = kv_mma_stage_bytes<kD>();
  static_assert(kChunks >= 8, "the swizzle permutes 8 chunks within a row");
  const IndexParams& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  unsigned char* warp_smem = smem + warp * (kKvStages * kStageBytes);
  auto q_tile = [&](int stage) { return reinterpret_cast<T*>(warp_smem + stage * kStageBytes); };
  auto pointers = [&](int stage) {
    return reinterpret_cast<ulonglong2*>(warp_smem + stage * kStageBytes + 2 * kPairs * kD * 2);
  };
  auto stats = [&](int stage) {
    return reinterpret_cast<float4*>(warp_smem + stage * kStageBytes + 2 * kPairs * kD * 2 +
                                     kPairs * 16);
  };

  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (item >= p.B * p.Hkv * p.Lk) return;
  const KeySegment key = key_segment(bp, item, counts, starts);
  const int64_t j = key.j, bh = key.bh, h = key.h, b = key.b, seg = key.seg, n_rows = key.n_rows;
  const int64_t n_steps = (n_rows + kPairs - 1) / kPairs;
  const int g = lane >> 2, quad = lane & 3;   // the fragments' row (or column) and quad

  // B fragments of [[k 0] [0 v]]: column 0 (lanes 0-3) holds K's row, column 1 (lanes 4-7)
  // V's; every other lane zeros.
  uint32_t kb[kSteps][2], vb[kSteps][2];
  {
    const uint32_t* k_row = reinterpret_cast<const uint32_t*>(
        static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + j * p.k_sn);
    const uint32_t* v_row = reinterpret_cast<const uint32_t*>(
        static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh + j * p.v_sn);
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      kb[st][0] = g == 0 ? k_row[8 * st + quad] : 0u;
      kb[st][1] = g == 0 ? k_row[8 * st + 4 + quad] : 0u;
      vb[st][0] = g == 1 ? v_row[8 * st + quad] : 0u;
      vb[st][1] = g == 1 ? v_row[8 * st + 4 + quad] : 0u;
    }
  }

  const bool has_softcap = p.softcap > 0.f;
  const bool has_bias = p.bias != nullptr;
  const float tanh_mul = has_softcap ? p.scale / p.softcap : 0.f;
  // The kv head's first query head: pair (entry e, head g) reads row qrows[seg + e] of
  // query head h * G + g.
  const T* q_kv = static_cast<const T*>(p.q) + b * p.q_sb + h * p.G * p.q_sh;
  const T* do_kv = static_cast<const T*>(bp.dout) + b * bp.do_sb + h * p.G * bp.do_sh;
  const float2* rs_kv = rowstat + (b * p.Hq + h * p.G) * p.Lq;

  // Pair lanes (0-15): this lane's pair of step t, loaded a step ahead: its query row (-1:
  // no pair) and its head within the kv head's G.
  auto pair_of = [&](int64_t t) -> int2 {
    const int64_t rr = t * kPairs + lane;
    if (lane >= kPairs || rr >= n_rows) return make_int2(-1, 0);
    const int64_t e = rr / p.G;
    return make_int2(qrows[seg + e], static_cast<int>(rr - e * p.G));
  };
  // The gather's lanes: 16-byte chunk gc of row gr of each iteration's kRowsPerIt rows. Row
  // r = it * kRowsPerIt + gr has r & 7 = x ^ gr with x = (it * kRowsPerIt) & 7 (kRowsPerIt
  // divides 8), so its swizzled chunk gc ^ (r & 7) is the lane's gc ^ gr XOR a constant.
  constexpr int kRowsPerIt = 32 / kChunks;
  const int gc = lane % kChunks, gr = lane / kChunks;
  const uint32_t gather_row = gr * kD * 2;   // bytes
  const int gather_chunk = gc ^ gr;
  // Step t's copies into stage t % kKvStages (a commit either way: one group per step).
  auto issue = [&](int64_t t, int2 pair) {
    if (t < n_steps) {
      const int stage = static_cast<int>(t % kKvStages);
      if (lane < kPairs) {
        const T* q_ptr = nullptr;
        const T* do_ptr = nullptr;
        float4* st = stats(stage) + lane;
        const int64_t qi = pair.x, hg = pair.y;
        if (qi >= 0) {
          q_ptr = q_kv + hg * p.q_sh + qi * p.q_sm;
          do_ptr = do_kv + hg * bp.do_sh + qi * bp.do_sm;
          cp_async_8(smem_addr(st), rs_kv + hg * p.Lq + qi);
          st->z = has_bias ? to_float(static_cast<const T*>(p.bias)[b * p.bias_sb +
                                      ((h * p.G + hg) / p.bias_head_div) * p.bias_sh +
                                      qi * p.bias_sq + j * p.bias_sk])
                           : 0.f;
        } else {
          *st = make_float4(0.f, 0.f, 0.f, 0.f);
        }
        pointers(stage)[lane] = make_ulonglong2(reinterpret_cast<uint64_t>(q_ptr),
                                                reinterpret_cast<uint64_t>(do_ptr));
      }
      __syncwarp();
      const uint32_t q_dst = smem_addr(q_tile(stage)) + gather_row;
      const ulonglong2* table = pointers(stage) + gr;
      constexpr int kIts = kPairs / kRowsPerIt;
      // kShortChains: the pointers of up to 8 iterations (32 registers) read before their
      // copies; else each right before its own.
      constexpr int kGroup = !kShortChains ? 1 : kIts < 8 ? kIts : 8;
#pragma unroll
      for (int it0 = 0; it0 < kIts; it0 += kGroup) {
        ulonglong2 ptrs[kGroup];
#pragma unroll
        for (int u = 0; u < kGroup; ++u) ptrs[u] = table[(it0 + u) * kRowsPerIt];
#pragma unroll
        for (int u = 0; u < kGroup; ++u) {
          const int it = it0 + u;
          const int x = (it * kRowsPerIt) & 7;
          const uint32_t swz = q_dst + it * kRowsPerIt * kD * 2 + ((gather_chunk ^ x) << 4);
          const bool none = ptrs[u].x == 0;
          cp_async_16_or_zeros(swz, reinterpret_cast<const T*>(ptrs[u].x) + gc * 8, none);
          cp_async_16_or_zeros(swz + kPairs * kD * 2,
                               reinterpret_cast<const T*>(ptrs[u].y) + gc * 8, none);
        }
      }
    }
    cp_async_commit();
  };

  float acc[kSteps][4];   // [dK dV] (D x 8): column 0 dK, column 1 dV (lanes with quad 0)
#pragma unroll
  for (int st = 0; st < kSteps; ++st) acc[st][0] = acc[st][1] = acc[st][2] = acc[st][3] = 0.f;

  // ldmatrix lanes: A operands (Q, dO as 16 pairs x D) as the dQ pass's; the transposed A
  // operands (Q^T, dO^T as D x 16 pairs) address rows as the dQ pass's non-trans B. Their
  // byte offsets in a tile for k-steps 0-3; step st is step st % 4's plus (st / 4) * 128
  // bytes (the swizzle leaves chunk bits above the third alone).
  uint32_t a_off[4], t_off[4];
  {
    const int a_row = ((lane >> 3) & 1) * 8 + (lane & 7), a_bit = lane >> 4;
    const int t_row = (lane >> 4) * 8 + (lane & 7), t_bit = (lane >> 3) & 1;
#pragma unroll
    for (int s4 = 0; s4 < 4; ++s4) {
      a_off[s4] = (a_row * kD + (((2 * s4 + a_bit) ^ (a_row & 7)) << 3)) * 2;
      t_off[s4] = (t_row * kD + (((2 * s4 + t_bit) ^ (t_row & 7)) << 3)) * 2;
    }
  }
  constexpr uint32_t kDoTile = kPairs * kD * 2;   // the dO tile, bytes after the Q tile

  issue(0, pair_of(0));
  int2 next_pair = pair_of(1);
  for (int64_t t = 0; t < n_steps; ++t) {
    __syncwarp();   // every lane is done with stage (t + 1) % kKvStages (step t - 1)
    issue(t + 1, next_pair);
    next_pair = pair_of(t + 2);
    cp_async_wait<1>();
    __syncwarp();   // step t's tiles and the statistics its pair lanes copied
    const int stage = static_cast<int>(t % kKvStages);
    const uint32_t qt = smem_addr(q_tile(stage));

    // [s dp]: row g and g + 8 of the 16 pairs, columns 2 quad, 2 quad + 1.
    // kShortChains: four chains (Q even, dO even, Q odd, dO odd k-steps), summed after;
    // else one chain, all into sd.
    float sd[4] = {0.f, 0.f, 0.f, 0.f};
    float part[4][4] = {};
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      uint32_t qa[4], da[4];
      const uint32_t at = qt + a_off[st & 3] + (st >> 2) * 128;
      ldmatrix_x4(qa, at);
      ldmatrix_x4(da, at + kDoTile);
      Mma<T>::run(kShortChains ? part[2 * (st & 1)] : sd, qa, kb[st][0], kb[st][1]);
      Mma<T>::run(kShortChains ? part[2 * (st & 1) + 1] : sd, da, vb[st][0], vb[st][1]);
    }
    if constexpr (kShortChains) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sd[e] = (part[0][e] + part[2][e]) + (part[1][e] + part[3][e]);
    }
    // P and dS of pairs g (sd[0], sd[1]) and g + 8 (sd[2], sd[3]); meaningful on quad 0.
    float pe[2], ds[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int pair = g + 8 * half;
      const float4 st = stats(stage)[pair];
      const bool ok = t * kPairs + pair < n_rows;
      float x = sd[2 * half], tt = 0.f;
      if (has_softcap) {
        tt = tanhf(x * tanh_mul);
        x = p.softcap * tt;
      } else {
        x *= p.scale;
      }
      x += st.z;
      pe[half] = ok ? exp2f(x * kLog2e - st.x) : 0.f;
      float d = pe[half] * (sd[2 * half + 1] - st.y);
      if (has_softcap) d *= 1.f - tt * tt;
      ds[half] = quad == 0 ? d * p.scale : 0.f;
      pe[half] = quad == 0 ? pe[half] : 0.f;
    }
    // B fragments of [[dS 0] [0 P]] (32 x 8): lanes of column 0 take dS of pairs 2 quad,
    // 2 quad + 1 (b0) and + 8 (b1), from lanes 8 quad (pair 2 quad) and 8 quad + 4; column 1
    // the same pairs' P; other lanes zeros.
    const int src0 = 8 * quad, src1 = 8 * quad + 4;
    constexpr unsigned kAll = 0xffffffffu;
    const float ds0 = __shfl_sync(kAll, ds[0], src0), ds1 = __shfl_sync(kAll, ds[0], src1);
    const float ds8 = __shfl_sync(kAll, ds[1], src0), ds9 = __shfl_sync(kAll, ds[1], src1);
    const float p0 = __shfl_sync(kAll, pe[0], src0), p1 = __shfl_sync(kAll, pe[0], src1);
    const float p8 = __shfl_sync(kAll, pe[1], src0), p9 = __shfl_sync(kAll, pe[1], src1);
    const uint32_t bq0 = g == 0 ? Mma<T>::pack(ds0, ds1) : 0u;
    const uint32_t bq1 = g == 0 ? Mma<T>::pack(ds8, ds9) : 0u;
    const uint32_t bd0 = g == 1 ? Mma<T>::pack(p0, p1) : 0u;
    const uint32_t bd1 = g == 1 ? Mma<T>::pack(p8, p9) : 0u;
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      uint32_t qa[4], da[4];
      const uint32_t at = qt + t_off[st & 3] + (st >> 2) * 128;
      ldmatrix_x4_trans(qa, at);
      ldmatrix_x4_trans(da, at + kDoTile);
      Mma<T>::run(acc[st], qa, bq0, bq1);
      Mma<T>::run(acc[st], da, bd0, bd1);
    }
  }
  cp_async_wait<0>();
  __syncwarp();

  // dK and dV rows: quad-0 lanes hold dimensions 16 st + g (acc[st][0], [1]) and + 8
  // ([2], [3]); through shared memory (stage 0's Q tile) into 16-byte stores.
  float* out_s = reinterpret_cast<float*>(warp_smem);
  if (quad == 0) {
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      out_s[16 * st + g] = acc[st][0];
      out_s[kD + 16 * st + g] = acc[st][1];
      out_s[16 * st + g + 8] = acc[st][2];
      out_s[kD + 16 * st + g + 8] = acc[st][3];
    }
  }
  __syncwarp();
  const int64_t out_row = (bh * p.Lk + j) * kD;
#pragma unroll
  for (int c = lane; c < 2 * kChunks; c += 32) {
    const int which = c / kChunks, chunk = c % kChunks;
    const float* x = out_s + which * kD + chunk * 8;
    uint4 w;
    w.x = Mma<T>::pack(x[0], x[1]);
    w.y = Mma<T>::pack(x[2], x[3]);
    w.z = Mma<T>::pack(x[4], x[5]);
    w.w = Mma<T>::pack(x[6], x[7]);
    T* dst = static_cast<T*>(which == 0 ? bp.dk : bp.dv) + out_row + chunk * 8;
    *reinterpret_cast<uint4*>(dst) = w;
  }
}

// ------------------------------------------------------------------ host side

// Workspace layout, each piece 256-byte aligned.
struct Layout {
  size_t rowstat = 0, counts = 0, starts = 0, keys_in = 0, keys_out = 0, vals_in = 0,
         vals_out = 0, temp = 0, temp_bytes = 0, total = 0;
  int64_t rows = 0, buckets = 0, entries = 0;
  int end_bit = 1;
};

inline size_t align256(size_t x) { return (x + 255) / 256 * 256; }

Layout layout(IndexBackwardParams const& bp) {
  const IndexParams& p = bp.fwd;
  Layout L;
  L.rows = p.B * p.Hq * p.Lq;
  L.buckets = bp.Bi * bp.Hi * (p.Lk + 1);
  L.entries = bp.Bi * bp.Hi * p.Lq * p.W;
  while (L.end_bit < 32 && (int64_t{1} << L.end_bit) < L.buckets) ++L.end_bit;
  size_t scan_bytes = 0, sort_bytes = 0;
  if (L.buckets > 0 && L.buckets <= INT32_MAX)
    CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), static_cast<int>(L.buckets)));
  if (L.entries > 0 && L.entries <= INT32_MAX)
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr),
                                               static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                               static_cast<int32_t*>(nullptr), static_cast<int>(L.entries), 0,
                                               L.end_bit));
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align256(bytes);
    return at;
  };
  L.rowstat = take(L.rows * sizeof(float2));
  L.counts = take(L.buckets * sizeof(int32_t));
  L.starts = take(L.buckets * sizeof(int32_t));
  L.keys_in = take(L.entries * sizeof(uint32_t));
  L.keys_out = take(L.entries * sizeof(uint32_t));
  L.vals_in = take(L.entries * sizeof(int32_t));
  L.vals_out = take(L.entries * sizeof(int32_t));
  L.temp_bytes = std::max(scan_bytes, sort_bytes);
  L.temp = take(L.temp_bytes);
  L.total = off;
  return L;
}

// One non-blocking stream of the highest priority per device, made on first use, for the
// transposed lists beside the dQ pass (C83).
cudaStream_t side_stream() {
  static std::mutex mu;
  static std::map<int, cudaStream_t> streams;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams.find(device);
  if (it != streams.end()) return it->second;
  int lowest = 0, highest = 0;
  CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, highest));
  streams[device] = s;
  return s;
}

template <typename T, int kD, bool kOneStage>
void launch_dq(IndexBackwardParams const& bp, const float2* rowstat, cudaStream_t stream) {
  const IndexParams& p = bp.fwd;
  constexpr int kWarps = Config<kD, kOneStage>::kWarps;
  constexpr int smem = kWarps * warp_smem_bytes<kD, kOneStage>();
  const int64_t n_groups = (p.G + kHeads - 1) / kHeads;
  const int64_t items = p.B * p.Hkv * n_groups * p.Lq;
  if (items == 0) return;
  auto kernel = dq_kernel<T, kD, kOneStage>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<static_cast<unsigned>((items + kWarps - 1) / kWarps), kWarps * 32, smem, stream>>>(
      bp, rowstat);
  CUDA_CHECK(cudaGetLastError());
}

template <typename T, int kD>
void launch(IndexBackwardParams const& bp, cudaStream_t stream) {
  const IndexParams& p = bp.fwd;
  const Layout L = layout(bp);
  unsigned char* ws = static_cast<unsigned char*>(bp.workspace);
  float2* rowstat = reinterpret_cast<float2*>(ws + L.rowstat);
  int32_t* counts = reinterpret_cast<int32_t*>(ws + L.counts);
  int32_t* starts = reinterpret_cast<int32_t*>(ws + L.starts);
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(ws + L.keys_in);
  uint32_t* keys_out = reinterpret_cast<uint32_t*>(ws + L.keys_out);
  int32_t* vals_in = reinterpret_cast<int32_t*>(ws + L.vals_in);
  int32_t* vals_out = reinterpret_cast<int32_t*>(ws + L.vals_out);
  void* temp = ws + L.temp;

  auto rows_and_dq = [&] {
    // 1. delta, lse2
    if (L.rows > 0) {
      // 16-byte loads (C81) where out's rows are 16-byte aligned (dO's are: tma_ready); out
      // is contiguous but may start at any element. Bit 137438953472: the warp-per-row kernel.
      if (!(p.debug_high & 64) && reinterpret_cast<uintptr_t>(p.out) % 16 == 0) {
        constexpr int64_t kRowsPerCta = 8 * (256 / kD);
        prep_vec_kernel<T, kD><<<static_cast<unsigned>((L.rows + kRowsPerCta - 1) / kRowsPerCta),
                                 256, 0, stream>>>(bp, rowstat);
      } else {
        prep_kernel<T><<<static_cast<unsigned>((L.rows + 7) / 8), 256, 0, stream>>>(bp, rowstat);
      }
      CUDA_CHECK(cudaGetLastError());
    }
    // 2. dQ (bit 34359738368: the pipelined kernel)
    if (p.debug_high & 16)
      launch_dq<T, kD, false>(bp, rowstat, stream);
    else
      launch_dq<T, kD, true>(bp, rowstat, stream);
  };
  auto transposed_lists = [&](cudaStream_t on) {
    // 3. transposed lists
    if (L.buckets > 0) {
      CUDA_CHECK(cudaMemsetAsync(counts, 0, L.buckets * sizeof(int32_t), on));
      if (L.entries > 0) {
        csr_keys_kernel<<<static_cast<unsigned>((L.entries + 255) / 256), 256, 0, on>>>(
            bp, keys_in, vals_in, counts);
        CUDA_CHECK(cudaGetLastError());
        size_t temp_bytes = L.temp_bytes;
        CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, vals_in, vals_out,
                                                   static_cast<int>(L.entries), 0, L.end_bit, on));
      }
      size_t temp_bytes = L.temp_bytes;
      CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, starts,
                                               static_cast<int>(L.buckets), on));
    }
  };
  // Step 3, which needs only the lists, on a second stream of high priority beside steps 1
  // and 2, joined before step 4 (events: the fork and the join are captured into a CUDA
  // graph like any cross-stream edge). C83, H200: -12% to -2% from 8K W=16 to 32K W=256.
  // Bit 549755813888: one stream, for A/B runs.
  if (!(p.debug_high & 256)) {
    cudaStream_t lists_stream = side_stream();
    cudaEvent_t fork, join;
    CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(fork, stream));
    CUDA_CHECK(cudaStreamWaitEvent(lists_stream, fork, 0));
    transposed_lists(lists_stream);
    CUDA_CHECK(cudaEventRecord(join, lists_stream));
    rows_and_dq();
    CUDA_CHECK(cudaStreamWaitEvent(stream, join, 0));
    CUDA_CHECK(cudaEventDestroy(fork));   // released once their work is done
    CUDA_CHECK(cudaEventDestroy(join));
  } else {
    rows_and_dq();
    transposed_lists(stream);
  }
  // 4. dK, dV
  {
    using C = KvConfig<kD>;
    const int64_t items = p.B * p.Hkv * p.Lk;
    if (items > 0) {
      const unsigned blocks = static_cast<unsigned>((items + C::kWarps - 1) / C::kWarps);
      if (!(p.debug_high & 8)) {   // bit 17179869184 takes the CUDA-core FMA kernel (C78)
        constexpr int kWarps = KvMmaConfig<kD>::kWarps;
        constexpr int smem = kWarps * kKvStages * kv_mma_stage_bytes<kD>();
        // shorter dependency chains (C80); bit 68719476736: the one-chain kernel
        auto kernel = (p.debug_high & 32) ? dkdv_mma_kernel<T, kD> : dkdv_mma_kernel<T, kD, true>;
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        kernel<<<static_cast<unsigned>((items + kWarps - 1) / kWarps), kWarps * 32, smem, stream>>>(
            bp, rowstat, counts, starts, vals_out);
      } else {
        dkdv_kernel<T, kD><<<blocks, C::kWarps * 32, 0, stream>>>(bp, rowstat, counts, starts,
                                                                 vals_out);
      }
      CUDA_CHECK(cudaGetLastError());
    }
  }
}

template <int kD>
void launch_dtype(IndexBackwardParams const& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::kBFloat16)
    launch<__nv_bfloat16, kD>(p, stream);
  else
    launch<__half, kD>(p, stream);
}

}  // namespace index_bwd

size_t index_bwd_workspace_bytes(IndexBackwardParams const& p) { return index_bwd::layout(p).total; }

std::string index_bwd_unsupported(IndexBackwardParams const& p) {
  const IndexParams& f = p.fwd;
  if (f.D != 64 && f.D != 128 && f.D != 256)
    return "head dim " + std::to_string(f.D) + " (64, 128 or 256)";
  if (p.Bi * p.Hi * f.Lq * f.W > INT32_MAX)
    return "Bi*Hi*Lq*W >= 2^31 list entries (the transposed lists use int32 positions)";
  if (p.Bi * p.Hi * (f.Lk + 1) > INT32_MAX) return "Bi*Hi*(Lk+1) >= 2^31 key buckets";
  if (f.B * f.Hkv * f.Lk / index_bwd::KvConfig<64>::kWarps >= INT32_MAX ||
      f.B * f.Hq * f.Lq / 8 >= INT32_MAX)
    return "too many rows for one grid";
  return "";
}

void index_bwd_sm90(IndexBackwardParams const& p, DType dtype, cudaStream_t stream) {
  switch (p.fwd.D) {
    case 64: index_bwd::launch_dtype<64>(p, dtype, stream); break;
    case 128: index_bwd::launch_dtype<128>(p, dtype, stream); break;
    case 256: index_bwd::launch_dtype<256>(p, dtype, stream); break;
    default:
      throw std::invalid_argument("flexsparse CUDA index backward: head dim must be 64, 128 or 256");
  }
}

}  // namespace flexsparse
