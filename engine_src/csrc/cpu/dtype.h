// Scalar conversions between float and the 16-bit storage types, round-to-nearest-even.
// Portable C++ (no intrinsics): used by the scalar kernels and for the few elements the vector
// kernels write one at a time.
#pragma once
#include <cstdint>
#include <cstring>

#include "cpu/kernels.h"

namespace batchgen::cpu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float to_float(float x) { return x; }
inline float to_float(BF16 x) { return bits_float(uint32_t{x.bits} << 16); }

inline float to_float(F16 x) {
  const uint32_t sign = uint32_t{x.bits & 0x8000u} << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu;
  const uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf, nan
  if (exponent == 0) {                                                             // zero, subnormal
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // * 2^-24
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));  // rebias 15 -> 127
}

template <typename T>
T from_float(float f);

template <>
inline float from_float<float>(float f) {
  return f;
}

template <>
inline BF16 from_float<BF16>(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BF16{static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet nan
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return BF16{static_cast<uint16_t>((u + rounding) >> 16)};
}

template <>
inline F16 from_float<F16>(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return F16{static_cast<uint16_t>(sign | 0x7e00u)};  // nan
  if (magnitude >= 0x477ff000u) return F16{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520: inf
  if (magnitude < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5 leaves the float's last mantissa bit
    // worth 2^-24, the half subnormal step, so the float adder does the rounding for us.
    const float shifted = bits_float(magnitude) + 0.5f;
    return F16{static_cast<uint16_t>(sign | (float_bits(shifted) - 0x3f000000u))};
  }
  const uint32_t odd = (magnitude >> 13) & 1u;
  const uint32_t rebiased = magnitude - (112u << 23) + 0xfffu + odd;  // rebias, round half to even
  return F16{static_cast<uint16_t>(sign | (rebiased >> 13))};
}

}  // namespace batchgen::cpu
