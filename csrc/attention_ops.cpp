// The CUDA backend's op kernels: flexsparse::cuda_attention (block descriptors and index
// masks) and flexsparse::cuda_attention_backward (block descriptors and, not yet the
// default path, index masks without dbias), registered for the
// CUDA dispatch key. Their schemas, fake kernels and autograd are defined once in Python
// (the op layer); this file checks the tensors, fills the kernel arguments (params.h) and
// launches (kernels.h).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <Python.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <limits>
#include <optional>
#include <vector>

#include "checks.h"
#include "kernels.h"

// The extension module (import flexsparse._C registers the kernels below).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

namespace flexsparse {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Head dim of a broadcastable tensor (1, Hkv or Hq) as the divisor of the query head.
int head_div(int64_t size, int64_t Hq, int64_t Hkv, const char* what) {
  if (size == Hq) return 1;
  if (size == Hkv) return static_cast<int>(Hq / Hkv);
  FLEXSPARSE_CHECK(size == 1, "flexsparse cuda: ", what, " head dim ", size, " must be 1, Hkv=", Hkv,
              " or Hq=", Hq);
  return static_cast<int>(Hq);
}

int64_t bstride(const Tensor& t, int dim) { return t.size(dim) == 1 ? 0 : t.stride(dim); }

// FLEXSPARSE_CUDA_DEBUG (A/B and probe switches, docs/perf-notes.md), read per call as a
// 64-bit value: bits 0-30 go to the params' `debug` (what atoi gave before), bits 31 and
// up, shifted down by 31, to the index kernels' `debug_high`: 2^31 the index forward's
// pipelined kernel, 2^32 its one-row-per-warp kernel (index_fwd.cu), 2^33 the one-launch
// document builds (build_ops.h), 2^34 the index backward's FMA dK/dV pass, 2^35 its
// pipelined dQ pass, 2^36 its dK/dV pass with one dependency chain (before C80), 2^37 its
// preprocess with 2-byte loads (before C81) and 2^39 its transposed lists on the caller's
// stream only (before C83) (index_bwd.cu); to the block kernels' `debug_high`: 2^40 the
// backward's dS^T stores through CuTe's partition (before C86 and C105), 2^41 its dQ
// staged in 8-byte pieces (before C87), 2^46 the other place of its dS^T stores than the
// kernel's default (before or after the dV product is issued, C106) and 2^47 the other
// order of its exponentials and dS (interleaved or not, C107), bf16, and at head dim 128
// 2^49 the other of 0 and 1 lse / delta pairs read before the waits than the kernel's
// (C110) (bwd_sm90.cuh);
// probes of the forward (wrong results, timing only): 2^42 queries loaded for a CTA's first
// work tiles only, 2^43 no O store; 2^44 the forward's two query buffers at hd128
// (kQBuffers, opt-in), 2^48 its one query buffer at hd64 (before C92), 2^50 hd64's two
// query buffers with the register-store epilogue (bf16, before C111) and 2^52 the staged
// column ranges where a window would take the band kernels (C113) (fwd_sm90.cuh) and, in
// the backward, the per-key intervals from the window (C114) (bwd_sm90.cuh); 2^53 one CTA
// per key tile instead of the persistent backward (C118, the bf16 hd128 64-row kernel's
// default) (bwd_sm90.cuh). (Earlier
// uses, removed, docs/perf-notes.md: 2^46 C89's 4-byte stores, then C101's turn ring run on
// across work tiles; 2^47 C91's crossed work tiles; 2^49-2^51 C95's softmax probes, then
// 2^49 C96's early list walk probe, now every forward kernel's walk, then C110's early
// columns of C107 in the 80-row backward; 2^50 C110's two early statistics pairs; 2^51
// C110's statistics by shuffles, then C112's band masks in hd64's plain forward, then
// C116's opt-in dK / dV TMA-store epilogue, now the backward's only one; bit 16 the
// backward's direct dK / dV stores, before C28, removed with C28's 16-byte store loop;
// 2^52 C99's L2 prefetch of the next query tile and 2^53 C100's backward without the dS
// barrier, both timed no better, then C117's V loaded after the first query tile in the
// backward, even (now C118's); 2^54 C104's one-warpgroup dQ, slower, then C119's dV
// through the dS buffers in the persistent epilogue; 2^55 C120's persistent hd64 128-row
// backward; 2^56 C121's persistent epilogue stores issued by the dQ writer: all three
// timed even against the persistent default and removed; then 2^54 C122's persistent
// 80-row backward, even, removed.)
// 2^38 is the block-grid builds' list_kernel and 2^45 their two-pass grid_list_kernel (no
// slabs) (build_ops.h).
int64_t debug_bits() {
  const char* dbg = std::getenv("FLEXSPARSE_CUDA_DEBUG");
  return dbg ? std::strtoll(dbg, nullptr, 10) : 0;
}
// FLEXSPARSE_CUDA_DEBUG into a params struct's `debug` (bits 0-30) and `debug_high` (bits
// 31 and up, shifted down by 31), read once.
template <class Params>
void set_debug(Params& p) {
  const int64_t bits = debug_bits();
  p.debug = static_cast<int>(bits & 0x7fffffff);
  p.debug_high = static_cast<int>(bits >> 31);
}

// TMA (block kernels) and 16-byte cp.async (index kernel) need the last dim contiguous,
// 16-byte aligned strides and base.
Tensor tma_ready(const Tensor& t) {
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d < t.dim() - 1; ++d) ok = ok && (t.stride(d) * t.element_size()) % 16 == 0;
  // a contiguous but misaligned view stays itself under contiguous(): clone it
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

struct Inputs {
  Tensor q, k, v;
  OptTensor bias;
  std::vector<Tensor> keep;   // contiguous copies the kernels read
};

// What every kernel needs of query, key and value: CUDA, fp16/bf16 of one dtype, 4-D,
// GQA heads, D = Dv in {64, 128, 256}.
void check_qkv(const Inputs& in) {
  const Tensor& q = in.q;
  FLEXSPARSE_CHECK(q.is_cuda() && in.k.is_cuda() && in.v.is_cuda(), "flexsparse cuda: CUDA tensors only");
  FLEXSPARSE_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "flexsparse cuda: dtype ", q.scalar_type(), " (float16 or bfloat16)");
  FLEXSPARSE_CHECK(in.k.scalar_type() == q.scalar_type() && in.v.scalar_type() == q.scalar_type(),
              "flexsparse cuda: query, key and value must share a dtype");
  FLEXSPARSE_CHECK(q.dim() == 4 && in.k.dim() == 4 && in.v.dim() == 4, "flexsparse cuda: 4-D q, k, v");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3);
  const int64_t Hkv = in.k.size(1), Lk = in.k.size(2);
  FLEXSPARSE_CHECK(in.k.size(0) == B && in.v.size(0) == B && in.v.size(1) == Hkv && in.v.size(2) == Lk &&
                  in.k.size(3) == D && in.v.size(3) == D && Hkv > 0 && Hq % Hkv == 0,
              "flexsparse cuda: shapes q ", q.sizes(), " k ", in.k.sizes(), " v ", in.v.sizes());
  FLEXSPARSE_CHECK(D == 64 || D == 128 || D == 256, "flexsparse cuda: head dim ", D, " (64, 128 or 256)");
}

