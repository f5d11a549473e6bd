// The decoder layers of a Llama-style model on CPU, run in one call from Python: the same checked
// ops in the same order as batchgen/models/llama.py's layers (so the same results, bit for bit),
// without the Python around them, which cost ~60 us a layer (~2 ms a SmolLM2 decode step).
#pragma once
#include <torch/extension.h>

#include <array>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace batchgen {

// A projection's packed weight: bf16 GEMM panels (ops.h), or int8 panels with their compensation sums and
// scales (ops.h's linear_int8: the input quantized per row on the fly).
struct PackedWeight {
  torch::Tensor panels;
  c10::optional<torch::Tensor> compensation, w_scale;
  bool int8() const { return compensation.has_value(); }
};

// One layer's weights: the norms' weights ([hidden], the activation dtype) and the projections, all bf16 or all
// int8 (quantization="int8"); in int8, gate's panels alternate with up's (linear_silu_mul_int8) and up is unused.
// qkv_bias float32 [q + 2 * kv] or none; q_norm and k_norm ([head_dim], Qwen3's norms of each head's q and k
// before the rotary embedding) both or neither.
struct DecoderLayerWeights {
  torch::Tensor input_norm;
  PackedWeight qkv, o;
  torch::Tensor post_norm;
  PackedWeight gate, up, down;
  c10::optional<torch::Tensor> qkv_bias, q_norm, k_norm;
};

// The LoRA adapters of one piece of a projection's output columns, [first, first + b_t.size(2)), one a slot:
// lora_shrink_expand's a [slots, rank, in], b_t [slots, rank, columns] and ranks [slots]. Python loads adapters
// into these tensors in place. A projection's pieces cover its columns in order (q, k and v apart, so that no
// expand runs over another piece's zero block); none: no adapter there.
struct LoRAPiece {
  int64_t first;
  torch::Tensor a, b_t, ranks;
};
using LoRAProjection = std::vector<LoRAPiece>;
struct DecoderLayerLoRA {
  LoRAProjection qkv, o, gate_up, down;  // gate_up: the gate's columns, then the up projection's
};

struct DecoderShape {
  int64_t num_heads, num_kv_heads, head_dim, hidden, intermediate;
  double eps, scale;
  int64_t sliding_window = 0;  // every layer's attention window (Mistral), 0 for none
};

class DecoderStack {
 public:
  DecoderStack(std::vector<DecoderLayerWeights> layers, DecoderShape shape);

  // x: the step's embeddings [tokens, hidden]; the rest as the Python layers take it (positions
  // and the rotary table, each layer's caches, and AttentionMetadata's fields, decodes first).
  // Returns the last layer's output and the residual stream, whose sum the final norm takes.
  // lora_segments (int32 [count, 3]: first row, end row, adapter slot; needs set_lora): each segment's rows
  // get their slot's low-rank terms, added to the projections' float32 sums before they are rounded (and
  // before the SiLU); rows outside every segment get exactly the results they would get without.
  // key_scales, value_scales (one float32 [num_kv_heads] a layer, or none): an fp8 cache's (ops.reshape_and_cache).
  std::tuple<torch::Tensor, torch::Tensor> forward(
      torch::Tensor x, const torch::Tensor& positions, const torch::Tensor& cos_sin,
      std::vector<torch::Tensor> key_caches, std::vector<torch::Tensor> value_caches,
      const torch::Tensor& slot_mapping, int64_t num_decode_tokens,
      const c10::optional<torch::Tensor>& decode_block_tables, const c10::optional<torch::Tensor>& decode_seq_lens,
      const c10::optional<torch::Tensor>& decode_seq_groups, const c10::optional<torch::Tensor>& prefill_block_tables,
      const c10::optional<torch::Tensor>& prefill_seq_lens,
      const c10::optional<torch::Tensor>& prefill_query_start_loc,
      const c10::optional<torch::Tensor>& lora_segments = c10::nullopt,
      const std::vector<torch::Tensor>& key_scales = {}, const std::vector<torch::Tensor>& value_scales = {}) const;

  // The adapters' weights, one entry a layer (checked against the shape); bf16 projections only.
  void set_lora(std::vector<DecoderLayerLoRA> lora);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Seconds spent in each kind of op since construction (norms, qkv, rotary, cache_write,
  // decode_attention, prefill_attention, o, gate_up, down, lora: the adapters' terms): the breakdown that timing the Python
  // layers' calls gave (scripts/bench.py). Two clock reads an op, ~13 us a SmolLM2 step.
  std::map<std::string, double> op_seconds() const;

 private:
  enum Stage {
    kNorms, kQkv, kRotary, kCacheWrite, kDecodeAttention, kPrefillAttention, kO, kGateUp, kDown, kLoRA, kStages
  };

  std::vector<DecoderLayerWeights> layers_;
  std::vector<DecoderLayerLoRA> lora_;
  DecoderShape shape_;
  mutable std::array<double, kStages> seconds_{};
};

}  // namespace batchgen
