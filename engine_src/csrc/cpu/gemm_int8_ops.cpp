// The int8 GEMM's ops (gemm_int8.h): operand checks, the choice of loop, activations quantized per row
// and the work cut into tasks for torch's threads.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "cpu/gemm_int8.h"
#include "cpu/gemm_parallel.h"
#include "cpu/isa.h"
#include "cpu/moe_slots.h"
#include "ops.h"

namespace batchgen::cpu {
namespace {

// A loop, and the slowest kernel table (isa.cpp's names) whose processors may run it: the loop in use
// follows the active table (BATCHGEN_CPU_ISA=avx2 also runs int8 as an AVX2 processor would).
struct Int8Kernel {
  const char* name;
  Int8GemmFn gemm;
  bool (*supported)();
  const char* table;
};

bool always() { return true; }
#ifdef BATCHGEN_HAVE_AVX2
bool has_avx_vnni() { return __builtin_cpu_supports("avxvnni"); }
#endif
#ifdef BATCHGEN_HAVE_AVX512
bool has_avx512_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}
bool has_amx_int8() { return has_avx512_vnni() && has_amx(25); }
bool emulates_amx_int8() { return has_avx512_vnni() && (!has_amx_int8() || amx_emulation_asked()); }
#endif

// Slowest first.
const std::vector<Int8Kernel>& int8_kernels() {
  static const std::vector<Int8Kernel> list = {
      {"scalar", &int8_scalar::gemm_int8, &always, "scalar"},
#ifdef BATCHGEN_HAVE_AVX2
      {"avx2", &int8_avx2::gemm_int8, &always, "avx2"},
      {"avx_vnni", &int8_avx_vnni::gemm_int8, &has_avx_vnni, "avx2"},
#endif
#ifdef BATCHGEN_HAVE_AVX512
      {"avx512_vnni", &int8_avx512_vnni::gemm_int8, &has_avx512_vnni, "avx512"},
      {"amx_int8", &int8_amx::gemm_int8, &has_amx_int8, "amx_bf16"},
      {"amx_int8_emulated", &int8_amx_emulated::gemm_int8, &emulates_amx_int8, "amx_emulated"},
#endif
  };
  return list;
}

std::atomic<const Int8Kernel*> forced{nullptr};

int table_rank(const std::string& table) {
  // amx_emulated last: its loop runs only under that table (or when forced).
  static const std::vector<std::string> order = {"scalar", "avx2", "avx512", "avx512_bf16", "amx_bf16",
                                                 "amx_emulated"};
  return static_cast<int>(std::find(order.begin(), order.end(), table) - order.begin());
}

const Int8Kernel& kernel_in_use() {
  if (const Int8Kernel* kernel = forced.load(std::memory_order_acquire)) return *kernel;
  const int active = table_rank(active_kernels().name);
  const Int8Kernel* best = &int8_kernels().front();
  for (const Int8Kernel& k : int8_kernels()) {
    if (k.supported() && table_rank(k.table) <= active) best = &k;
  }
  return *best;
}

void run_int8_gemm(const Int8GemmArgs& args) {
  const Int8GemmFn gemm = kernel_in_use().gemm;
  const int64_t panels = (args.cols + kInt8PanelCols - 1) / kInt8PanelCols;
  parallel_panels(args.rows, panels, kInt8BlockRows, [&](int64_t first_row, int64_t rows, int64_t begin, int64_t end) {
    gemm(int8_rows(args, first_row, rows), begin, end);
  });
}

// run_int8_gemm for a gate_up weight (check_int8_weight): each pair of panels multiplies kSiluMulRows rows at a
// time into float32 sums on the stack, which the kernel table's silu_mul_row turns into the pair's columns of
// out while they are in cache.
// The gate_up GEMM's pairs of panels [begin, end) for every row of args, with `gemm`.
void silu_mul_pairs(const Int8GemmArgs& args, Int8GemmFn gemm, int64_t begin, int64_t end) {
  constexpr int64_t kSiluMulRows = 4 * kInt8BlockRows;
  const SiluMulRowFn finish = active_kernels().silu_mul_row[args.out_kind == Int8Out::bf16 ? 1 : 0];
  const int64_t panel_bytes = args.depth * kInt8PanelCols;
  const int64_t element_bytes = args.out_kind == Int8Out::bf16 ? 2 : 4;
  alignas(64) float sums[kSiluMulRows][2 * kInt8PanelCols];
  for (int64_t pair = begin; pair < end; ++pair) {
    Int8GemmArgs part = args;
    part.weight = args.weight + 2 * pair * panel_bytes;
    part.compensation = args.compensation + 2 * pair * kInt8PanelCols;
    part.w_scale = args.w_scale + 2 * pair * kInt8PanelCols;
    part.out = sums;
    part.out_stride = 2 * kInt8PanelCols;
    part.out_kind = Int8Out::f32;
    part.cols = 2 * kInt8PanelCols;
    const int64_t col = pair * kInt8PanelCols, width = std::min<int64_t>(kInt8PanelCols, args.cols - col);
    for (int64_t row = 0; row < args.rows; row += kSiluMulRows) {
      const int64_t count = std::min(kSiluMulRows, args.rows - row);
      part.x = args.x + row * args.x_stride;
      part.x_scale = args.x_scale + row;
      part.rows = count;
      gemm(part, 0, 2);
      for (int64_t r = 0; r < count; ++r) {
        char* out = static_cast<char*>(args.out) + ((row + r) * args.out_stride + col) * element_bytes;
        finish(sums[r], sums[r] + kInt8PanelCols, out, width);
      }
    }
  }
}

void run_int8_silu_mul(const Int8GemmArgs& args) {
  const Int8GemmFn gemm = kernel_in_use().gemm;
  const int64_t pairs = (args.cols + kInt8PanelCols - 1) / kInt8PanelCols;
  parallel_panels(args.rows, pairs, kInt8BlockRows, [&](int64_t first_row, int64_t rows, int64_t begin, int64_t end) {
    silu_mul_pairs(int8_rows(args, first_row, rows), gemm, begin, end);
  });
}

// `gate_up`: the panels alternate a gate's and an up projection's, each of `cols` outputs.
void check_int8_weight(const char* op, const torch::Tensor& weight, const torch::Tensor& compensation,
                       const torch::Tensor& w_scale, int64_t depth, int64_t cols, bool gate_up) {
  const int64_t panels = (cols + kInt8PanelCols - 1) / kInt8PanelCols * (gate_up ? 2 : 1);
  TORCH_CHECK_VALUE(weight.is_cpu() && weight.scalar_type() == torch::kInt8 && weight.is_contiguous() &&
                        weight.dim() == 4 && weight.size(0) == panels && weight.size(1) * kInt8GroupBytes == depth &&
                        weight.size(2) == kInt8PanelCols && weight.size(3) == kInt8GroupBytes,
                    op, ": weight must be contiguous int8 CPU panels [", panels, ", ", depth / kInt8GroupBytes, ", ",
                    kInt8PanelCols, ", ", kInt8GroupBytes, "] for ", cols, gate_up ? " outputs of gate and up" : " outputs",
                    ", got ", weight.scalar_type(), " ",
                    weight.sizes());
  for (const auto& [name, t, dtype] : {std::tuple{"compensation", &compensation, torch::kInt32},
                                       std::tuple{"w_scale", &w_scale, torch::kFloat32}}) {
    TORCH_CHECK_VALUE(t->is_cpu() && t->scalar_type() == dtype && t->is_contiguous() && t->dim() == 1 &&
                          t->size(0) == panels * kInt8PanelCols,
                      op, ": ", name, " must be a contiguous ", dtype, " CPU tensor of ", panels * kInt8PanelCols,
                      " entries, got ", t->scalar_type(), " ", t->sizes());
  }
}

Int8GemmArgs int8_args(const char* op, torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& x_scale,
                       const torch::Tensor& weight, const torch::Tensor& compensation, const torch::Tensor& w_scale,
                       const c10::optional<torch::Tensor>& bias, bool gate_up = false) {
  TORCH_CHECK_VALUE(q.is_cpu() && q.scalar_type() == torch::kUInt8 && q.dim() == 2 && q.stride(1) == 1 &&
                        q.size(1) % kInt8DepthStep == 0,
                    op, ": q must be a uint8 CPU tensor [rows, depth], depth a multiple of ", kInt8DepthStep,
                    ", contiguous in its last dimension, got ", q.scalar_type(), " ", q.sizes());
  const int64_t rows = q.size(0), depth = q.size(1);
  TORCH_CHECK_VALUE(x_scale.is_cpu() && x_scale.scalar_type() == torch::kFloat32 && x_scale.is_contiguous() &&
                        x_scale.dim() == 1 && x_scale.size(0) == rows,
                    op, ": x_scale must be a contiguous float32 CPU tensor of ", rows, " entries");
  const auto kind = out.scalar_type();
  TORCH_CHECK_VALUE(out.is_cpu() && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == rows &&
                        (kind == torch::kFloat32 || kind == torch::kBFloat16 || kind == torch::kInt32),
                    op, ": out must be a float32, bfloat16 or int32 CPU tensor [", rows,
                    ", cols] contiguous in its last dimension, got ", kind, " ", out.sizes());
  const int64_t cols = out.size(1);
  check_int8_weight(op, weight, compensation, w_scale, depth, cols, gate_up);
  Int8GemmArgs args{};
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->is_cpu() && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                          bias->dim() == 1 && bias->size(0) == cols,
                      op, ": bias must be a contiguous float32 CPU tensor of ", cols, " entries");
    args.bias = bias->data_ptr<float>();
  }
  args.x = q.data_ptr<uint8_t>();
  args.x_stride = q.stride(0);
  args.x_scale = x_scale.data_ptr<float>();
  args.weight = weight.data_ptr<int8_t>();
  args.compensation = compensation.data_ptr<int32_t>();
  args.w_scale = w_scale.data_ptr<float>();
  args.out = out.data_ptr();
  args.out_stride = out.stride(0);
  args.out_kind = kind == torch::kFloat32 ? Int8Out::f32 : kind == torch::kBFloat16 ? Int8Out::bf16 : Int8Out::i32;
  args.rows = rows;
  args.cols = cols;
  args.depth = depth;
  args.finish = active_kernels().finish_int8_rows;
  return args;
}

}  // namespace

