// What the two kernels over tiled caches share (paged_attention_tiles.cpp: AVX-512-BF16
// spans, every cache type; paged_attention_amx.cpp: AMX tiles, bf16): a call's geometry,
// pointers and work items, and one thread's state for the query rows of an item.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_cell.h"
#include "float_convert.h"
#include "kv_tiles.h"
#include "paged_items.h"

namespace kvserve_tiles {

// One call over tiled caches [blocks, block_size / TILE, Hkv, TILE, D] (kv_tiles.h) of
// `elem`-byte elements, `tile` query rows a work item (make_items).
struct TiledCall {
  TiledCall(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& query_start,
            at::Tensor& out, int64_t tile, int64_t window, int64_t sinks,
            const float* sink_logits)
      : S(lens.size(0)), Hq(q.size(1)), BS(k_cache.size(1) * TILE), Hkv(k_cache.size(2)),
        G(Hq / Hkv), MB(tables.size(1)), D(q.size(2)), q_row(q.stride(0)), row(Hkv * D),
        tile(tile), window(window), sinks(sinks),
        q(reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>())),
        k(static_cast<const char*>(k_cache.data_ptr())),
        v(static_cast<const char*>(v_cache.data_ptr())), tables(tables.data_ptr<int64_t>()),
        lens(lens.data_ptr<int64_t>()), qs(query_start.data_ptr<int64_t>()),
        out(out.data_ptr<c10::BFloat16>()), sink_logits(sink_logits),
        threads(at::get_num_threads()),
        items(kvserve_items::make_items(S, qs, this->lens, tile, Hkv, window, sinks, threads)),
        lines{k, v, this->tables, MB, BS, row * static_cast<int64_t>(k_cache.element_size()),
              true} {}

  // The first slot of sequence s's cell c.
  int64_t slot(int64_t s, int64_t c) const {
    const int64_t pos = c * TILE;
    return tables[s * MB + pos / BS] * BS + pos % BS;
  }
  // Where the K (V) tiles of all heads at `slot` start, in elements of type CT.
  template <typename CT>
  const CT* k_at(int64_t slot) const {
    return reinterpret_cast<const CT*>(k) + slot * row;
  }
  template <typename CT>
  const CT* v_at(int64_t slot) const {
    return reinterpret_cast<const CT*>(v) + slot * row;
  }

  const int64_t S, Hq, BS, Hkv, G, MB, D;
  const int64_t q_row;  // q's row stride: rows may be a view of the QKV output
  const int64_t row;    // elements per slot; a tile is TILE * row
  const int64_t tile, window, sinks;
  const uint16_t* const q;  // bf16
  const char* const k;
  const char* const v;
  const int64_t* const tables;
  const int64_t* const lens;
  const int64_t* const qs;
  c10::BFloat16* const out;
  const float* const sink_logits;  // float32 [Hq] (gpt-oss), or nullptr
  const int threads;
  const std::vector<kvserve_items::Item> items;
  const kvserve_items::CellLines lines;
};

// One thread's query rows of an item. Per KV head h, its "A rows" a = r * G + g (row r of
// the item, query head g of the group) lie at h * per_head + a: q [.][D] bf16, acc [.][D],
// running max m and sum l. vis[r]: row r's visible keys.
struct ItemRows {
  explicit ItemRows(const TiledCall& c)
      : per_head(c.tile * c.G), q(c.Hkv * per_head * c.D), acc(c.Hkv * per_head * c.D),
        m(c.Hkv * per_head), l(c.Hkv * per_head), vis(c.tile) {}

  // Loads the item's rows (their visible keys and queries) and resets its heads' state.
  void begin(const TiledCall& c, const kvserve_items::Item& item) {
    const int64_t n = c.qs[item.seq + 1] - c.qs[item.seq], na = (item.r1 - item.r0) * c.G;
    for (int64_t r = 0; r < item.r1 - item.r0; ++r) {
      vis[r] = kvserve_items::visible(c.lens[item.seq] - n + item.r0 + r + 1, c.window,
                                      c.sinks);
      const int64_t tok = c.qs[item.seq] + item.r0 + r;
      for (int64_t h = item.h0; h < item.h1; ++h)
        std::memcpy(q.data() + (h * per_head + r * c.G) * c.D,
                    c.q + tok * c.q_row + h * c.G * c.D, c.G * c.D * sizeof(uint16_t));
    }
    for (int64_t h = item.h0; h < item.h1; ++h) {
      std::fill_n(acc.begin() + h * per_head * c.D, na * c.D, 0.f);
      std::fill_n(m.begin() + h * per_head, na, kvserve_cell::NEG_BIG);
      std::fill_n(l.begin() + h * per_head, na, 0.f);
    }
  }

  // Writes the item's rows to c.out: each A row's acc / l (with the head's sink logit:
  // kvserve_cell::row_scale), rounded to bf16.
  void finish(const TiledCall& c, const kvserve_items::Item& item) const {
    for (int64_t r = 0; r < item.r1 - item.r0; ++r) {
      const int64_t tok = c.qs[item.seq] + item.r0 + r;
      for (int64_t h = item.h0; h < item.h1; ++h)
        for (int64_t g = 0; g < c.G; ++g) {
          const int64_t a = h * per_head + r * c.G + g;
          const float* sink = c.sink_logits ? c.sink_logits + h * c.G + g : nullptr;
          const float inv = kvserve_cell::row_scale(m[a], l[a], sink);
          const float* x = acc.data() + a * c.D;
          c10::BFloat16* o = c.out + (tok * c.Hq + h * c.G + g) * c.D;
#pragma omp simd
          for (int64_t d = 0; d < c.D; ++d) o[d] = kvserve_cpu::from_f<c10::BFloat16>(x[d] * inv);
        }
    }
  }

  const int64_t per_head;  // A rows per KV head: tile * G
  std::vector<uint16_t> q;
  std::vector<float> acc, m, l;
  std::vector<kvserve_items::Visible> vis;
};

}  // namespace kvserve_tiles