// Query, key and value (copied where the kernels' alignment needs it), their pointers and
// strides (AttentionTensors), and the sizes, which AttentionParams holds as int and
// IndexParams as int64.
template <class Params>
void set_qkv(Params& p, Inputs& in, double scale, double softcap) {
  in.q = tma_ready(in.q);
  in.k = tma_ready(in.k);
  in.v = tma_ready(in.v);
  p.q = in.q.data_ptr();
  p.k = in.k.data_ptr();
  p.v = in.v.data_ptr();
  p.q_sb = in.q.stride(0); p.q_sh = in.q.stride(1); p.q_sm = in.q.stride(2);
  p.k_sb = in.k.stride(0); p.k_sh = in.k.stride(1); p.k_sn = in.k.stride(2);
  p.v_sb = in.v.stride(0); p.v_sh = in.v.stride(1); p.v_sn = in.v.stride(2);
  p.B = in.q.size(0); p.Hq = in.q.size(1); p.Lq = in.q.size(2); p.D = in.q.size(3);
  p.Hkv = in.k.size(1); p.Lk = in.k.size(2);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
}

// The bias (in the query's dtype), broadcast by strides 0 and a head divisor.
template <class Params>
void set_bias(Params& p, Inputs& in) {
  if (!in.bias.has_value()) return;
  Tensor bias = *in.bias;
  FLEXSPARSE_CHECK(bias.dim() == 4, "flexsparse cuda: bias must be 4-D, got ", bias.sizes());
  FLEXSPARSE_CHECK(bias.device() == in.q.device(), "flexsparse cuda: bias is on ", bias.device(),
              ", query on ", in.q.device());
  if (bias.scalar_type() != in.q.scalar_type()) bias = bias.to(in.q.scalar_type());
  in.keep.push_back(bias);
  FLEXSPARSE_CHECK((bias.size(0) == 1 || bias.size(0) == p.B) && (bias.size(2) == 1 || bias.size(2) == p.Lq) &&
                  (bias.size(3) == 1 || bias.size(3) == p.Lk),
              "flexsparse cuda: bias shape ", bias.sizes(), " does not broadcast to (", p.B, ", ",
              p.Hq, ", ", p.Lq, ", ", p.Lk, ")");
  p.bias = bias.data_ptr();
  p.bias_sb = bstride(bias, 0); p.bias_sh = bstride(bias, 1);
  p.bias_sq = bstride(bias, 2); p.bias_sk = bstride(bias, 3);
  p.bias_head_div = head_div(bias.size(1), p.Hq, p.Hkv, "bias");
}

