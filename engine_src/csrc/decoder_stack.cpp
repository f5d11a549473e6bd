#include "decoder_stack.h"

#include <chrono>
#include <utility>

#include "checked_ops.h"
#include "ops.h"

namespace batchgen {

using torch::Tensor;

DecoderStack::DecoderStack(std::vector<DecoderLayerWeights> layers, DecoderShape shape)
    : layers_(std::move(layers)), shape_(shape) {
  const DecoderShape& s = shape_;
  TORCH_CHECK_VALUE(!layers_.empty(), "DecoderStack: no layers");
  const bool int8 = layers_[0].qkv.int8();
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayerWeights& w = layers_[i];
    TORCH_CHECK_VALUE(w.q_norm.has_value() == w.k_norm.has_value(), "DecoderStack: layer ", i,
                      " has a q norm or a k norm without the other");
    TORCH_CHECK_VALUE(w.qkv.int8() == int8 && w.o.int8() == int8 && w.gate.int8() == int8 && w.down.int8() == int8,
                      "DecoderStack: layer ", i, " mixes int8 and bf16 projections");
  }
  TORCH_CHECK_VALUE(s.num_heads > 0 && s.num_kv_heads > 0 && s.num_heads % s.num_kv_heads == 0 && s.head_dim > 0 &&
                        s.hidden > 0 && s.intermediate > 0,
                    "DecoderStack: bad shape: ", s.num_heads, " heads, ", s.num_kv_heads, " kv heads, head_dim ",
                    s.head_dim, ", hidden ", s.hidden, ", intermediate ", s.intermediate);
}

