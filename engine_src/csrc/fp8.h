// fp8 KV cache elements: conversions between float and the two OCP 8-bit formats, written once in
// portable C++ for the CPU kernels and the CUDA kernels alike (no intrinsics, no torch, no CUDA header).
//
// - e4m3 ("fn": no infinities): bias 7, largest finite 448, smallest subnormal 2^-9. 0x7f/0xff are NaN.
// - e5m2: bias 15, largest finite 57344, smallest subnormal 2^-16, with infinities (fp16's top byte).
// A cached element is `round_to_fp8(x / scale)` and reads back as `fp8_to_float(byte) * scale`.
// Rounding is to nearest, ties to even, and saturating: |x / scale| beyond the largest finite value
// becomes that value (as vLLM's CUDA kernels convert with __NV_SATFINITE), so a cache never holds an
// infinity or a NaN made from a finite input; NaN stays NaN. torch's `.to(torch.float8_e4m3fn)` of
// a value clamped to +-448 gives the same byte (tests/test_kv_fp8.py checks every case it covers).
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define BATCHGEN_HD __host__ __device__ __forceinline__
#else
#define BATCHGEN_HD inline
#endif

namespace batchgen {

// How a KV cache stores its elements: as the activations (same), or in one of the fp8 formats.
enum class KVFormat : int { same = 0, fp8_e4m3 = 1, fp8_e5m2 = 2 };

struct Fp8Layout {
  int mantissa_bits;      // 3 (e4m3) or 2 (e5m2)
  int bias;               // 7 or 15
  uint32_t max_finite;    // the float bits of the largest finite value
  uint8_t max_code;       // its byte (sign clear)
  uint8_t nan_code;       // a NaN's byte (sign clear)
};

BATCHGEN_HD Fp8Layout fp8_layout(KVFormat f) {
  return f == KVFormat::fp8_e5m2 ? Fp8Layout{2, 15, 0x47600000u, 0x7b, 0x7f}   // 57344
                                 : Fp8Layout{3, 7, 0x43e00000u, 0x7e, 0x7f};   // 448
}

BATCHGEN_HD uint32_t fp8_float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

BATCHGEN_HD float fp8_bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// a + b rounded once (never fused or reassociated, also under nvcc's fast math).
BATCHGEN_HD float fp8_add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// a / b rounded once (IEEE division, also under nvcc's fast math, which would approximate it).
BATCHGEN_HD float fp8_div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// x (already divided by the scale) as an fp8 byte: round to nearest even, saturating. Written without
// branches (every case computed, then selected) so that the CPU cache write's loop vectorizes (layer_impl.h);
// the bytes are those of the earlier branching form for all 2^32 floats, both formats.
BATCHGEN_HD uint8_t float_to_fp8(float x, KVFormat f) {
  const Fp8Layout l = fp8_layout(f);
  const uint32_t u = fp8_float_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t magnitude = u & 0x7fffffffu;
  // A normal: the float's bits rounded at the format's last mantissa bit, ties to even, the exponent rebiased.
  const int drop = 23 - l.mantissa_bits;  // mantissa bits a float has beyond the format's
  const uint32_t odd = (magnitude >> drop) & 1u;
  const uint32_t rounded = magnitude + ((1u << (drop - 1)) - 1u) + odd;
  const uint32_t normal = (rounded >> drop) - (static_cast<uint32_t>(127 - l.bias) << l.mantissa_bits);
  // A subnormal (or zero): a multiple of the step 2^(1 - bias - mantissa_bits). Scaled by its inverse the value
  // is at most 2^mantissa_bits (larger magnitudes clamped to the smallest normal, whose code that is); adding
  // 2^23 makes the float adder round it to an integer, ties to even.
  const uint32_t min_normal = static_cast<uint32_t>(127 - l.bias + 1) << 23;
  const int step_exponent = 1 - l.bias - l.mantissa_bits;
  const float steps = fp8_bits_float(magnitude < min_normal ? magnitude : min_normal) *
                      fp8_bits_float(static_cast<uint32_t>(127 - step_exponent) << 23);
  const uint32_t subnormal = static_cast<uint32_t>(static_cast<int32_t>(fp8_add_rn(steps, 8388608.0f) - 8388608.0f));
  uint32_t code = magnitude < min_normal ? subnormal : normal;
  code = magnitude >= l.max_finite ? l.max_code : code;
  code = magnitude > 0x7f800000u ? l.nan_code : code;  // NaN stays NaN
  return static_cast<uint8_t>(sign | code);
}

// An fp8 byte as a float, exactly.
BATCHGEN_HD float fp8_to_float(uint8_t b, KVFormat f) {
  const Fp8Layout l = fp8_layout(f);
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exponent = (b & 0x7fu) >> l.mantissa_bits;
  const uint32_t mantissa = b & ((1u << l.mantissa_bits) - 1u);
  if (f == KVFormat::fp8_e4m3 && (b & 0x7fu) == 0x7fu) return fp8_bits_float(sign | 0x7fc00000u);  // its NaN
  if (f == KVFormat::fp8_e5m2 && exponent == 31u) return fp8_bits_float(sign | 0x7f800000u | (mantissa << 21));
  if (exponent == 0) {  // zero or subnormal: mantissa steps of 2^(1 - bias - mantissa_bits)
    const int step_exponent = 1 - l.bias - l.mantissa_bits;
    const float value = static_cast<float>(mantissa) * fp8_bits_float(static_cast<uint32_t>(127 + step_exponent) << 23);
    return sign ? -value : value;
  }
  return fp8_bits_float(sign | ((exponent + 127 - l.bias) << 23) | (mantissa << (23 - l.mantissa_bits)));
}

}  // namespace batchgen
