// The op flexsparse::topk_rows for CUDA (schema and fake in ops/schema.py; kernel in
// topk.cu): included by attention_ops.cpp so that the torch headers compile once.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks.h"
#include "kernels.h"

namespace flexsparse {
namespace topk {

// int32 (..., rows, k): per row of scores (..., rows, Lk) (bf16, fp16 or fp32), the positions of its k largest
// scores (not -inf, not NaN), ascending, then -1. causal: row r is query row0 + r of
// num_queries and sees keys j <= row0 + r + Lk - num_queries.
// warps_per_row: 1, 4, 8 or 16 warps per row; 0 picks by Lk.
at::Tensor topk_rows(const at::Tensor& scores, int64_t k, bool causal, int64_t row0,
                     int64_t num_queries, int64_t warps_per_row) {
  const auto dtype = scores.scalar_type();
  FLEXSPARSE_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
                   "flexsparse topk_rows: scores must be bf16, fp16 or fp32, got ", dtype);
  FLEXSPARSE_CHECK_VALUE(scores.dim() >= 2, "flexsparse topk_rows: scores must be (..., rows, Lk), got ",
                    scores.sizes());
  FLEXSPARSE_CHECK_VALUE(k >= 0 && k < (int64_t(1) << 31), "flexsparse topk_rows: k must be in [0, 2^31), got ", k);
  const int64_t rows = scores.size(-2), Lk = scores.size(-1);
  FLEXSPARSE_CHECK_VALUE(Lk <= kTopkMaxKeys, "flexsparse topk_rows: rows of at most ", kTopkMaxKeys,
                    " keys, got Lk=", Lk);
  FLEXSPARSE_CHECK_VALUE(warps_per_row == 0 || warps_per_row == 1 || warps_per_row == 4 || warps_per_row == 8 ||
                        warps_per_row == 16,
                    "flexsparse topk_rows: warps_per_row must be 0, 1, 4, 8 or 16, got ", warps_per_row);
  std::vector<int64_t> shape = scores.sizes().vec();
  shape.back() = k;
  at::Tensor out = at::empty(shape, scores.options().dtype(at::kInt));
  if (out.numel() == 0) return out;
  const int64_t lead = out.numel() / (rows * k);
  const at::Tensor s = scores.reshape({lead, rows, Lk});   // a view unless the leading dims are strided
  const at::Tensor o = out.view({lead, rows, k});
  TopkParams p;
  p.scores = s.data_ptr();
  p.wide = dtype == at::kFloat;
  p.s_lead = s.stride(0); p.s_row = s.stride(1); p.s_col = s.stride(2);
  p.out = o.data_ptr<int32_t>();
  p.o_lead = o.stride(0); p.o_row = o.stride(1);
  p.rows = rows; p.n_rows = s.size(0) * rows;
  p.Lk = static_cast<int>(Lk); p.k = static_cast<int>(k);
  p.causal = causal; p.row0 = row0; p.off = Lk - num_queries;
  p.warps_per_row = static_cast<int>(warps_per_row);
  p.inf_bits = dtype == at::kBFloat16 ? 0x7F80u : 0x7C00u;
  c10::cuda::CUDAGuard guard(scores.device());
  topk_rows_cuda(p, at::cuda::getCurrentCUDAStream());
  CUDA_CHECK(cudaGetLastError());
  return out;
}

}  // namespace topk

TORCH_LIBRARY_IMPL(flexsparse, CUDA, m) { m.impl("topk_rows", &topk::topk_rows); }

}  // namespace flexsparse
