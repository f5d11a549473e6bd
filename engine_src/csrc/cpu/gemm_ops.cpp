// bf16 GEMMs of the linear layers on weights packed in panels (kernels.h: GemmArgs; the loop is cpu/gemm_impl.h,
// or gemm_amx.h on tiles, in the AVX-512 kernel tables, gemm_avx2.h on AVX2): the work cut into tasks for torch's
// threads.
#include <torch/extension.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/gemm_parallel.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace batchgen::cpu {
namespace {

// x widened to float32 (exact), rows `depth` apart, in a buffer of the calling thread's, for the tables whose GEMM
// widens bf16: once per call, the rows split over torch's threads, where each task widening its own rows had every
// thread widen all of them whenever the panels alone were cut between threads.
const float* widened_x(const GemmArgs& args) {
  thread_local std::vector<float> wide;
  wide.resize(static_cast<size_t>(args.rows * args.depth));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, args.depth));
  float* const out = wide.data();  // the lambda runs on other threads, whose `wide` is another vector
  at::parallel_for(0, args.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const BF16* src = args.x + r * args.x_stride;
      float* dst = out + r * args.depth;
      for (int64_t k = 0; k < args.depth; ++k) dst[k] = to_float(src[k]);
    }
  });
  return out;
}

void run_gemm(GemmArgs args, int64_t panels) {
  const KernelTable& kernels = active_kernels();
  TORCH_CHECK_VALUE(kernels.gemm_bf16 != nullptr, "the bf16 GEMM needs AVX2 or AVX-512 kernels; active: ",
                    kernels.name);
  if (kernels.gemm_widens_bf16) args.x_wide = widened_x(args);
  parallel_panels(args.rows, panels, kGemmTileRows, [&](int64_t first_row, int64_t rows, int64_t begin, int64_t end) {
    kernels.gemm_bf16(gemm_rows(args, first_row, rows), begin, end);
  });
}

const BF16* bf16_data(const torch::Tensor& t) { return static_cast<const BF16*>(t.data_ptr()); }

GemmArgs args_of(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                 const c10::optional<torch::Tensor>& addend) {
  GemmArgs args{};
  args.x = bf16_data(x);
  args.x_stride = x.stride(0);
  args.weight = bf16_data(weight);
  args.out = out.data_ptr();
  args.out_stride = out.stride(0);
  args.float_out = out.scalar_type() == torch::kFloat32;
  args.rows = x.size(0);
  args.cols = out.size(1);
  args.depth = x.size(1);
  if (addend.has_value()) {
    args.addend = addend->data_ptr<float>();
    args.addend_stride = addend->stride(0);
  }
  return args;
}

// A mixture of experts' GEMMs: for each expert e, rows [first[e], first[e] + count[e]) of a call's args through
// that expert's panels (`args_of_expert`). Every expert's panels are cut among torch's threads at once, by cost,
// instead of one parallel call an expert: at decode an expert gets a few rows, and 64 calls a layer spent more
// time starting and joining threads than multiplying. A task's cost is its rows (whole tiles) plus
// kPanelReadRows for reading the panel: a panel of 48 columns at depth 1,024 reads in about the time 12-16 rows
// take through it on one core (Zen 4), and at a few rows an expert the reads are most of the work. Contiguous
// panels of one expert in a thread's share go in one kernel call, so that each prefetches the next.
template <typename ArgsOf>
void run_expert_gemms(const std::vector<int64_t>& first, const std::vector<int64_t>& count, int64_t panels,
                      const ArgsOf& args_of_expert) {
  constexpr int64_t kPanelReadRows = 16;
  const KernelTable& kernels = active_kernels();
  std::vector<int64_t> experts;  // the experts with rows, and each one's cost before it
  std::vector<int64_t> cost_before{0};
  for (size_t e = 0; e < count.size(); ++e) {
    if (count[e] == 0) continue;
    const int64_t rows = (count[e] + kGemmTileRows - 1) / kGemmTileRows * kGemmTileRows;
    experts.push_back(static_cast<int64_t>(e));
    cost_before.push_back(cost_before.back() + panels * (rows + kPanelReadRows));
  }
  if (experts.empty()) return;
  const int64_t total = cost_before.back();
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), total);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t share_begin = total * t / threads, share_end = total * (t + 1) / threads;
      // The experts whose costs overlap this share; in each, the panels whose start falls in it.
      size_t i = std::upper_bound(cost_before.begin(), cost_before.end(), share_begin) - cost_before.begin() - 1;
      for (; i < experts.size() && cost_before[i] < share_end; ++i) {
        const int64_t e = experts[i];
        const int64_t panel_cost = (cost_before[i + 1] - cost_before[i]) / panels;
        const auto first_panel_at = [&](int64_t at) {
          return std::clamp<int64_t>((at - cost_before[i] + panel_cost - 1) / panel_cost, 0, panels);
        };
        const int64_t panel_begin = first_panel_at(share_begin), panel_end = first_panel_at(share_end);
        if (panel_begin < panel_end) kernels.gemm_bf16(args_of_expert(e), panel_begin, panel_end);
      }
    }
  });
}

}  // namespace

