// The sampler on CPU. argmax_logsumexp summarises every row of logits, read once in the model's
// own dtype (bf16 or float32): the greedy choice and the log of the softmax's normaliser. torch
// needs a float32 copy of the whole batch, then argmax and logsumexp over it. Rows are cut into
// fixed blocks spread over the threads, so one row of a 262k vocabulary is read by every core. sample_tokens draws the random
// rows (batchgen/ops/reference.py has the same in torch). The row kernels are the active
// instruction set's (layer_impl.h).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace batchgen::cpu {
namespace {

// The row of logits that a call's row r reads: rows[r], or r itself without `rows` (top_k, sample_tokens,
// mask_logits).
class SelectedRows {
 public:
  SelectedRows(const torch::Tensor& logits, const c10::optional<torch::Tensor>& rows)
      : ids_(rows.has_value() ? rows->data_ptr<int64_t>() : nullptr),
        count_(rows.has_value() ? rows->size(0) : logits.size(0)) {}
  int64_t count() const { return count_; }
  int64_t operator[](int64_t r) const { return ids_ != nullptr ? ids_[r] : r; }

 private:
  const int64_t* ids_;
  int64_t count_;
};

// draw_in_id_order scans a row in chunks of this many weights, each summed as a whole (vectorised)
// before any of its weights is looked at one by one.
constexpr int64_t kChunk = 64;

struct RowFilter {
  int64_t top_k;  // 0: off
  float top_p;    // 1: off
  float min_p;    // relative to the most likely token; 0: off
};

// With no filter: the first token, in id order, whose cumulative weight exceeds u times the total.
int64_t draw_in_id_order(const float* w, int64_t n, float total, float u) {
  const float target = u * total;
  float cdf = 0.0f;
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t end = std::min(c + kChunk, n);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = c; i < end; ++i) sum += w[i];
    if (cdf + sum <= target) {
      cdf += sum;
      continue;
    }
    for (int64_t i = c; i < end; ++i) {
      cdf += w[i];
      if (cdf > target) return i;
    }
  }
  return n - 1;
}

// Every token the filter can keep, and maybe some more, into cand (room for n ids); returns their
// count: the tokens at or above a weight threshold, lowered 16-fold until their mass reaches top_p,
// or there are top_k of them, or the threshold is min_p (tokens are kept most likely first, so the
// kept ones are among them).
int64_t collect_candidates(CollectRowFn collect_row, const float* w, int64_t n, float total, const RowFilter& f,
                           int32_t* cand) {
  const float needed_mass = f.top_p * total * 1.0001f;  // a margin for the order of the sums
  for (float threshold = std::max(f.min_p, 1.0f / 16);; threshold /= 16) {
    if (threshold < 1e-30f) threshold = 0.0f;
    float mass = 0.0f;
    const int64_t count = collect_row(w, n, threshold, cand, &mass);
    if ((f.top_p < 1.0f && mass >= needed_mass) || (f.top_k > 0 && count >= f.top_k) ||
        (f.min_p > 0.0f && threshold <= f.min_p) || threshold == 0.0f) {
      if (count > 0) return count;
      // None: min_p = 1 where rounding left the top weight a hair under 1.
      cand[0] = static_cast<int32_t>(std::max_element(w, w + n) - w);
      return 1;
    }
  }
}

// A thread's room for one row's candidates (n of each).
struct RowScratch {
  std::unique_ptr<int32_t[]> ids;
  std::unique_ptr<uint64_t[]> keys;

  explicit RowScratch(int64_t n) : ids(new int32_t[n]), keys(new uint64_t[n]) {}  // not zeroed
};

// Puts the candidates cand[0, count) in order of decreasing weight, ties lower id first, keeping
// the first `keep` of that order. Each is sorted as one integer: a positive float's bits order as
// the float does, so (bits << 32) | ~id orders by weight and then by id, and the comparisons read
// no weights (rows of thousands of candidates, 16 a call: 1.97 -> 1.43 ms against sorting ids).
int64_t order_candidates(const float* w, int32_t* cand, int64_t count, int64_t keep, uint64_t* keys) {
  for (int64_t j = 0; j < count; ++j) {
    uint32_t bits;
    std::memcpy(&bits, w + cand[j], sizeof(bits));
    keys[j] = static_cast<uint64_t>(bits) << 32 | ~static_cast<uint32_t>(cand[j]);
  }
  if (keep < count) {
    std::nth_element(keys, keys + keep, keys + count, std::greater<>());
    count = keep;
  }
  std::sort(keys, keys + count, std::greater<>());
  for (int64_t j = 0; j < count; ++j) cand[j] = static_cast<int32_t>(~static_cast<uint32_t>(keys[j]));
  return count;
}

