// Per-row quantization of the int8 GEMM's activations (gemm_int8.h), torch-free.
#pragma once
#include <cstdint>

#include "cpu/kernels.h"

namespace batchgen::cpu {

// q[k] = round_half_even(x[k] / s) clamped to [-127, 127], plus kInt8ZeroPoint, for k < depth, and the
// zero point up to padded_depth; s = max_k |x[k]| / 127 (1 for a row of zeros). Returns s.
template <typename T>
float quantize_int8_row(const T* x, int64_t depth, int64_t padded_depth, uint8_t* q);

}  // namespace batchgen::cpu
