// reshape_and_cache and copy_blocks: pure data movement, so the kernels copy opaque units
// (16, 8, 4 or 2 bytes, the widest that every address and stride allows) instead of elements; except the
// writes into fp8 caches, which quantize each element (../csrc/fp8.h).
#include <algorithm>
#include <cstdint>

#include "common.cuh"

namespace batchgen::kernels {
namespace {

constexpr int kCacheThreads = 128;

// One thread block per token: copies its num_kv_heads rows of key and value into its slot.
// Sizes and strides are in units.
template <typename Unit>
__global__ void reshape_and_cache_kernel(const Unit* __restrict__ key, const Unit* __restrict__ value,
                                         Unit* __restrict__ key_cache, Unit* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping, int num_kv_heads, int head_units,
                                         int block_size, int64_t key_token_stride, int64_t key_head_stride,
                                         int64_t value_token_stride, int64_t value_head_stride) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // padding token
  const int64_t block = slot / block_size;
  const int64_t offset = slot % block_size;
  const Unit* key_row = key + token * key_token_stride;
  const Unit* value_row = value + token * value_token_stride;
  const int units = num_kv_heads * head_units;
  for (int i = threadIdx.x; i < units; i += blockDim.x) {
    const int head = i / head_units;
    const int d = i % head_units;
    const int64_t dst = ((block * num_kv_heads + head) * block_size + offset) * head_units + d;
    key_cache[dst] = key_row[head * key_head_stride + d];
    value_cache[dst] = value_row[head * value_head_stride + d];
  }
}

// reshape_and_cache into an fp8 cache: one thread block per token, a thread per element of its rows, each
// stored as round(x / scale[head]) in the cache's format. Strides are in elements of T.
template <typename T, KVFormat F>
__global__ void reshape_and_cache_fp8_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                             uint8_t* __restrict__ key_cache, uint8_t* __restrict__ value_cache,
                                             const int64_t* __restrict__ slot_mapping, int num_kv_heads, int head_dim,
                                             int block_size, int64_t key_token_stride, int64_t key_head_stride,
                                             int64_t value_token_stride, int64_t value_head_stride,
                                             const float* __restrict__ k_scale, const float* __restrict__ v_scale) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // padding token
  const int64_t block = slot / block_size;
  const int64_t offset = slot % block_size;
  const int elements = num_kv_heads * head_dim;
  for (int i = threadIdx.x; i < elements; i += blockDim.x) {
    const int head = i / head_dim;
    const int d = i % head_dim;
    const int64_t dst = ((block * num_kv_heads + head) * block_size + offset) * head_dim + d;
    const float k = to_float(key[token * key_token_stride + head * key_head_stride + d]);
    const float v = to_float(value[token * value_token_stride + head * value_head_stride + d]);
    key_cache[dst] = float_to_fp8(k_scale != nullptr ? fp8_div_rn(k, k_scale[head]) : k, F);
    value_cache[dst] = float_to_fp8(v_scale != nullptr ? fp8_div_rn(v, v_scale[head]) : v, F);
  }
}

// blockIdx.x: pair index, blockIdx.y: 0 copies the key block, 1 the value block.
template <typename Unit>
__global__ void copy_blocks_kernel(Unit* __restrict__ key_cache, Unit* __restrict__ value_cache,
                                   const int64_t* __restrict__ block_mapping, int64_t block_units) {
  Unit* cache = blockIdx.y == 0 ? key_cache : value_cache;
  const int64_t src = block_mapping[2 * static_cast<int64_t>(blockIdx.x)];
  const int64_t dst = block_mapping[2 * static_cast<int64_t>(blockIdx.x) + 1];
  const Unit* from = cache + src * block_units;
  Unit* to = cache + dst * block_units;
  for (int64_t i = threadIdx.x; i < block_units; i += blockDim.x) to[i] = from[i];
}

// Widest unit (16, 8, 4 or 2 bytes) dividing every value; each is an address or a byte count.
template <typename... Values>
int unit_bytes(Values... values) {
  for (int unit : {16, 8, 4}) {
    if (((static_cast<uint64_t>(values) % unit == 0) && ...)) return unit;
  }
  return 2;
}

uint64_t address(const void* p) { return reinterpret_cast<uint64_t>(p); }

template <typename Unit>
cudaError_t reshape_and_cache_units(const void* key, const void* value, void* key_cache, void* value_cache,
                                    const int64_t* slot_mapping, int64_t num_tokens, int num_kv_heads,
                                    int head_dim_bytes, int block_size, const int64_t strides_bytes[4],
                                    cudaStream_t stream) {
  constexpr int64_t u = sizeof(Unit);
  reshape_and_cache_kernel<Unit><<<static_cast<unsigned>(num_tokens), kCacheThreads, 0, stream>>>(
      static_cast<const Unit*>(key), static_cast<const Unit*>(value), static_cast<Unit*>(key_cache),
      static_cast<Unit*>(value_cache), slot_mapping, num_kv_heads, static_cast<int>(head_dim_bytes / u),
      block_size, strides_bytes[0] / u, strides_bytes[1] / u, strides_bytes[2] / u, strides_bytes[3] / u);
  return cudaGetLastError();
}