namespace {

// Runs fn, adding its seconds to total.
template <typename Fn>
void timed(double& total, Fn&& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  total += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A projection's LoRA terms for the step as the GEMM's addend (see lora_shrink_expand's store), or none.
c10::optional<Tensor> lora_addend(const LoRAProjection& p, const Tensor& input, const Tensor& segments,
                                  int64_t cols) {
  if (p.empty()) return c10::nullopt;
  Tensor addend = torch::empty({input.size(0), cols}, input.options().dtype(torch::kFloat32));
  for (const LoRAPiece& piece : p) {
    Tensor columns = addend.narrow(1, piece.first, piece.b_t.size(2));
    checked::lora_shrink_expand(columns, input, segments, piece.a, piece.b_t, piece.ranks, 1.0, true);
  }
  return addend;
}

// A piece's a: float32 [slots, rank, in], or the bf16 form [slots, ceil(in / 2), rank, 2] (ops.h); b_t's
// size(2) is the piece's columns in both forms.
void check_lora(const LoRAProjection& p, size_t layer, const char* name, int64_t in, int64_t out) {
  int64_t next = 0;
  for (const LoRAPiece& piece : p) {
    const bool pairs = piece.a.dim() == 4;
    TORCH_CHECK_VALUE(piece.first == next && piece.b_t.dim() == piece.a.dim() && piece.ranks.dim() == 1 &&
                          (pairs ? piece.a.size(1) == (in + 1) / 2 : piece.a.dim() == 3 && piece.a.size(2) == in) &&
                          piece.ranks.size(0) == piece.a.size(0),
                      "DecoderStack.set_lora: layer ", layer, " ", name, " piece at column ", piece.first,
                      " needs to start at column ", next, " with a [slots, rank, ", in,
                      "] (or bf16 pairs [slots, ", (in + 1) / 2, ", rank, 2]), b_t to match and ranks [slots], got ",
                      piece.a.sizes(), ", ", piece.b_t.sizes(), ", ", piece.ranks.sizes());
    next += piece.b_t.size(2);
  }
  TORCH_CHECK_VALUE(p.empty() || next == out, "DecoderStack.set_lora: layer ", layer, " ", name,
                    "'s pieces cover ", next, " of its ", out, " columns");
}

// out = in W^T (+ bias) (+ addend, bf16 only: set_lora refuses int8 stacks).
void project(Tensor& out, const Tensor& in, const PackedWeight& w, const c10::optional<Tensor>& bias,
             const c10::optional<Tensor>& addend) {
  if (w.int8()) {
    cpu::linear_int8(out, in, w.panels, *w.compensation, *w.w_scale, bias);
  } else {
    checked::gemm_bf16(out, in, w.panels, bias, addend);
  }
}

const Tensor& required(const c10::optional<Tensor>& t, const char* name, const char* when) {
  TORCH_CHECK_VALUE(t.has_value(), "DecoderStack.forward: ", name, " is needed ", when);
  return *t;
}

}  // namespace

void DecoderStack::set_lora(std::vector<DecoderLayerLoRA> lora) {
  const DecoderShape& s = shape_;
  TORCH_CHECK_VALUE(!layers_[0].qkv.int8(), "DecoderStack.set_lora: LoRA needs bf16 projections, not int8");
  TORCH_CHECK_VALUE(lora.size() == layers_.size(), "DecoderStack.set_lora: ", layers_.size(), " layers but ",
                    lora.size(), " entries");
  const int64_t q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
  for (size_t i = 0; i < lora.size(); ++i) {
    check_lora(lora[i].qkv, i, "qkv", s.hidden, q_size + 2 * kv_size);
    check_lora(lora[i].o, i, "o", q_size, s.hidden);
    check_lora(lora[i].gate_up, i, "gate_up", s.hidden, 2 * s.intermediate);
    check_lora(lora[i].down, i, "down", s.intermediate, s.hidden);
  }
  lora_ = std::move(lora);
}

std::tuple<Tensor, Tensor> DecoderStack::forward(
    Tensor x, const Tensor& positions, const Tensor& cos_sin, std::vector<Tensor> key_caches,
    std::vector<Tensor> value_caches, const Tensor& slot_mapping, int64_t num_decode_tokens,
    const c10::optional<Tensor>& decode_block_tables, const c10::optional<Tensor>& decode_seq_lens,
    const c10::optional<Tensor>& decode_seq_groups, const c10::optional<Tensor>& prefill_block_tables,
    const c10::optional<Tensor>& prefill_seq_lens, const c10::optional<Tensor>& prefill_query_start_loc,
    const c10::optional<Tensor>& lora_segments, const std::vector<Tensor>& key_scales,
    const std::vector<Tensor>& value_scales) const {
  const DecoderShape& s = shape_;
  const size_t count = layers_.size();
  TORCH_CHECK_VALUE(key_caches.size() == count && value_caches.size() == count, "DecoderStack.forward: ", count,
                    " layers but ", key_caches.size(), " key and ", value_caches.size(), " value caches");
  const bool scaled = !key_scales.empty() || !value_scales.empty();
  TORCH_CHECK_VALUE(!scaled || (key_scales.size() == count && value_scales.size() == count), "DecoderStack.forward: ",
                    count, " layers but ", key_scales.size(), " key and ", value_scales.size(), " value scales");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == s.hidden, "DecoderStack.forward: x must be [tokens, ", s.hidden,
                    "], got ", x.sizes());
  const int64_t tokens = x.size(0), decodes = num_decode_tokens;
  TORCH_CHECK_VALUE(decodes >= 0 && decodes <= tokens, "DecoderStack.forward: num_decode_tokens ", decodes,
                    " is not in [0, ", tokens, "]");
  const int64_t heads = s.num_heads, kv_heads = s.num_kv_heads, head_dim = s.head_dim;
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const auto options = x.options();
  const bool with_lora = lora_segments.has_value() && lora_segments->size(0) > 0;
  TORCH_CHECK_VALUE(!with_lora || !lora_.empty(), "DecoderStack.forward: lora_segments given but no adapters set");
  Tensor residual;
  double* const seconds = seconds_.data();
  // A layer's LoRA terms of one projection, timed apart from the GEMMs.
  auto addend = [&](const LoRAProjection& p, const Tensor& input, int64_t cols) {
    c10::optional<Tensor> terms;
    timed(seconds[kLoRA], [&] { terms = lora_addend(p, input, *lora_segments, cols); });
    return terms;
  };
  for (size_t i = 0; i < count; ++i) {
    const DecoderLayerWeights& w = layers_[i];
    if (!residual.defined()) {  // the first layer: the embeddings are the residual stream
      residual = x;
      x = torch::empty_like(residual);
      timed(seconds[kNorms], [&] { checked::rms_norm(x, residual, w.input_norm, s.eps); });
    } else {
      timed(seconds[kNorms], [&] { checked::fused_add_rms_norm(x, residual, w.input_norm, s.eps); });
    }
    const DecoderLayerLoRA* lora = with_lora ? &lora_[i] : nullptr;
    Tensor qkv = torch::empty({tokens, q_size + 2 * kv_size}, options);
    const auto qkv_terms = lora ? addend(lora->qkv, x, q_size + 2 * kv_size) : c10::nullopt;
    timed(seconds[kQkv], [&] { project(qkv, x, w.qkv, w.qkv_bias, qkv_terms); });
    Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, heads + kv_heads, head_dim});
    const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim});
    Tensor q = qk.narrow(1, 0, heads), k = qk.narrow(1, heads, kv_heads);
    if (w.q_norm.has_value()) {
      timed(seconds[kNorms], [&] {
        checked::rms_norm(q, q, *w.q_norm, s.eps);
        checked::rms_norm(k, k, *w.k_norm, s.eps);
      });
    }
    timed(seconds[kRotary], [&] { checked::rotary_embedding(positions, qk, cos_sin); });
    // An fp8 cache's scales (ops.reshape_and_cache): none for a cache of the activations' dtype.
    const c10::optional<Tensor> k_scale = scaled ? c10::optional<Tensor>(key_scales[i]) : c10::nullopt;
    const c10::optional<Tensor> v_scale = scaled ? c10::optional<Tensor>(value_scales[i]) : c10::nullopt;
    timed(seconds[kCacheWrite], [&] {
      checked::reshape_and_cache(k, v, key_caches[i], value_caches[i], slot_mapping, k_scale, v_scale);
    });
    Tensor attn = torch::empty({tokens, heads, head_dim}, options);
    if (decodes > 0) {
      Tensor out = attn.narrow(0, 0, decodes);
      const char* when = "for decode tokens";
      const Tensor& tables = required(decode_block_tables, "decode_block_tables", when);
      const Tensor& lens = required(decode_seq_lens, "decode_seq_lens", when);
      timed(seconds[kDecodeAttention], [&] {
        checked::paged_attention_decode(out, q.narrow(0, 0, decodes), key_caches[i], value_caches[i], tables, lens,
                                        s.scale, decode_seq_groups, s.sliding_window, 0.0, k_scale, v_scale);
      });
    }
    if (decodes < tokens) {
      Tensor out = attn.narrow(0, decodes, tokens - decodes);
      const char* when = "for prefill tokens";
      const Tensor& tables = required(prefill_block_tables, "prefill_block_tables", when);
      const Tensor& lens = required(prefill_seq_lens, "prefill_seq_lens", when);
      const Tensor& starts = required(prefill_query_start_loc, "prefill_query_start_loc", when);
      timed(seconds[kPrefillAttention], [&] {
        checked::paged_attention_prefill(out, q.narrow(0, decodes, tokens - decodes), key_caches[i],
                                         value_caches[i], tables, lens, starts, s.scale, s.sliding_window, 0.0,
                                         k_scale, v_scale);
      });
    }
    Tensor o = torch::empty({tokens, s.hidden}, options);
    const Tensor attn_rows = attn.view({tokens, q_size});
    const auto o_terms = lora ? addend(lora->o, attn_rows, s.hidden) : c10::nullopt;
    timed(seconds[kO], [&] { project(o, attn_rows, w.o, c10::nullopt, o_terms); });
    timed(seconds[kNorms], [&] { checked::fused_add_rms_norm(o, residual, w.post_norm, s.eps); });
    Tensor h = torch::empty({tokens, s.intermediate}, options);
    const auto gate_up_terms = lora ? addend(lora->gate_up, o, 2 * s.intermediate) : c10::nullopt;
    timed(seconds[kGateUp], [&] {
      if (w.gate.int8()) {
        cpu::linear_silu_mul_int8(h, o, w.gate.panels, *w.gate.compensation, *w.gate.w_scale);
      } else {
        checked::gemm_silu_mul_bf16(h, o, w.gate.panels, w.up.panels, gate_up_terms);
      }
    });
    x = torch::empty({tokens, s.hidden}, options);
    const auto down_terms = lora ? addend(lora->down, h, s.hidden) : c10::nullopt;
    timed(seconds[kDown], [&] { project(x, h, w.down, c10::nullopt, down_terms); });
  }
  return {x, residual};
}

std::map<std::string, double> DecoderStack::op_seconds() const {
  return {{"norms", seconds_[kNorms]},
          {"qkv", seconds_[kQkv]},
          {"rotary", seconds_[kRotary]},
          {"cache_write", seconds_[kCacheWrite]},
          {"decode_attention", seconds_[kDecodeAttention]},
          {"prefill_attention", seconds_[kPrefillAttention]},
          {"o", seconds_[kO]},
          {"gate_up", seconds_[kGateUp]},
          {"down", seconds_[kDown]},
          {"lora", seconds_[kLoRA]}};
}

}  // namespace batchgen
