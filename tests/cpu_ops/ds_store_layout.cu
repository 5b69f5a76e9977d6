// Host check of the backward's hand-computed dS^T stmatrix addresses (bwd_sm90.cuh,
// ds_store_offset, docs/perf-notes.md C86) against CuTe's partition of the same shared
// memory layout, for every consumer thread, every one of its four stores and both
// buffers, in each BwdTraits that takes them (kDsStoreByHand); and that the S^T
// fragment's first query column is 2 (lane % 4), which the lse/delta loads assume.
// Built and run by .ci/run (nvcc, no GPU: the layouts are evaluated on the host):
//   nvcc -std=c++17 --expt-relaxed-constexpr -arch=sm_90a -I csrc -I <cutlass include> \
//        tests/cpu_ops/ds_store_layout.cu -o /tmp/ds_store_layout && /tmp/ds_store_layout
// The 80-row kernel's transposed stores (ds_store_offset_keys_contiguous, C105) too: its
// 64 x 80 wgmma atoms need CuTe's extended shapes, as in bwd_sm90_hd128_m80.cu (the other
// traits' atoms have power-of-two N, which the flag does not change).
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include <cstdio>

#include "bwd_sm90.cuh"

using namespace cute;

// Every consumer thread's dS^T stores through Atom in T's layout, CuTe's partition against
// ours(t, k): the byte offset of thread t's k-th store (8 contiguous values) in the first
// buffer; the second buffer is kBlockM * kBlockN elements on. Counts into checked and bad.
template <class T, class Atom, class Ours>
void check_stores(const char* name, const char* ours_name, Ours ours, int& checked, int& bad) {
  using Element = typename T::Element;
  constexpr int kStores = T::kBlockM / 16;
  typename T::TiledMmaSdP mma_sdp;
  auto smem_copy_ds = make_tiled_copy_C(Copy_Atom<Atom, Element>{}, mma_sdp);
  // 1024-byte aligned, as the kernel's buffer (the swizzle acts on address bits)
  static Element storage[cosize_v<typename T::SmemLayoutdS> + 1024];
  Element* base = reinterpret_cast<Element*>((reinterpret_cast<uintptr_t>(storage) + 1023) & ~uintptr_t(1023));
  Tensor sdSt = make_tensor(make_smem_ptr(base), typename T::SmemLayoutdSt{});
  const long buf_bytes = long(T::kBlockM) * T::kBlockN * sizeof(Element);
  for (int t = 0; t < T::kMmaThreads; ++t) {
    Tensor d = smem_copy_ds.get_thread_slice(t).partition_D(sdSt);
    static_assert(decltype(size<0>(d))::value == 8 * kStores && decltype(size<1>(d))::value == 1 &&
                  decltype(size<2>(d))::value == 1, "kBlockM / 16 stores of 8 values per thread");
    for (int b = 0; b < 2; ++b)
      for (int k = 0; k < kStores; ++k)
        for (int e = 0; e < 8; ++e) {
          const long cute_at = reinterpret_cast<char*>(raw_pointer_cast(&d(make_coord(e, k), 0, 0, b))) -
                               reinterpret_cast<char*>(base);
          const long at = long(ours(t, k)) + b * buf_bytes + 2 * e;
          ++checked;
          if (cute_at != at && bad++ < 5)
            printf("%s: thread %d buffer %d store %d value %d: CuTe %ld, %s %ld\n", name, t, b, k, e, cute_at,
                   ours_name, at);
        }
  }
}

// kDsStoreByHand: stmatrix of the queries-contiguous layout, four stores per thread at
// ds_store_offset XOR 32 k; and the S^T fragment's first query column is 2 (lane % 4).
template <class T>
int check(const char* name) {
  static_assert(T::kDsStoreByHand, "a kernel that takes the hand-computed stores");
  int checked = 0, bad = 0;
  check_stores<T, SM90_U32x4_STSM_N>(
      name, "ds_store_offset", [](int t, int k) { return flexsparse::sm90::ds_store_offset(t) ^ (32u * k); },
      checked, bad);
  typename T::TiledMmaSdP mma_sdp;
  Tensor cS = make_identity_tensor(Shape<Int<T::kBlockN>, Int<T::kBlockM>>{});
  for (int t = 0; t < T::kMmaThreads; ++t) {
    const int col = get<1>(mma_sdp.get_thread_slice(t).partition_C(cS)(0));
    ++checked;
    if (col != 2 * (t & 3) && bad++ < 5) printf("%s: thread %d first column %d\n", name, t, col);
  }
  printf("%s: %d checks, %d mismatches\n", name, checked, bad);
  return bad;
}

// kDsStoreTransByHand: stmatrix.trans of the keys-contiguous layout, kBlockM / 16 stores
// per thread at ds_store_offset_keys_contiguous + 2048 k.
template <class T>
int check_trans(const char* name) {
  static_assert(T::kDsStoreTransByHand && T::kDsKeysContiguous, "a kernel that takes the transposed stores");
  int checked = 0, bad = 0;
  check_stores<T, SM90_U16x8_STSM_T>(
      name, "ds_store_offset_keys_contiguous",
      [](int t, int k) { return flexsparse::sm90::ds_store_offset_keys_contiguous<T::kBlockM>(t) + 2048u * k; },
      checked, bad);
  printf("%s: %d checks, %d mismatches\n", name, checked, bad);
  return bad;
}

int main() {
  using flexsparse::sm90::BwdTraits;
  using flexsparse::sm90::Fp16Element;
  int bad = check<BwdTraits<cutlass::bfloat16_t, 128, 2>>("hd128 bf16");
  bad += check<BwdTraits<cutlass::bfloat16_t, 128, 2, 64, true>>("hd128 bf16 plain");
  bad += check<BwdTraits<Fp16Element, 128, 2>>("hd128 fp16");
  bad += check<BwdTraits<cutlass::bfloat16_t, 64, 2>>("hd64 bf16, 64-row steps");
  bad += check<BwdTraits<Fp16Element, 64, 2, 64, true>>("hd64 fp16 plain, 64-row steps");
  bad += check_trans<BwdTraits<cutlass::bfloat16_t, 128, 2, 80, true>>("hd128 bf16, 80-row steps");
  bad += check_trans<BwdTraits<Fp16Element, 128, 2, 80, true>>("hd128 fp16, 80-row steps");
  static_assert(!BwdTraits<cutlass::bfloat16_t, 128, 2, 64, false, true>::kDsStoreTransByHand,
                "the bias-tile kernels keep CuTe's transposed stores");
  static_assert(!BwdTraits<cutlass::bfloat16_t, 64, 2, 128, true>::kDsStoreByHand &&
                !BwdTraits<cutlass::bfloat16_t, 128, 2, 64, false, true>::kDsStoreByHand &&
                !BwdTraits<cutlass::bfloat16_t, 256, 1>::kDsStoreByHand,
                "128-row steps, bias tiles and head dim 256 keep CuTe's stores");
  return bad != 0;
}