BlockListParams list_params(const OptTensor& count, const OptTensor& index, int64_t B,
                            int64_t Hq, int64_t Hkv, int64_t n_rows, int64_t n_blocks,
                            const char* name, std::vector<Tensor>& keep) {
  BlockListParams l;
  FLEXSPARSE_CHECK(count.has_value() && index.has_value(), "flexsparse cuda: the descriptor's ", name,
              " lists are missing (the cuda backend needs all eight block lists)");
  FLEXSPARSE_CHECK(count->dim() == 3 && count->size(2) == n_rows, "flexsparse cuda: ", name,
              "_count shape ", count->sizes(), " (expected (Bd, Hd, ", n_rows, "))");
  FLEXSPARSE_CHECK((index->dim() == 4 || (index->dim() == 5 && index->size(4) == 2 && index->size(3) <= 4)) &&
                  index->size(0) == count->size(0) && index->size(1) == count->size(1) &&
                  index->size(2) == n_rows,
              "flexsparse cuda: ", name, "_index shape ", index->sizes());
  // Rows expanded from one (stride 0 in both tensors): that row only, read by every row.
  const bool one_row = n_rows > 1 && count->stride(2) == 0 && index->stride(2) == 0;
  const int64_t stored_rows = one_row ? 1 : n_rows;
  Tensor c = (one_row ? count->narrow(2, 0, 1) : *count).to(at::kInt).contiguous();
  Tensor x = (one_row ? index->narrow(2, 0, 1) : *index).to(at::kInt).contiguous();
  keep.push_back(c);
  keep.push_back(x);
  const int64_t Bd = c.size(0), Hd = c.size(1);
  FLEXSPARSE_CHECK(Bd == 1 || Bd == B, "flexsparse cuda: ", name, "_count batch ", Bd, " for B=", B);
  l.count = c.data_ptr<int32_t>();
  l.index = x.data_ptr<int32_t>();
  l.batch_stride = Bd == 1 ? 0 : Hd * stored_rows;
  l.head_stride = stored_rows;
  l.row_stride = one_row ? 0 : 1;
  l.head_div = head_div(Hd, Hq, Hkv, name);
  l.ranges = x.dim() == 5 ? static_cast<int>(x.size(3)) : 0;
  l.width = x.dim() == 5 ? 2 * l.ranges : static_cast<int>(x.size(3));
  l.n_blocks = static_cast<int>(n_blocks);
  return l;
}

