// 16 floats in an AVX-512 register. Only compiled inside the target("avx512...") region of
// kernels_avx512.cpp; the library calls it only when the processor reports AVX-512.
#pragma once
#include <immintrin.h>

#include "cpu/kernels.h"

namespace batchgen::cpu::avx512 {

struct Vec {
  static constexpr int N = 16;
  __m512 v;

  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float a) { return {_mm512_set1_ps(a)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const BF16* p) {  // bf16 is the high half of a float: widen and shift
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
  }
  static Vec load(const F16* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};

inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
inline Vec round_nearest(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec scale_pow2(Vec p, Vec n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p * 2^n

inline Vec zero_if_below(Vec value, Vec x, float limit) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(limit), _CMP_GE_OQ);
  return {_mm512_maskz_mov_ps(keep, value.v)};
}

}  // namespace batchgen::cpu::avx512
