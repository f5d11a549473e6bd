// The int8 GEMM on AVX-VNNI's 256-bit vpdpbusd (gemm_int8_256.inc), called only where the processor
// has it (gemm_int8_ops.cpp).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/gemm_int8.h"
#include "cpu/kernels.h"

#ifdef BATCHGEN_HAVE_AVX2
#define BATCHGEN_INT8_TARGET "avx2,fma,avxvnni"
#include "cpu/int8_target_begin.inc"
#define BATCHGEN_INT8_NS int8_avx_vnni
#define BATCHGEN_INT8_VNNI 1
#include "cpu/gemm_int8_256.inc"
#include "cpu/int8_target_end.inc"
#endif
