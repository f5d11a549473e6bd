// The AMX tile unit in plain C++, for the amx_emulated kernel table (kernels_amx_emulated.cpp) and int8 loop
// (gemm_int8_amx_emulated.cpp): the amx_bf16 code compiled again with its tile intrinsics replaced by the
// functions below, so that its layouts, tails, masks and batch invariance are tested on processors without
// AMX (isa.cpp offers the table where AVX512-BF16 runs and AMX does not). Each thread has its own eight tiles,
// as on the hardware.
//
// tdpbusd's int32 sums are exact, as on the hardware. tdpbf16ps follows the Intel SDM's pseudo-code: per
// pair of the depth, the even product and then the odd one added into the float32 sum, each rounded to
// nearest even, inputs and results below float32's normal range taken as zero. Whether the tile unit
// rounds in that order has not been checked on one: the emulated table tests the code's logic, not the
// hardware's last bits (tests compare the tile paths with references within tolerances, and with
// themselves bit for bit).
#pragma once
#ifndef BATCHGEN_AMX_EMULATED
#error "amx_emulated.h is for the emulated AMX tables"
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cpu/kernels.h"

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

struct EmulatedTiles {
  static constexpr int kTiles = 8, kRows = 16, kRowBytes = 64;
  uint16_t colsb[kTiles] = {};
  uint8_t rows[kTiles] = {};
  bool configured = false;
  alignas(64) uint8_t data[kTiles][kRows][kRowBytes] = {};
};

thread_local EmulatedTiles emulated_tiles;

[[noreturn]] inline void emulated_fault(const char* what) {
  std::fprintf(stderr, "batchgen: emulated AMX: %s\n", what);  // the hardware would raise #UD
  std::abort();
}

inline EmulatedTiles& configured_tiles() {
  if (!emulated_tiles.configured) emulated_fault("a tile instruction before ldtilecfg");
  return emulated_tiles;
}

// ldtilecfg of a palette-1 configuration (amx_tiles.h's TileConfig layout: 16 bytes, colsb[16], rows[16]).
inline void emulated_loadconfig(const void* config) {
  const auto* bytes = static_cast<const uint8_t*>(config);
  if (bytes[0] != 1) emulated_fault("palette other than 1");
  EmulatedTiles& t = emulated_tiles;
  for (int i = 0; i < EmulatedTiles::kTiles; ++i) {
    std::memcpy(&t.colsb[i], bytes + 16 + 2 * i, sizeof(uint16_t));
    t.rows[i] = bytes[48 + i];
    if (t.colsb[i] > EmulatedTiles::kRowBytes || t.rows[i] > EmulatedTiles::kRows) emulated_fault("tile too large");
  }
  std::memset(t.data, 0, sizeof t.data);
  t.configured = true;
}

inline void emulated_release() {
  emulated_tiles.configured = false;
  std::memset(emulated_tiles.data, 0, sizeof emulated_tiles.data);
}

inline void emulated_zero(int tile) { std::memset(configured_tiles().data[tile], 0, sizeof emulated_tiles.data[0]); }

inline void emulated_load(int tile, const void* base, int64_t stride) {
  EmulatedTiles& t = configured_tiles();
  std::memset(t.data[tile], 0, sizeof t.data[0]);
  for (int r = 0; r < t.rows[tile]; ++r)
    std::memcpy(t.data[tile][r], static_cast<const char*>(base) + r * stride, t.colsb[tile]);
}

inline void emulated_store(int tile, void* base, int64_t stride) {
  EmulatedTiles& t = configured_tiles();
  for (int r = 0; r < t.rows[tile]; ++r)
    std::memcpy(static_cast<char*>(base) + r * stride, t.data[tile][r], t.colsb[tile]);
}

// The shapes a product needs: c is M x N 4-byte sums, a is M x K 4-byte groups, b is K x N groups.
inline void check_product(const EmulatedTiles& t, int c, int a, int b) {
  if (t.rows[a] != t.rows[c] || t.colsb[b] != t.colsb[c] || t.rows[b] * 4 != t.colsb[a])
    emulated_fault("tile shapes that do not multiply");
}

inline float bf16_operand(const uint8_t* p) {  // input denormals read as zero
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  if ((bits & 0x7f80) == 0) bits &= 0x8000;
  uint32_t wide = uint32_t{bits} << 16;
  float x;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}

inline float flush_denormal(float x) { return std::fabs(x) < 0x1p-126f ? std::copysign(0.0f, x) : x; }

// The loop both products share: row m of tile c (4-byte sums of type Sum) gains, for each group k of the depth in
// order, add_group(sum, group k of a's row m, group n of b's row k) in its column n.
template <typename Sum, typename AddGroup>
void emulated_product(int c, int a, int b, AddGroup add_group) {
  EmulatedTiles& t = configured_tiles();
  check_product(t, c, a, b);
  const int N = t.colsb[c] / 4, K = t.colsb[a] / 4;
  for (int m = 0; m < t.rows[c]; ++m) {
    Sum sum[16];
    std::memcpy(sum, t.data[c][m], sizeof sum);
    for (int k = 0; k < K; ++k)
      for (int n = 0; n < N; ++n) sum[n] = add_group(sum[n], &t.data[a][m][4 * k], &t.data[b][k][4 * n]);
    std::memcpy(t.data[c][m], sum, 4 * N);
  }
  count_emulated_tile_product();
}

// tdpbf16ps: per pair, the even product and then the odd one, each rounded.
inline void emulated_dpbf16ps(int c, int a, int b) {
  emulated_product<float>(c, a, b, [](float sum, const uint8_t* x, const uint8_t* y) {
    sum = flush_denormal(std::fma(bf16_operand(x), bf16_operand(y), sum));
    return flush_denormal(std::fma(bf16_operand(x + 2), bf16_operand(y + 2), sum));
  });
}

// tdpbusd: unsigned bytes of a times signed bytes of b, four to a 32-bit sum (wrapping, as the hardware's).
inline void emulated_dpbusd(int c, int a, int b) {
  emulated_product<uint32_t>(c, a, b, [](uint32_t sum, const uint8_t* x, const uint8_t* y) {
    int32_t group = 0;
    for (int i = 0; i < 4; ++i) group += int32_t{x[i]} * int32_t{static_cast<int8_t>(y[i])};
    return sum + static_cast<uint32_t>(group);
  });
}

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS

// The tile intrinsics the amx_bf16 code uses, on the emulated unit.
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_dpbusd
#define _tile_loadconfig(config) emulated_loadconfig(config)
#define _tile_release() emulated_release()
#define _tile_zero(tile) emulated_zero(tile)
#define _tile_loadd(tile, base, stride) emulated_load(tile, base, stride)
#define _tile_stored(tile, base, stride) emulated_store(tile, base, stride)
#define _tile_dpbf16ps(c, a, b) emulated_dpbf16ps(c, a, b)
#define _tile_dpbusd(c, a, b) emulated_dpbusd(c, a, b)
