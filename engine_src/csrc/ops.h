// CPU implementations of the batchgen._C operations (contracts in engine_src/README.md).
// bindings.cpp has checked dtypes, shapes, devices and layouts before calling (caches and index
// tensors contiguous; query, key, value and out with a unit stride in their last dimension);
// these functions check the values that index memory (slots, block tables, lengths, query
// offsets). Block mappings on the host (always so for swap_blocks) are checked by bindings.cpp.
#pragma once
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "cpu/kernels.h"

namespace batchgen::cpu {

// The kernel table's index (DType) of a float32, bfloat16 or float16 tensor.
DType dtype_of(const torch::Tensor& t);
// How a cache stores its elements: fp8 for torch's float8_e4m3fn and float8_e5m2 caches, else as the queries.
KVFormat kv_format_of(const torch::Tensor& cache);

// The per-kv-head float32 scales of fp8 caches (an element reads as byte * scale), each optional (1.0).
struct KVScales {
  c10::optional<torch::Tensor> k;
  c10::optional<torch::Tensor> v;
};

// fp8 caches take round(key / k_scale[head]) and round(value / v_scale[head]) (fp8.h).
void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                       torch::Tensor& value_cache, const torch::Tensor& slot_mapping, const KVScales& scales = {});

// seq_groups (optional, int32 [num_seqs]): sequences side by side with the same id may read the
// blocks their tables share once for all of them (see shared_runs in attention.cpp).
void paged_attention_decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                            const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& seq_lens, double scale,
                            const c10::optional<torch::Tensor>& seq_groups, int64_t sliding_window,
                            double logits_soft_cap, const KVScales& scales = {},
                            const c10::optional<torch::Tensor>& sinks = c10::nullopt);

// The bytes paged_attention_decode reads for these sequences (every key, no window), read with nothing else
// done, on the threads and tasks decode would use: what memory gives decode's access pattern, the yardstick of
// scripts/bench_kv_fp8.py --decode. Decode's order (tiles of kTileKeys keys, each (block, kv head) piece of K
// then of V, kv heads inner), or with whole_blocks each block's kv heads together. Returns the bytes' sum as
// 64-bit words (so that the reads are not optimised away). CPU only.
int64_t read_decode_blocks(const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_lens, bool whole_blocks);

// sliding_window (0 off), logits_soft_cap (0 off) and sinks (optional, float32 [num_heads]: each query head's
// attention sink) as in engine_src/README.md, for both ops.
// key_limit (optional, int32 [num_tokens]): the last key position each query token sees, in place of its own
// (Gemma 3's image tokens see their whole image); each in [its position, its seq_len - 1].
void paged_attention_prefill(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                             const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, double scale,
                             int64_t sliding_window, double logits_soft_cap, const KVScales& scales = {},
                             const c10::optional<torch::Tensor>& key_limit = c10::nullopt,
                             const c10::optional<torch::Tensor>& sinks = c10::nullopt);

void copy_blocks(std::vector<torch::Tensor>& key_caches, std::vector<torch::Tensor>& value_caches,
                 const torch::Tensor& block_mapping);

void swap_blocks(const torch::Tensor& src, torch::Tensor& dst, const torch::Tensor& block_mapping);

// Element-wise layer ops (cpu/layer_ops.cpp); rows are 2-D [n, d] or 3-D [n, h, d] with a unit
// stride in the last dimension.
void rms_norm(torch::Tensor& out, const torch::Tensor& input, const torch::Tensor& weight, double eps);

void fused_add_rms_norm(torch::Tensor& input, torch::Tensor& residual, const torch::Tensor& weight, double eps);

void rotary_embedding(const torch::Tensor& positions, torch::Tensor& x, const torch::Tensor& cos_sin_cache);

// For each row of logits [n, vocab] (float32 or bfloat16): the index of its first maximum and
// log(sum(exp(row))) in float32 (cpu/sampling_ops.cpp).
void argmax_logsumexp(const torch::Tensor& logits, torch::Tensor& argmax, torch::Tensor& log_total);
// top_k, sample_tokens and mask_logits read the rows of logits that `rows` (int64 [m]) names, in its order, or
// every row without it; their outputs and per-row inputs have one row per row read.
void top_k(const torch::Tensor& logits, int64_t k, torch::Tensor& values, torch::Tensor& ids,
           const c10::optional<torch::Tensor>& rows);
void sample_tokens(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_k,
                   const torch::Tensor& top_p, const torch::Tensor& min_p, const torch::Tensor& u,
                   torch::Tensor& tokens, const c10::optional<torch::Tensor>& rows);
// out [n, vocab] float32 = logits [n, vocab] (float32 or bfloat16) as float32, -inf where bit i % 32 of
// allowed[r, i / 32] (int32 [n, words], words * 32 >= vocab) is 0: a grammar's mask applied in one pass.
void mask_logits(const torch::Tensor& logits, const torch::Tensor& allowed, torch::Tensor& out,
                 const c10::optional<torch::Tensor>& rows);

