// Paged attention over a tiled cache (kv_tiles.h: bf16, or 8-bit codes with per-token
// scales), decode tokens and prefill chunks in one call, as paged_attention.cpp does for
// caches of rows: the same work items, dynamic schedule and K/V prefetch (paged_items.h),
// but no per-step staging of a cell. Every cell is one tile, read in place: its K as the
// dimension pairs of 16 keys that vdpbf16ps scores lane-parallel, its V as the key pairs
// P·V takes (8-bit codes converted to bf16 in registers, exactly, their scales applied per
// key lane). A row's keys are folded a span of up to four cells at a time
// (attention_span.h, which states the determinism rule this follows).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_span.h"
#include "kv_codes.h"
#include "kv_tiles.h"
#include "paged_items.h"
#include "tiled_rows.h"

namespace kvserve_tiles {

namespace {

using kvserve_cell::CELL;
using kvserve_cell::NEG_BIG;
using kvserve_cell::SPAN;
using kvserve_items::Item;
using kvserve_items::row_lanes;
static_assert(TILE == CELL, "a tile is one cell");
static_assert(SPAN <= kvserve_items::PREFETCH_CELLS, "a Trickle holds a span's cells");

#ifdef __AVX512BF16__
// 32 codes of a tile as their bf16 values (exact), at `to`.
template <typename CT>
inline void convert32(const CT* from, c10::BFloat16* to) {
  _mm512_storeu_si512(to, kvserve_cell::tile32(from));
}

template <int D, typename CT>
void tiles_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& tables, const at::Tensor& lens,
                  const at::Tensor& query_start, at::Tensor& out, double scale, double softcap,
                  int64_t window, int64_t sinks, const c10::Half* ksp, const c10::Half* vsp,
                  const float* sink_logits) {
  const int64_t G = q.size(1) / k_cache.size(2);
  const TiledCall call(q, k_cache, v_cache, tables, lens, query_start, out,
                       std::max<int64_t>(1, kvserve_items::TILE_FLOATS / (G * D)), window,
                       sinks, sink_logits);
  const int64_t Hkv = call.Hkv;
  std::atomic<int64_t> counter{0};

#pragma omp parallel num_threads(call.threads)
  {
    ItemRows rows(call);
    const int64_t per_head = rows.per_head * D;  // elements of q and acc per KV head
    // 8-bit codes, an item of several rows: a span's K and V tiles of one head, converted
    // to bf16 once for all its rows instead of once per row (prefill 256-token prompts:
    // each key is read by ~128 rows)
    constexpr bool codes = !std::is_same_v<CT, c10::BFloat16>;
    std::vector<c10::BFloat16> conv(codes ? 2 * SPAN * CELL * D : 0);
    kvserve_items::Claims claims(call.items, counter, call.lines);
    kvserve_items::Trickle trickle;
    while (const Item* it = claims.next()) {
      const Item& item = *it;
      const int64_t s = item.seq, nr = item.r1 - item.r0, h0 = item.h0, h1 = item.h1;
      const int64_t c0 = item.lo / CELL, c1 = (item.hi - 1) / CELL;  // its cells [c0, c1]
      rows.begin(call, item);
      const auto* qb = reinterpret_cast<const uint32_t*>(rows.q.data());  // bf16 pairs
      for (int64_t span = c0 / SPAN; span <= c1 / SPAN; ++span) {
        trickle.reset();
        const int64_t ca = std::max(span * SPAN, c0), cb = std::min(span * SPAN + SPAN - 1, c1);
        const CT* kt[SPAN];  // the span's tiles (all heads), from cell ca on
        const CT* vt[SPAN];
        int64_t first_slot[SPAN];
        for (int64_t c = ca; c <= cb; ++c) {
          const int64_t i = c - ca;
          first_slot[i] = call.slot(s, c);
          kt[i] = call.k_at<CT>(first_slot[i]);
          vt[i] = call.v_at<CT>(first_slot[i]);
          trickle.add(claims.ahead(c - c0));
        }
        // a decode row: the span's prefetches, a few lines at each step of its folds (one
        // fold per KV head; paged_items.h); several rows: all of them now, as their
        // arithmetic is long enough to hide it
        if (nr > 1) trickle.drain();
        else trickle.pace((h1 - h0) * kvserve_cell::span_steps<D>(G, cb - ca + 1));
        for (int64_t h = h0; h < h1; ++h) {
          const bool convert = codes && nr > 1;
          if (convert)
            for (int64_t i = 0; i <= cb - ca; ++i)
              for (int64_t e = 0; e < CELL * D; e += 32) {
                convert32(kt[i] + h * CELL * D + e, conv.data() + i * CELL * D + e);
                convert32(vt[i] + h * CELL * D + e, conv.data() + (SPAN + i) * CELL * D + e);
              }
          for (int64_t r = 0; r < nr; ++r) {
            const CT* kr[SPAN];
            const CT* vr[SPAN];
            const c10::BFloat16* kc[SPAN];  // the same tiles, converted
            const c10::BFloat16* vc[SPAN];
            const c10::Half* ksc[SPAN] = {};  // 8-bit codes: the cells' scales of head h
            const c10::Half* vsc[SPAN] = {};
            uint16_t mk[SPAN];
            int nc = 0;
            for (int64_t c = ca; c <= cb; ++c) {
              const uint16_t lanes = row_lanes(rows.vis[r], c * CELL);
              if (!lanes) continue;
              kr[nc] = kt[c - ca] + h * CELL * D;
              vr[nc] = vt[c - ca] + h * CELL * D;
              if (convert) {
                kc[nc] = conv.data() + (c - ca) * CELL * D;
                vc[nc] = conv.data() + (SPAN + c - ca) * CELL * D;
              }
              if (ksp != nullptr) {
                const int64_t at = kvserve_tiles::scale_index(first_slot[c - ca], h, Hkv);
                ksc[nc] = ksp + at;
                vsc[nc] = vsp + at;
              }
              mk[nc++] = lanes;
            }
            if (!nc) continue;
            const int64_t off = h * per_head + r * G * D;
            const int64_t ml = h * rows.per_head + r * G;
            const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
            float* const m = rows.m.data() + ml;
            float* const l = rows.l.data() + ml;
            if (convert)
              kvserve_cell::fold_span<D, c10::BFloat16, true>(qb + off / 2, G, sc, cap, kc, vc,
                                                              ksc, vsc, mk, nc, trickle, m, l,
                                                              rows.acc.data() + off);
            else
              kvserve_cell::fold_span<D, CT>(qb + off / 2, G, sc, cap, kr, vr, ksc, vsc, mk, nc,
                                             trickle, m, l, rows.acc.data() + off);
          }
        }
        trickle.drain();  // what rows with fewer cells than the span left
      }
      rows.finish(call, item);
    }
  }
}
#endif

}  // namespace

