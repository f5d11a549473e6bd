// Run-time choice of the instruction set the CPU attention kernels use.
#pragma once
#include <string>
#include <vector>

#include "cpu/kernels.h"

namespace batchgen::cpu {

// The kernels in use. The first call picks the best set the processor supports, or the one
// named by the environment variable BATCHGEN_CPU_ISA (scalar, avx2, avx512, avx512_bf16, amx_bf16, or
// amx_emulated: the amx_bf16 code on an emulated tile unit, for tests on processors without AMX).
const KernelTable& active_kernels();

// Names of the sets this build has and this processor runs, slowest first (amx_emulated, where offered,
// first of all; the last is the default).
std::vector<std::string> supported_isas();

// Switches the kernels in use (ValueError when `name` is not supported); for tests and benchmarks.
void set_isa(const std::string& name);

// Whether BATCHGEN_EMULATE_AMX=1 asks for the emulated AMX tables (amx_emulated, amx_int8_emulated) where the
// processor has AMX itself, to compare the emulation with the tile unit (tests/test_amx_emulated.py).
bool amx_emulation_asked();

// Whether the processor has AMX tiles with the feature of CPUID leaf 7 EDX bit `feature_bit` (22 AMX-BF16,
// 25 AMX-INT8) and Linux lets this process use them.
bool has_amx(int feature_bit);

}  // namespace batchgen::cpu