// bf16 GEMMs on weights packed in panels [cols / kGemmPanelCols rounded up, depth / 2, kGemmPanelCols, 2]
// (cpu/gemm_ops.cpp): out[rows, cols] = x w^T (+ bias, float32), or silu(x gate^T) * (x up^T); out is
// bf16 or float32 (unrounded sums). `addend` (float32 [rows, cols], or [rows, 2 * cols] for gate then up) is
// added to the sums first.
// Only where the active kernel table has it (has_gemm_bf16: every one but the scalar table); gemm_widens_bf16: its
// pairs widen to float32 FMAs (no bf16 dot product).
bool has_gemm_bf16();
bool gemm_widens_bf16();
void gemm_bf16(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
               const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& addend = c10::nullopt);
void gemm_silu_mul_bf16(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& gate,
                        const torch::Tensor& up, const c10::optional<torch::Tensor>& addend = c10::nullopt);
// A mixture of experts' SiLU-gated experts on those GEMMs (cpu/gemm_ops.cpp): out[t] (bf16 [tokens, features]) =
// sum over t's k experts e = expert_ids[t, r] (int64 [tokens, k]), in ascending e, of weights[t, r] (float32) *
// down[e](silu(hidden[t] gate[e]^T) * (hidden[t] up[e]^T)), the down projection's sums and the weighted sum in
// float32, rounded to bf16 once; silu(...) * (...) rounded to bf16 as gemm_silu_mul_bf16 rounds it. A token's
// result depends on that token alone.
void moe_silu_experts_bf16(torch::Tensor& out, const torch::Tensor& hidden, const torch::Tensor& expert_ids,
                           const torch::Tensor& weights, const std::vector<torch::Tensor>& gates,
                           const std::vector<torch::Tensor>& ups, const std::vector<torch::Tensor>& downs,
                           int64_t intermediate);

// Segmented LoRA (cpu/lora_ops.cpp): for each segment (int32 [count, 3]: first row, end row, slot; in order,
// apart), y[rows] += scale * (x[rows] A[slot]^T) B[slot], A float32 [slots, rank, in], b_t float32 [slots,
// rank, out] (B transposed), slot s using its first ranks[s] ranks (int32 [slots], optional: all); x float32 or
// bfloat16, y x's dtype or float32. `store` (y float32): writes the term instead, and -0.0 into every other
// row (outside the segments, or of a slot of rank 0): an addend that changes nothing. With bf16 x, A and B may
// come in bf16 as pairs for the bf16 dot product (a [slots, ceil(in / 2), rank, 2], b_t [slots, rank / 2, out,
// 2], rank a multiple of 16; cpu/kernels.h: LoRAArgs): then x A^T is rounded to bf16 before the expand.
void lora_shrink_expand(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& segments,
                        const torch::Tensor& a, const torch::Tensor& b_t,
                        const c10::optional<torch::Tensor>& ranks, double scale, bool store);

// int8 GEMMs (cpu/gemm_int8_ops.cpp, layouts in cpu/gemm_int8.h): activations quantized per row into q
// (uint8, offset by 128) and x_scale; out[rows, cols] (float32, bfloat16 or the exact int32 sums) =
// x_scale[m] * w_scale[n] * (q - 128) w^T (+ bias) on int8 weight panels with their compensation sums.
// linear_int8 quantizes x (float32 or bfloat16) and multiplies in one call. The loop follows the active
// kernel table unless set_int8_kernel names one ("" follows the table again).
std::vector<std::string> supported_int8_kernels();
std::string int8_kernel();
void set_int8_kernel(const std::string& name);
void quantize_int8_rows(const torch::Tensor& x, torch::Tensor& q, torch::Tensor& x_scale);
void gemm_int8(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& x_scale, const torch::Tensor& weight,
               const torch::Tensor& compensation, const torch::Tensor& w_scale,
               const c10::optional<torch::Tensor>& bias);
void linear_int8(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                 const torch::Tensor& compensation, const torch::Tensor& w_scale,
                 const c10::optional<torch::Tensor>& bias);
// The int8 MLP's gate and up in one call: out = silu(x gate^T) * (x up^T) in out's dtype (each factor rounded
// to it first, as transformers' MLP does: kernels.h's silu_mul_row), for a weight whose panels alternate the
// gate's and the up projection's; x quantized once.
void linear_silu_mul_int8(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                          const torch::Tensor& compensation, const torch::Tensor& w_scale);
// A mixture of experts' SiLU-gated experts on int8 compute, each expert's (gate_up panels, compensation, w_scale)
// from pack_int8_gate_up and (down panels, compensation, w_scale) from pack_int8_weight (cpu/gemm_int8_ops.cpp):
// out[t] (hidden's dtype, float32 or bf16) = the sum over t's experts, in ascending expert order, of weights[t, r]
// * linear_int8(linear_silu_mul_int8(hidden[t], gate_up[e]), down[e]) in float32, rounded once; bit for bit one
// linear_silu_mul_int8 and one float32 linear_int8 call an expert.
using Int8Panels = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;
void moe_silu_experts_int8(torch::Tensor& out, const torch::Tensor& hidden, const torch::Tensor& expert_ids,
                           const torch::Tensor& weights, const std::vector<Int8Panels>& gate_ups,
                           const std::vector<Int8Panels>& downs, int64_t intermediate);

}  // namespace batchgen::cpu
