// Segmented LoRA (SGMV, as in Punica): the CUDA twin of engine_src/csrc/cpu/lora_ops.cpp. Two kernels, each
// one thread block per (segment, tile): the shrink puts t = scale * x A[slot]^T of a tile of a segment's rows
// into float32 workspace, one warp per (row, rank) dot product; the expand adds t B[slot] into y, one thread
// per output column of a tile of rows, the ranks summed in order. Every sum runs in an order fixed by the row
// and its slot alone (lanes, then the warp's butterfly), so a row's result does not depend on its segment or
// neighbours.
#include <cstdint>

#include "common.cuh"
#include "kernels.h"

namespace batchgen::kernels {
namespace {

constexpr int kShrinkWarps = 8;    // warps of a shrink block
constexpr int kTileRows = 16;      // a segment's rows per block
constexpr int kExpandCols = 128;   // output columns per expand block (one a thread)

// The segment's [begin, end) rows, its slot and rank.
struct SegmentRows {
  int begin, end, slot, rank;
};

__device__ __forceinline__ SegmentRows segment_rows(const int* segments, const int* ranks, int capacity) {
  const int* s = segments + 3 * blockIdx.x;
  return {s[0], s[1], s[2], ranks != nullptr ? ranks[s[2]] : capacity};
}

template <typename T>
__global__ void lora_shrink_kernel(float* __restrict__ t, const T* __restrict__ x, int64_t x_stride,
                                   const int* __restrict__ segments, const float* __restrict__ a,
                                   const int* __restrict__ ranks, int capacity, int in, float scale) {
  const SegmentRows seg = segment_rows(segments, ranks, capacity);
  const int first = seg.begin + blockIdx.y * kTileRows;
  const int rows = min(kTileRows, seg.end - first);
  if (rows <= 0) return;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int job = warp; job < rows * seg.rank; job += kShrinkWarps) {
    const int row = first + job / seg.rank, r = job % seg.rank;
    const T* xr = x + row * x_stride;
    const float* ar = a + (static_cast<int64_t>(seg.slot) * capacity + r) * in;
    float sum = 0.f;
    for (int k = lane; k < in; k += kWarpSize) sum += to_float(xr[k]) * ar[k];
    sum = warp_sum(sum);
    if (lane == 0) t[static_cast<int64_t>(row) * capacity + r] = scale * sum;
  }
}

template <typename Y>
__global__ void lora_expand_kernel(Y* __restrict__ y, int64_t y_stride, const float* __restrict__ t,
                                   const int* __restrict__ segments, const float* __restrict__ b_t,
                                   const int* __restrict__ ranks, int capacity, int out, bool store) {
  const SegmentRows seg = segment_rows(segments, ranks, capacity);
  const int first = seg.begin + blockIdx.y * kTileRows;
  const int rows = min(kTileRows, seg.end - first);
  const int col = blockIdx.z * kExpandCols + threadIdx.x;
  if (rows <= 0 || col >= out || seg.rank == 0) return;
  const float* b = b_t + static_cast<int64_t>(seg.slot) * capacity * out + col;
  for (int i = 0; i < rows; ++i) {
    const int row = first + i;
    const float* tr = t + static_cast<int64_t>(row) * capacity;
    float sum = 0.f;
    for (int r = 0; r < seg.rank; ++r) sum += tr[r] * b[static_cast<int64_t>(r) * out];
    Y* dst = y + row * y_stride + col;
    *dst = store ? from_float<Y>(sum) : from_float<Y>(to_float(*dst) + sum);
  }
}

// store: every row starts as -0.0 (the rows of the segments are then overwritten).
__global__ void fill_negative_zero_kernel(float* __restrict__ y, int64_t y_stride, int cols) {
  float* row = y + blockIdx.x * y_stride;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) row[c] = -0.f;
}

}  // namespace

size_t lora_workspace_bytes(int64_t num_rows, int capacity) {
  return static_cast<size_t>(num_rows) * capacity * sizeof(float);
}

cudaError_t launch_lora_shrink_expand(DType dtype, bool y_float, void* y, int64_t y_stride, const void* x,
                                      int64_t x_stride, int64_t num_rows, const int* segments, int num_segments,
                                      int max_segment_rows, const float* a, const float* b_t, const int* ranks,
                                      int capacity, int in, int out, float scale, bool store, void* workspace,
                                      cudaStream_t stream) {
  if (store && !y_float) return cudaErrorInvalidValue;
  if (store && num_rows > 0) {
    fill_negative_zero_kernel<<<static_cast<unsigned>(num_rows), kExpandCols, 0, stream>>>(static_cast<float*>(y),
                                                                                          y_stride, out);
  }
  if (num_segments == 0 || max_segment_rows == 0 || capacity == 0) return cudaGetLastError();
  float* t = static_cast<float*>(workspace);
  const unsigned tiles = static_cast<unsigned>(ceil_div(max_segment_rows, kTileRows));
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    lora_shrink_kernel<T><<<dim3(num_segments, tiles), kShrinkWarps * kWarpSize, 0, stream>>>(
        t, static_cast<const T*>(x), x_stride, segments, a, ranks, capacity, in, scale);
    const dim3 grid(num_segments, tiles, ceil_div(out, kExpandCols));
    if (y_float) {
      lora_expand_kernel<float><<<grid, kExpandCols, 0, stream>>>(static_cast<float*>(y), y_stride, t, segments, b_t,
                                                                  ranks, capacity, out, store);
    } else {
      lora_expand_kernel<T><<<grid, kExpandCols, 0, stream>>>(static_cast<T*>(y), y_stride, t, segments, b_t, ranks,
                                                              capacity, out, store);
    }
    return cudaGetLastError();
  });
}

}  // namespace batchgen::kernels
