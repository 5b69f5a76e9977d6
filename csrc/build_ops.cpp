// The mask-build ops (issue 16): flexsparse::build_document and flexsparse::build_prefix_lm,
// one call per build that allocates every output here and runs the kernels of
// build_masks.cu (CUDA) or the same steps as plain loops (CPU, for tests and CPU users).
// Schemas and fake kernels: ops/schema.py. What is built: build_masks.h.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <sstream>
#include <tuple>
#include <vector>

#include "build_masks.h"

namespace flexsparse {
namespace build {
namespace {

using at::Tensor;
using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// ---- the CPU build: the steps of build_masks.h as loops

void build_cpu(BuildParams& p, std::vector<int64_t>& ends) {
  const int m = p.m;
  for (int64_t b = 0; b < p.Bl; ++b) {
    const int64_t* row_ends = p.kind == kPrefixLM ? nullptr : ends.data() + b * p.n_docs;
    const int64_t prefix = p.kind == kPrefixLM ? p.prefix[b] : 0;
    for (int64_t kb = 0; kb < p.nKB; ++kb) {
      Stats st[kMaxSlots];
      for (int64_t j = kb * p.bk; j < min64(p.Lk, (kb + 1) * p.bk); ++j) {
        int64_t ds = 0, de = 0, s[kMaxSlots], e[kMaxSlots];
        if (row_ends != nullptr) {
          int64_t d = document_of(row_ends, p.n_docs, j);
          de = row_ends[d];
          ds = d > 0 ? row_ends[d - 1] : 0;
        }
        column_intervals(p.kind, p.Lq, p.Lk, j, ds, de, prefix, s, e);
        int32_t* cr = p.col_ranges + (b * p.Lk + j) * 2 * m;
        for (int r = 0; r < m; ++r) {
          cr[2 * r] = (int32_t)s[r];
          cr[2 * r + 1] = (int32_t)e[r];
          st[r].add(s[r], e[r]);
        }
      }
      int32_t bd[kMaxSlots][4];
      for (int r = 0; r < m; ++r) st[r].bounds(p.Lq, p.bq, p.nQB, bd[r]);
      TORCH_CHECK(key_block_rows(p, b, kb, bd),
                  "flexsparse build: a key block needs more than 4 block ranges");
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
      TORCH_CHECK(query_block_rows(p, b, qb, p.filled + ws_at(p, b, 0, 0)),
                  "flexsparse build: a query block needs more than 4 block ranges");
  }
}

std::string list_text(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
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
  TORCH_CHECK_VALUE(!negative, "lengths: lengths must be non-negative");
  TORCH_CHECK_VALUE(!wrong, "lengths: lengths must sum to L=", L, ", got ", list_text(totals));
}

void check_prefix_cpu(const Tensor& prefix) {
  const int64_t* v = prefix.data_ptr<int64_t>();
  std::vector<int64_t> all(v, v + prefix.numel());
  for (int64_t x : all) TORCH_CHECK_VALUE(x >= 0, "prefix_len: must be >= 0, got ", list_text(all));
}

// ---- the ops

Outputs build(int kind, const Tensor& data_in, int64_t Lq, int64_t Lk, int64_t block_q,
              int64_t block_k) {
  TORCH_CHECK_VALUE(block_q > 0 && block_k > 0, "flexsparse build: block sizes must be positive, got (",
                    block_q, ", ", block_k, ")");
  TORCH_CHECK_VALUE(Lq >= 0 && Lk >= 0 && Lq < (int64_t(1) << 31) && Lk < (int64_t(1) << 31),
                    "flexsparse build: sequence lengths must be in [0, 2^31), got (", Lq, ", ", Lk, ")");
  TORCH_CHECK_TYPE(!at::isFloatingType(data_in.scalar_type()) && data_in.scalar_type() != at::kBool,
                   "flexsparse build: lengths must be an integer tensor, got ", data_in.scalar_type());
  const bool docs = kind != kPrefixLM;
  if (docs) {
    TORCH_CHECK_VALUE((data_in.dim() == 1 || data_in.dim() == 2) && data_in.numel() > 0,
                      "flexsparse build: lengths must be (n,) or (B, n), nonempty, got ",
                      data_in.sizes());
    TORCH_CHECK_VALUE(Lq == Lk, "lengths: needs Lq == Lk, got Lq=", Lq, ", Lk=", Lk);
  } else {
    TORCH_CHECK_VALUE(data_in.dim() == 1 && data_in.size(0) > 0,
                      "flexsparse build: prefix_len must be (B,) with B > 0, got ", data_in.sizes());
  }
  Tensor data = data_in.to(at::kLong).contiguous();
  if (data.dim() == 1 && docs) data = data.unsqueeze(0);     // (n,) -> (1, n)
  BuildParams p;
  p.kind = kind;
  p.m = slots_of(kind);
  p.Bl = data.size(0);
  p.Lq = Lq; p.Lk = Lk; p.bq = block_q; p.bk = block_k;
  p.nQB = (Lq + block_q - 1) / block_q;
  p.nKB = (Lk + block_k - 1) / block_k;
  auto opts = data.options().dtype(at::kInt);
  const int64_t Bl = p.Bl, nQB = p.nQB, nKB = p.nKB, R = kMaxRanges;
  Tensor cr = at::empty({Bl, 1, Lk, 2 * p.m}, opts);
  Tensor kv_c = at::empty({Bl, 1, nQB}, opts), kv_i = at::empty({Bl, 1, nQB, R, 2}, opts);
  Tensor kvf_c = at::empty({Bl, 1, nQB}, opts), kvf_i = at::empty({Bl, 1, nQB, R, 2}, opts);
  Tensor q_c = at::empty({Bl, 1, nKB}, opts), q_i = at::empty({Bl, 1, nKB, R, 2}, opts);
  Tensor qf_c = at::empty({Bl, 1, nKB}, opts), qf_i = at::empty({Bl, 1, nKB, R, 2}, opts);
  Tensor ws = at::empty({2, Bl, 4, p.m, nKB}, opts);
  p.col_ranges = cr.data_ptr<int32_t>();
  p.kv_count = kv_c.data_ptr<int32_t>(); p.kv_index = kv_i.data_ptr<int32_t>();
  p.kv_full_count = kvf_c.data_ptr<int32_t>(); p.kv_full_index = kvf_i.data_ptr<int32_t>();
  p.q_count = q_c.data_ptr<int32_t>(); p.q_index = q_i.data_ptr<int32_t>();
  p.q_full_count = qf_c.data_ptr<int32_t>(); p.q_full_index = qf_i.data_ptr<int32_t>();
  p.bounds = ws.data_ptr<int32_t>();
  p.filled = p.bounds + Bl * 4 * p.m * nKB;
  if (docs) {
    p.lengths = data.data_ptr<int64_t>();
    p.n_docs = data.size(1);
  } else {
    p.prefix = data.data_ptr<int64_t>();
  }
  if (data.is_cuda()) {
    c10::cuda::CUDAGuard guard(data.device());
    Tensor ends;
    if (needs_ends(p)) {
      ends = at::empty({Bl, p.n_docs}, data.options());
      p.ends = ends.data_ptr<int64_t>();
    }
    build_column_ranges_cuda(p, at::cuda::getCurrentCUDAStream().stream());
  } else {
    TORCH_CHECK(data.device().is_cpu(), "flexsparse build: CPU or CUDA tensors, got ", data.device());
    std::vector<int64_t> ends;
    if (docs) {
      ends.resize(Bl * p.n_docs);
      check_lengths_cpu(data, Lk, ends);
    } else {
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

}  // namespace

TORCH_LIBRARY_IMPL(flexsparse, CPU, m) {
  m.impl("build_document", &build_document);
  m.impl("build_prefix_lm", &build_prefix_lm);
}

TORCH_LIBRARY_IMPL(flexsparse, CUDA, m) {
  m.impl("build_document", &build_document);
  m.impl("build_prefix_lm", &build_prefix_lm);
}

}  // namespace build
}  // namespace flexsparse
