// The sampler's summary of every row of logits, read once in the model's own dtype (bf16 or
// float32): the greedy choice and the log of the softmax's normaliser. torch needs a float32 copy
// of the whole batch, then argmax and logsumexp over it (~1.5 ms a step at 40 rows of a 49k
// vocabulary on 2 cores, against ~0.3 ms here). The row kernel is the active instruction set's
// (layer_impl.h).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>

#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace batchgen::cpu {

void argmax_logsumexp(const torch::Tensor& logits, torch::Tensor& argmax, torch::Tensor& log_total) {
  const SummariseRowFn summarise = active_kernels().summarise_row[static_cast<int>(dtype_of(logits))];
  const int64_t n = logits.size(1), stride = logits.stride(0) * logits.element_size();
  const char* data = static_cast<const char*>(logits.data_ptr());
  int64_t* index = argmax.data_ptr<int64_t>();
  float* total = log_total.data_ptr<float>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) summarise(data + r * stride, n, index + r, total + r);
  });
}

}  // namespace batchgen::cpu
