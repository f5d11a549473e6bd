// Segmented LoRA on CPU (Punica's shrink and expand in one pass a row): every row of a segment gets its
// adapter slot's scale * (x A^T) B^T, the rows of all segments spread over torch's threads in chunks. The
// row kernel (cpu/lora_impl.h) comes from the active instruction set's table.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace batchgen::cpu {
namespace {

struct Segment {
  int64_t begin, end, slot;
};

// The segments' rows cut into chunks of at most `rows` rows (whole tiles of the kernel but the last).
std::vector<Segment> chunks_of(const std::vector<Segment>& segments, int64_t rows) {
  std::vector<Segment> chunks;
  for (const Segment& s : segments) {
    for (int64_t first = s.begin; first < s.end; first += rows) chunks.push_back({first, std::min(s.end, first + rows), s.slot});
  }
  return chunks;
}

// Rows outside every segment get -0.0, which adds nothing to any float (x + -0.0 is x, bit for bit).
void fill_gaps(float* y, int64_t stride, int64_t cols, int64_t rows, const std::vector<Segment>& segments) {
  int64_t row = 0;
  auto fill = [&](int64_t end) {
    for (; row < end; ++row) std::fill(y + row * stride, y + row * stride + cols, -0.0f);
  };
  for (const Segment& s : segments) {
    fill(s.begin);
    row = s.end;
  }
  fill(rows);
}

}  // namespace

void lora_shrink_expand(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& segments,
                        const torch::Tensor& a, const torch::Tensor& b_t, const c10::optional<torch::Tensor>& ranks,
                        double scale, bool store) {
  const bool pairs = a.scalar_type() == torch::kBFloat16;  // the bf16 form (kernels.h: LoRAArgs)
  const int64_t rows = x.size(0), slots = a.size(0), capacity = a.size(pairs ? 2 : 1);
  const int32_t* seg = segments.data_ptr<int32_t>();
  const int32_t* slot_ranks = ranks.has_value() ? ranks->data_ptr<int32_t>() : nullptr;
  for (int64_t s = 0; s < slots && slot_ranks != nullptr; ++s) {
    TORCH_CHECK_VALUE(slot_ranks[s] >= 0 && slot_ranks[s] <= capacity, "lora_shrink_expand: ranks[", s, "] = ",
                      slot_ranks[s], " is not in [0, ", capacity, "]");
  }
  std::vector<Segment> active;  // the segments whose slot has ranks here
  int64_t previous_end = 0;
  for (int64_t s = 0; s < segments.size(0); ++s) {
    const int64_t begin = seg[3 * s], end = seg[3 * s + 1], slot = seg[3 * s + 2];
    TORCH_CHECK_VALUE(begin >= previous_end && begin <= end && end <= rows, "lora_shrink_expand: segment ", s,
                      " covers rows [", begin, ", ", end, ") of ", rows,
                      "; segments must be in order, apart and inside x");
    TORCH_CHECK_VALUE(slot >= 0 && slot < slots, "lora_shrink_expand: segment ", s, " names slot ", slot, " of ",
                      slots);
    previous_end = end;
    if (begin < end && capacity > 0 && (slot_ranks == nullptr || slot_ranks[slot] > 0)) active.push_back({begin, end, slot});
  }
  LoRAArgs args{};
  args.x = x.data_ptr();
  args.x_stride = x.stride(0);
  args.a = a.data_ptr();
  args.b = b_t.data_ptr();
  args.ranks = slot_ranks;
  args.y = y.data_ptr();
  args.y_stride = y.stride(0);
  args.y_float = y.scalar_type() == torch::kFloat32;
  args.store = store;
  args.in = x.size(1);
  args.out = y.size(1);
  args.rank = capacity;
  args.scale = static_cast<float>(scale);
  if (store) fill_gaps(y.data_ptr<float>(), args.y_stride, args.out, rows, active);
  if (active.empty()) return;
  const LoRARowsFn kernel =
      pairs ? active_kernels().lora_rows_bf16 : active_kernels().lora_rows[static_cast<int>(dtype_of(x))];
  TORCH_CHECK_VALUE(kernel != nullptr, "lora_shrink_expand: no kernel for ", x.scalar_type());
  // Chunks of ~64k multiply-adds in whole tiles over torch's threads; a call of fewer than ~128k (a decode
  // step's rows of a small piece) runs on this thread, where waking the others would cost more than the work.
  // The bf16 form runs ~4x as many a second (AMX: tests at ~150-200 GMAC/s a thread), so 8x both: a parallel
  // region costs microseconds on a quiet machine and can cost milliseconds on a busy one.
  const int64_t macs_per_row = std::max<int64_t>(1, capacity * (args.in + args.out));
  const int64_t tile = pairs ? kLoRABlockRows : kLoRATileRows;
  const int64_t chunk_macs = int64_t{1} << (pairs ? 19 : 16);
  const int64_t chunk_rows = std::max<int64_t>(1, chunk_macs / macs_per_row / tile) * tile;
  const std::vector<Segment> chunks = chunks_of(active, chunk_rows);
  int64_t active_rows = 0;
  for (const Segment& s : active) active_rows += s.end - s.begin;
  const int64_t grain = active_rows * macs_per_row < 2 * chunk_macs ? static_cast<int64_t>(chunks.size()) : 1;
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kLoRATileRows * args.in);
    for (int64_t c = begin; c < end; ++c) kernel(args, chunks[c].begin, chunks[c].end, chunks[c].slot, scratch.data());
  });
}

}  // namespace batchgen::cpu
