// 16 floats in an AVX-512 register, in namespace BATCHGEN_ISA_NS. Only compiled inside the
// target("avx512...") region of kernels_avx512.inc; used only when the processor has AVX-512.
#pragma once
#include <immintrin.h>

#include "cpu/kernels.h"

namespace batchgen::cpu::BATCHGEN_ISA_NS {

struct Vec {
  static constexpr int N = 16;
  static constexpr int kRegisters = 32;  // zmm0-31: what the loops' accumulators are sized by
  __m512 v;

  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float a) { return {_mm512_set1_ps(a)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const BF16* p) { return from_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // N bf16 values' bits as floats: bf16 is the high half of a float, so widen and shift.
  static Vec from_bf16(__m256i bits) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
  }
  static Vec load(const F16* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  // N fp8 bytes placed in fp16 bits (sign to bit 15, the rest shifted left by `shift`, 7 or 8), as floats
  // (attention_impl.h's CachedLoad): sign-extended and shifted, the sign's copies masked off (see vec_avx2.h).
  static Vec load_fp8_as_half(const uint8_t* p, int shift) {
    const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i keep = _mm256_set1_epi16(static_cast<int16_t>(0x8000 | (0xffff >> (9 - shift))));
    return {_mm512_cvtph_ps(_mm256_and_si256(_mm256_sll_epi16(wide, _mm_cvtsi32_si128(shift)), keep))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(F16* p) const {  // rounded to nearest even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};

inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
inline float first_lane(Vec a) { return _mm512_cvtss_f32(a.v); }

// Sums of four vectors: a and b go to ab[0], ab[1], c and d to cd[0], cd[1]. Cheaper than four
// reduce_add calls: the shuffles and adds are shared between the vectors.
inline void reduce_add4(Vec a, Vec b, Vec c, Vec d, float* ab, float* cd) {
  // 128-bit lanes [a0+a2, a1+a3, b0+b2, b1+b3], the same for c and d.
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(a.v, b.v, 0x44), _mm512_shuffle_f32x4(a.v, b.v, 0xee));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(c.v, d.v, 0x44), _mm512_shuffle_f32x4(c.v, d.v, 0xee));
  // Lane k holds four partial sums of input k (a, b, c, d).
  const __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
  // Sum within each lane, then gather element 0 of every lane.
  const __m512 w = _mm512_add_ps(z, _mm512_permute_ps(z, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 t = _mm512_add_ps(w, _mm512_permute_ps(w, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128 sums = _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, t));
  _mm_storel_pi(reinterpret_cast<__m64*>(ab), sums);
  _mm_storeh_pi(reinterpret_cast<__m64*>(cd), sums);
}

inline Vec round_nearest(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec scale_pow2(Vec p, Vec n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p * 2^n

// The mask of lanes [0, count), count 0 to 16.
inline __mmask16 first_lanes(int count) { return static_cast<__mmask16>((1u << count) - 1u); }
// The first `count` floats of p (zeros after), and a store of x's first `count` lanes: nothing past them is touched.
inline Vec load_first(const float* p, int count) { return {_mm512_maskz_loadu_ps(first_lanes(count), p)}; }
inline void store_first(Vec x, float* p, int count) { _mm512_mask_storeu_ps(p, first_lanes(count), x.v); }

// Bit i set where lane i of x is >= limit.
inline uint32_t lanes_at_least(Vec x, float limit) {
  return _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(limit), _CMP_GE_OQ);
}

// Bit i set where lane i of x is NaN.
inline uint32_t lanes_nan(Vec x) { return _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q); }

inline Vec zero_if_below(Vec value, Vec x, float limit) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(limit), _CMP_GE_OQ);
  return {_mm512_maskz_mov_ps(keep, value.v)};
}

// Lane i of `below` where lane i of x < limit, else of `other`.
inline Vec blend_below(Vec x, float limit, Vec below, Vec other) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, _mm512_set1_ps(limit), _CMP_LT_OQ), other.v, below.v)};
}