bool has_gemm_bf16() { return active_kernels().gemm_bf16 != nullptr; }

bool gemm_widens_bf16() { return active_kernels().gemm_widens_bf16; }

void gemm_bf16(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
               const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& addend) {
  GemmArgs args = args_of(out, x, weight, addend);
  if (bias.has_value()) args.bias = bias->data_ptr<float>();
  run_gemm(args, weight.size(0));
}

void gemm_silu_mul_bf16(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& gate,
                        const torch::Tensor& up, const c10::optional<torch::Tensor>& addend) {
  GemmArgs args = args_of(out, x, gate, addend);
  args.up = bf16_data(up);
  run_gemm(args, gate.size(0));
}

}  // namespace batchgen::cpu

namespace batchgen::cpu {

void moe_silu_experts_bf16(torch::Tensor& out, const torch::Tensor& hidden, const torch::Tensor& expert_ids,
                           const torch::Tensor& weights, const std::vector<torch::Tensor>& gates,
                           const std::vector<torch::Tensor>& ups, const std::vector<torch::Tensor>& downs,
                           int64_t intermediate) {
  const KernelTable& kernels = active_kernels();
  TORCH_CHECK_VALUE(kernels.gemm_bf16 != nullptr, "the bf16 GEMM needs AVX2 or AVX-512 kernels; active: ",
                    kernels.name);
  const int64_t tokens = hidden.size(0), features = hidden.size(1), k = expert_ids.size(1);
  const int64_t num_experts = static_cast<int64_t>(gates.size()), slots = tokens * k;
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  // The (token, rank) slots grouped by expert, each expert's in slot order (a counting sort).
  std::vector<int64_t> count(num_experts, 0), first(num_experts, 0), position(slots), slot_at(slots);
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK_VALUE(ids[s] >= 0 && ids[s] < num_experts, "moe_silu_experts_bf16: token ", s / k, " names expert ",
                      ids[s], " of ", num_experts);
    ++count[ids[s]];
  }
  std::exclusive_scan(count.begin(), count.end(), first.begin(), int64_t{0});
  std::vector<int64_t> next = first;
  for (int64_t s = 0; s < slots; ++s) {
    position[s] = next[ids[s]]++;
    slot_at[position[s]] = s;
  }
  // Each slot's token row, in slot_at's order; through the gate and up projections; through the down projection.
  // In buffers kept by the calling thread from call to call: fresh ones of a prefill's size (115 MB at 2,048
  // tokens of Granite MoE's layer) came from the kernel as new pages at every call, and faulting them in took 1/6
  // of the call.
  thread_local std::vector<BF16> row_buffer, gated_buffer;
  thread_local std::vector<float> out_buffer;
  const auto buffer = [](auto& kept, int64_t rows, int64_t cols, torch::ScalarType dtype) {
    if (kept.size() < static_cast<size_t>(rows * cols)) kept.resize(rows * cols);
    return torch::from_blob(kept.data(), {rows, cols}, torch::TensorOptions().dtype(dtype));
  };
  torch::Tensor rows = buffer(row_buffer, slots, features, torch::kBFloat16);
  torch::Tensor gated = buffer(gated_buffer, slots, intermediate, torch::kBFloat16);
  torch::Tensor expert_out = buffer(out_buffer, slots, features, torch::kFloat32);
  const BF16* x = bf16_data(hidden);
  BF16* row_data = static_cast<BF16*>(rows.data_ptr());
  at::parallel_for(0, slots, std::max<int64_t>(1, 4096 / features), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      std::copy_n(x + slot_at[p] / k * hidden.stride(0), features, row_data + p * features);
    }
  });
  GemmArgs up_args = args_of(gated, rows, gates[0], c10::nullopt);
  if (kernels.gemm_widens_bf16) up_args.x_wide = widened_x(up_args);
  run_expert_gemms(first, count, gates[0].size(0), [&](int64_t e) {
    GemmArgs a = gemm_rows(up_args, first[e], count[e]);
    a.weight = bf16_data(gates[e]);
    a.up = bf16_data(ups[e]);
    return a;
  });
  GemmArgs down_args = args_of(expert_out, gated, downs[0], c10::nullopt);
  if (kernels.gemm_widens_bf16) down_args.x_wide = widened_x(down_args);
  run_expert_gemms(first, count, downs[0].size(0), [&](int64_t e) {
    GemmArgs a = gemm_rows(down_args, first[e], count[e]);
    a.weight = bf16_data(downs[e]);
    return a;
  });
  // Each token's k outputs weighted and summed in float32 in ascending expert order, rounded once.
  const float* y = expert_out.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  BF16* result = static_cast<BF16*>(out.data_ptr());
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(features);
    std::vector<int64_t> order(k);
    for (int64_t t = begin; t < end; ++t) {
      std::iota(order.begin(), order.end(), t * k);
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (const int64_t s : order) {
        const float* row = y + position[s] * features;
        for (int64_t f = 0; f < features; ++f) sum[f] += row[f] * w[s];
      }
      BF16* dst = result + t * out.stride(0);
      for (int64_t f = 0; f < features; ++f) dst[f] = from_float<BF16>(sum[f]);
    }
  });
}

}  // namespace batchgen::cpu