std::vector<std::string> supported_int8_kernels() {
  std::vector<std::string> names;
  for (const Int8Kernel& k : int8_kernels()) {
    if (k.supported()) names.emplace_back(k.name);
  }
  return names;
}

std::string int8_kernel() { return kernel_in_use().name; }

void set_int8_kernel(const std::string& name) {
  if (name.empty()) {
    forced.store(nullptr, std::memory_order_release);
    return;
  }
  for (const Int8Kernel& k : int8_kernels()) {
    if (name == k.name && k.supported()) {
      forced.store(&k, std::memory_order_release);
      return;
    }
  }
  std::string joined;
  for (const std::string& n : supported_int8_kernels()) joined += (joined.empty() ? "" : ", ") + n;
  TORCH_CHECK_VALUE(false, "int8 GEMM kernel '", name, "' is not supported here; supported: ", joined);
}

void quantize_int8_rows(const torch::Tensor& x, torch::Tensor& q, torch::Tensor& x_scale) {
  const char* op = "quantize_int8_rows";
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE(x.is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                        (dtype == torch::kFloat32 || dtype == torch::kBFloat16),
                    op, ": x must be a float32 or bfloat16 CPU tensor [rows, depth] contiguous in its last dimension");
  const int64_t rows = x.size(0), depth = x.size(1);
  TORCH_CHECK_VALUE(q.is_cpu() && q.scalar_type() == torch::kUInt8 && q.dim() == 2 && q.stride(1) == 1 &&
                        q.size(0) == rows && q.size(1) >= depth && q.size(1) % kInt8DepthStep == 0,
                    op, ": q must be a uint8 CPU tensor [", rows, ", depth rounded up to ", kInt8DepthStep, "]");
  TORCH_CHECK_VALUE(x_scale.is_cpu() && x_scale.scalar_type() == torch::kFloat32 && x_scale.is_contiguous() &&
                        x_scale.dim() == 1 && x_scale.size(0) == rows,
                    op, ": x_scale must be a contiguous float32 CPU tensor of ", rows, " entries");
  const int64_t padded = q.size(1);
  uint8_t* q_data = q.data_ptr<uint8_t>();
  float* scales = x_scale.data_ptr<float>();
  const QuantizeInt8RowFn quantize = active_kernels().quantize_int8_row[static_cast<int>(dtype_of(x))];
  const auto* x_data = static_cast<const char*>(x.data_ptr());
  const int64_t row_bytes = x.stride(0) * x.element_size();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scales[r] = quantize(x_data + r * row_bytes, depth, padded, q_data + r * q.stride(0));
    }
  });
}

