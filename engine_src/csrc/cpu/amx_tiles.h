// The AMX tile configuration the amx_bf16 kernels share (gemm_amx.h, the prefill path of
// attention_impl.h): eight tiles of 16 rows x 64 bytes, i.e. 16 x 16 float32 sums or 16 x 32 bf16
// operands. The configuration belongs to the thread, so every kernel call loads it and releases
// the tiles when done. The amx_emulated table compiles the same code on an emulated unit (amx_emulated.h).
#pragma once
#ifndef BATCHGEN_AMX
#error "amx_tiles.h is for the amx_bf16 kernel table"
#endif

#include <immintrin.h>

#include <cstdint>

#ifdef BATCHGEN_AMX_EMULATED
#include "cpu/amx_emulated.h"
#endif

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

constexpr int kAmxRows = 16;   // rows of a tile
constexpr int kAmxPairs = 16;  // bf16 pairs in a row of an operand tile (64 bytes)

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = kAmxRows;
  }
  _tile_loadconfig(&config);
}

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
