// The tiled layout of a plain 16-bit KV cache: the order in which the bf16 attention folds
// (attention_span.h) read a cell, so decode and prefill read K and V in place instead of
// transposing K and pairing V for every cell of every step.
//
// A cache of tiles is [2, slots / TILE, H, TILE, D]: slots are grouped by TILE = 16 (one
// attention cell; a block of block_size slots is block_size / TILE whole tiles), and each
// (tile, head) holds TILE * D elements:
//   K: [D / 2][TILE][2]  — dimension pairs, key lanes side by side: kT[d / 2][lane][d % 2]
//   V: [TILE / 2][D][2]  — key pairs, dimension by dimension:       v[lane / 2][d][lane % 2]
// Whole blocks move as opaque bytes (swap, host tier, KV store) exactly as rows do; only the
// writer (put_slot) and the reader (attention_tiles, paged_attention_tiles.cpp) know the
// order. kvserve/kv/cache.py's tiles_from_rows / rows_from_tiles are the same permutation
// in PyTorch.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvserve_tiles {

constexpr int64_t TILE = 16;  // slots per tile: kvserve_cell::CELL

// Writes one slot's K row and V row of head h (D 16-bit elements each) into its tile of the
// caches' K part `kc` and V part `vc` (H heads).
inline void put_slot(const uint16_t* k, const uint16_t* v, int64_t slot, int64_t h, int64_t H,
                     int64_t D, uint16_t* kc, uint16_t* vc) {
  const int64_t base = ((slot / TILE) * H + h) * TILE * D, lane = slot % TILE;
  uint16_t* kt = kc + base + 2 * lane;
  for (int64_t j = 0; j < D / 2; ++j) {
    kt[j * 2 * TILE] = k[2 * j];
    kt[j * 2 * TILE + 1] = k[2 * j + 1];
  }
  uint16_t* vt = vc + base + (lane / 2) * 2 * D + lane % 2;
  for (int64_t d = 0; d < D; ++d) vt[2 * d] = v[d];
}

// True when attention_tiles reads a cache of tiles of `cache` elements for a `q` query of
// head_dim `d` (bf16 both; d 32, 64, 96, 128 or 256; a build with AVX-512-BF16).
bool tiles_readable(at::ScalarType q, at::ScalarType cache, int64_t d);

// paged_attention over tiled caches [blocks, block_size / TILE, Hkv, TILE, D] (the entry in
// paged_attention.cpp validates the arguments and states their contract); writes `out`.
void attention_tiles(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& tables, const at::Tensor& lens,
                     const at::Tensor& query_start, at::Tensor& out, double scale,
                     int64_t window, int64_t sinks);

}  // namespace kvserve_tiles
