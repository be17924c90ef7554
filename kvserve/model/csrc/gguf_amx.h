// gguf_gemm.cpp's int8 kinds on AMX-INT8 tiles (Sapphire Rapids and later): s8 (Q8_0) and
// c8 (--quantization int8) for products of 2 rows and more. The VNNI tile is bound by its
// dot products from a few rows on (~0.8 TOPS on this 2-core machine; the tiles ~2).
//
// The packed weights are already AMX's B operand: a weight group's chunks of 4 K values for
// 16 rows lie 64 bytes apart, block after block, so K/4 consecutive chunks are a tile of
// 64-byte rows at a stride of 64. The activations' codes [M, K] are the A operand, read in
// place at their row stride. tdpbsud multiplies them (signed) by the stored q + 128
// (unsigned) into int32 sums.
//
// Contract: bit for bit the VNNI tile's result (gguf_c8.h, gguf_tile_vnni.h). A tile's
// int32 sum over one activation block is exact whatever the order of its products; the
// float steps after it (the -128 sx correction, the scales, the FMA into the row's one
// accumulator, the blocks in order) are the VNNI tile's, in its order. So which kernel
// computes a row, and with which other rows, changes none of its bits.
#pragma once

#include <cstdint>

#include "gguf_blocks.h"

namespace kvserve_gguf {

constexpr int64_t kAmxRows = 32;  // rows of one tile pass: two A tiles of 16
constexpr int kAmxGroups = 2;     // weight groups of one pass: two B tiles of 16 outputs

// True when this build has AMX-INT8 and the process holds the tile state (asked once).
bool amx_int8_ready();

// Sets whether the AMX kernel may run where ready; returns the previous setting (tests).
bool amx_int8_enable(bool enable);

// True when the AMX kernel should compute kind `kind` (kS8, or kC8) for m rows.
bool amx_int8_takes(int kind, int64_t m);

// Rows [r0, r0 + rows) (rows <= 32) x groups [g, g + ng) (ng 1 or 2) of kind kS8 or kC8:
// acc[j][r][.] = what the VNNI tile writes for row r0 + r of group g + j. Loads this
// thread's tile configuration where it differs from the last one loaded. `pf` (or nullptr):
// the first of two groups whose weights to prefetch into L2 meanwhile (the next pair).
void tile_amx(int kind, const QAct& a, int64_t r0, int rows, const QWeight& w, int64_t g,
              int ng, float (*acc)[kAmxRows][16], const uint8_t* pf);

// Releases this thread's tiles; the next tile_amx loads its configuration again. Called by
// each thread at the end of its share of a product.
void amx_release();

}  // namespace kvserve_gguf
