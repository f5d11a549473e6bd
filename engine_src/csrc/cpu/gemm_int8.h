// Torch-free interface of the int8 GEMM (cpu/gemm_int8_ops.cpp and the per-instruction-set loops in
// gemm_int8_<isa>.cpp): out[m, n] = sx[m] * sw[n] * sum_k q[m, k] w[n, k] (+ bias[n]).
//
// Weights are quantized symmetrically per output feature at load (int8 in [-127, 127] and a float32
// scale) or come so quantized from a checkpoint (int8 in [-128, 127]); activations per row on the fly (int8 in [-127, 127] and a float32 scale), stored offset by
// kInt8ZeroPoint as unsigned bytes: the operand order of vpdpbusd and tdpbusd (u8 x s8). The loops that
// multiply the offset bytes subtract the zero point's share afterwards, 128 * sum_k w[n, k] per output
// feature (`compensation`, computed at packing). Sums are int32 and exact, so every loop gives the same
// sums whatever its order, and a row's output depends on that row alone (batch invariance); the activations'
// quantization and the float epilogue are the active kernel table's quantize_int8_row and finish_int8_rows
// (kernels.h), whose bytes and bits every table shares.
#pragma once
#include <cstdint>

#include "cpu/kernels.h"

namespace batchgen::cpu {

constexpr int kInt8PanelCols = kGemmPanelCols;  // output features per panel
constexpr int kInt8DepthStep = 64;              // the packed depth is a multiple of this (one AMX tile step)
constexpr int kInt8GroupBytes = 4;              // depth elements per 32-bit lane of vpdpbusd
constexpr int kInt8ZeroPoint = 128;
constexpr int kInt8BlockRows = 16;  // rows the loops finish at once (an AMX tile's rows)

enum class Int8Out : int { f32 = 0, bf16 = 1, i32 = 2 };

struct Int8GemmArgs {
  const uint8_t* x;  // [rows, depth]: q + kInt8ZeroPoint, each in [1, 255]; rows x_stride bytes apart
  int64_t x_stride;
  const float* x_scale;         // [rows]
  const int8_t* weight;         // panels [cols / kInt8PanelCols rounded up][depth / 4][kInt8PanelCols][4]
  const int32_t* compensation;  // [panels * kInt8PanelCols]: kInt8ZeroPoint * sum_k w[n, k]
  const float* w_scale;         // [panels * kInt8PanelCols]
  const float* bias;            // [cols] or nullptr
  void* out;                    // [rows, cols], rows out_stride elements apart
  int64_t out_stride;
  Int8Out out_kind;
  int64_t rows, cols, depth;  // depth a multiple of kInt8DepthStep
  FinishInt8RowsFn finish;    // the epilogue each loop calls on its blocks of sums
};

// The same call restricted to rows [first, first + count).
inline Int8GemmArgs int8_rows(const Int8GemmArgs& a, int64_t first, int64_t count) {
  Int8GemmArgs part = a;
  part.x = a.x + first * a.x_stride;
  part.x_scale = a.x_scale + first;
  const int64_t element_bytes = a.out_kind == Int8Out::bf16 ? 2 : 4;
  part.out = static_cast<char*>(a.out) + first * a.out_stride * element_bytes;
  part.rows = count;
  return part;
}

// Computes the columns of panels [panel_begin, panel_end) for every row.
using Int8GemmFn = void (*)(const Int8GemmArgs& args, int64_t panel_begin, int64_t panel_end);

// The loops, slowest first; each namespace's `gemm_int8` runs only where its instructions exist.
namespace int8_scalar {
void gemm_int8(const Int8GemmArgs& args, int64_t panel_begin, int64_t panel_end);
}
#ifdef BATCHGEN_HAVE_AVX2
namespace int8_avx2 {  // vpmaddubsw on |w| and sign(q, w), then vpmaddwd: exact for q in [-127, 127], any w
void gemm_int8(const Int8GemmArgs& args, int64_t panel_begin, int64_t panel_end);
}
namespace int8_avx_vnni {  // vpdpbusd on 256-bit vectors (VEX-encoded AVX-VNNI)
void gemm_int8(const Int8GemmArgs& args, int64_t panel_begin, int64_t panel_end);
}
#endif
#ifdef BATCHGEN_HAVE_AVX512
namespace int8_avx512_vnni {  // vpdpbusd on 512-bit vectors
void gemm_int8(const Int8GemmArgs& args, int64_t panel_begin, int64_t panel_end);
}
namespace int8_amx {  // tdpbusd on AMX tiles
void gemm_int8(const Int8GemmArgs& args, int64_t panel_begin, int64_t panel_end);
}
namespace int8_amx_emulated {  // the same on an emulated tile unit (amx_emulated.h), for tests
void gemm_int8(const Int8GemmArgs& args, int64_t panel_begin, int64_t panel_end);
}
#endif

}  // namespace batchgen::cpu
