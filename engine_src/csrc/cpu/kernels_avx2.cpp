// The attention kernel on AVX2 + FMA + F16C, the baseline the whole library is compiled for on
// x86-64 (setup.py).
#include "cpu/kernels.h"

#ifdef BATCHGEN_HAVE_AVX2
#include "cpu/vec_avx2.h"

#define BATCHGEN_ISA_NS avx2
#define BATCHGEN_GEMM_BF16_AVX2 1  // the bf16 GEMM with widened pairs (gemm_avx2.h)
#include "cpu/kernel_table_impl.h"
#endif
