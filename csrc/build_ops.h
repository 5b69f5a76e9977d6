// The mask-build ops (issue 16): flexsparse::build_document, build_prefix_lm and
// build_column_ranges, one call per build that allocates every output here and runs the
// kernels of build_masks.cu (CUDA) or the same steps as plain loops (CPU, for tests).
// Schemas and fake kernels: ops/schema.py. What is built: build_masks.h.
//
// Included once, at the end of attention_ops.cpp: a translation unit of its own would
// compile the torch headers a second time (~45 s of CI's csrc compile on 2 cores).
// With FLEXSPARSE_CPU_ONLY the CPU kernels alone (no CUDA headers or kernels): the
// CPU-only library that the CPU tests build (tests/cpu_build_ops.py), so that CI runs
// tests/test_build_op.py on a machine without CUDA torch.
#pragma once
#include <ATen/ATen.h>
#ifndef FLEXSPARSE_CPU_ONLY
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "build_masks.h"
#include "checks.h"

namespace flexsparse {
namespace build {
namespace {

using at::Tensor;
using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// ---- the CPU build: the steps of build_masks.h as loops

// Column ranges and block layouts: the padded lists of row b (list_kernel in
// build_masks.cu).
void padded_lists_cpu(BuildParams& p, int64_t b) {
  const int32_t* bounds = p.layout || p.states ? nullptr : p.bounds + ws_at(p, b, 0, 0);
  for (int kv = 1; kv >= 0; --kv) {
    const int64_t rows = kv ? p.nQB : p.nKB, n = kv ? p.nKB : p.nQB;
    for (int64_t row = 0; row < rows; ++row) {
      int32_t* part = partial_list(p, kv, b, row);   // nullptr: nothing to store
      int32_t* full = full_list(p, kv, b, row);
      std::vector<int> st(n);
      int64_t np = 0, nf = 0;
      for (int64_t i = 0; i < n; ++i) {
        int64_t qb = kv ? row : i, kb = kv ? i : row;
        st[i] = bounds == nullptr ? grid_state(p, b, qb, kb)
                                  : block_state(bounds + kb, p.m, p.nKB, (int32_t)qb);
        np += st[i] == kPartial;
        nf += st[i] == kFull;
      }
      int64_t bp = 0, bf = 0;
      for (int64_t i = 0; i < n; ++i) {
        if (part != nullptr) part[st[i] == kPartial ? bp : np + (i - bp)] = (int32_t)i;
        full[st[i] == kFull ? bf : nf + (i - bf)] = (int32_t)i;
        bp += st[i] == kPartial;
        bf += st[i] == kFull;
      }
      if (int32_t* c = partial_count(p, kv, b, row)) *c = (int32_t)np;
      *full_count(p, kv, b, row) = (int32_t)nf;
    }
  }
}

void build_cpu(BuildParams& p, std::vector<int64_t>& ends) {
  const int m = p.m;
  for (int64_t b = 0; b < p.Bl; ++b) {
    const int64_t* row_ends = p.kind == kPrefixLM ? nullptr : ends.data() + b * p.n_docs;
    const int64_t prefix = p.kind == kPrefixLM ? p.prefix[b] : 0;
    for (int64_t kb = 0; kb < p.nKB; ++kb) {
      Stats st[kMaxSlots];
      for (int64_t j = kb * p.bk; j < min64(p.Lk, (kb + 1) * p.bk); ++j) {
        int64_t ds = 0, de = 0, s[kMaxSlots], e[kMaxSlots];
        if (p.kind == kColumnRanges) {
          flashmask_intervals(p.C, p.causal, p.Lq, p.Lk, j, p.startend + (b * p.Lk + j) * p.C,
                              s, e);
        } else {
          if (row_ends != nullptr) {
            int64_t d = document_of(row_ends, p.n_docs, j);
            de = row_ends[d];
            ds = d > 0 ? row_ends[d - 1] : 0;
          }
          column_intervals(p.kind, p.Lq, p.Lk, j, ds, de, prefix, s, e);
        }
        int32_t* cr = p.col_ranges + (b * p.Lk + j) * 2 * m;
        for (int r = 0; r < m; ++r) {
          cr[2 * r] = (int32_t)s[r];
          cr[2 * r + 1] = (int32_t)e[r];
          st[r].add(s[r], e[r]);
        }
      }
      int32_t bd[kMaxSlots][4];
      for (int r = 0; r < m; ++r) st[r].bounds(p.Lq, p.bq, p.nQB, bd[r]);
      if (p.kind == kColumnRanges) {
        for (int r = 0; r < m; ++r)
          for (int t = 0; t < 4; ++t) p.bounds[ws_at(p, b, t, r) + kb] = bd[r][t];
      } else {
        FLEXSPARSE_CHECK(key_block_rows(p, b, kb, bd),
                    "flexsparse build: a key block needs more than 4 block ranges");
      }
    }
    if (p.kind == kColumnRanges) {
      padded_lists_cpu(p, b);
      continue;
    }
    for (int r = 0; r < m; ++r) {
      for (int t0 = 0; t0 < 4; t0 += 2) {
        const int32_t* lo = p.bounds + ws_at(p, b, t0, r);
        const int32_t* hi = p.bounds + ws_at(p, b, t0 + 1, r);
        int32_t* flo = p.filled + ws_at(p, b, t0, r);
        int32_t* fhi = p.filled + ws_at(p, b, t0 + 1, r);
        int32_t prev = 0;
        for (int64_t i = 0; i < p.nKB; ++i) {
          bool empty = hi[i] <= lo[i];
          if (!empty && hi[i] > prev) prev = hi[i];
          fhi[i] = empty ? prev : hi[i];
        }
        int32_t next = (int32_t)p.nQB;
        for (int64_t i = p.nKB - 1; i >= 0; --i) {
          bool empty = hi[i] <= lo[i];
          if (!empty && lo[i] < next) next = lo[i];
          flo[i] = empty ? next : lo[i];
        }
      }
    }
    for (int64_t qb = 0; qb < p.nQB; ++qb)
      FLEXSPARSE_CHECK(query_block_rows(p, b, qb, p.filled + ws_at(p, b, 0, 0)),
                  "flexsparse build: a query block needs more than 4 block ranges");
  }
}

std::string list_text(const std::vector<int64_t>& v) {
  return check_detail::piece(c10::IntArrayRef(v));   // (no std::ostream: csrc/checks.h)
}

// The CPU build checks values as masks.py does in eager mode (ValueError, same text).
void check_lengths_cpu(const Tensor& lengths, int64_t L, std::vector<int64_t>& ends) {
  const int64_t Bl = lengths.size(0), n = lengths.size(1);
  const int64_t* len = lengths.data_ptr<int64_t>();
  std::vector<int64_t> totals(Bl);
  bool negative = false, wrong = false;
  for (int64_t b = 0; b < Bl; ++b) {
    int64_t acc = 0;
    for (int64_t d = 0; d < n; ++d) {
      negative = negative || len[b * n + d] < 0;
      acc += len[b * n + d];
      ends[b * n + d] = acc;
    }
    totals[b] = acc;
    wrong = wrong || acc != L;
  }
  FLEXSPARSE_CHECK_VALUE(!negative, "lengths: lengths must be non-negative");
  FLEXSPARSE_CHECK_VALUE(!wrong, "lengths: lengths must sum to L=", L, ", got ", list_text(totals));
}

void check_prefix_cpu(const Tensor& prefix) {
  const int64_t* v = prefix.data_ptr<int64_t>();
  std::vector<int64_t> all(v, v + prefix.numel());
  for (int64_t x : all) FLEXSPARSE_CHECK_VALUE(x >= 0, "prefix_len: must be >= 0, got ", list_text(all));
}

// ---- the ops

Outputs build(int kind, const Tensor& data_in, int64_t Lq, int64_t Lk, int64_t block_q,
              int64_t block_k, bool causal = false) {
  FLEXSPARSE_CHECK_VALUE(block_q > 0 && block_k > 0, "flexsparse build: block sizes must be positive, got (",
                    block_q, ", ", block_k, ")");
  FLEXSPARSE_CHECK_VALUE(Lq >= 0 && Lk >= 0 && Lq < (int64_t(1) << 31) && Lk < (int64_t(1) << 31),
                    "flexsparse build: sequence lengths must be in [0, 2^31), got (", Lq, ", ", Lk, ")");
  FLEXSPARSE_CHECK_TYPE(!at::isFloatingType(data_in.scalar_type()) && data_in.scalar_type() != at::kBool,
                   "flexsparse build: lengths must be an integer tensor, got ", data_in.scalar_type());
  const bool docs = kind == kDocument || kind == kDocumentCausal, flash = kind == kColumnRanges;
  if (docs) {
    FLEXSPARSE_CHECK_VALUE((data_in.dim() == 1 || data_in.dim() == 2) && data_in.numel() > 0,
                      "flexsparse build: lengths must be (n,) or (B, n), nonempty, got ",
                      data_in.sizes());
    FLEXSPARSE_CHECK_VALUE(Lq == Lk, "lengths: needs Lq == Lk, got Lq=", Lq, ", Lk=", Lk);
  } else if (flash) {
    FLEXSPARSE_CHECK_VALUE(data_in.dim() == 4 && data_in.size(2) == Lk && data_in.size(0) > 0 &&
                          data_in.size(1) > 0,
                      "flexsparse build: startend_row_indices must be (B, H, Lk=", Lk, ", C), got ",
                      data_in.sizes());
    const int64_t C = data_in.size(3);
    FLEXSPARSE_CHECK_VALUE(causal ? (C == 1 || C == 2 || C == 4) : (C == 2 || C == 4),
                      "flexsparse build: startend_row_indices: last dim C=", C,
                      " is not valid with causal=", causal);
  } else {
    FLEXSPARSE_CHECK_VALUE(data_in.dim() == 1 && data_in.size(0) > 0,
                      "flexsparse build: prefix_len must be (B,) with B > 0, got ", data_in.sizes());
  }
  Tensor data = data_in.to(at::kLong).contiguous();
  if (data.dim() == 1 && docs) data = data.unsqueeze(0);     // (n,) -> (1, n)
  BuildParams p;
  p.kind = kind;
  p.C = flash ? (int)data.size(3) : 0;
  p.causal = causal;
  p.m = slots_of(kind, p.C, causal);
  const int64_t Bd = data.size(0), Hd = flash ? data.size(1) : 1;
  p.Bl = Bd * Hd;
  p.Lq = Lq; p.Lk = Lk; p.bq = block_q; p.bk = block_k;
  p.nQB = (Lq + block_q - 1) / block_q;
  p.nKB = (Lk + block_k - 1) / block_k;
  auto opts = data.options().dtype(at::kInt);
  const int64_t nQB = p.nQB, nKB = p.nKB, R = kMaxRanges;
  // list rows: 4 ranges (range form) or every block (padded lists, column ranges)
  auto index_shape = [&](int64_t rows, int64_t n) {
    return flash ? std::vector<int64_t>{Bd, Hd, rows, n} : std::vector<int64_t>{Bd, Hd, rows, R, 2};
  };
  Tensor cr = at::empty({Bd, Hd, Lk, 2 * p.m}, opts);
  Tensor kv_c = at::empty({Bd, Hd, nQB}, opts), kv_i = at::empty(index_shape(nQB, nKB), opts);
  Tensor kvf_c = at::empty({Bd, Hd, nQB}, opts), kvf_i = at::empty(index_shape(nQB, nKB), opts);
  Tensor q_c = at::empty({Bd, Hd, nKB}, opts), q_i = at::empty(index_shape(nKB, nQB), opts);
  Tensor qf_c = at::empty({Bd, Hd, nKB}, opts), qf_i = at::empty(index_shape(nKB, nQB), opts);
  Tensor ws = at::empty({flash ? 1 : 2, p.Bl, 4, p.m, nKB}, opts);
  p.col_ranges = cr.data_ptr<int32_t>();
  p.kv_count = kv_c.data_ptr<int32_t>(); p.kv_index = kv_i.data_ptr<int32_t>();
  p.kv_full_count = kvf_c.data_ptr<int32_t>(); p.kv_full_index = kvf_i.data_ptr<int32_t>();
  p.q_count = q_c.data_ptr<int32_t>(); p.q_index = q_i.data_ptr<int32_t>();
  p.q_full_count = qf_c.data_ptr<int32_t>(); p.q_full_index = qf_i.data_ptr<int32_t>();
  p.bounds = ws.data_ptr<int32_t>();
  p.filled = flash ? nullptr : p.bounds + p.Bl * 4 * p.m * nKB;
  if (docs) {
    p.lengths = data.data_ptr<int64_t>();
    p.n_docs = data.size(1);
  } else if (flash) {
    p.startend = data.data_ptr<int64_t>();
  } else {
    p.prefix = data.data_ptr<int64_t>();
  }
#ifndef FLEXSPARSE_CPU_ONLY
  if (data.is_cuda()) {
    c10::cuda::CUDAGuard guard(data.device());
    p.fused = (debug_bits() >> 33) & 1;
    Tensor ends;
    if (needs_ends(p)) {
      ends = at::empty({p.Bl, p.n_docs}, data.options());
      p.ends = ends.data_ptr<int64_t>();
    }
    build_column_ranges_cuda(p, at::cuda::getCurrentCUDAStream().stream());
  } else
#endif
  {
    FLEXSPARSE_CHECK(data.device().is_cpu(), "flexsparse build: CPU or CUDA tensors, got ", data.device());
    std::vector<int64_t> ends;
    if (docs) {
      ends.resize(p.Bl * p.n_docs);
      check_lengths_cpu(data, Lk, ends);
    } else if (!flash) {
      check_prefix_cpu(data);
    }
    build_cpu(p, ends);
  }
  return {cr, kv_c, kv_i, kvf_c, kvf_i, q_c, q_i, qf_c, qf_i};
}

Outputs build_document(const Tensor& lengths, int64_t L, int64_t block_q, int64_t block_k,
                       bool causal) {
  return build(causal ? kDocumentCausal : kDocument, lengths, L, L, block_q, block_k);
}

Outputs build_prefix_lm(const Tensor& prefix_len, int64_t Lq, int64_t Lk, int64_t block_q,
                        int64_t block_k) {
  return build(kPrefixLM, prefix_len, Lq, Lk, block_q, block_k);
}

Outputs build_column_ranges(const Tensor& startend, int64_t Lq, int64_t Lk, int64_t block_q,
                            int64_t block_k, bool causal) {
  return build(kColumnRanges, startend, Lq, Lk, block_q, block_k, causal);
}

using ListOutputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// The eight padded lists of a block grid (Bd, Hd, nQB, nKB), as descriptor._block_lists
// gives them: a bool layout (True = FULL, else SKIP: masks.block_sparse at the call's block
// size) or int32 states (SKIP / PARTIAL / FULL, descriptor.from_block_state's). One
// launch on CUDA.
ListOutputs build_block_lists(const Tensor& layout_in) {
  FLEXSPARSE_CHECK_VALUE(layout_in.dim() == 4, "flexsparse build: layout must be (B, H, nQB, nKB), got ",
                         layout_in.sizes());
  const bool states = layout_in.scalar_type() == at::kInt;
  FLEXSPARSE_CHECK_TYPE(states || layout_in.scalar_type() == at::kBool,
                        "flexsparse build: layout must be bool or int32 block states, got ",
                        layout_in.scalar_type());
  Tensor layout = layout_in.contiguous();
  const int64_t Bd = layout.size(0), Hd = layout.size(1), nQB = layout.size(2), nKB = layout.size(3);
  BuildParams p;   // (list_kernel and padded_lists_cpu read the grid, not p.kind or bounds)
  p.Bl = Bd * Hd;
  p.nQB = nQB;
  p.nKB = nKB;
  if (states) p.states = layout.data_ptr<int32_t>();
  else p.layout = layout.data_ptr<bool>();
  auto opts = layout.options().dtype(at::kInt);
  // A layout's partial lists: one stored row per (b, h), expanded over the list rows
  // (BuildParams::partial_one_row; ops/schema.py's fake gives the same strides).
  p.partial_one_row = !states;
  auto partial = [&](std::vector<int64_t> shape) {
    if (!p.partial_one_row) return at::empty(shape, opts);
    std::vector<int64_t> one = shape;
    one[2] = 1;
    return at::empty(one, opts).expand(shape);
  };
  Tensor kv_c = partial({Bd, Hd, nQB}), kv_i = partial({Bd, Hd, nQB, nKB});
  Tensor kvf_c = at::empty({Bd, Hd, nQB}, opts), kvf_i = at::empty({Bd, Hd, nQB, nKB}, opts);
  Tensor q_c = partial({Bd, Hd, nKB}), q_i = partial({Bd, Hd, nKB, nQB});
  Tensor qf_c = at::empty({Bd, Hd, nKB}, opts), qf_i = at::empty({Bd, Hd, nKB, nQB}, opts);
  p.kv_count = kv_c.data_ptr<int32_t>(); p.kv_index = kv_i.data_ptr<int32_t>();
  p.kv_full_count = kvf_c.data_ptr<int32_t>(); p.kv_full_index = kvf_i.data_ptr<int32_t>();
  p.q_count = q_c.data_ptr<int32_t>(); p.q_index = q_i.data_ptr<int32_t>();
  p.q_full_count = qf_c.data_ptr<int32_t>(); p.q_full_index = qf_i.data_ptr<int32_t>();
#ifndef FLEXSPARSE_CPU_ONLY
  if (layout.is_cuda()) {
    c10::cuda::CUDAGuard guard(layout.device());
    p.grid_by_warp = (debug_bits() >> 38) & 1;
    p.grid_two_pass = (debug_bits() >> 45) & 1;
    build_block_lists_cuda(p, at::cuda::getCurrentCUDAStream().stream());
  } else
#endif
  {
    FLEXSPARSE_CHECK(layout.device().is_cpu(), "flexsparse build: CPU or CUDA tensors, got ", layout.device());
    for (int64_t b = 0; b < p.Bl; ++b) padded_lists_cpu(p, b);
  }
  return {kv_c, kv_i, kvf_c, kvf_i, q_c, q_i, qf_c, qf_i};
}

}  // namespace

TORCH_LIBRARY_IMPL(flexsparse, CPU, m) {
  m.impl("build_document", &build_document);
  m.impl("build_prefix_lm", &build_prefix_lm);
  m.impl("build_column_ranges", &build_column_ranges);
  m.impl("build_block_lists", &build_block_lists);
}

#ifndef FLEXSPARSE_CPU_ONLY
TORCH_LIBRARY_IMPL(flexsparse, CUDA, m) {
  m.impl("build_document", &build_document);
  m.impl("build_prefix_lm", &build_prefix_lm);
  m.impl("build_column_ranges", &build_column_ranges);
  m.impl("build_block_lists", &build_block_lists);
}
#endif

}  // namespace build
}  // namespace flexsparse
