// The attention kernel on plain C++ "vectors": the fallback on processors without AVX2 (and on
// non-x86), also selectable on x86 for testing (BATCHGEN_CPU_ISA=scalar).
#include "cpu/vec_scalar.h"

#define BATCHGEN_ISA_NS scalar
#include "cpu/kernel_table_impl.h"