// Fill everything but out/lse. Returns the tensors the kernels read (kept alive by the caller).
AttentionParams fill_params(Inputs& in, const OptTensor& kv_count, const OptTensor& kv_index,
                            const OptTensor& kv_full_count, const OptTensor& kv_full_index,
                            const OptTensor& q_count, const OptTensor& q_index,
                            const OptTensor& q_full_count, const OptTensor& q_full_index,
                            const OptTensor& dense_mask, const OptTensor& col_ranges,
                            const OptTensor& partial_bits_index, const OptTensor& partial_bits,
                            int64_t block_q, int64_t block_k, double scale, double softcap,
                            bool need_q_lists) {
  check_qkv(in);
  const int64_t B = in.q.size(0), Hq = in.q.size(1), Lq = in.q.size(2), D = in.q.size(3);
  const int64_t Hkv = in.k.size(1), Lk = in.k.size(2);
  // (Also checked in Python before the call: ops/cuda_backend.py.)
  const int64_t tile_m = fwd_tile_m(), tile_n = fwd_tile_n(static_cast<int>(D));
  if (!(block_q > 0 && block_q % tile_m == 0 && block_k > 0 && block_k % tile_n == 0)) {
    const std::string msg = "flexsparse cuda: descriptor block size (" + std::to_string(block_q) + ", " +
                            std::to_string(block_k) + ") must be multiples of (" + std::to_string(tile_m) +
                            ", " + std::to_string(tile_n) + ")";
    FLEXSPARSE_CHECK(false, msg);
  }

  AttentionParams p;
  set_qkv(p, in, scale, softcap);
  p.block_q = block_q; p.block_k = block_k;
  set_bias(p, in);

  const int64_t nQB = (Lq + block_q - 1) / block_q, nKB = (Lk + block_k - 1) / block_k;
  p.kv_partial = list_params(kv_count, kv_index, B, Hq, Hkv, nQB, nKB, "kv", in.keep);
  p.kv_full = list_params(kv_full_count, kv_full_index, B, Hq, Hkv, nQB, nKB, "kv_full", in.keep);
  if (need_q_lists) {
    p.q_partial = list_params(q_count, q_index, B, Hq, Hkv, nKB, nQB, "q", in.keep);
    p.q_full = list_params(q_full_count, q_full_index, B, Hq, Hkv, nKB, nQB, "q_full", in.keep);
  }

  PredicateParams& pr = p.pred;
  if (dense_mask.has_value()) {
    Tensor dm = *dense_mask;
    FLEXSPARSE_CHECK(dm.dim() == 4, "flexsparse cuda: dense_mask must be 4-D, got ", dm.sizes());
    FLEXSPARSE_CHECK((dm.size(0) == 1 || dm.size(0) == B) && (dm.size(2) == 1 || dm.size(2) == Lq) &&
                    (dm.size(3) == 1 || dm.size(3) == Lk),
                "flexsparse cuda: dense_mask shape ", dm.sizes());
    if (dm.scalar_type() != at::kBool) dm = dm.ne(0);
    in.keep.push_back(dm);
    pr.dense = reinterpret_cast<const uint8_t*>(dm.data_ptr<bool>());
    pr.dense_sb = bstride(dm, 0); pr.dense_sh = bstride(dm, 1);
    pr.dense_sq = bstride(dm, 2); pr.dense_sk = bstride(dm, 3);
    pr.dense_head_div = head_div(dm.size(1), Hq, Hkv, "dense_mask");
  }
  if (col_ranges.has_value()) {
    Tensor cr = col_ranges->to(at::kInt).contiguous();
    in.keep.push_back(cr);
    FLEXSPARSE_CHECK(cr.dim() == 4 && cr.size(2) == Lk && cr.size(3) % 2 == 0 &&
                    (cr.size(0) == 1 || cr.size(0) == B),
                "flexsparse cuda: col_ranges shape ", cr.sizes(), " (expected (Bc, Hc, ", Lk, ", 2m))");
    pr.col_ranges = cr.data_ptr<int32_t>();
    pr.cr_sb = bstride(cr, 0); pr.cr_sh = bstride(cr, 1); pr.cr_sk = cr.stride(2);
    pr.cr_head_div = head_div(cr.size(1), Hq, Hkv, "col_ranges");
    pr.n_col_ranges = static_cast<int>(cr.size(3) / 2);
  }
  if (partial_bits_index.has_value()) {
    FLEXSPARSE_CHECK(partial_bits.has_value(), "flexsparse cuda: partial_bits_index without partial_bits");
    Tensor bi = partial_bits_index->to(at::kInt).contiguous();
    Tensor bits = partial_bits->to(at::kInt).contiguous();
    in.keep.push_back(bi);
    in.keep.push_back(bits);
    FLEXSPARSE_CHECK(bi.dim() == 4 && bi.size(2) == nQB && bi.size(3) == nKB &&
                    (bi.size(0) == 1 || bi.size(0) == B),
                "flexsparse cuda: partial_bits_index shape ", bi.sizes());
    FLEXSPARSE_CHECK(bits.dim() == 3 && bits.size(1) == block_q && bits.size(2) == (block_k + 31) / 32,
                "flexsparse cuda: partial_bits shape ", bits.sizes());
    pr.bits_index = bi.data_ptr<int32_t>();
    pr.bi_sb = bstride(bi, 0); pr.bi_sh = bstride(bi, 1); pr.bi_sq = bi.stride(2);
    pr.bi_head_div = head_div(bi.size(1), Hq, Hkv, "partial_bits_index");
    pr.bits = bits.data_ptr<int32_t>();
    pr.bits_sp = bits.stride(0); pr.bits_sr = bits.stride(1);
    pr.bits_count = static_cast<int>(bits.size(0));
  }
  return p;
}

