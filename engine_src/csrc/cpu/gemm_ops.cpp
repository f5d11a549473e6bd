// bf16 GEMMs of the linear layers on weights packed in panels (kernels.h: GemmArgs; the loop is
// cpu/gemm_impl.h, or gemm_amx.h on tiles, in the AVX-512 kernel tables; gemm_avx2.h on AVX2): the work cut into tasks for torch's threads.
#include <torch/extension.h>

#include "cpu/gemm_parallel.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace batchgen::cpu {
namespace {

void run_gemm(const GemmArgs& args, int64_t panels) {
  const GemmFn gemm = active_kernels().gemm_bf16;
  TORCH_CHECK_VALUE(gemm != nullptr, "the bf16 GEMM needs AVX2 or AVX-512 kernels; active: ", active_kernels().name);
  parallel_panels(args.rows, panels, kGemmTileRows, [&](int64_t first_row, int64_t rows, int64_t begin, int64_t end) {
    gemm(gemm_rows(args, first_row, rows), begin, end);
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
