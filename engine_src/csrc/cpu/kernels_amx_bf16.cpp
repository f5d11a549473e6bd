// The avx512_bf16 kernels with the bf16 GEMM on the AMX tile unit (gemm_amx.h; see kernels_avx512.inc).
#include "cpu/kernels.h"

#ifdef BATCHGEN_HAVE_AVX512
#define BATCHGEN_ISA_NS amx_bf16
#define BATCHGEN_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,amx-tile,amx-bf16"
#define BATCHGEN_DOT_BF16 1
#define BATCHGEN_AMX 1
#include "cpu/kernels_avx512.inc"
#endif