// The descriptor's window hint (masks.sliding_window's (left, right), int32 (2,) on the
// device) for calls with column ranges: the forward's band kernels and the backward's
// per-key intervals read it on the device (no host read, no sync) in place of staging the
// ranges (docs/perf-notes.md C113, C114).
void set_window(AttentionParams& p, Inputs& in, const OptTensor& window) {
  if (!window.has_value() || p.pred.col_ranges == nullptr) return;
  Tensor w = window->contiguous();
  FLEXSPARSE_CHECK(w.device() == in.q.device() && w.scalar_type() == at::kInt && w.numel() == 2,
                   "flexsparse cuda: window must be int32 (2,) on the query's device, got ",
                   w.scalar_type(), " ", w.sizes(), " on ", w.device());
  in.keep.push_back(w);
  p.pred.window = w.data_ptr<int32_t>();
}

DType dtype_of(const Tensor& t) {
#ifdef FLEXSPARSE_COMPILE_CHECK_BF16_ONLY   // sm90_utils.cuh: CI's compile-check build
  FLEXSPARSE_CHECK(t.scalar_type() == at::kBFloat16,
                   "flexsparse cuda: this build (FLEXSPARSE_COMPILE_CHECK_BF16_ONLY) has no fp16 kernels");
#endif
  return t.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
}

void check_sm90(const Tensor& q) {
  auto* prop = at::cuda::getDeviceProperties(q.get_device());
  FLEXSPARSE_CHECK(prop->major == 9, "flexsparse cuda: kernels are built for sm_90a (Hopper); this GPU is sm_",
              prop->major, prop->minor);
}

bool any_present(std::initializer_list<std::reference_wrapper<const OptTensor>> tensors) {
  for (const OptTensor& t : tensors)
    if (t.has_value()) return true;
  return false;
}

// Index mode (docs/design.md, "Index mode"): the kernel arguments of query, key, value,
// bias and the lists (index_fwd.cu and index_bwd.cu), all but out and lse, and the
// FLEXSPARSE_CUDA_DEBUG bits both kernels read.
IndexParams index_params(Inputs& in, const Tensor& idx, double scale, double softcap) {
  check_qkv(in);
  const Tensor& q = in.q;
  const int64_t B = q.size(0), Lq = q.size(2), Hkv = in.k.size(1), Lk = in.k.size(2);
  FLEXSPARSE_CHECK(idx.device() == q.device(), "flexsparse cuda: attn_indices is on ", idx.device(),
              ", query on ", q.device());
  FLEXSPARSE_CHECK(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong,
              "flexsparse cuda: attn_indices dtype ", idx.scalar_type(), " (int32 or int64)");
  FLEXSPARSE_CHECK(idx.dim() == 4 && (idx.size(0) == 1 || idx.size(0) == B) &&
                  (idx.size(1) == 1 || idx.size(1) == Hkv) && idx.size(2) == Lq,
              "flexsparse cuda: attn_indices shape ", idx.sizes(), " (expected (B|1, Hkv|1, ", Lq,
              ", W) with B=", B, ", Hkv=", Hkv, ")");
  // The kernel holds key positions as int.
  FLEXSPARSE_CHECK(Lk <= std::numeric_limits<int32_t>::max(),
              "flexsparse cuda: index masks need Lk < 2^31, got ", Lk);

  IndexParams p;
  set_qkv(p, in, scale, softcap);
  set_bias(p, in);
  p.G = static_cast<int>(p.Hq / p.Hkv);
  p.W = idx.size(3);
  p.idx = idx.data_ptr();
  p.idx_int64 = idx.scalar_type() == at::kLong;
  p.idx_sb = bstride(idx, 0); p.idx_sh = bstride(idx, 1);
  p.idx_sq = idx.stride(2); p.idx_sw = idx.stride(3);
  set_debug(p);
  return p;
}

// Index mode forward: the gather kernel of index_fwd.cu.
std::tuple<Tensor, Tensor> index_attention(Inputs& in, const Tensor& idx, double scale,
                                           double softcap) {
  IndexParams p = index_params(in, idx, scale, softcap);
  const Tensor& q = in.q;
  Tensor out = at::empty(q.sizes(), q.options());
  Tensor lse = at::empty({p.B, p.Hq, p.Lq}, q.options().dtype(at::kFloat));
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  index_fwd_sm90(p, dtype_of(q), at::cuda::getCurrentCUDAStream());
  return {out, lse};
}

