// out (M, N) = x (M, K) @ w (N, K)^T (+ bias), bfloat16 in and out, float32 sums: a product of few rows that reads
// w once from memory, with AVX-512 BF16's dot product of pairs (skinny_gemm.py builds and calls it).
//
// Each thread takes blocks of N_BLOCK rows of w; a block's rows are read once from memory (prefetched a block ahead)
// and again from L1 for every M_BLOCK rows of x, so up to a few dozen rows cost about what one row costs.
#include <immintrin.h>

#include "bf16.h"
#include <stdint.h>
#include <string.h>

namespace {

constexpr int64_t N_BLOCK = 4;
constexpr int64_t M_BLOCK = 4;
constexpr int64_t PREFETCH_BLOCKS = 2;

// rows [m0, m0 + MB) of x against rows [n0, n0 + NB) of w
template <int MB, int NB>
inline void block(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t m0, int64_t n0,
                  int64_t N, int64_t K) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      const uint16_t* row = w + (n0 + j) * K + k;
      if (m0 == 0) _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_BLOCKS * N_BLOCK * K), _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, row);
    }
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (m0 + i) * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float sum = _mm512_reduce_add_ps(acc[i][j]);
      if (bias) sum += from_bf16(bias[n0 + j]);
      out[(m0 + i) * N + n0 + j] = to_bf16(sum);
    }
}

template <int NB>
inline void rows_of_w(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t n0,
                      int64_t M, int64_t N, int64_t K) {
  int64_t m0 = 0;
  for (; m0 + M_BLOCK <= M; m0 += M_BLOCK) block<M_BLOCK, NB>(x, w, bias, out, m0, n0, N, K);
  switch (M - m0) {
    case 3: block<3, NB>(x, w, bias, out, m0, n0, N, K); break;
    case 2: block<2, NB>(x, w, bias, out, m0, n0, N, K); break;
    case 1: block<1, NB>(x, w, bias, out, m0, n0, N, K); break;
    default: break;
  }
}

}  // namespace

extern "C" void skinny_gemm_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t M,
                                 int64_t N, int64_t K, int threads) {
  const int64_t blocks = N / N_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) rows_of_w<N_BLOCK>(x, w, bias, out, b * N_BLOCK, M, N, K);
  for (int64_t n0 = blocks * N_BLOCK; n0 < N; ++n0) rows_of_w<1>(x, w, bias, out, n0, M, N, K);
}
