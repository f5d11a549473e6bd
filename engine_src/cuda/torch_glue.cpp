// Torch-facing side of the CUDA kernels (cuda_ops.h): picks the device and stream, turns tensors
// into pointers, sizes and strides, and calls the torch-free launchers of kernels.h. Argument
// shapes and devices are validated by the caller (bindings.cpp); the checks here are the ones
// the raw-pointer launchers depend on (dtype, contiguity, alignment).
#include "cuda_ops.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels.h"

namespace batchgen::cuda {
namespace {

namespace k = batchgen::kernels;

k::DType kernel_dtype(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat:
      return k::DType::kFloat32;
    case torch::kHalf:
      return k::DType::kFloat16;
    case torch::kBFloat16:
      return k::DType::kBFloat16;
    default:
      TORCH_CHECK(false, "batchgen: unsupported dtype ", t.scalar_type(), " (float32, float16 or bfloat16 only)");
  }
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "batchgen::", op, ": CUDA error: ", cudaGetErrorString(err));
}

int to_int(int64_t value, const char* what) {
  TORCH_CHECK(value >= 0 && value <= std::numeric_limits<int>::max(), "batchgen: ", what, " out of range: ", value);
  return static_cast<int>(value);
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// fp8 caches (float8_e4m3fn, float8_e5m2) hold one byte an element beside activations of any dtype.
KVFormat kv_format(const torch::Tensor& cache) {
  switch (cache.scalar_type()) {
    case torch::kFloat8_e4m3fn:
      return KVFormat::fp8_e4m3;
    case torch::kFloat8_e5m2:
      return KVFormat::fp8_e5m2;
    default:
      return KVFormat::same;
  }
}

// An optional float32 tensor's data (an fp8 cache's per-kv-head scales, attention sinks), or null.
const float* scale_ptr(const c10::optional<torch::Tensor>& scale) {
  return scale.has_value() ? scale->data_ptr<float>() : nullptr;
}

// The kernels read element pairs with one access, so a cache must start on a pair boundary.
void check_cache(const torch::Tensor& cache, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), "batchgen: ", name,
              " must be a contiguous [num_blocks, num_kv_heads, block_size, head_dim] tensor");
  TORCH_CHECK(cache.scalar_type() == like.scalar_type() || kv_format(cache) != KVFormat::same, "batchgen: ", name,
              " dtype ", cache.scalar_type(), " differs from ", like.scalar_type());
  const auto address = reinterpret_cast<uintptr_t>(cache.data_ptr());
  TORCH_CHECK(address % (2 * cache.element_size()) == 0, "batchgen: ", name, " is not aligned to two elements");
}

// Inputs may have any strides except in their last dimension.
torch::Tensor unit_last_stride(const torch::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

torch::Tensor int32_contiguous(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kInt, "batchgen: ", name, " must be int32, got ", t.scalar_type());
  return t.contiguous();
}

// Calls write(target) with `out` itself when its last dimension is contiguous, else with a
// contiguous temporary that is copied into `out` afterwards.
template <typename Write>
void write_into(torch::Tensor& out, Write&& write) {
  if (out.stride(-1) == 1) {
    write(out);
    return;
  }
  torch::Tensor target = torch::empty(out.sizes(), out.options());
  write(target);
  out.copy_(target);
}

int64_t block_bytes_of(const torch::Tensor& cache) {
  return cache.size(0) == 0 ? 0 : cache.numel() / cache.size(0) * cache.element_size();
}

}  // namespace

void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                       torch::Tensor& value_cache, const torch::Tensor& slot_mapping,
                       const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale) {
  const c10::cuda::CUDAGuard guard(key_cache.device());
  check_cache(key_cache, key, "key_cache");
  check_cache(value_cache, key, "value_cache");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "batchgen: key and value dtypes differ");
  const torch::Tensor keys = unit_last_stride(key);
  const torch::Tensor values = unit_last_stride(value);
  const torch::Tensor slots = slot_mapping.to(key_cache.device(), torch::kLong).contiguous();
  check_launch(k::launch_reshape_and_cache(kernel_dtype(key), keys.data_ptr(), values.data_ptr(),
                                           key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr<int64_t>(),
                                           keys.size(0), to_int(key_cache.size(1), "num_kv_heads"),
                                           to_int(key_cache.size(3), "head_dim"),
                                           to_int(key_cache.size(2), "block_size"), keys.stride(0), keys.stride(1),
                                           values.stride(0), values.stride(1), current_stream(),
                                           kv_format(key_cache), scale_ptr(k_scale), scale_ptr(v_scale)),
               "reshape_and_cache");
}

