// Device helpers shared by the kernels: element-pair loads with float conversion, warp
// reductions and compile-time dispatch over dtype and head_dim. No torch header here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace batchgen::kernels {

constexpr int kWarpSize = 32;

// Pair<T>::type holds two adjacent elements; loads and stores of a pair are one 4- or 8-byte access.
template <typename T>
struct Pair;

template <>
struct Pair<float> {
  using type = float2;
  static __device__ __forceinline__ float2 to_float2(float2 v) { return v; }
};

template <>
struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
};

template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
};

// Two elements starting at `p` (which must be aligned to a pair) as floats.
template <typename T>
__device__ __forceinline__ float2 load_pair(const T* p) {
  return Pair<T>::to_float2(*reinterpret_cast<const typename Pair<T>::type*>(p));
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// When a warp spreads a head_dim vector over its lanes as element pairs, the first element of
// lane's pair in step `step`: each step covers 64 consecutive elements.
__device__ __forceinline__ int pair_index(int step, int lane) { return step * 2 * kWarpSize + 2 * lane; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, mask));
  return v;
}

// Softmax runs in base 2: scores are pre-multiplied by log2(e), so exp(x) becomes exp2f(x').
constexpr float kLog2e = 1.4426950408889634f;

// exp2f(x - max) that is 0 for x == -inf even when max is -inf too (a row that saw no key yet).
__device__ __forceinline__ float exp2_shifted(float x, float max) {
  return exp2f(x - (max == -INFINITY ? 0.f : max));
}

// Head `head`'s attention sink (GPT-OSS) in base 2: a score in natural units (`sinks` float32 [num_heads]) times
// log2(e).
__device__ __forceinline__ float sink_log2(const float* sinks, int head) { return sinks[head] * kLog2e; }

// A row's softmax sum with its head's attention sink joined: total + exp(sink - max), the row's max in base 2
// (`sinks` null: none). Every row reaching it saw a key, so max is finite.
__device__ __forceinline__ float with_sink(float total, const float* sinks, int head, float max) {
  return sinks == nullptr ? total : total + exp2f(sink_log2(sinks, head) - max);
}

// Number of `step`-wide chunks needed to cover n.
__host__ __device__ constexpr int ceil_div(int n, int step) { return (n + step - 1) / step; }

// The first key a query at `position` sees: 0, or with a sliding window (> 0) position - window + 1
// (transformers' `kv_idx > q_idx - sliding_window`).
__host__ __device__ __forceinline__ int window_begin(int position, int window) {
  return window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
}

// The soft cap of a base-2 score: cap * tanh(s / cap) with cap = logits_soft_cap * log2(e), which is
// logits_soft_cap * tanh(s_e / logits_soft_cap) in base 2. Off (cap 0): s unchanged.
__device__ __forceinline__ float soft_capped(float score, float cap_log2) {
  return cap_log2 > 0.f ? cap_log2 * tanhf(score / cap_log2) : score;
}

// A type as a value, for generic lambdas: f(Tag<T>{}) lets f name T.
template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<T>{}) with T the element type of `dtype`.
template <typename F>
cudaError_t dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(Tag<float>{});
    case DType::kFloat16:
      return f(Tag<__half>{});
    case DType::kBFloat16:
      return f(Tag<__nv_bfloat16>{});
  }
  return cudaErrorInvalidValue;
}

// Calls f(std::integral_constant<int, HEAD_DIM>{}) for a supported head_dim.
template <typename F>
cudaError_t dispatch_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 80:
      return f(std::integral_constant<int, 80>{});
    case 96:
      return f(std::integral_constant<int, 96>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    case 256:
      return f(std::integral_constant<int, 256>{});
  }
  return cudaErrorInvalidValue;
}

// fp8 cache elements (../csrc/fp8.h): one byte each, read as floats by the cache's format. A kernel over a
// cache of T takes C = T; over an fp8 cache C = Fp8<format>, with the scales applied outside the loads.
template <KVFormat F>
struct Fp8 {
  uint8_t bits;
  static constexpr KVFormat kFormat = F;
};

template <typename C>
struct IsFp8 : std::false_type {};
template <KVFormat F>
struct IsFp8<Fp8<F>> : std::true_type {};

// Two fp8 bytes, the low bytes of `pair`'s 16-bit halves, as the floats they hold, exactly, through fp16 bits
// (~7 PTX instructions an element and no branch, where fp8_to_float's cases took ~35): e5m2 is fp16's top
// byte; e4m3's bits shifted 7 places (the sign 8) read as its value x 2^-8, subnormals included (fp16
// subnormals widen to float exactly), which a multiply by 256 undoes. e4m3's NaN byte (0x7f, never written by
// the cache write) reads 480, as on the CPU; every other byte gives fp8_to_float's value.
template <KVFormat F>
__device__ __forceinline__ float2 fp8_pair_to_float2(uint32_t pair) {
  const uint32_t bits =
      F == KVFormat::fp8_e5m2 ? pair << 8 : ((pair & 0x007f007fu) << 7) | ((pair & 0x00800080u) << 8);
  __half2 half_pair;
  std::memcpy(&half_pair, &bits, sizeof bits);
  const float2 f = __half22float2(half_pair);
  return F == KVFormat::fp8_e5m2 ? f : make_float2(f.x * 256.f, f.y * 256.f);
}

// Elements 2i and 2i + 1 (i < 4) of an 8-byte piece of an fp8 cache, as floats.
template <KVFormat F>
__device__ __forceinline__ float2 fp8_piece_pair(const uint2& piece, int i) {
  const uint32_t word = (i < 2 ? piece.x : piece.y) >> (16 * (i % 2));
  return fp8_pair_to_float2<F>((word & 0xffu) | ((word & 0xff00u) << 8));
}

// Calls f(Tag<C>{}) with C the cache element type: T itself, or the fp8 format's.
template <typename T, typename F>
cudaError_t dispatch_cache(KVFormat format, F&& f) {
  switch (format) {
    case KVFormat::same:
      return f(Tag<T>{});
    case KVFormat::fp8_e4m3:
      return f(Tag<Fp8<KVFormat::fp8_e4m3>>{});
    case KVFormat::fp8_e5m2:
      return f(Tag<Fp8<KVFormat::fp8_e5m2>>{});
  }
  return cudaErrorInvalidValue;
}

inline bool is_supported_block_size(int block_size) {
  return block_size == 8 || block_size == 16 || block_size == 32;
}

}  // namespace batchgen::kernels