// The largest of |x[j]|'s float32 bits for j < k, k advanced over the whole vectors of x[0 .. n) (float32 or
// bf16): the sign cleared, an unsigned maximum, two operations a vector (layer_impl.h's quantize_int8_row).
inline uint32_t magnitude_bits_max(const float* x, int64_t n, int64_t& k) {
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  __m512i m = _mm512_setzero_si512();
  for (k = 0; k + 16 <= n; k += 16) m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_loadu_si512(x + k), magnitude));
  return _mm512_reduce_max_epu32(m);
}

inline uint32_t magnitude_bits_max(const BF16* x, int64_t n, int64_t& k) {
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  __m512i m = _mm512_setzero_si512();
  for (k = 0; k + 32 <= n; k += 32) m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512(x + k), magnitude));
  const __m512i wide = _mm512_max_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(m)),
                                        _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(m, 1)));
  return _mm512_reduce_max_epu32(wide) << 16;
}

// q[k] = round_half_even(min(max(x[k] / scale, -127), 127)) + zero_point for k below the returned count (whole
// vectors; NaN to -127: minps returns its second operand for NaN, maxps then -127): the int8 GEMM's activations
// (layer_impl.h's quantize_int8_row). Clamped before rounding, as rounding after gives the same integers.
template <typename T>
inline int64_t quantize_int8_vectors(const T* x, int64_t n, float scale, int zero_point, uint8_t* q) {
  const Vec divisor = Vec::set1(scale);
  const __m512 top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
  const __m512i offset = _mm512_set1_epi32(zero_point);
  int64_t k = 0;
  for (; k + Vec::N <= n; k += Vec::N) {
    const __m512 v = _mm512_max_ps(_mm512_min_ps(top, (Vec::load(x + k) / divisor).v), bottom);
    const __m512i i = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(i, offset)));
  }
  return k;
}

#ifdef BATCHGEN_DOT_BF16
// 32 bf16 values, 16 pairs: an operand of the bf16 dot product (AVX512-BF16).
struct BF16Pairs {
  __m512i v;