void paged_attention_decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                            const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& seq_lens, double scale, int64_t sliding_window,
                            double logits_soft_cap, const c10::optional<torch::Tensor>& k_scale,
                            const c10::optional<torch::Tensor>& v_scale, const c10::optional<torch::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  check_cache(key_cache, query, "key_cache");
  check_cache(value_cache, query, "value_cache");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "batchgen: out and query dtypes differ");
  const torch::Tensor q = unit_last_stride(query);
  const torch::Tensor tables = int32_contiguous(block_tables, "block_tables");
  const torch::Tensor lens = int32_contiguous(seq_lens, "seq_lens");
  const int num_seqs = to_int(q.size(0), "num_seqs");
  const int num_heads = to_int(q.size(1), "num_heads");
  const int head_dim = to_int(q.size(2), "head_dim");
  const int block_size = to_int(key_cache.size(2), "block_size");
  // Longest context the block tables can describe: bounds seq_lens without reading them back.
  const int max_context_len = to_int(tables.size(1) * block_size, "max_blocks_per_seq * block_size");

  // A window longer than any context is no window.
  const int window = static_cast<int>(std::min<int64_t>(sliding_window, max_context_len));
  const size_t workspace_bytes =
      k::paged_attention_decode_workspace_bytes(num_seqs, num_heads, head_dim, max_context_len, window);
  torch::Tensor workspace;
  if (workspace_bytes > 0) {
    workspace = torch::empty({static_cast<int64_t>(workspace_bytes)}, q.options().dtype(torch::kByte));
  }
  const cudaStream_t stream = current_stream();
  write_into(out, [&](torch::Tensor& target) {
    check_launch(k::launch_paged_attention_decode(
                     kernel_dtype(q), target.data_ptr(), target.stride(0), target.stride(1), q.data_ptr(),
                     q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr<int>(),
                     tables.stride(0), lens.data_ptr<int>(), num_seqs, num_heads,
                     to_int(key_cache.size(1), "num_kv_heads"), head_dim, block_size, max_context_len,
                     static_cast<float>(scale), window, static_cast<float>(logits_soft_cap),
                     workspace_bytes > 0 ? workspace.data_ptr() : nullptr, stream, kv_format(key_cache),
                     scale_ptr(k_scale), scale_ptr(v_scale), scale_ptr(sinks)),
                 "paged_attention_decode");
  });
}

void paged_attention_prefill(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                             const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, double scale,
                             int64_t sliding_window, double logits_soft_cap, const c10::optional<torch::Tensor>& k_scale,
                             const c10::optional<torch::Tensor>& v_scale,
                             const c10::optional<torch::Tensor>& key_limit,
                             const c10::optional<torch::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  check_cache(key_cache, query, "key_cache");
  check_cache(value_cache, query, "value_cache");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "batchgen: out and query dtypes differ");
  const torch::Tensor q = unit_last_stride(query);
  const torch::Tensor tables = int32_contiguous(block_tables, "block_tables");
  const torch::Tensor lens = int32_contiguous(seq_lens, "seq_lens");
  const torch::Tensor starts = int32_contiguous(query_start_loc, "query_start_loc");
  const torch::Tensor limits = key_limit.has_value() ? int32_contiguous(*key_limit, "key_limit") : torch::Tensor();
  const cudaStream_t stream = current_stream();
  write_into(out, [&](torch::Tensor& target) {
    check_launch(k::launch_paged_attention_prefill(
                     kernel_dtype(q), target.data_ptr(), target.stride(0), target.stride(1), q.data_ptr(),
                     q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr<int>(),
                     tables.stride(0), lens.data_ptr<int>(), starts.data_ptr<int>(),
                     to_int(lens.size(0), "num_seqs"), q.size(0), to_int(q.size(1), "num_heads"),
                     to_int(key_cache.size(1), "num_kv_heads"), to_int(q.size(2), "head_dim"),
                     to_int(key_cache.size(2), "block_size"), static_cast<float>(scale),
                     static_cast<int>(std::min<int64_t>(sliding_window, 0x7fffffff)),
                     static_cast<float>(logits_soft_cap), stream, kv_format(key_cache), scale_ptr(k_scale),
                     scale_ptr(v_scale), limits.defined() ? limits.data_ptr<int>() : nullptr, scale_ptr(sinks)),
                 "paged_attention_prefill");
  });
}

void copy_blocks(std::vector<torch::Tensor>& key_caches, std::vector<torch::Tensor>& value_caches,
                 const torch::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "batchgen: as many key caches as value caches expected");
  if (key_caches.empty() || block_mapping.numel() == 0) return;
  const torch::Tensor& first = key_caches[0];
  const c10::cuda::CUDAGuard guard(first.device());
  std::vector<void*> keys;
  std::vector<void*> values;
  for (size_t layer = 0; layer < key_caches.size(); ++layer) {
    for (const torch::Tensor* cache : {&key_caches[layer], &value_caches[layer]}) {
      TORCH_CHECK(cache->device() == first.device() && cache->sizes() == first.sizes() && cache->is_contiguous() &&
                      cache->scalar_type() == first.scalar_type(),
                  "batchgen::copy_blocks: every cache must be contiguous and match the first one's device, shape and "
                  "dtype (layer ",
                  layer, ")");
    }
    keys.push_back(key_caches[layer].data_ptr());
    values.push_back(value_caches[layer].data_ptr());
  }
  const torch::Tensor mapping = block_mapping.to(first.device(), torch::kLong).contiguous();
  check_launch(k::launch_copy_blocks(keys.data(), values.data(), to_int(static_cast<int64_t>(keys.size()), "layers"),
                                     mapping.data_ptr<int64_t>(), mapping.size(0), block_bytes_of(first),
                                     current_stream()),
               "copy_blocks");
}