void gemm_int8(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& x_scale, const torch::Tensor& weight,
               const torch::Tensor& compensation, const torch::Tensor& w_scale,
               const c10::optional<torch::Tensor>& bias) {
  run_int8_gemm(int8_args("gemm_int8", out, q, x_scale, weight, compensation, w_scale, bias));
}

namespace {

// x quantized per row for weight's panels: (q, x_scale).
std::pair<torch::Tensor, torch::Tensor> quantized_input(const char* op, const torch::Tensor& x,
                                                        const torch::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 4, op, ": weight must be int8 panels, got ", weight.sizes());
  const int64_t padded = weight.size(1) * kInt8GroupBytes;
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) <= padded && x.size(1) > padded - kInt8DepthStep, op, ": x has ",
                    x.size(1), " features, the weight's panels ", padded, " (padded)");
  torch::Tensor q = torch::empty({x.size(0), padded}, x.options().dtype(torch::kUInt8));
  torch::Tensor x_scale = torch::empty({x.size(0)}, x.options().dtype(torch::kFloat32));
  quantize_int8_rows(x, q, x_scale);
  return {q, x_scale};
}

}  // namespace

void linear_int8(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                 const torch::Tensor& compensation, const torch::Tensor& w_scale,
                 const c10::optional<torch::Tensor>& bias) {
  const auto [q, x_scale] = quantized_input("linear_int8", x, weight);
  gemm_int8(out, q, x_scale, weight, compensation, w_scale, bias);
}

