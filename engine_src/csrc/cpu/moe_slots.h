// What the mixture-of-experts ops share (gemm_ops.cpp's bf16 experts, gemm_int8_ops.cpp's int8 ones): the
// (token, rank) slots grouped by expert, every expert's panels cut among torch's threads in one parallel call,
// and each token's expert outputs weighted and summed in float32 in ascending expert order.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "cpu/dtype.h"

namespace batchgen::cpu {

// The routing both ops take: expert_ids int64 and weights float32, contiguous CPU tensors [tokens of hidden, k].
inline void check_routing(const char* op, const torch::Tensor& hidden, const torch::Tensor& expert_ids,
                          const torch::Tensor& weights) {
  TORCH_CHECK_VALUE(expert_ids.is_cpu() && weights.is_cpu() && expert_ids.scalar_type() == torch::kInt64 &&
                        weights.scalar_type() == torch::kFloat32 && expert_ids.dim() == 2 &&
                        expert_ids.is_contiguous() && weights.is_contiguous() &&
                        weights.sizes() == expert_ids.sizes() && expert_ids.size(0) == hidden.size(0),
                    op, ": expert_ids and weights must be contiguous CPU tensors [", hidden.size(0),
                    ", k] (expert_ids must be Long, weights Float), got ", expert_ids.scalar_type(), " ",
                    expert_ids.sizes(), " and ", weights.scalar_type(), " ", weights.sizes());
}

// The slots of expert_ids (int64 [tokens, k]) grouped by expert, each expert's in slot order (a counting sort):
// expert e's slots sit at [first[e], first[e] + count[e]) of that order; slot s (= token * k + rank) at
// position[s], and the slot at position p is slot_at[p].
struct ExpertSlots {
  std::vector<int64_t> count, first, position, slot_at;

  ExpertSlots(const torch::Tensor& expert_ids, int64_t num_experts, const char* op)
      : count(num_experts, 0), first(num_experts, 0) {
    const int64_t slots = expert_ids.numel(), k = expert_ids.size(1);
    const int64_t* ids = expert_ids.data_ptr<int64_t>();
    for (int64_t s = 0; s < slots; ++s) {
      TORCH_CHECK_VALUE(ids[s] >= 0 && ids[s] < num_experts, op, ": token ", s / k, " names expert ", ids[s], " of ",
                        num_experts);
      ++count[ids[s]];
    }
    std::exclusive_scan(count.begin(), count.end(), first.begin(), int64_t{0});
    position.resize(slots);
    slot_at.resize(slots);
    std::vector<int64_t> next = first;
    for (int64_t s = 0; s < slots; ++s) {
      position[s] = next[ids[s]]++;
      slot_at[position[s]] = s;
    }
  }
};

// Calls run(e, panel_begin, panel_end) for the panels of every expert with slots, cut among torch's threads at
// once by cost, instead of one parallel call an expert: at decode an expert gets a few rows, and 64 calls a layer
// spent more time starting and joining threads than multiplying. A task's cost is its rows (whole tiles of
// `tile_rows`) plus kPanelReadRows for reading the panel: a panel of 48 columns at depth 1,024 reads in about the
// time 12-16 rows take through it on one core (Zen 4), and at a few rows an expert the reads are most of the work.
// A thread's panels of one expert are contiguous: one call, so that each prefetches the next. Each panel of each
// expert runs exactly once, whatever the thread count.
template <typename Run>
void parallel_expert_panels(const ExpertSlots& slots, int64_t panels, int64_t tile_rows, const Run& run) {
  constexpr int64_t kPanelReadRows = 16;
  std::vector<int64_t> experts;  // the experts with rows, and each one's cost before it
  std::vector<int64_t> cost_before{0};
  for (size_t e = 0; e < slots.count.size(); ++e) {
    if (slots.count[e] == 0) continue;
    const int64_t rows = (slots.count[e] + tile_rows - 1) / tile_rows * tile_rows;
    experts.push_back(static_cast<int64_t>(e));
    cost_before.push_back(cost_before.back() + panels * (rows + kPanelReadRows));
  }
  if (experts.empty() || panels == 0) return;
  const int64_t total = cost_before.back();
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), total);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t share_begin = total * t / threads, share_end = total * (t + 1) / threads;
      // The experts whose costs overlap this share; in each, the panels whose cost starts in it.
      size_t i = std::upper_bound(cost_before.begin(), cost_before.end(), share_begin) - cost_before.begin() - 1;
      for (; i < experts.size() && cost_before[i] < share_end; ++i) {
        const int64_t panel_cost = (cost_before[i + 1] - cost_before[i]) / panels;
        const auto first_panel_at = [&](int64_t at) {
          return std::clamp<int64_t>((at - cost_before[i] + panel_cost - 1) / panel_cost, 0, panels);
        };
        const int64_t panel_begin = first_panel_at(share_begin), panel_end = first_panel_at(share_end);
        if (panel_begin < panel_end) run(experts[i], panel_begin, panel_end);
      }
    }
  });
}

// out[t] (T: bf16 or float, rows out_stride apart) = the sum over token t's slots, in ascending expert order, of
// weights[slot] * y[position[slot]] (float32 rows of `features`), each product rounded to float32, then the sum,
// rounded to T once.
template <typename T>
void sum_expert_outputs(T* out, int64_t out_stride, const float* y, int64_t features, const ExpertSlots& slots,
                        const torch::Tensor& expert_ids, const torch::Tensor& weights) {
  const int64_t tokens = expert_ids.size(0), k = expert_ids.size(1);
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(features);
    std::vector<int64_t> order(k);
    for (int64_t t = begin; t < end; ++t) {
      std::iota(order.begin(), order.end(), t * k);
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (const int64_t s : order) {
        const float* row = y + slots.position[s] * features;
        for (int64_t f = 0; f < features; ++f) sum[f] += row[f] * w[s];
      }
      T* dst = out + t * out_stride;
      for (int64_t f = 0; f < features; ++f) dst[f] = from_float<T>(sum[f]);
    }
  });
}

// A buffer of the calling thread's, kept from call to call, as a [rows, cols] tensor of `dtype` (no owner): fresh
// ones of a prefill's size came from the kernel as new pages at every call, and faulting them in took a sixth of a
// MoE layer's call (115 MB at 2,048 tokens of Granite MoE's layer).
template <typename Element>
torch::Tensor kept_buffer(std::vector<Element>& kept, int64_t rows, int64_t cols, torch::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(rows * cols) * c10::elementSize(dtype);
  const size_t elements = (bytes + sizeof(Element) - 1) / sizeof(Element);
  if (kept.size() < elements) kept.resize(elements);
  return torch::from_blob(kept.data(), {rows, cols}, torch::TensorOptions().dtype(dtype));
}

}  // namespace batchgen::cpu
