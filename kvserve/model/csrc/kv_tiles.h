// The tiled layout of a plain 16-bit or 8-bit KV cache: the order in which the attention folds
// (attention_span.h) read a cell, so decode and prefill read K and V in place instead of
// transposing K and pairing V for every cell of every step.
//
// A cache of tiles is [2, slots / TILE, H, TILE, D]: slots are grouped by TILE = 16 (one
// attention cell; a block of block_size slots is block_size / TILE whole tiles), and each
// (tile, head) holds TILE * D elements:
//   K: [D / 2][TILE][2]  — dimension pairs, key lanes side by side: kT[d / 2][lane][d % 2]
//   V: [TILE / 2][D][2]  — key pairs, dimension by dimension:       v[lane / 2][d][lane % 2]
// An 8-bit cache (int8, fp8; per-token scales) holds its codes in the same order, and its
// float16 scales per part as [slots / TILE, H, TILE] (scale_index).
// Whole blocks move as opaque bytes (swap, host tier, KV store) exactly as rows do; only the
// writer (put_k, put_v) and the reader (attention_tiles, paged_attention_tiles.cpp) know the
// order. kvserve/model/kv_cache.py's tiles_from_rows / rows_from_tiles are the same permutation
// in PyTorch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace kvserve_tiles {

constexpr int64_t TILE = 16;  // slots per tile: kvserve_cell::CELL

// Writes one slot's K row of head h (D elements of 16 or 8 bits) into its tile of the K
// part `kc` of a cache of H heads.
template <typename T>
inline void put_k(const T* k, int64_t slot, int64_t h, int64_t H, int64_t D, T* kc) {
  T* kt = kc + ((slot / TILE) * H + h) * TILE * D + 2 * (slot % TILE);
  for (int64_t j = 0; j < D / 2; ++j) {
    kt[j * 2 * TILE] = k[2 * j];
    kt[j * 2 * TILE + 1] = k[2 * j + 1];
  }
}

// The same for a V row into the V part `vc`.
template <typename T>
inline void put_v(const T* v, int64_t slot, int64_t h, int64_t H, int64_t D, T* vc) {
  const int64_t lane = slot % TILE;
  T* vt = vc + ((slot / TILE) * H + h) * TILE * D + (lane / 2) * 2 * D + lane % 2;
  for (int64_t d = 0; d < D; ++d) vt[2 * d] = v[d];
}

// Both rows of a 16-bit plain cache's slot.
inline void put_slot(const uint16_t* k, const uint16_t* v, int64_t slot, int64_t h, int64_t H,
                     int64_t D, uint16_t* kc, uint16_t* vc) {
  put_k(k, slot, h, H, D, kc);
  put_v(v, slot, h, H, D, vc);
}

// Where the float16 scale of (slot, head h) of a tiled 8-bit cache sits in its part's
// scales [slots / TILE, H, TILE]: a tile's 16 scales of one head side by side, the lanes
// the kernel multiplies its scores and weights by.
inline int64_t scale_index(int64_t slot, int64_t h, int64_t H) {
  return ((slot / TILE) * H + h) * TILE + slot % TILE;
}

// True when attention_tiles reads a cache of tiles of `cache` elements for a `q` query of
// head_dim `d`: a bf16 query; a bf16 cache, or int8 / fp8 codes with per-token scales;
// d 32, 64, 96, 128 or 256; a build with AVX-512-BF16.
bool tiles_readable(at::ScalarType q, at::ScalarType cache, int64_t d);

// paged_attention over tiled caches [blocks, block_size / TILE, Hkv, TILE, D] (the entry in
// paged_attention.cpp validates the arguments and states their contract); writes `out`.
// An 8-bit cache comes with its float16 scales k_scale, v_scale [slots / TILE, Hkv, TILE]
// (scale_index); a bf16 cache with none (nullptr). `softcap` > 0 soft-caps the scores
// (cap · tanh(score / cap)), which the AMX kernel does not: such calls take the AVX-512 one.
// sink_logits: float32 [Hq] (one more softmax column per head), or nullptr.
void attention_tiles(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& tables, const at::Tensor& lens,
                     const at::Tensor& query_start, at::Tensor& out, double scale,
                     double softcap, int64_t window, int64_t sinks, const c10::Half* k_scale,
                     const c10::Half* v_scale, const float* sink_logits);

// True when bf16 tiles are read on AMX tiles (paged_attention_amx.cpp): a build and CPU
// with AMX-BF16, the tile state granted, and the kernel not turned off (attention_use_amx).
bool attention_amx_usable();

// attention_tiles for a bf16 cache on AMX tiles; needs attention_amx_usable().
void attention_tiles_amx(const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& tables,
                         const at::Tensor& lens, const at::Tensor& query_start, at::Tensor& out,
                         double scale, int64_t window, int64_t sinks,
                         const float* sink_logits);

}  // namespace kvserve_tiles
