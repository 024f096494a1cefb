// out (M, N) = x (M, K) @ w (N, K)^T (+ bias), bfloat16 in and out, float32 sums: a product of few rows that reads
// w once from memory, with AVX-512 BF16's dot product of pairs (skinny_gemm.py builds it; the prepacked layers call
// its op, tinyserve::skinny_linear).
//
// Each thread takes blocks of rows of w; a block's rows are read once from memory (prefetched ahead) and again from L1
// for every M_BLOCK rows of x. For few short rows of x, where the product waits on memory, a block is one row of w
// (one stream of memory a thread); for more, where it waits on arithmetic and on reading x again, four, each x row's
// 4 sums taken at once.
#include <immintrin.h>

#include "bf16.h"
#include <stdint.h>
#include <string.h>

namespace {

// rows of w a block: at 1-8 rows of x one (30 against 21 GB/s at one row), above four (16 rows 18.5 against 29.7 ms,
// SmolLM2-135M's layers); four from 4 rows where a row of x is long (Llama-3.2-1B's layers, K 2048 and 8192: 8 rows
// 92 against 161 ms, x re-read from L2 for every row of w; docs/BENCHMARKS.md, "Why these paths"). The small loops are
// unrolled so that the accumulators stay in registers (GCC otherwise stored each to the stack at every step).
constexpr int64_t N_BLOCK = 1;
constexpr int64_t N_BLOCK_WIDE = 4;
constexpr int64_t WIDE_FROM_ROWS = 8;
constexpr int64_t WIDE_FROM_K = 2048;
constexpr int64_t M_BLOCK = 4;
constexpr int64_t PREFETCH_BLOCKS = 2;
constexpr int64_t K_CHUNK = 1024;  // 4 rows of w over a chunk: 8 KB

// The 16 sums of a 4 x 4 block's accumulators (acc[i][j]: x row i, w row j) as one vector, [4 i + j]: pairs added
// within 128-bit lanes, then across them; ~3 instructions a sum where a reduction of each takes ~10, which bounded
// the products of more rows.
inline __m512 sums_4x4(const __m512 (&acc)[4][4]) {
  const __m512* v = &acc[0][0];
  __m512 pairs[8], quads[4];
#pragma GCC unroll 16
  for (int i = 0; i < 8; ++i)  // each 128-bit lane: v[2i]'s two partial sums, v[2i + 1]'s, interleaved
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane: v[4i] ... v[4i + 3]'s sums over the lane
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // 128-bit lanes: 0x88 takes each source's lanes 0 and 2, 0xDD its 1 and 3
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
}

// rows [m0, m0 + 4) of x against rows [n0, n0 + 4) of w over k in [k0, k1): the 16 partial sums carried in
// `partial` (acc[i][j] at [4 i + j]), started at k0 = 0
inline void part_4x4(const uint16_t* x, const uint16_t* w, __m512* partial, int64_t m0, int64_t n0, int64_t K,
                     int64_t k0, int64_t k1, bool prefetch) {
  __m512 acc[4][4];
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < 4; ++j) acc[i][j] = k0 == 0 ? _mm512_setzero_ps() : partial[4 * i + j];
  for (int64_t k = k0; k < k1; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    __m512bh wv[4];
#pragma GCC unroll 16
    for (int j = 0; j < 4; ++j) {
      const uint16_t* row = w + (n0 + j) * K + k;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_BLOCKS * 4 * K), _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, row);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 4; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (m0 + i) * K + k);
#pragma GCC unroll 16
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < 4; ++j) partial[4 * i + j] = acc[i][j];
}

// the 4 x 4 block's outputs from its partial sums
inline void finish_4x4(const __m512 (&partial)[16], const uint16_t* bias, uint16_t* out, int64_t m0, int64_t n0,
                       int64_t N) {
  __m512 sums = sums_4x4(reinterpret_cast<const __m512(&)[4][4]>(partial));
  if (bias) {  // bias[n0 + j] at [4 i + j]
    uint64_t four;
    memcpy(&four, bias + n0, 8);
    const __m128i widened = _mm_cvtepu16_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(four)));
    const __m128 b = _mm_castsi128_ps(_mm_slli_epi32(widened, 16));  // a bf16 is a float's top 16 bits
    sums = _mm512_add_ps(sums, _mm512_broadcast_f32x4(b));
  }
  alignas(32) uint16_t rounded[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(rounded), (__m256i)_mm512_cvtneps_pbh(sums));
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) memcpy(out + (m0 + i) * N + n0, rounded + 4 * i, 8);
}

// rows of x in blocks of 4 against rows [n0, n0 + 4) of w, up to 32 rows at once, K in chunks whose 4 rows of w stay
// in L1 for every block of x (Llama-3.2-1B's layers: 8 rows 83-85 against 90 ms, 16 rows 122-127 against 142)
inline int64_t rows_4x4(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t n0,
                        int64_t M, int64_t N, int64_t K) {
  int64_t m0 = 0;
  while (m0 + 4 <= M) {
    const int64_t blocks = (M - m0) / 4 < 8 ? (M - m0) / 4 : 8;
    alignas(64) __m512 partial[8][16];
    for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
      const int64_t k1 = K - k0 < K_CHUNK ? K : k0 + K_CHUNK;
      for (int64_t b = 0; b < blocks; ++b) part_4x4(x, w, partial[b], m0 + 4 * b, n0, K, k0, k1, b == 0);
    }
    for (int64_t b = 0; b < blocks; ++b) finish_4x4(partial[b], bias, out, m0 + 4 * b, n0, N);
    m0 += 4 * blocks;
  }
  return m0;
}

// rows [m0, m0 + MB) of x against rows [n0, n0 + NB) of w
template <int MB, int NB>
inline void block(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t m0, int64_t n0,
                  int64_t N, int64_t K) {
  __m512 acc[MB][NB];
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    __m512bh wv[NB];
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) {
      const uint16_t* row = w + (n0 + j) * K + k;
      if (m0 == 0) _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_BLOCKS * NB * K), _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, row);
    }
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (m0 + i) * K + k);
#pragma GCC unroll 16
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 16
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
  if constexpr (NB == 4 && M_BLOCK == 4) m0 = rows_4x4(x, w, bias, out, n0, M, N, K);
  for (; m0 + M_BLOCK <= M; m0 += M_BLOCK) block<M_BLOCK, NB>(x, w, bias, out, m0, n0, N, K);
  switch (M - m0) {
    case 3: block<3, NB>(x, w, bias, out, m0, n0, N, K); break;
    case 2: block<2, NB>(x, w, bias, out, m0, n0, N, K); break;
    case 1: block<1, NB>(x, w, bias, out, m0, n0, N, K); break;
    default: break;
  }
}

template <int NB>
void product(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t M, int64_t N,
             int64_t K, int threads) {
  const int64_t blocks = N / NB;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) rows_of_w<NB>(x, w, bias, out, b * NB, M, N, K);
  for (int64_t n0 = blocks * NB; n0 < N; ++n0) rows_of_w<1>(x, w, bias, out, n0, M, N, K);
}

}  // namespace

extern "C" void skinny_gemm_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t M,
                                 int64_t N, int64_t K, int threads) {
  if (M > WIDE_FROM_ROWS || (M >= 4 && K >= WIDE_FROM_K))
    product<N_BLOCK_WIDE>(x, w, bias, out, M, N, K, threads);
  else
    product<N_BLOCK>(x, w, bias, out, M, N, K, threads);
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
