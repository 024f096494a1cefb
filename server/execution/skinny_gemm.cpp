// out (M, N) = x (M, K) @ w (N, K)^T (+ bias), bfloat16 in and out, float32 sums: a product of few rows that reads
// w once from memory, with AVX-512 BF16's dot product of pairs (skinny_gemm.py builds it; the prepacked layers call
// its op, tinyserve::skinny_linear).
//
// Each thread takes blocks of N_BLOCK rows of w; a block's rows are read once from memory (prefetched ahead)
// and again from L1 for every M_BLOCK rows of x, so up to a few dozen rows cost about what one row costs.
#include <immintrin.h>

#include "bf16.h"
#include <stdint.h>
#include <string.h>

namespace {

// a row of w a block: one stream of memory a thread, faster than 4 at 1-8 rows of x (docs/BENCHMARKS.md, "Why these
// paths")
constexpr int64_t N_BLOCK = 1;
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

// The prepacked layers' op (server/execution/decoder/prepacked.py): up to max_rows bf16 rows this kernel over the
// plain weight, more rows oneDNN (its linear over the prepacked weight, or aten's over the plain one where there is no
// packed copy). A dispatcher kernel of torch's stable ABI: no Python a call. Registered for every backend (the packed
// weight is a oneDNN tensor).
#include "stable_ops.h"

#include <string>

namespace {

using stable_ops::from;
using stable_ops::Tensor;

Tensor skinny_linear(Tensor x, std::optional<Tensor> weight, std::optional<Tensor> packed, std::optional<Tensor> bias,
                     int64_t max_rows) {
  const int64_t K = x.size(x.dim() - 1), M = x.numel() / K;
  if (weight && x.scalar_type() == torch::headeronly::ScalarType::BFloat16 && M <= max_rows) {
    x = torch::stable::contiguous(x);
    const int64_t N = weight->size(0);
    Tensor out = stable_ops::rows_out(x, N);
    skinny_gemm_bf16(static_cast<const uint16_t*>(x.data_ptr()), static_cast<const uint16_t*>(weight->data_ptr()),
                     bias ? static_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
                     static_cast<uint16_t*>(out.data_ptr()), M, N, K,
                     static_cast<int>(torch::stable::get_num_threads()));
    return out;
  }
  if (!packed) return stable_ops::linear(x, *weight, bias);
  std::array<StableIValue, 6> stack{from(x), from(*packed), from(bias), from(std::string("none")),
                                    from(std::vector<std::optional<double>>{}),
                                    from(std::optional<std::string>(std::string("")))};
  STABLE_TORCH_ERROR_CODE_CHECK(
      torch_call_dispatcher("mkldnn::_linear_pointwise", "", stack.data(), TORCH_ABI_VERSION));
  return torch::stable::detail::to<Tensor>(stack[0]);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(tinyserve, m) {
  m.def("skinny_linear(Tensor x, Tensor? weight, Tensor? packed, Tensor? bias, int max_rows) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(tinyserve, CompositeExplicitAutograd, m) {
  m.impl("skinny_linear", TORCH_BOX(&skinny_linear));
}
