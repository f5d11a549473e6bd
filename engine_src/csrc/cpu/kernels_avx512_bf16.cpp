// The attention kernel on AVX-512 with AVX512-BF16, whose bf16 dot product computes the scores
// of bf16 caches (see kernels_avx512.inc).
#include "cpu/kernels.h"

#ifdef BATCHGEN_HAVE_AVX512
#define BATCHGEN_ISA_NS avx512_bf16
#define BATCHGEN_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi"
#define BATCHGEN_DOT_BF16 1
#include "cpu/kernels_avx512.inc"
#endif
