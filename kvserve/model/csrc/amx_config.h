// The AMX tile configuration (palette 1) shared by the kernels that run on tiles
// (bf16_gemm_amx.cpp, paged_attention_amx.cpp): each of the 8 tile registers' rows and
// bytes per row. A kernel loads its own with _tile_loadconfig and releases the tiles when
// its call ends, so two kernels never see each other's configuration.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__)
#include <immintrin.h>
#endif

namespace kvserve_amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if defined(__AMX_TILE__)
// Loads `cfg` into the tile unit. GCC's _tile_loadconfig tells the compiler it reads only
// the first 8 bytes, so the stores to the rest could be dropped as dead: the barrier keeps
// them (without it, -O3 handed ldtilecfg a half-written configuration, a #GP).
inline void load_config(const TileConfig& cfg) {
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
#endif

}  // namespace kvserve_amx