std::tuple<Tensor, Tensor> cuda_attention(
    const Tensor& query, const Tensor& key, const Tensor& value, const OptTensor& bias,
    const OptTensor& kv_count, const OptTensor& kv_index, const OptTensor& kv_full_count,
    const OptTensor& kv_full_index, const OptTensor& q_count, const OptTensor& q_index,
    const OptTensor& q_full_count, const OptTensor& q_full_index, const OptTensor& dense_mask,
    const OptTensor& col_ranges, const OptTensor& partial_bits_index,
    const OptTensor& partial_bits, const OptTensor& attn_indices, const OptTensor& window,
    int64_t block_q, int64_t block_k, double scale, double softcap, bool deterministic) {
  (void)deterministic;   // the forward is deterministic
  c10::cuda::CUDAGuard guard(query.device());
  check_sm90(query);
  Inputs in{query, key, value, bias, {}};
  if (attn_indices.has_value()) {
    FLEXSPARSE_CHECK(!any_present({kv_count, kv_index, kv_full_count, kv_full_index, q_count, q_index,
                              q_full_count, q_full_index, dense_mask, col_ranges,
                              partial_bits_index, partial_bits, window}),
                "flexsparse cuda: an index mask (attn_indices) takes no other mask tensors");
    return index_attention(in, *attn_indices, scale, softcap);
  }
  AttentionParams p = fill_params(in, kv_count, kv_index, kv_full_count, kv_full_index, q_count,
                                  q_index, q_full_count, q_full_index, dense_mask, col_ranges,
                                  partial_bits_index, partial_bits, block_q, block_k, scale,
                                  softcap, /*need_q_lists=*/false);
  set_window(p, in, window);
  Tensor out = at::empty(query.sizes(), query.options());
  Tensor lse = at::empty({p.B, p.Hq, p.Lq}, query.options().dtype(at::kFloat));
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  // Heaviest query tiles first: for masks whose work grows with the query index (causal,
  // prefix-LM) the grid's last wave then holds light tiles; neutral for uniform masks.
  p.reverse_tiles = true;
  set_debug(p);
  if (p.B * p.Hq * p.Lq == 0) return {out, lse};
  auto stream = at::cuda::getCurrentCUDAStream();
  // The persistent kernel's work-tile counter, zeroed on the stream (graph-capturable);
  // FLEXSPARSE_CUDA_DEBUG bit 128 runs the static schedule instead. Biased calls: the
  // redo queue after it (AttentionParams::redo), its count and bitmap zeroed by the same
  // memset.
  const int n_work = fwd_work_tiles(p);
  const int64_t zeroed = p.bias != nullptr ? 2 + redo_words(n_work) : 1;
  Tensor tile_counter = at::empty({zeroed + (p.bias != nullptr ? n_work : 0)}, query.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(tile_counter.data_ptr(), 0, zeroed * sizeof(int), stream));
  if (!(p.debug & 128)) p.tile_counter = tile_counter.data_ptr<int>();
  if (p.bias != nullptr) p.redo = tile_counter.data_ptr<int>() + 1;
  fwd_sm90(p, dtype_of(query), stream);
  return {out, lse};
}

#ifdef FLEXSPARSE_HAS_BACKWARD   // set by setup.py when csrc/bwd_sm90.cu exists
// The gradient of a bias broadcast to (B, Hq, Lq, Lk): summed over the dimensions where the
// bias has size 1 (or Hkv heads shared by a group of query heads), in float32.
Tensor reduce_to_shape(const Tensor& full, const Tensor& bias, int64_t Hkv) {
  if (full.sizes() == bias.sizes()) return full.to(bias.scalar_type());
  Tensor g = full.to(at::kFloat);
  const int64_t B = full.size(0), Hq = full.size(1), Lq = full.size(2), Lk = full.size(3);
  if (bias.size(1) == Hkv && Hkv != Hq && Hkv != 1)
    g = g.view({B, Hkv, Hq / Hkv, Lq, Lk}).sum(2);
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < 4; ++d)
    if (bias.size(d) == 1 && g.size(d) != 1) dims.push_back(d);
  if (!dims.empty()) g = g.sum(dims, /*keepdim=*/true);
  return g.to(bias.scalar_type());
}

