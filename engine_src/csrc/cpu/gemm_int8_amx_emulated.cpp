// The AMX int8 GEMM (gemm_int8_amx.inc) on an emulated tile unit (amx_emulated.h), the int8 loop of the
// amx_emulated kernel table: its logic tested on processors without AMX.
#include "cpu/kernels.h"

#ifdef BATCHGEN_HAVE_AVX512
#define BATCHGEN_INT8_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"
#define BATCHGEN_ISA_NS int8_amx_emulated
#define BATCHGEN_AMX_EMULATED 1
#include "cpu/gemm_int8_amx.inc"
#endif
