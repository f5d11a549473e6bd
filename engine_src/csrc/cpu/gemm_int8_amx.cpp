// The int8 GEMM on the AMX tile unit (gemm_int8_amx.inc), called only where the processor has AMX-INT8
// (gemm_int8_ops.cpp).
#include "cpu/kernels.h"

#ifdef BATCHGEN_HAVE_AVX512
#define BATCHGEN_INT8_TARGET "avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-int8"
#define BATCHGEN_ISA_NS int8_amx
#include "cpu/gemm_int8_amx.inc"
#endif
