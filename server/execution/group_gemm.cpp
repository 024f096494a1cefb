// out (M, N) = x (M, K) @ w (N, K)^T (+ bias) for w held as GGUF's blocks are: integer codes with a float16 scale (and
// zero) per group of 16 or 32 columns, w = code * scale + zero. x and out bfloat16 (group_gemm.py builds and calls it).
//
// As llama.cpp computes its quantized products: each row of x is quantized to int8 per group of 32 columns
// (x ~ dx * qx, dx = max |x| / 127), and a group's dot product is one of integers, code . qx, with AVX-512 VNNI's
// unsigned x signed byte products (vpdpbusd: 64 products an instruction), scaled by scale * dx; a group's zero
// multiplies the exact float sum of x over the group. Codes: 4 bits, two a byte (a 64-column chunk's byte j holds
// code j in its low half, code 32 + j in its high half), 5 or 6 bits (those nibbles and a plane a bit above), or
// one signed byte each (offset by 128 to unsigned for
// vpdpbusd, the offset taken back through the row's own products with 128). K is a multiple of 64.
//
// A thread takes blocks of N_BLOCK rows of w, turns their codes into unsigned bytes once in a tile that stays in its
// cache, and runs every row of x over the tile, M_BLOCK rows at a time.
#include <immintrin.h>

#include "bf16.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace {

constexpr int64_t N_BLOCK = 4;
constexpr int64_t M_BLOCK = 4;

// x's rows quantized: per row, K int8 values, and per 64-column chunk the lanes' factors (lanes 0-7: the first
// 32-group's dx, 8-15: the second's) and the lanes' offsets (128 x the sum of the 4 values each lane multiplies)
struct Activations {
  std::vector<int8_t> q;       // (M, K)
  std::vector<float> dx;       // (M, K / 64, 16)
  std::vector<int32_t> offset; // (M, K / 64, 16)
  std::vector<float> sums;     // (M, K / group): the float sum of x over each w group, for the zeros
};

// 16 bf16 values as floats
inline __m512 load16(const uint16_t* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}

// x's rows to int8 per group of 32: q = round(x * 127 / max |x|) (to nearest even, as lrintf; the same float product)
void quantize(const uint16_t* x, int64_t M, int64_t K, int group, bool offsets, bool zeros, Activations& a) {
  const int64_t chunks = K / 64;
  a.q.resize(M * K);
  a.dx.resize(M * chunks * 16);
  if (offsets) a.offset.resize(M * chunks * 16);
  if (zeros) a.sums.resize(M * (K / group));
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < K / 32; ++g) {
      const __m512 lo = load16(x + m * K + g * 32), hi = load16(x + m * K + g * 32 + 16);
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
      const float d = top / 127.0f, inv = top > 0 ? 127.0f / top : 0.0f;
      int8_t* qs = a.q.data() + m * K + g * 32;
      const __m512 scale = _mm512_set1_ps(inv);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qs), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, scale))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, scale))));
      float* lanes = a.dx.data() + (m * chunks + g / 2) * 16 + (g % 2) * 8;
      for (int l = 0; l < 8; ++l) lanes[l] = d;
      if (offsets) {
        int32_t* o = a.offset.data() + (m * chunks + g / 2) * 16 + (g % 2) * 8;
        for (int l = 0; l < 8; ++l) o[l] = 128 * (qs[4 * l] + qs[4 * l + 1] + qs[4 * l + 2] + qs[4 * l + 3]);
      }
      if (zeros && group == 32) {
        a.sums[m * (K / 32) + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
      } else if (zeros) {  // groups of 16
        a.sums[m * (K / 16) + 2 * g] = _mm512_reduce_add_ps(lo);
        a.sums[m * (K / 16) + 2 * g + 1] = _mm512_reduce_add_ps(hi);
      }
    }
  }
}

// a 64-column chunk's 4-bit codes (32 bytes, two a byte) as 64 bytes in k order
inline __m512i nibbles(const uint8_t* chunk) {
  const __m256i low_half = _mm256_set1_epi8(0x0F), b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i lo = _mm256_and_si256(b, low_half), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low_half);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// row n's codes as K unsigned bytes in k order (byte codes offset by 128). A row of 4-bit codes is K / 2 bytes of
// nibbles; of 5- and 6-bit codes, those and then a plane for each bit above them, K / 8 bytes each (bit t of byte b:
// code 8b + t)
inline void codes_to_bytes(const uint8_t* codes, int bits, int64_t n, int64_t K, uint8_t* tile) {
  const uint8_t* row = codes + n * K * bits / 8;
  for (int64_t k = 0; k < K; k += 64) {
    if (bits < 8) {
      __m512i c = nibbles(row + k / 2);
      for (int bit = 4; bit < bits; ++bit) {
        uint64_t plane;
        memcpy(&plane, row + K / 2 + (bit - 4) * K / 8 + k / 8, 8);
        c = _mm512_or_si512(c, _mm512_and_si512(_mm512_movm_epi8(plane), _mm512_set1_epi8(static_cast<char>(1 << bit))));
      }
      _mm512_storeu_si512(tile + k, c);
    } else {
      const __m512i b = _mm512_loadu_si512(row + k);
      _mm512_storeu_si512(tile + k, _mm512_xor_si512(b, _mm512_set1_epi8(static_cast<char>(0x80))));
    }
  }
}

