// Key-block bounds of document and prefix-LM masks two ways, for tests/test_build_stats.py:
// from every column of the block (what the column kernel and the CPU build compute) and
// from its first and last column only (monotone_key_block_bounds, what the fused build's
// row CTA computes), csrc/build_masks.h. Reads from stdin: kind (0 document causal,
// 1 document, 2 prefix-LM), Lq, Lk, block_q, block_k, then n and n values (document
// lengths, or one prefix length); prints one line per key block: the m x 4 bounds of
// every column, then those of the two columns.
#include <cstdio>
#include <vector>

#include "build_masks.h"

using namespace flexsparse::build;

int main() {
  BuildParams p;
  long long Lq, Lk, bq, bk, n;
  if (std::scanf("%d %lld %lld %lld %lld %lld", &p.kind, &Lq, &Lk, &bq, &bk, &n) != 6) return 1;
  std::vector<int64_t> values(n), ends(n);
  for (long long i = 0; i < n; ++i) {
    long long v;
    if (std::scanf("%lld", &v) != 1) return 1;
    values[i] = v;
    ends[i] = (i > 0 ? ends[i - 1] : 0) + v;
  }
  p.m = slots_of(p.kind);
  p.Lq = Lq; p.Lk = Lk; p.bq = bq; p.bk = bk;
  p.nQB = (Lq + bq - 1) / bq;
  p.nKB = (Lk + bk - 1) / bk;
  p.n_docs = n;
  const int64_t prefix = p.kind == kPrefixLM ? values[0] : 0;
  for (int64_t kb = 0; kb < p.nKB; ++kb) {
    Stats st[kMaxSlots];
    for (int64_t j = kb * p.bk; j < min64(p.Lk, (kb + 1) * p.bk); ++j) {
      int64_t s[kMaxSlots], e[kMaxSlots];
      document_column(p, ends.data(), prefix, j, s, e);
      for (int r = 0; r < p.m; ++r) st[r].add(s[r], e[r]);
    }
    int32_t every[kMaxSlots][4], two[kMaxSlots][4];
    for (int r = 0; r < p.m; ++r) st[r].bounds(p.Lq, p.bq, p.nQB, every[r]);
    monotone_key_block_bounds(p, ends.data(), prefix, kb, two);
    for (int r = 0; r < p.m; ++r)
      for (int t = 0; t < 4; ++t) std::printf("%d ", every[r][t]);
    std::printf("|");
    for (int r = 0; r < p.m; ++r)
      for (int t = 0; t < 4; ++t) std::printf(" %d", two[r][t]);
    std::printf("\n");
  }
  return 0;
}