// The token drawn at u from a row's distribution: weights w (from weights_row, total their sum),
// restricted by the filter to a prefix of the tokens in order of decreasing weight (ties: lower id
// first), or, with no filter, all tokens in id order; the first token whose cumulative weight
// exceeds u times the kept total.
int64_t draw_row(CollectRowFn collect_row, const float* w, int64_t n, float total, const RowFilter& f, float u,
                 RowScratch& scratch) {
  if (!(total > 0.0f)) return 0;  // every logit -inf (or NaN)
  if (f.top_k <= 0 && f.top_p >= 1.0f && f.min_p <= 0.0f) return draw_in_id_order(w, n, total, u);
  int32_t* cand = scratch.ids.get();
  int64_t count = collect_candidates(collect_row, w, n, total, f, cand);
  count = order_candidates(w, cand, count, f.top_k > 0 ? f.top_k : count, scratch.keys.get());
  // The kept prefix: the nucleus (probability mass before a token below top_p) and min_p; the
  // most likely token always stays.
  int64_t kept = 1;
  float mass = w[cand[0]] / total, kept_total = w[cand[0]];
  for (; kept < count; ++kept) {
    const float weight = w[cand[kept]];
    if (mass >= f.top_p || weight < f.min_p) break;
    mass += weight / total;
    kept_total += weight;
  }
  const float target = u * kept_total;
  float cdf = 0.0f;
  for (int64_t j = 0; j < kept; ++j) {
    cdf += w[cand[j]];
    if (cdf > target) return cand[j];
  }
  return cand[kept - 1];
}

// argmax_logsumexp's blocks: a fixed number of elements, whatever the batch and the threads, so that a row's
// blocks and their combination in order are always the same. 8,192 elements (32 KB of float32) stay in the
// level-1 cache between summarise_block's passes.
constexpr int64_t kSummaryBlock = 8192;

// mask_logits splits rows into blocks of this many words of 32 tokens, spread over the threads.
constexpr int64_t kMaskBlockWords = 256;

// A row's first argmax and logsumexp from the summaries of its blocks, in order.
std::pair<int64_t, float> combine_blocks(const BlockSummary* blocks, int64_t count) {
  for (int64_t b = 0; b < count; ++b) {
    if (blocks[b].nan) return {blocks[b].argmax, std::numeric_limits<float>::quiet_NaN()};
  }
  int64_t best = 0;
  for (int64_t b = 1; b < count; ++b) best = blocks[b].max > blocks[best].max ? b : best;
  const float top = blocks[best].max;
  if (std::isinf(top)) return {blocks[best].argmax, top};
  float sum = 0.0f;
  for (int64_t b = 0; b < count; ++b) {
    if (blocks[b].sum > 0.0f) sum += blocks[b].sum * std::exp(blocks[b].max - top);
  }
  return {blocks[best].argmax, top + std::log(sum)};
}

}  // namespace

void sample_tokens(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_k,
                   const torch::Tensor& top_p, const torch::Tensor& min_p, const torch::Tensor& u,
                   torch::Tensor& tokens, const c10::optional<torch::Tensor>& rows) {
  const WeightsRowFn weights_row = active_kernels().weights_row[static_cast<int>(dtype_of(logits))];
  const CollectRowFn collect_row = active_kernels().collect_row;
  const int64_t n = logits.size(1), stride = logits.stride(0) * logits.element_size();
  const char* x = static_cast<const char*>(logits.data_ptr());
  const float* temp = temperature.data_ptr<float>();
  const int64_t* k = top_k.data_ptr<int64_t>();
  const float* p = top_p.data_ptr<float>();
  const float* m = min_p.data_ptr<float>();
  const float* uniform = u.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const SelectedRows selected(logits, rows);
  at::parallel_for(0, selected.count(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(n);
    RowScratch scratch(n);
    for (int64_t r = begin; r < end; ++r) {
      const float total = weights_row(x + selected[r] * stride, n, temp[r], w.data());
      out[r] = draw_row(collect_row, w.data(), n, total, {k[r], p[r], m[r]}, uniform[r], scratch);
    }
  });
}

void argmax_logsumexp(const torch::Tensor& logits, torch::Tensor& argmax, torch::Tensor& log_total) {
  const SummariseBlockFn summarise = active_kernels().summarise_block[static_cast<int>(dtype_of(logits))];
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0) * logits.element_size();
  const int64_t blocks = (n + kSummaryBlock - 1) / kSummaryBlock;
  const char* data = static_cast<const char*>(logits.data_ptr());
  std::vector<BlockSummary> parts(rows * blocks);
  // Blocks of all rows in one parallel loop: a batch of one row still has every thread at work.
  at::parallel_for(0, rows * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t r = unit / blocks, first = unit % blocks * kSummaryBlock;
      summarise(data + r * stride, first, std::min(first + kSummaryBlock, n), &parts[unit]);
    }
  });
  int64_t* index = argmax.data_ptr<int64_t>();
  float* total = log_total.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const auto [argmax_r, log_total_r] = combine_blocks(&parts[r * blocks], blocks);
    index[r] = argmax_r;
    total[r] = log_total_r;
  }
}