bool tiles_readable(at::ScalarType q, at::ScalarType cache, int64_t d) {
#ifdef __AVX512BF16__
  const bool readable = cache == at::kBFloat16 || cache == at::kChar ||
                        cache == at::kFloat8_e4m3fn || cache == at::kFloat8_e5m2;
  return q == at::kBFloat16 && readable && (d == 32 || d == 64 || d == 96 || d == 128 || d == 256);
#else
  return false;
#endif
}

#ifdef __AVX512BF16__
namespace {
template <typename CT>
void tiles_for_codes(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& tables, const at::Tensor& lens,
                     const at::Tensor& query_start, at::Tensor& out, double scale,
                     double softcap, int64_t window, int64_t sinks, const c10::Half* ks,
                     const c10::Half* vs, const float* sl) {
#define KVSERVE_TILES_D(d)                                                                 \
  case d:                                                                                  \
    return tiles_kernel<d, CT>(q, k_cache, v_cache, tables, lens, query_start, out, scale, \
                               softcap, window, sinks, ks, vs, sl);
  switch (q.size(2)) {
    KVSERVE_TILES_D(32)
    KVSERVE_TILES_D(64)
    KVSERVE_TILES_D(96)
    KVSERVE_TILES_D(128)
    KVSERVE_TILES_D(256)
    default: break;
  }
#undef KVSERVE_TILES_D
  TORCH_CHECK(false, "paged_attention: no tiled kernel for head_dim ", q.size(2));
}
}  // namespace
#endif

void attention_tiles(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& tables, const at::Tensor& lens,
                     const at::Tensor& query_start, at::Tensor& out, double scale,
                     double softcap, int64_t window, int64_t sinks, const c10::Half* ks,
                     const c10::Half* vs, const float* sink_logits) {
#ifdef __AVX512BF16__
  const auto run = [&](auto tag) {
    using CT = decltype(tag);
    tiles_for_codes<CT>(q, k_cache, v_cache, tables, lens, query_start, out, scale, softcap,
                        window, sinks, ks, vs, sink_logits);
  };
  switch (k_cache.scalar_type()) {
    case at::kBFloat16:
      if (attention_amx_usable() && softcap == 0)
        return attention_tiles_amx(q, k_cache, v_cache, tables, lens, query_start, out, scale,
                                   window, sinks, sink_logits);
      return run(c10::BFloat16{});
    case at::kChar: return run(int8_t{});
    case at::kFloat8_e4m3fn: return run(c10::Float8_e4m3fn{});
    case at::kFloat8_e5m2: return run(c10::Float8_e5m2{});
    default: break;
  }
#endif
  TORCH_CHECK(false, "paged_attention: no tiled kernel for a ", k_cache.scalar_type(), " cache");
}

}  // namespace kvserve_tiles

namespace {

// fp8 codes [n] (n a multiple of 64) -> their bf16 values, as decode rows convert them: by
// the 64-code byte lookup (kv_codes.h's fp8_codes64) with AVX-512-VBMI, else by codes32 as
// prefill rows do. A test hook, so that every code's conversion can be checked against
// PyTorch's.
at::Tensor fp8_lookup_bf16(const at::Tensor& codes) {
  const auto t = codes.scalar_type();
  TORCH_CHECK(t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2,
              "fp8_lookup_bf16: fp8 codes expected, got ", t);
  TORCH_CHECK(codes.is_contiguous() && codes.numel() % 64 == 0,
              "fp8_lookup_bf16: contiguous codes, a multiple of 64 of them");
  TORCH_CHECK(kvserve_tiles::tiles_readable(at::kBFloat16, t, 64),
              "fp8_lookup_bf16: this build has no AVX-512-BF16 tiles kernel");
  auto out = at::empty(codes.sizes(), codes.options().dtype(at::kBFloat16));
#ifdef __AVX512BF16__
  auto* o = reinterpret_cast<__m512i*>(out.data_ptr());
  const auto convert = [&](auto tag) {
    using CT = decltype(tag);
    const CT* c = codes.data_ptr<CT>();
    for (int64_t i = 0; i < codes.numel(); i += 64) {
#ifdef __AVX512VBMI__
      kvserve_codes::fp8_codes64(c + i, o[i / 32], o[i / 32 + 1]);
#else
      o[i / 32] = kvserve_codes::codes32(c + i);
      o[i / 32 + 1] = kvserve_codes::codes32(c + i + 32);
#endif
    }
  };
  if (t == at::kFloat8_e4m3fn) convert(c10::Float8_e4m3fn{});
  else convert(c10::Float8_e5m2{});
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("fp8_lookup_bf16(Tensor codes) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("fp8_lookup_bf16", fp8_lookup_bf16);
}