  static BF16Pairs zero() { return {_mm512_setzero_si512()}; }
  // The first `count` (32 or 16) elements at p, zeros after them.
  static BF16Pairs load(const BF16* p, int count) {
    if (count == 32) return {_mm512_loadu_si512(p)};
    return {_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  // The first `pairs` (0 to 16) pairs at p, zeros after them.
  static BF16Pairs load_pairs(const BF16* p, int pairs) {
    if (pairs == 16) return {_mm512_loadu_si512(p)};
    return {_mm512_maskz_loadu_epi32(first_lanes(pairs), p)};
  }
  // The pair p[0], p[1] in every lane.
  static BF16Pairs broadcast_pair(const BF16* p) {
    int32_t pair;
    __builtin_memcpy(&pair, p, sizeof pair);
    return {_mm512_set1_epi32(pair)};
  }
};

// Pairs (a[i], b[i]) for the elements i = 8L .. 8L + 3 of each 128-bit lane L (lo) or
// i = 8L + 4 .. 8L + 7 (hi).
inline BF16Pairs interleave_lo(BF16Pairs a, BF16Pairs b) { return {_mm512_unpacklo_epi16(a.v, b.v)}; }
inline BF16Pairs interleave_hi(BF16Pairs a, BF16Pairs b) { return {_mm512_unpackhi_epi16(a.v, b.v)}; }

// Puts a chunk of 2N sums accumulated from interleave_lo/hi operands back in order: lo holds, per
// 128-bit lane L, the chunk's elements 8L .. 8L + 3 and hi its elements 8L + 4 .. 8L + 7; after,
// lo holds elements 0 .. N - 1 and hi N .. 2N - 1.
inline void unpermute_chunk(Vec& lo, Vec& hi) {
  const __m512 first = _mm512_shuffle_f32x4(lo.v, hi.v, 0x44);  // lanes lo0, lo1, hi0, hi1
  const __m512 second = _mm512_shuffle_f32x4(lo.v, hi.v, 0xee);  // lo2, lo3, hi2, hi3
  lo = {_mm512_shuffle_f32x4(first, first, 0xd8)};  // lo0, hi0, lo1, hi1
  hi = {_mm512_shuffle_f32x4(second, second, 0xd8)};
}

// Elements 0 .. N - 1 of x as floats.
inline Vec first_floats(BF16Pairs x) {
  return Vec::from_bf16(_mm512_castsi512_si256(x.v));
}

// c + (a . b) per pair: lane i gains a[2i] * b[2i] + a[2i + 1] * b[2i + 1].
inline Vec dot_pairs(BF16Pairs a, BF16Pairs b, Vec c) {
  return {_mm512_dpbf16_ps(c.v, (__m512bh)a.v, (__m512bh)b.v)};
}

// dst[c * dst_stride + r] = src[r * src_stride + c] for r, c < 16: a 16 x 16 block of 4-byte
// words transposed in three rounds of in-register shuffles.
inline void transpose16x16(const uint32_t* src, int64_t src_stride, uint32_t* dst, int64_t dst_stride) {
  __m512i r[16], a[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  // Per 128-bit lane L, rows 2i and 2i + 1 interleaved: columns 4L, 4L + 1 (lo) and 4L + 2, 4L + 3 (hi).
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // r[4i + c], lane L: column 4L + c of rows 4i .. 4i + 3.
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  // Column 4L + c gathers lane L of r[c], r[4 + c], r[8 + c], r[12 + c]: a 4 x 4 transpose of lanes.
  for (int c = 0; c < 4; ++c) {
    const __m512i p0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), p1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
    const __m512i p2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i p3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
    _mm512_storeu_si512(dst + c * dst_stride, _mm512_shuffle_i32x4(p0, p2, 0x88));
    _mm512_storeu_si512(dst + (4 + c) * dst_stride, _mm512_shuffle_i32x4(p0, p2, 0xdd));
    _mm512_storeu_si512(dst + (8 + c) * dst_stride, _mm512_shuffle_i32x4(p1, p3, 0x88));
    _mm512_storeu_si512(dst + (12 + c) * dst_stride, _mm512_shuffle_i32x4(p1, p3, 0xdd));
  }
}

// x rounded to bf16 (nearest even) into dst[0 .. 16).
inline void store_bf16(Vec x, BF16* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(x.v));
}

// x rounded to bf16 and widened back (vcvtneps2bf16: nearest even, a NaN quieted as from_float quiets it); the
// lanes holding a subnormal, which the instruction flushes to zero where from_float rounds it, are added to
// `subnormal`.
inline Vec round_bf16(Vec x, __mmask16& subnormal) {
  subnormal |= _mm512_fpclass_ps_mask(x.v, 0x20);
  return Vec::from_bf16((__m256i)_mm512_cvtneps_pbh(x.v));
}

inline __mmask16 subnormal_lanes(Vec x) { return _mm512_fpclass_ps_mask(x.v, 0x20); }

// The first `count` (0 to 16) lanes of x rounded to bf16 into dst[0 .. count).
inline void store_bf16(Vec x, BF16* dst, int count) {
  _mm256_mask_storeu_epi16(dst, first_lanes(count), (__m256i)_mm512_cvtneps_pbh(x.v));
}

// fp8 bytes (e4m3 or e5m2) as bf16, exactly, by table: the bf16 of each of the 128 magnitudes split into its low
// and its high byte, two 128-byte tables that vpermt2b (AVX512-VBMI) looks 64 bytes up in at once, the byte's
// sign or-ed into the high byte, the two bytes then put side by side, in order or as the pair path's
// interleaved V rows, by one more vpermt2b. Four instructions for 32 elements where the integer steps through
// the exponent took seven (and a lookup for the subnormals), and no byte needs a case of its own. A copy held
// in a loop's local variable keeps its constants in kRegisters vector registers.
class BytesToBF16 {
 public:
  static constexpr int kRegisters = 8;