void swap_blocks(const torch::Tensor& src, torch::Tensor& dst, const torch::Tensor& block_mapping) {
  TORCH_CHECK(src.is_cuda() || dst.is_cuda(), "batchgen::swap_blocks: src or dst must be a CUDA tensor");
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "batchgen::swap_blocks: caches must be contiguous");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "batchgen::swap_blocks: src and dst dtypes differ");
  TORCH_CHECK(block_mapping.device().is_cpu() && block_mapping.scalar_type() == torch::kLong,
              "batchgen::swap_blocks: block_mapping must be an int64 CPU tensor");
  const int64_t block_bytes = block_bytes_of(src);
  TORCH_CHECK(block_bytes == block_bytes_of(dst), "batchgen::swap_blocks: src and dst blocks differ in size");
  if (block_mapping.numel() == 0) return;

  const cudaMemcpyKind kind = !src.is_cuda()   ? cudaMemcpyHostToDevice
                              : !dst.is_cuda() ? cudaMemcpyDeviceToHost
                                               : cudaMemcpyDeviceToDevice;
  const c10::cuda::CUDAGuard guard(src.is_cuda() ? src.device() : dst.device());
  const cudaStream_t stream = current_stream();
  // One copy per run of blocks consecutive on both sides (a sequence's blocks often are), not one per block:
  // each cudaMemcpyAsync costs microseconds of host time, a whole sequence's swap thousands of them.
  const torch::Tensor mapping = block_mapping.contiguous();
  const int64_t* flat = mapping.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> pairs(static_cast<size_t>(mapping.size(0)));
  for (size_t i = 0; i < pairs.size(); ++i) pairs[i] = {flat[2 * i], flat[2 * i + 1]};
  std::sort(pairs.begin(), pairs.end());  // a swap's sources and destinations are in different caches
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(dst.data_ptr());
  for (size_t first = 0; first < pairs.size();) {
    size_t end = first + 1;
    while (end < pairs.size() && pairs[end].first == pairs[end - 1].first + 1 &&
           pairs[end].second == pairs[end - 1].second + 1) {
      ++end;
    }
    C10_CUDA_CHECK(cudaMemcpyAsync(to + pairs[first].second * block_bytes, from + pairs[first].first * block_bytes,
                                   static_cast<size_t>(block_bytes) * (end - first), kind, stream));
    first = end;
  }
}

void lora_shrink_expand(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& segments,
                        const torch::Tensor& a, const torch::Tensor& b_t, const c10::optional<torch::Tensor>& ranks,
                        double scale, bool store) {
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(a.is_contiguous() && b_t.is_contiguous(), "batchgen::lora_shrink_expand: a and b_t must be contiguous");
  // The grid's row tiles cover the longest segment. A host table is read for that length before it is copied
  // over; a device table is not read (that would synchronise): every row of x bounds it, and the tiles past a
  // segment's end return at once.
  const torch::Tensor table = segments.contiguous();
  int max_segment_rows = to_int(x.size(0), "rows");
  if (table.is_cpu()) {
    const int* rows = table.data_ptr<int>();
    max_segment_rows = 0;
    for (int64_t i = 0; i < table.size(0); ++i) {
      max_segment_rows = std::max(max_segment_rows, rows[3 * i + 1] - rows[3 * i]);
    }
  }
  const torch::Tensor device_table = table.to(x.device());
  torch::Tensor device_ranks;
  if (ranks.has_value()) device_ranks = ranks->to(x.device()).contiguous();
  const int capacity = to_int(a.size(1), "rank");
  const torch::Tensor workspace = torch::empty(
      {static_cast<int64_t>(k::lora_workspace_bytes(x.size(0), capacity))}, x.options().dtype(torch::kUInt8));
  check_launch(k::launch_lora_shrink_expand(
                   kernel_dtype(x), y.scalar_type() == torch::kFloat, y.data_ptr(), y.stride(0), x.data_ptr(),
                   x.stride(0), x.size(0), device_table.data_ptr<int>(), to_int(table.size(0), "segments"),
                   max_segment_rows, a.data_ptr<float>(), b_t.data_ptr<float>(),
                   device_ranks.defined() ? device_ranks.data_ptr<int>() : nullptr, capacity,
                   to_int(x.size(1), "in_features"), to_int(y.size(1), "out_features"), static_cast<float>(scale),
                   store, workspace.data_ptr(), current_stream()),
               "lora_shrink_expand");
}

}  // namespace batchgen::cuda