// row n's scales for the lanes of a 64-column chunk: a vpdpbusd lane sums 4 columns
inline __m512 chunk_scales(const uint16_t* scales, int64_t n, int64_t groups, int group, int64_t chunk) {
  const int per_chunk = 64 / group;
  const __m128i half = _mm_maskz_loadu_epi16(static_cast<__mmask8>((1 << per_chunk) - 1), scales + n * groups + chunk * per_chunk);
  const __m512i lanes = group == 32 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                    : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(lanes, _mm512_castps256_ps512(_mm256_cvtph_ps(half)));
}

// row n's zeros times the float sums of x row m over their groups
inline float zero_sum(const Activations& a, const uint16_t* zeros, int64_t n, int64_t m, int64_t groups) {
  const uint16_t* z = zeros + n * groups;
  const float* s = a.sums.data() + m * groups;
  __m512 zacc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 live = groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (groups - g)) - 1);
    zacc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, z + g)), _mm512_maskz_loadu_ps(live, s + g), zacc);
  }
  return _mm512_reduce_add_ps(zacc);
}

// One row of x against row n of 4-bit codes in groups of 32, where a step reads each code once and waits on the
// arithmetic around it: the nibbles unpacked in registers (no tile), the scales of 8 chunks converted at once.
inline float row_4bit(const Activations& a, const uint8_t* codes, const uint16_t* scales, int64_t n, int64_t K) {
  const int64_t chunks = K / 64;
  const uint8_t* row = codes + n * K / 2;
  const uint16_t* s = scales + n * (K / 32);
  const __m512i first = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);  // a chunk's two groups
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t c0 = 0; c0 < chunks; c0 += 8) {
    const int64_t live = chunks - c0 < 8 ? chunks - c0 : 8;
    const __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << (2 * live)) - 1), s + 2 * c0));
    __m512i lanes = first;
    for (int64_t c = c0; c < c0 + live; ++c) {
      const __m512i w = nibbles(row + c * 32);
      const __m512i qx = _mm512_loadu_si512(a.q.data() + c * 64);
      const __m512 dots = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, qx));
      const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(lanes, sv), _mm512_loadu_ps(a.dx.data() + c * 16));
      acc[c & 1] = _mm512_fmadd_ps(dots, scale, acc[c & 1]);
      lanes = _mm512_add_epi32(lanes, _mm512_set1_epi32(2));
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}

template <int MB, int NB>
inline void block(const Activations& a, const uint8_t* tile, const uint16_t* scales, const uint16_t* zeros,
                  const uint16_t* bias, uint16_t* out, int64_t m0, int64_t n0, int64_t N, int64_t K, int group,
                  bool offsets) {
  const int64_t groups = K / group, chunks = K / 64;
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i wv[NB];
    __m512 sv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm512_loadu_si512(tile + j * K + c * 64);
      sv[j] = chunk_scales(scales, n0 + j, groups, group, c);
    }
    for (int i = 0; i < MB; ++i) {
      const int64_t at = (m0 + i) * chunks + c;
      const __m512i qx = _mm512_loadu_si512(a.q.data() + (m0 + i) * K + c * 64);
      const __m512 dx = _mm512_loadu_ps(a.dx.data() + at * 16);
      const __m512i start = offsets ? _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(a.offset.data() + at * 16))
                                    : _mm512_setzero_si512();
      for (int j = 0; j < NB; ++j) {
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, wv[j], qx));
        acc[i][j] = _mm512_fmadd_ps(dots, _mm512_mul_ps(sv[j], dx), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float sum = _mm512_reduce_add_ps(acc[i][j]);
      if (zeros) sum += zero_sum(a, zeros, n0 + j, m0 + i, groups);
      if (bias) sum += from_bf16(bias[n0 + j]);
      out[(m0 + i) * N + n0 + j] = to_bf16(sum);
    }
}

template <int NB>
inline void rows_of_x(const Activations& a, const uint8_t* tile, const uint16_t* scales, const uint16_t* zeros,
                      const uint16_t* bias, uint16_t* out, int64_t n0, int64_t M, int64_t N, int64_t K, int group,
                      bool offsets) {
  int64_t m0 = 0;
  for (; m0 + M_BLOCK <= M; m0 += M_BLOCK)
    block<M_BLOCK, NB>(a, tile, scales, zeros, bias, out, m0, n0, N, K, group, offsets);
  switch (M - m0) {
    case 3: block<3, NB>(a, tile, scales, zeros, bias, out, m0, n0, N, K, group, offsets); break;
    case 2: block<2, NB>(a, tile, scales, zeros, bias, out, m0, n0, N, K, group, offsets); break;
    case 1: block<1, NB>(a, tile, scales, zeros, bias, out, m0, n0, N, K, group, offsets); break;
    default: break;
  }
}

}  // namespace