  // bf16_of[b]: the bf16 of magnitude b (the byte with its sign clear).
  explicit BytesToBF16(const BF16 (&bf16_of)[128]) {
    alignas(64) uint8_t low[128], high[128], in_order[64], lo_pairs[64], hi_pairs[64];
    for (int b = 0; b < 128; ++b) {
      low[b] = static_cast<uint8_t>(bf16_of[b].bits & 0xff);
      high[b] = static_cast<uint8_t>(bf16_of[b].bits >> 8);
    }
    // Word w of the result from element e: its low byte from the low bytes' vector (indices 0-63), its high
    // byte from the high bytes' (64-127). Elements 0-31 are the first row's bytes, 32-63 the second's.
    auto word = [](uint8_t* index, int w, int e) {
      index[2 * w] = static_cast<uint8_t>(e);
      index[2 * w + 1] = static_cast<uint8_t>(64 + e);
    };
    for (int w = 0; w < 32; ++w) {
      word(in_order, w, w);
      // interleave_lo/hi's order: per 128-bit lane L, elements 8L .. 8L + 3 (lo) or 8L + 4 .. 8L + 7 (hi) of the
      // two rows, alternately.
      const int lane = w / 8, k = w % 8, row = k % 2 == 0 ? 0 : 32;
      word(lo_pairs, w, row + 8 * lane + k / 2);
      word(hi_pairs, w, row + 8 * lane + 4 + k / 2);
    }
    low_[0] = _mm512_load_si512(low);
    low_[1] = _mm512_load_si512(low + 64);
    high_[0] = _mm512_load_si512(high);
    high_[1] = _mm512_load_si512(high + 64);
    in_order_ = _mm512_load_si512(in_order);
    lo_pairs_ = _mm512_load_si512(lo_pairs);
    hi_pairs_ = _mm512_load_si512(hi_pairs);
    sign_ = _mm512_set1_epi8(static_cast<char>(0x80));
  }

  // The first `count` (32 or 16) bytes at p as bf16, zeros after them (byte 0 is bf16 0): the pair path's
  // operand, converted in registers (attention_impl.h's CachedLoad<Fp8Pairs>).
  BF16Pairs pairs(const uint8_t* p, int count) const {
    const __m256i bytes = count == 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                      : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m512i low, high;
    look_up(_mm512_zextsi256_si512(bytes), low, high);
    return {_mm512_permutex2var_epi8(low, in_order_, high)};
  }

  // interleave_lo and interleave_hi of the bf16 of 32 bytes at a and at b (zeros where b is null).
  void interleaved(const uint8_t* a, const uint8_t* b, BF16Pairs& lo, BF16Pairs& hi) const {
    const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
    const __m256i second =
        b != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)) : _mm256_setzero_si256();
    __m512i low, high;
    look_up(_mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1), low, high);
    lo = {_mm512_permutex2var_epi8(low, lo_pairs_, high)};
    hi = {_mm512_permutex2var_epi8(low, hi_pairs_, high)};
  }

  // dst[0 .. n) = the bf16 of src[0 .. n), n a multiple of 32.
  void operator()(const uint8_t* src, BF16* dst, int64_t n) const {
    // The constants in registers: the stores below may alias the members (vector types may alias anything),
    // and loading them again each step made the loop 1.6x slower (a microbenchmark on Zen 4).
    const BytesToBF16 local = *this;
    for (int64_t i = 0; i < n; i += 32) _mm512_storeu_si512(dst + i, local.pairs(src + i, 32).v);
  }

 private:
  // The low bytes and the signed high bytes of the bf16 of the 64 bytes in x.
  void look_up(__m512i x, __m512i& low, __m512i& high) const {
    low = _mm512_permutex2var_epi8(low_[0], x, low_[1]);
    high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high_[0], x, high_[1]), x, sign_, 0xf8);  // | x & sign
  }

  __m512i low_[2], high_[2], in_order_, lo_pairs_, hi_pairs_, sign_;
};
#else
// x's bf16 bits, rounded as from_float rounds (nearest even, subnormals kept, a NaN quieted), without the bf16
// instructions: the GEMM's stores (gemm_impl.h) on the avx512 table.
inline __m256i bf16_bits(Vec x) {
  const __m512i u = _mm512_castps_si512(x.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q), quiet));
}

inline void store_bf16(Vec x, BF16* dst) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bf16_bits(x)); }

inline void store_bf16(Vec x, BF16* dst, int count) {
  _mm256_mask_storeu_epi16(dst, first_lanes(count), bf16_bits(x));
}
#endif

}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