template <typename Unit>
cudaError_t copy_blocks_units(void* const* key_caches, void* const* value_caches, int num_layers,
                              const int64_t* block_mapping, int64_t num_pairs, int64_t block_bytes,
                              cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_pairs), 2);
  for (int layer = 0; layer < num_layers; ++layer) {
    copy_blocks_kernel<Unit><<<grid, kCacheThreads * 2, 0, stream>>>(static_cast<Unit*>(key_caches[layer]),
                                                                    static_cast<Unit*>(value_caches[layer]),
                                                                    block_mapping, block_bytes / sizeof(Unit));
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Calls f(Tag<Unit>{}) for the unsigned type of `unit` bytes.
template <typename F>
cudaError_t dispatch_unit(int unit, F&& f) {
  switch (unit) {
    case 16:
      return f(Tag<uint4>{});
    case 8:
      return f(Tag<uint2>{});
    case 4:
      return f(Tag<uint32_t>{});
    default:
      return f(Tag<uint16_t>{});
  }
}

constexpr int64_t kMaxGridX = 0x7fffffff;

}  // namespace

cudaError_t launch_reshape_and_cache(DType dtype, const void* key, const void* value, void* key_cache,
                                     void* value_cache, const int64_t* slot_mapping, int64_t num_tokens,
                                     int num_kv_heads, int head_dim, int block_size, int64_t key_token_stride,
                                     int64_t key_head_stride, int64_t value_token_stride,
                                     int64_t value_head_stride, cudaStream_t stream, KVFormat kv_format,
                                     const float* k_scale, const float* v_scale) {
  if (num_tokens == 0) return cudaSuccess;
  if (num_tokens > kMaxGridX || block_size <= 0) return cudaErrorInvalidValue;
  if (kv_format != KVFormat::same) {
    return dispatch_dtype(dtype, [&](auto dtype_tag) {
      using T = typename decltype(dtype_tag)::type;
      const auto launch = [&](auto kernel) {
        kernel<<<static_cast<unsigned>(num_tokens), kCacheThreads, 0, stream>>>(
            static_cast<const T*>(key), static_cast<const T*>(value), static_cast<uint8_t*>(key_cache),
            static_cast<uint8_t*>(value_cache), slot_mapping, num_kv_heads, head_dim, block_size, key_token_stride,
            key_head_stride, value_token_stride, value_head_stride, k_scale, v_scale);
        return cudaGetLastError();
      };
      return kv_format == KVFormat::fp8_e5m2 ? launch(reshape_and_cache_fp8_kernel<T, KVFormat::fp8_e5m2>)
                                             : launch(reshape_and_cache_fp8_kernel<T, KVFormat::fp8_e4m3>);
    });
  }
  const int elem = dtype == DType::kFloat32 ? 4 : 2;
  const int64_t strides_bytes[4] = {key_token_stride * elem, key_head_stride * elem, value_token_stride * elem,
                                    value_head_stride * elem};
  const int head_dim_bytes = head_dim * elem;
  const int unit = unit_bytes(address(key), address(value), address(key_cache), address(value_cache),
                              head_dim_bytes, strides_bytes[0], strides_bytes[1], strides_bytes[2],
                              strides_bytes[3]);
  const auto run = [&](auto tag) {
    using Unit = typename decltype(tag)::type;
    return reshape_and_cache_units<Unit>(key, value, key_cache, value_cache, slot_mapping, num_tokens,
                                         num_kv_heads, head_dim_bytes, block_size, strides_bytes, stream);
  };
  return dispatch_unit(unit, run);
}

cudaError_t launch_copy_blocks(void* const* key_caches, void* const* value_caches, int num_layers,
                               const int64_t* block_mapping, int64_t num_pairs, int64_t block_bytes,
                               cudaStream_t stream) {
  if (num_pairs == 0 || num_layers == 0) return cudaSuccess;
  if (num_pairs > kMaxGridX || block_bytes % 2 != 0) return cudaErrorInvalidValue;
  int unit = 16;
  for (int layer = 0; layer < num_layers; ++layer) {
    unit = std::min(unit, unit_bytes(address(key_caches[layer]), address(value_caches[layer]), block_bytes));
  }
  const auto run = [&](auto tag) {
    using Unit = typename decltype(tag)::type;
    return copy_blocks_units<Unit>(key_caches, value_caches, num_layers, block_mapping, num_pairs, block_bytes,
                                   stream);
  };
  return dispatch_unit(unit, run);
}

}  // namespace batchgen::kernels
