// The kernel table of one instruction set: the attention kernel (attention_impl.h) and the row
// kernels of the layer ops and the sampler (layer_impl.h, which uses the former's vector exp),
// compiled once per set. kernels_<isa>.cpp define BATCHGEN_ISA_NS, include the matching
// vec_<isa>.h and then this file.
#ifndef BATCHGEN_ISA_NS
#error "define BATCHGEN_ISA_NS before including kernel_table_impl.h"
#endif

#include "cpu/attention_impl.h"
#ifdef BATCHGEN_AMX
#include "cpu/gemm_amx.h"
#elif defined(BATCHGEN_GEMM_BF16)
#include "cpu/gemm_impl.h"
#elif defined(BATCHGEN_GEMM_BF16_AVX2)
#include "cpu/gemm_avx2.h"
#endif
#include "cpu/kernels.h"
#include "cpu/layer_impl.h"
#include "cpu/lora_impl.h"

#define BATCHGEN_STRINGIFY_(x) #x
#define BATCHGEN_STRINGIFY(x) BATCHGEN_STRINGIFY_(x)

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

constexpr KernelTable kTable{BATCHGEN_STRINGIFY(BATCHGEN_ISA_NS),
                             {&attend<float>, &attend<BF16>, &attend<F16>},
                             {&norm_row<float>, &norm_row<BF16>, nullptr},
                             {&add_norm_row<float>, &add_norm_row<BF16>, nullptr},
                             {&rotary_row<float>, &rotary_row<BF16>, nullptr},
                             {&silu_mul_row<float>, &silu_mul_row<BF16>, nullptr},
                             {&summarise_block<float>, &summarise_block<BF16>, nullptr},
                             {&weights_row<float>, &weights_row<BF16>, nullptr},
                             &collect_row,
                             {&top_k_block<float>, &top_k_block<BF16>, nullptr},
#ifdef BATCHGEN_AMX
                             &gemm_row_blocks<&gemm_panels_amx, kAmxRowBlockBytes>, kGemmWidensBF16,
#elif defined(BATCHGEN_GEMM_BF16)
                             &gemm_row_blocks<&gemm_panels, kPanelRowBlockBytes>, kGemmWidensBF16,
#elif defined(BATCHGEN_GEMM_BF16_AVX2)
                             &gemm_row_blocks<&gemm_strips, kWidenedRowBlockBytes>, kGemmWidensBF16,
#else
                             nullptr, false,
#endif
                             {&lora_rows<float>, &lora_rows<BF16>, nullptr},
                             &lora_rows_bf16,
                             {&quantize_fp8_row<float>, &quantize_fp8_row<BF16>, &quantize_fp8_row<F16>},
                             {&quantize_int8_row<float>, &quantize_int8_row<BF16>, nullptr},
                             &finish_int8_rows};

}  // namespace

const KernelTable& kernel_table() { return kTable; }

}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
