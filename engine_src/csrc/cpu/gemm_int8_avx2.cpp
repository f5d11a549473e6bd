// The int8 GEMM on AVX2 without a dot-product instruction (gemm_int8_256.inc); AVX2 is the baseline
// the library is compiled for on x86-64 (setup.py).
#include "cpu/kernels.h"

#ifdef BATCHGEN_HAVE_AVX2
#define BATCHGEN_INT8_NS int8_avx2
#include "cpu/gemm_int8_256.inc"
#endif
