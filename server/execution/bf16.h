// bfloat16 <-> float32 for our kernels (skinny_gemm.cpp, group_gemm.cpp): a bf16 is a float's top 16 bits.
#pragma once
#include <stdint.h>
#include <string.h>

inline uint16_t to_bf16(float value) {  // round to nearest even, as torch does
  uint32_t bits;
  memcpy(&bits, &value, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float from_bf16(uint16_t value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  memcpy(&out, &bits, 4);
  return out;
}
