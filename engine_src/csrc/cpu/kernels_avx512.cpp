// The attention kernel on AVX-512 F/BW/VL/DQ (see kernels_avx512.inc).
#include "cpu/kernels.h"

#ifdef BATCHGEN_HAVE_AVX512
#define BATCHGEN_ISA_NS avx512
#define BATCHGEN_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq"
#include "cpu/kernels_avx512.inc"
#endif
