// Portable "vector" of 8 floats in plain C++: the kernels' fallback on any architecture. The
// fixed-length loops are left to the compiler's auto-vectoriser.
#pragma once
#include <cmath>

#include "cpu/dtype.h"

namespace batchgen::cpu::scalar {

struct Vec {
  static constexpr int N = 8;
  static constexpr int kRegisters = 16;  // as AVX2, which the auto-vectoriser mostly targets
  float x[N];

  static Vec zero() { return set1(0.0f); }
  static Vec set1(float a) {
    Vec r;
    for (int i = 0; i < N; ++i) r.x[i] = a;
    return r;
  }
  template <typename T>
  static Vec load(const T* p) {
    Vec r;
    for (int i = 0; i < N; ++i) r.x[i] = to_float(p[i]);
    return r;
  }
  // N fp8 bytes placed in fp16 bits (sign to bit 15, the rest shifted left by `shift`), as floats
  // (attention_impl.h's CachedLoad).
  static Vec load_fp8_as_half(const uint8_t* p, int shift) {
    Vec r;
    for (int i = 0; i < N; ++i) {
      const uint32_t b = p[i];
      r.x[i] = to_float(F16{static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << shift))});
    }
    return r;
  }
  void store(float* p) const {
    for (int i = 0; i < N; ++i) p[i] = x[i];
  }
  void store(F16* p) const {  // rounded to nearest even
    for (int i = 0; i < N; ++i) p[i] = from_float<F16>(x[i]);
  }
};

inline Vec operator+(Vec a, Vec b) {
  for (int i = 0; i < Vec::N; ++i) a.x[i] += b.x[i];
  return a;
}
inline Vec operator-(Vec a, Vec b) {
  for (int i = 0; i < Vec::N; ++i) a.x[i] -= b.x[i];
  return a;
}
inline Vec operator*(Vec a, Vec b) {
  for (int i = 0; i < Vec::N; ++i) a.x[i] *= b.x[i];
  return a;
}
inline Vec operator/(Vec a, Vec b) {
  for (int i = 0; i < Vec::N; ++i) a.x[i] /= b.x[i];
  return a;
}
inline Vec fma(Vec a, Vec b, Vec c) {  // a * b + c
  for (int i = 0; i < Vec::N; ++i) c.x[i] += a.x[i] * b.x[i];
  return c;
}
inline Vec max(Vec a, Vec b) {
  for (int i = 0; i < Vec::N; ++i) a.x[i] = a.x[i] > b.x[i] ? a.x[i] : b.x[i];
  return a;
}
inline float reduce_add(Vec a) {
  float s = 0.0f;
  for (int i = 0; i < Vec::N; ++i) s += a.x[i];
  return s;
}
inline float reduce_max(Vec a) {
  float m = a.x[0];
  for (int i = 1; i < Vec::N; ++i) m = a.x[i] > m ? a.x[i] : m;
  return m;
}
inline float first_lane(Vec a) { return a.x[0]; }
// Sums of four vectors: a and b go to ab[0], ab[1], c and d to cd[0], cd[1].
inline void reduce_add4(Vec a, Vec b, Vec c, Vec d, float* ab, float* cd) {
  ab[0] = reduce_add(a);
  ab[1] = reduce_add(b);
  cd[0] = reduce_add(c);
  cd[1] = reduce_add(d);
}

inline Vec round_nearest(Vec a) {
  for (int i = 0; i < Vec::N; ++i) a.x[i] = std::nearbyint(a.x[i]);
  return a;
}
// p * 2^n for integral n in [-126, 127].
inline Vec scale_pow2(Vec p, Vec n) {
  for (int i = 0; i < Vec::N; ++i) p.x[i] = std::ldexp(p.x[i], static_cast<int>(n.x[i]));
  return p;
}
// Bit i set where lane i of x is >= limit.
inline uint32_t lanes_at_least(Vec x, float limit) {
  uint32_t bits = 0;
  for (int i = 0; i < Vec::N; ++i) bits |= static_cast<uint32_t>(x.x[i] >= limit) << i;
  return bits;
}

// Bit i set where lane i of x is NaN.
inline uint32_t lanes_nan(Vec x) {
  uint32_t bits = 0;
  for (int i = 0; i < Vec::N; ++i) bits |= static_cast<uint32_t>(x.x[i] != x.x[i]) << i;
  return bits;
}

inline Vec zero_if_below(Vec value, Vec x, float limit) {
  for (int i = 0; i < Vec::N; ++i) value.x[i] = x.x[i] >= limit ? value.x[i] : 0.0f;
  return value;
}

// Lane i of `below` where lane i of x < limit, else of `other`.
inline Vec blend_below(Vec x, float limit, Vec below, Vec other) {
  for (int i = 0; i < Vec::N; ++i) other.x[i] = x.x[i] < limit ? below.x[i] : other.x[i];
  return other;
}

// The int8 GEMM's activations in whole vectors (vec_avx2.h's): none here; quantize_int8_row's own loops do them all.
template <typename T>
inline uint32_t magnitude_bits_max(const T*, int64_t, int64_t& k) {
  k = 0;
  return 0;
}

template <typename T>
inline int64_t quantize_int8_vectors(const T*, int64_t, float, int, uint8_t*) {
  return 0;
}

}  // namespace batchgen::cpu::scalar