// Index mode backward (index_bwd.cu): dq, dk, dv, no dbias (ops/schema.py sends calls that
// want one to the Triton index backward). Not yet the default path: chosen by
// FLEXSPARSE_CUDA_INDEX_BWD=1 (ops/cuda_backend.py, index_backward_kernel()).
std::tuple<Tensor, Tensor, Tensor, Tensor> index_attention_backward(
    const Tensor& grad_out, const OptTensor& grad_lse, Inputs& in, const Tensor& out,
    const Tensor& lse, const Tensor& idx, double scale, double softcap, bool bias_requires_grad) {
  FLEXSPARSE_CHECK(!(in.bias.has_value() && bias_requires_grad),
              "flexsparse cuda: the CUDA index backward computes no bias gradient (the triton "
              "index backward does)");
  IndexBackwardParams bp;
  bp.fwd = index_params(in, idx, scale, softcap);
  IndexParams& p = bp.fwd;
  const Tensor& q = in.q;
  FLEXSPARSE_CHECK(out.sizes() == q.sizes() && grad_out.sizes() == q.sizes(),
              "flexsparse cuda: out ", out.sizes(), " and grad_out ", grad_out.sizes(),
              " must have the query's shape ", q.sizes());
  FLEXSPARSE_CHECK(lse.dim() == 3 && lse.size(0) == p.B && lse.size(1) == p.Hq && lse.size(2) == p.Lq,
              "flexsparse cuda: lse shape ", lse.sizes());
  Tensor o = out.to(q.scalar_type()).contiguous();
  Tensor l = lse.to(at::kFloat).contiguous();
  Tensor dout = tma_ready(grad_out.to(q.scalar_type()));
  p.out = o.data_ptr();
  p.lse = l.data_ptr<float>();
  bp.dout = dout.data_ptr();
  bp.do_sb = dout.stride(0); bp.do_sh = dout.stride(1); bp.do_sm = dout.stride(2);
  Tensor glse;
  if (grad_lse.has_value()) {
    FLEXSPARSE_CHECK(grad_lse->sizes() == lse.sizes(), "flexsparse cuda: grad_lse shape ",
                grad_lse->sizes());
    glse = grad_lse->to(at::kFloat).contiguous();
    bp.grad_lse = glse.data_ptr<float>();
  }
  Tensor dq = at::empty(q.sizes(), q.options());
  Tensor dk = at::empty(in.k.sizes(), in.k.options());
  Tensor dv = at::empty(in.v.sizes(), in.v.options());
  bp.dq = dq.data_ptr();
  bp.dk = dk.data_ptr();
  bp.dv = dv.data_ptr();
  bp.Bi = idx.size(0);
  bp.Hi = idx.size(1);
  const std::string why = index_bwd_unsupported(bp);
  FLEXSPARSE_CHECK(why.empty(), "flexsparse cuda index backward: ", why);
  Tensor workspace = at::empty({static_cast<int64_t>(index_bwd_workspace_bytes(bp))},
                               q.options().dtype(at::kByte));
  bp.workspace = workspace.data_ptr();
  index_bwd_sm90(bp, dtype_of(q), at::cuda::getCurrentCUDAStream());
  return {dq, dk, dv, at::empty({0}, q.options())};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> cuda_attention_backward(
    const Tensor& grad_out, const OptTensor& grad_lse, const Tensor& query, const Tensor& key,
    const Tensor& value, const Tensor& out, const Tensor& lse, const OptTensor& bias,
    const OptTensor& kv_count, const OptTensor& kv_index, const OptTensor& kv_full_count,
    const OptTensor& kv_full_index, const OptTensor& q_count, const OptTensor& q_index,
    const OptTensor& q_full_count, const OptTensor& q_full_index, const OptTensor& dense_mask,
    const OptTensor& col_ranges, const OptTensor& partial_bits_index,
    const OptTensor& partial_bits, const OptTensor& attn_indices, const OptTensor& window,
    int64_t block_q, int64_t block_k, double scale, double softcap, bool deterministic,
    bool bias_requires_grad) {
  c10::cuda::CUDAGuard guard(query.device());
  check_sm90(query);
  Inputs in{query, key, value, bias, {}};
  if (attn_indices.has_value()) {
    FLEXSPARSE_CHECK(!any_present({kv_count, kv_index, kv_full_count, kv_full_index, q_count, q_index,
                              q_full_count, q_full_index, dense_mask, col_ranges,
                              partial_bits_index, partial_bits, window}),
                "flexsparse cuda: an index mask (attn_indices) takes no other mask tensors");
    return index_attention_backward(grad_out, grad_lse, in, out, lse, *attn_indices, scale,
                                    softcap, bias_requires_grad);
  }
  BackwardParams bp;
  bp.fwd = fill_params(in, kv_count, kv_index, kv_full_count, kv_full_index, q_count, q_index,
                       q_full_count, q_full_index, dense_mask, col_ranges, partial_bits_index,
                       partial_bits, block_q, block_k, scale, softcap, /*need_q_lists=*/true);
  AttentionParams& p = bp.fwd;
  set_window(p, in, window);
  set_debug(p);
  Tensor o = out.contiguous();
  Tensor l = lse.to(at::kFloat).contiguous();
  Tensor dout = tma_ready(grad_out);
  p.out = o.data_ptr();
  p.lse = l.data_ptr<float>();
  bp.dout = dout.data_ptr();
  bp.do_sb = dout.stride(0); bp.do_sh = dout.stride(1); bp.do_sm = dout.stride(2);
  Tensor glse;
  if (grad_lse.has_value()) {
    glse = grad_lse->to(at::kFloat).contiguous();
    bp.grad_lse = glse.data_ptr<float>();
  }
  Tensor dq = at::empty(in.q.sizes(), query.options());
  Tensor dk = at::empty(in.k.sizes(), key.options());
  Tensor dv = at::empty(in.v.sizes(), value.options());
  bp.dq = dq.data_ptr();
  bp.dk = dk.data_ptr();
  bp.dv = dv.data_ptr();
  // dbias: bwd_sm90 writes the gradient of every (b, h, i, j), zero where the descriptor
  // skips a block (the bias-tile kernels write those zeros themselves, the others after a
  // memset); broadcast dimensions of the bias are summed here.
  Tensor dbias_full;
  if (bias.has_value() && bias_requires_grad) {
    dbias_full = at::empty({p.B, p.Hq, p.Lq, p.Lk}, query.options());
    bp.dbias = dbias_full.data_ptr();
    bp.dbias_sb = dbias_full.stride(0); bp.dbias_sh = dbias_full.stride(1);
    bp.dbias_sq = dbias_full.stride(2); bp.dbias_sk = dbias_full.stride(3);
  }
  bp.deterministic = deterministic;
  std::string why = bwd_sm90_unsupported(bp);
  FLEXSPARSE_CHECK(why.empty(), "flexsparse cuda backward: ", why);
  Tensor workspace = at::empty({static_cast<int64_t>(bwd_sm90_workspace_bytes(bp))},
                               query.options().dtype(at::kByte));
  bp.workspace = workspace.data_ptr();
  if (p.B * p.Hq * std::max(p.Lq, p.Lk) > 0)
    bwd_sm90(bp, dtype_of(query), at::cuda::getCurrentCUDAStream());
  Tensor dbias = at::empty({0}, query.options());
  if (dbias_full.defined()) dbias = reduce_to_shape(dbias_full, *bias, p.Hkv);
  return {dq, dk, dv, dbias};
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(flexsparse, CUDA, m) {
  m.impl("cuda_attention", &cuda_attention);
#ifdef FLEXSPARSE_HAS_BACKWARD
  m.impl("cuda_attention_backward", &cuda_attention_backward);
#endif
}

#ifdef FLEXSPARSE_FWD_TRACE
// Trace builds only (tests/gpu.sh trace): the forward's stamps of its last launch
// (kernels.h), as an int32 CPU tensor (the uint32 clock values' bits).
namespace {
uint32_t g_fwd_trace[kFwdTraceCtas * kFwdTraceTiles * 4 * kFwdTraceEvents];
Tensor fwd_trace() {
  return at::from_blob(g_fwd_trace, {kFwdTraceCtas, kFwdTraceTiles, 4, kFwdTraceEvents}, at::kInt).clone();
}
}  // namespace
uint32_t* fwd_trace_host() { return g_fwd_trace; }
TORCH_LIBRARY_FRAGMENT(flexsparse, m) { m.def("fwd_trace() -> Tensor", &fwd_trace); }
#endif
#if defined(FLEXSPARSE_BWD_TRACE) && defined(FLEXSPARSE_HAS_BACKWARD)
// Trace builds only (tests/gpu.sh btrace): the backward's stamps of its last launch.
namespace {
uint32_t g_bwd_trace[kBwdTraceCtas * (kBwdTraceSteps + 1) * 2 * kBwdTraceEvents];
Tensor bwd_trace() {
  return at::from_blob(g_bwd_trace, {kBwdTraceCtas, kBwdTraceSteps + 1, 2, kBwdTraceEvents}, at::kInt).clone();
}
}  // namespace
uint32_t* bwd_trace_host() { return g_bwd_trace; }
TORCH_LIBRARY_FRAGMENT(flexsparse, m) { m.def("bwd_trace() -> Tensor", &bwd_trace); }
namespace {
uint32_t g_bwd_life[kBwdLifeCtas * kBwdLifeEvents];
Tensor bwd_life() { return at::from_blob(g_bwd_life, {kBwdLifeCtas, kBwdLifeEvents}, at::kInt).clone(); }
}  // namespace
uint32_t* bwd_life_host() { return g_bwd_life; }
TORCH_LIBRARY_FRAGMENT(flexsparse, m) { m.def("bwd_life() -> Tensor", &bwd_life); }
#endif

}  // namespace flexsparse

// The mask-build ops (flexsparse::build_document, build_prefix_lm; kernels in
// build_masks.cu): in this translation unit so that the torch headers compile once.
#include "build_ops.h"

// The top-k op (flexsparse::topk_rows; kernel in topk.cu), in this unit for the same reason.
#include "topk_op.h"