void top_k(const torch::Tensor& logits, int64_t k, torch::Tensor& values, torch::Tensor& ids,
           const c10::optional<torch::Tensor>& selection) {
  const TopKBlockFn top_k_block = active_kernels().top_k_block[static_cast<int>(dtype_of(logits))];
  const SelectedRows selected(logits, selection);
  const int64_t rows = selected.count(), n = logits.size(1), stride = logits.stride(0) * logits.element_size();
  const int64_t blocks = (n + kSummaryBlock - 1) / kSummaryBlock;
  const char* data = static_cast<const char*>(logits.data_ptr());
  std::vector<float> block_values(rows * blocks * k);
  std::vector<int64_t> block_ids(rows * blocks * k), block_counts(rows * blocks);
  // The same fixed blocks as argmax_logsumexp's, merged in order: a row's result is its data's alone.
  at::parallel_for(0, rows * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t r = unit / blocks, first = unit % blocks * kSummaryBlock;
      TopKList list{&block_values[unit * k], &block_ids[unit * k], k};
      top_k_block(data + selected[r] * stride, first, std::min(first + kSummaryBlock, n), &list);
      block_counts[unit] = list.count;
    }
  });
  float* out_values = values.data_ptr<float>();
  int64_t* out_ids = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TopKList list{out_values + r * k, out_ids + r * k, k};
    for (int64_t unit = r * blocks; unit < (r + 1) * blocks; ++unit) {
      for (int64_t j = 0; j < block_counts[unit]; ++j) list.offer(block_values[unit * k + j], block_ids[unit * k + j]);
    }
    list.sort();
  }
}

namespace {

// The bits of x as a float32: a float's own, a bf16's shifted into the high half.
inline uint32_t float32_bits(uint32_t x) { return x; }
inline uint32_t float32_bits(uint16_t x) { return uint32_t{x} << 16; }

// out[32 * first_word, min(32 * end_word, n)) from x and one row's allowed bits, 32 tokens a word, as integer
// bit patterns (x is uint32_t for float32 logits, uint16_t for bf16), which the compiler vectorises.
template <typename Bits>
void mask_row(const Bits* x, const uint32_t* allowed, int64_t first_word, int64_t end_word, int64_t n,
              uint32_t* out) {
  constexpr uint32_t kNegInfBits = 0xff800000u;
  for (int64_t w = first_word; w < end_word; ++w) {
    const uint32_t bits = allowed[w];
    const int64_t base = 32 * w;
    if (base + 32 <= n) {
#pragma omp simd
      for (int j = 0; j < 32; ++j) {
        const uint32_t keep = 0u - ((bits >> j) & 1u);  // all ones or all zeros: a select without a branch
        out[base + j] = (float32_bits(x[base + j]) & keep) | (kNegInfBits & ~keep);
      }
    } else {
      for (int64_t i = base; i < n; ++i) out[i] = (bits >> (i - base)) & 1u ? float32_bits(x[i]) : kNegInfBits;
    }
  }
}

}  // namespace

void mask_logits(const torch::Tensor& logits, const torch::Tensor& allowed, torch::Tensor& out,
                 const c10::optional<torch::Tensor>& selection) {
  const SelectedRows selected(logits, selection);
  const int64_t rows = selected.count(), n = logits.size(1), words = (n + 31) / 32;
  const int64_t blocks = (words + kMaskBlockWords - 1) / kMaskBlockWords;
  const bool bf16 = logits.scalar_type() == torch::kBFloat16;
  const char* x = static_cast<const char*>(logits.data_ptr());
  const int64_t x_stride = logits.stride(0) * logits.element_size();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(allowed.data_ptr<int32_t>());
  const int64_t bits_stride = allowed.stride(0);
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  at::parallel_for(0, rows * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t r = unit / blocks, first = unit % blocks * kMaskBlockWords;
      const int64_t last = std::min(first + kMaskBlockWords, words);
      const uint32_t* row_bits = bits + r * bits_stride;
      const char* row = x + selected[r] * x_stride;
      if (bf16) {
        mask_row(reinterpret_cast<const uint16_t*>(row), row_bits, first, last, n, dst + r * n);
      } else {
        mask_row(reinterpret_cast<const uint32_t*>(row), row_bits, first, last, n, dst + r * n);
      }
    }
  });
}

}  // namespace batchgen::cpu