extern "C" void group_gemm_bf16(const uint16_t* x, const uint8_t* codes, int bits, const uint16_t* scales,
                                const uint16_t* zeros, int group, const uint16_t* bias, uint16_t* out, int64_t M,
                                int64_t N, int64_t K, int threads) {
  const bool offsets = bits == 8;
  static thread_local Activations kept;  // the caller's, reused (no allocation a product)
  Activations& a = kept;                  // the caller's for every thread of the region below
  quantize(x, M, K, group, offsets, zeros != nullptr, a);
  if (M == 1 && bits == 4 && group == 32) {  // a lone row (a decode step of one request)
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
      float sum = row_4bit(a, codes, scales, n, K);
      if (zeros) sum += zero_sum(a, zeros, n, 0, K / 32);
      if (bias) sum += from_bf16(bias[n]);
      out[n] = to_bf16(sum);
    }
    return;
  }
  const int64_t blocks = (N + N_BLOCK - 1) / N_BLOCK;
#pragma omp parallel num_threads(threads)
  {
    static thread_local std::vector<uint8_t> tile;
    tile.resize(N_BLOCK * K);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * N_BLOCK;
      const int64_t rows = N - n0 < N_BLOCK ? N - n0 : N_BLOCK;
      for (int64_t j = 0; j < rows; ++j) codes_to_bytes(codes, bits, n0 + j, K, tile.data() + j * K);
      if (rows == N_BLOCK)
        rows_of_x<N_BLOCK>(a, tile.data(), scales, zeros, bias, out, n0, M, N, K, group, offsets);
      else
        for (int64_t j = 0; j < rows; ++j)
          rows_of_x<1>(a, tile.data() + j * K, scales, zeros, bias, out, n0 + j, M, N, K, group, offsets);
    }
  }
}

// w (N, K) in bfloat16: code * scale + zero of every weight, computed in float32 (for products of many rows, which
// oneDNN's bf16 GEMM then computes faster than integer dot products)
extern "C" void group_dequantize_bf16(const uint8_t* codes, int bits, const uint16_t* scales, const uint16_t* zeros,
                                      int group, uint16_t* out, int64_t N, int64_t K, int threads) {
  const int64_t groups = K / group;
#pragma omp parallel num_threads(threads)
  {
    std::vector<uint8_t> row(K);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      codes_to_bytes(codes, bits, n, K, row.data());
      for (int64_t k = 0; k < K; k += 16) {
        const int64_t g = k / group;
        const float scale = _cvtsh_ss(scales[n * groups + g]), zero = zeros ? _cvtsh_ss(zeros[n * groups + g]) : 0.0f;
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row.data() + k)));
        if (bits == 8) c = _mm512_sub_epi32(c, _mm512_set1_epi32(128));  // the tile's bytes are offset by 128
        const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(scale), _mm512_set1_ps(zero));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + n * K + k), (__m256i)_mm512_cvtneps_pbh(w));
      }
    }
  }
}

// The op the server calls (group_gemm.py): tinyserve::group_gemm, a dispatcher kernel of torch's stable ABI, so that
// a step's products cost no Python call each (torch 2.13's ctypes-and-Python op took ~8 us of a small layer's ~20)
#include "stable_ops.h"

namespace {

using stable_ops::Tensor;

// x (..., K) @ w.T + bias, x and bias bf16, scales float16 (N, K / group), K a multiple of 64 (group_gemm.py
// calls it only then): up to max_rows rows our kernel; more, w in bf16 once for aten's linear (oneDNN)
Tensor group_gemm(Tensor x, Tensor codes, int64_t bits, Tensor scales, std::optional<Tensor> zeros,
                  std::optional<Tensor> bias, int64_t max_rows) {
  x = torch::stable::contiguous(x);
  const int64_t N = scales.size(0), K = x.size(x.dim() - 1), group = K / scales.size(1), M = x.numel() / K;
  const int threads = static_cast<int>(torch::stable::get_num_threads());
  const uint16_t* zeros_at = zeros ? static_cast<const uint16_t*>(zeros->data_ptr()) : nullptr;
  if (M > max_rows) {
    Tensor w = torch::stable::new_empty(x, {N, K});
    group_dequantize_bf16(static_cast<const uint8_t*>(codes.data_ptr()), static_cast<int>(bits),
                          static_cast<const uint16_t*>(scales.data_ptr()), zeros_at, static_cast<int>(group),
                          static_cast<uint16_t*>(w.data_ptr()), N, K, threads);
    return stable_ops::linear(x, w, bias);
  }
  Tensor out = stable_ops::rows_out(x, N);
  group_gemm_bf16(static_cast<const uint16_t*>(x.data_ptr()), static_cast<const uint8_t*>(codes.data_ptr()),
                  static_cast<int>(bits), static_cast<const uint16_t*>(scales.data_ptr()), zeros_at,
                  static_cast<int>(group), bias ? static_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
                  static_cast<uint16_t*>(out.data_ptr()), M, N, K, threads);
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(tinyserve, m) {
  m.def("group_gemm(Tensor x, Tensor codes, int bits, Tensor scales, Tensor? zeros, Tensor? bias, int max_rows) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(tinyserve, CPU, m) { m.impl("group_gemm", TORCH_BOX(&group_gemm)); }