void linear_silu_mul_int8(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                          const torch::Tensor& compensation, const torch::Tensor& w_scale) {
  const char* op = "linear_silu_mul_int8";
  const auto [q, x_scale] = quantized_input(op, x, weight);
  const Int8GemmArgs args = int8_args(op, out, q, x_scale, weight, compensation, w_scale, c10::nullopt, true);
  TORCH_CHECK_VALUE(args.out_kind != Int8Out::i32, op, ": out must be float32 or bfloat16, got int32");
  run_int8_silu_mul(args);
}

void moe_silu_experts_int8(torch::Tensor& out, const torch::Tensor& hidden, const torch::Tensor& expert_ids,
                           const torch::Tensor& weights, const std::vector<Int8Panels>& gate_ups,
                           const std::vector<Int8Panels>& downs, int64_t intermediate) {
  const char* op = "moe_silu_experts_int8";
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK_VALUE(hidden.is_cpu() && hidden.dim() == 2 && hidden.stride(1) == 1 &&
                        (dtype == torch::kFloat32 || dtype == torch::kBFloat16),
                    op, ": hidden must be a float32 or bfloat16 CPU tensor [tokens, features] contiguous in its last "
                    "dimension, got ", dtype, " ", hidden.sizes());
  TORCH_CHECK_VALUE(out.is_cpu() && out.scalar_type() == dtype && out.sizes() == hidden.sizes() && out.stride(1) == 1,
                    op, ": out must be a CPU tensor of hidden's dtype and shape ", hidden.sizes(), ", got ",
                    out.scalar_type(), " ", out.sizes());
  check_routing(op, hidden, expert_ids, weights);
  TORCH_CHECK_VALUE(!gate_ups.empty() && downs.size() == gate_ups.size(), op,
                    ": needs the same number (> 0) of gate_up and down weights, got ", gate_ups.size(), " and ",
                    downs.size());
  TORCH_CHECK_VALUE(intermediate > 0, op, ": intermediate must be positive, got ", intermediate);
  const auto padded = [](int64_t depth) { return (depth + kInt8DepthStep - 1) / kInt8DepthStep * kInt8DepthStep; };
  const int64_t features = hidden.size(1), k = expert_ids.size(1), slots = expert_ids.numel();
  const int64_t features_padded = padded(features), intermediate_padded = padded(intermediate);
  for (size_t e = 0; e < gate_ups.size(); ++e) {
    const auto& [gate_up, gate_up_compensation, gate_up_scale] = gate_ups[e];
    const auto& [down, down_compensation, down_scale] = downs[e];
    check_int8_weight(op, gate_up, gate_up_compensation, gate_up_scale, features_padded, intermediate, true);
    check_int8_weight(op, down, down_compensation, down_scale, intermediate_padded, features, false);
  }
  const ExpertSlots grouped(expert_ids, static_cast<int64_t>(gate_ups.size()), op);
  // Each token quantized once (per row, as linear_int8 quantizes it), its bytes gathered into the slots' grouped
  // order, through the gate_up GEMM, quantized again, through the down GEMM into float32: what Int8SiluAndMul and
  // Int8Linear compute an expert at a time, bit for bit.
  thread_local std::vector<uint8_t> token_q_buffer, row_q_buffer, gated_q_buffer;
  thread_local std::vector<float> token_scale_buffer, row_scale_buffer, gated_buffer, gated_scale_buffer, out_buffer;
  torch::Tensor token_q = kept_buffer(token_q_buffer, hidden.size(0), features_padded, torch::kUInt8);
  torch::Tensor token_scale = kept_buffer(token_scale_buffer, hidden.size(0), 1, torch::kFloat32).view(-1);
  quantize_int8_rows(hidden, token_q, token_scale);
  torch::Tensor row_q = kept_buffer(row_q_buffer, slots, features_padded, torch::kUInt8);
  torch::Tensor row_scale = kept_buffer(row_scale_buffer, slots, 1, torch::kFloat32).view(-1);
  const uint8_t* token_bytes = token_q.data_ptr<uint8_t>();
  const float* token_scales = token_scale.data_ptr<float>();
  uint8_t* row_bytes = row_q.data_ptr<uint8_t>();
  float* row_scales = row_scale.data_ptr<float>();
  at::parallel_for(0, slots, std::max<int64_t>(1, 8192 / features_padded), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t token = grouped.slot_at[p] / k;
      std::copy_n(token_bytes + token * features_padded, features_padded, row_bytes + p * features_padded);
      row_scales[p] = token_scales[token];
    }
  });
  const Int8GemmFn gemm = kernel_in_use().gemm;
  const auto set_weight = [](Int8GemmArgs& a, const Int8Panels& panels) {
    a.weight = std::get<0>(panels).data_ptr<int8_t>();
    a.compensation = std::get<1>(panels).data_ptr<int32_t>();
    a.w_scale = std::get<2>(panels).data_ptr<float>();
  };
  torch::Tensor gated = kept_buffer(gated_buffer, slots, intermediate, dtype);
  const auto& [gate_up0, gate_up_compensation0, gate_up_scale0] = gate_ups[0];
  const Int8GemmArgs up_args = int8_args(op, gated, row_q, row_scale, gate_up0, gate_up_compensation0, gate_up_scale0,
                                         c10::nullopt, true);
  const int64_t pairs = (intermediate + kInt8PanelCols - 1) / kInt8PanelCols;
  parallel_expert_panels(grouped, pairs, kInt8BlockRows, [&](int64_t e, int64_t begin, int64_t end) {
    Int8GemmArgs a = int8_rows(up_args, grouped.first[e], grouped.count[e]);
    set_weight(a, gate_ups[e]);
    silu_mul_pairs(a, gemm, begin, end);
  });
  torch::Tensor gated_q = kept_buffer(gated_q_buffer, slots, intermediate_padded, torch::kUInt8);
  torch::Tensor gated_scale = kept_buffer(gated_scale_buffer, slots, 1, torch::kFloat32).view(-1);
  quantize_int8_rows(gated, gated_q, gated_scale);
  torch::Tensor expert_out = kept_buffer(out_buffer, slots, features, torch::kFloat32);
  const auto& [down0, down_compensation0, down_scale0] = downs[0];
  const Int8GemmArgs down_args = int8_args(op, expert_out, gated_q, gated_scale, down0, down_compensation0,
                                           down_scale0, c10::nullopt);
  const int64_t panels = (features + kInt8PanelCols - 1) / kInt8PanelCols;
  parallel_expert_panels(grouped, panels, kInt8BlockRows, [&](int64_t e, int64_t begin, int64_t end) {
    Int8GemmArgs a = int8_rows(down_args, grouped.first[e], grouped.count[e]);
    set_weight(a, downs[e]);
    gemm(a, begin, end);
  });
  const float* y = expert_out.data_ptr<float>();
  if (dtype == torch::kBFloat16) {
    sum_expert_outputs(static_cast<BF16*>(out.data_ptr()), out.stride(0), y, features, grouped, expert_ids, weights);
  } else {
    sum_expert_outputs(out.data_ptr<float>(), out.stride(0), y, features, grouped, expert_ids, weights);
  }
}

}  // namespace batchgen::cpu
