// bf16 GEMMs of the linear layers on weights packed in panels (kernels.h: GemmArgs; the loop is cpu/gemm_impl.h,
// or gemm_amx.h on tiles, in the AVX-512 kernel tables, gemm_avx2.h on AVX2): the work cut into tasks for torch's
// threads.
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/gemm_parallel.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "cpu/moe_slots.h"
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

// The active kernel table, which must have the bf16 GEMM.
const KernelTable& gemm_kernels() {
  const KernelTable& kernels = active_kernels();
  TORCH_CHECK_VALUE(kernels.gemm_bf16 != nullptr, "the bf16 GEMM needs AVX2 or AVX-512 kernels; active: ",
                    kernels.name);
  return kernels;
}

void run_gemm(GemmArgs args, int64_t panels) {
  const KernelTable& kernels = gemm_kernels();
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

void moe_silu_experts_bf16(torch::Tensor& out, const torch::Tensor& hidden, const torch::Tensor& expert_ids,
                           const torch::Tensor& weights, const std::vector<torch::Tensor>& gates,
                           const std::vector<torch::Tensor>& ups, const std::vector<torch::Tensor>& downs,
                           int64_t intermediate) {
  const KernelTable& kernels = gemm_kernels();
  const int64_t features = hidden.size(1), k = expert_ids.size(1), slots = expert_ids.numel();
  const ExpertSlots grouped(expert_ids, static_cast<int64_t>(gates.size()), "moe_silu_experts_bf16");
  // Each slot's token row, in the grouped order; through the gate and up projections; through the down projection.
  thread_local std::vector<BF16> row_buffer, gated_buffer;
  thread_local std::vector<float> out_buffer;
  torch::Tensor rows = kept_buffer(row_buffer, slots, features, torch::kBFloat16);
  torch::Tensor gated = kept_buffer(gated_buffer, slots, intermediate, torch::kBFloat16);
  torch::Tensor expert_out = kept_buffer(out_buffer, slots, features, torch::kFloat32);
  const BF16* x = bf16_data(hidden);
  BF16* row_data = static_cast<BF16*>(rows.data_ptr());
  at::parallel_for(0, slots, std::max<int64_t>(1, 4096 / features), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      std::copy_n(x + grouped.slot_at[p] / k * hidden.stride(0), features, row_data + p * features);
    }
  });
  GemmArgs up_args = args_of(gated, rows, gates[0], c10::nullopt);
  if (kernels.gemm_widens_bf16) up_args.x_wide = widened_x(up_args);
  parallel_expert_panels(grouped, gates[0].size(0), kGemmTileRows, [&](int64_t e, int64_t begin, int64_t end) {
    GemmArgs a = gemm_rows(up_args, grouped.first[e], grouped.count[e]);
    a.weight = bf16_data(gates[e]);
    a.up = bf16_data(ups[e]);
    kernels.gemm_bf16(a, begin, end);
  });
  GemmArgs down_args = args_of(expert_out, gated, downs[0], c10::nullopt);
  if (kernels.gemm_widens_bf16) down_args.x_wide = widened_x(down_args);
  parallel_expert_panels(grouped, downs[0].size(0), kGemmTileRows, [&](int64_t e, int64_t begin, int64_t end) {
    GemmArgs a = gemm_rows(down_args, grouped.first[e], grouped.count[e]);
    a.weight = bf16_data(downs[e]);
    kernels.gemm_bf16(a, begin, end);
  });
  sum_expert_outputs(static_cast<BF16*>(out.data_ptr()), out.stride(0), expert_out.data_ptr<float>(), features,
                     grouped, expert_ids, weights);
}

}  // namespace batchgen::cpu
