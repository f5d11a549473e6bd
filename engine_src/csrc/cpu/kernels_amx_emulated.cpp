// The amx_bf16 kernels on an emulated tile unit (amx_emulated.h), for processors with AVX512-BF16 and no
// AMX: the tile paths' logic tested where no tile unit runs them (see kernels_avx512.inc).
#include <cstdio>  // for amx_emulated.h, included before kernels_avx512.inc's target pragma
#include <cstdlib>

#include "cpu/kernels.h"

#ifdef BATCHGEN_HAVE_AVX512
#define BATCHGEN_ISA_NS amx_emulated
#define BATCHGEN_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi"
#define BATCHGEN_DOT_BF16 1
#define BATCHGEN_AMX 1
#define BATCHGEN_AMX_EMULATED 1
#include "cpu/kernels_avx512.inc"
#endif
