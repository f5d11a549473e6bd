// bf16 GEMMs of the linear layers on weights packed in panels (kernels.h: GemmArgs; the loop is
// cpu/gemm_impl.h, in the AVX512-BF16 kernel table only): the work cut into tasks for torch's threads.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace batchgen::cpu {
namespace {

// Tasks of whole panels and every row, so that each weight is read from memory once per call; where
// the panels are too few for the threads (12 panels of a 576-wide projection on 16 threads), the rows
// are cut into runs of tiles as well.
void run_gemm(const GemmArgs& args, int64_t panels) {
  const GemmFn gemm = active_kernels().gemm_bf16;
  TORCH_CHECK_VALUE(gemm != nullptr, "the bf16 GEMM needs the avx512_bf16 kernels; active: ", active_kernels().name);
  if (args.rows == 0) return;
  const int64_t tiles = (args.rows + kGemmTileRows - 1) / kGemmTileRows;
  const int64_t threads = at::get_num_threads();
  const int64_t row_runs = std::clamp<int64_t>((2 * threads + panels - 1) / panels, 1, tiles);
  at::parallel_for(0, row_runs * panels, 1, [&](int64_t begin, int64_t end) {
    while (begin < end) {  // one call per row run: the panels of a run follow each other, so each prefetches the next
      const int64_t run = begin / panels, panel = begin % panels;
      const int64_t last = std::min(end, (run + 1) * panels);
      const int64_t first_row = run * tiles / row_runs * kGemmTileRows;
      const int64_t end_row = std::min(args.rows, (run + 1) * tiles / row_runs * kGemmTileRows);
      gemm(gemm_rows(args, first_row, end_row - first_row), panel, panel + (last - begin));
      begin = last;
    }
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
