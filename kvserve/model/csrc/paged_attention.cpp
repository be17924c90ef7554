// Paged attention for the CPU, one kernel for decode tokens and prefill chunks alike: each
// query row attends to its sequence's K/V read in place from the block cache (no gathered
// copy, no dense mask), float accumulation, GQA-aware (a KV head's rows are converted once
// for every query head and query row that shares them). A cell's K is transposed once so
// its scores are computed lane-parallel over keys (attention_cell.h). A bf16 query against
// a bf16 cache scores with bf16 dot products on the cache's own K and sums P·V with bf16
// dot products over key pairs of V (the weights rounded to bf16, as FlashAttention rounds
// P; float sums). Every other combination converts K and V to float first. Registered as
// torch.ops.kvserve.paged_attention.
//
// Determinism rule (README, "Determinism"): a row's result is a function of its query, its
// context's K/V and its position only. Its keys are visited in fixed cells of CELL
// positions (aligned to absolute positions and to block boundaries), cell by cell in
// position order, each key in the lane of its position % CELL, each cell folded into an
// online softmax by one non-inlined routine (`fold`): the same machine code for a decode
// token, a row of a prefill chunk, a row whose context came from the prefix cache, and
// whatever else shares the call. Which thread runs a row, which rows share its tile and
// how many rows the batch has change nothing.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_cell.h"
#include "kv_codes.h"
#include "kv_tiles.h"
#include "paged_items.h"
#include "ops.h"

namespace {

using kvserve_cell::CELL;     // keys per cell (and per online-softmax update)
using kvserve_cell::NEG_BIG;  // finite "minus infinity" (the build uses -ffast-math)
static_assert(kvserve_items::CELL == CELL, "one cell size");
using kvserve_items::Item;
using kvserve_items::Lines;
using kvserve_items::TILE_FLOATS;
using kvserve_items::Visible;
using kvserve_items::prefetch;
using kvserve_items::visible;

using namespace kvserve_codes;  // load, store, codes_to_bf16, Scales

template <int D, typename qt, typename ct>
void attention_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& tables, const at::Tensor& lens,
                      const at::Tensor& query_start, at::Tensor& out, double scale,
                      double softcap, int64_t window, int64_t sinks, Scales scales,
                      const float* sink_logits) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  const int64_t S = lens.size(0), Hq = q.size(1);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv, MB = tables.size(1);
  const qt* qp = q.data_ptr<qt>();
  const int64_t q_row = q.stride(0);  // rows may be strided (a view of the QKV output)
  const ct* kp = k_cache.data_ptr<ct>();
  const ct* vp = v_cache.data_ptr<ct>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  qt* op = out.data_ptr<qt>();
  const int64_t row = Hkv * D;  // elements per cache slot
  const int64_t tile = std::max<int64_t>(1, TILE_FLOATS / (G * D));
  const float cap = static_cast<float>(softcap);  // 0: scores not soft-capped
  // A bf16 query against a bf16 or 8-bit cache: scores and P·V by bf16 dot products, on
  // the cache's own K pairs (a bf16 cache) or on the 8-bit codes as bf16 (exact), their
  // scales applied per key lane (fold_bf16); every other combination converts to float.
  // A plain (unquantized) cache has no scales: its rows are converted without the multiply
  // by 1 (the same values, fewer instructions in the loop every key goes through).
  constexpr bool scaled = !std::is_same_v<ct, float> && !std::is_same_v<ct, c10::BFloat16> &&
                          !std::is_same_v<ct, c10::Half>;
  constexpr bool bf16_scores = kvserve_cell::kBf16Scores && D % 32 == 0 &&
                               std::is_same_v<qt, c10::BFloat16> &&
                               (std::is_same_v<ct, c10::BFloat16> || scaled);

  const int threads = at::get_num_threads();
  const std::vector<Item> items =
      kvserve_items::make_items(S, qs, lp, tile, Hkv, window, sinks, threads);
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(ct));
  const kvserve_items::CellLines cell_lines{reinterpret_cast<const char*>(kp),
                                            reinterpret_cast<const char*>(vp), tp, MB, BS,
                                            row_bytes, false};
  std::atomic<int64_t> counter{0};  // items claimed one ahead (kvserve_items::Claims)

#pragma omp parallel num_threads(threads)
  {
    const int64_t per_head = tile * G * D;
    std::vector<float> qf(bf16_scores ? 0 : Hkv * per_head), acc(Hkv * per_head),
        m(Hkv * tile * G), l(Hkv * tile * G);
    std::vector<uint32_t> qb(bf16_scores ? Hkv * per_head / 2 : 0);  // bf16 pairs
    std::vector<Visible> vis(tile);
    const std::vector<uint32_t> zero_row(D, 0u);  // lanes a cell does not fill (bf16 path)
    const uint32_t* rows[CELL];
    // One cell for every KV head, in float, 64-byte aligned: K as converted [Hkv][CELL][D],
    // K transposed [Hkv][D][CELL] and V [Hkv][CELL][D]; a key's lane is its position % CELL.
    // (bf16 scores: K pairs transposed [Hkv][D / 2][CELL] and V key pairs [Hkv][CELL / 2][D]
    // in the same space.) Zeroed once: lanes a cell does not fill hold finite stale values
    // (cache values of earlier cells), always masked, with weight 0.
    std::vector<float> kv_buf(3 * Hkv * CELL * D + 16, 0.f);
    // an 8-bit cell's scales per key lane [Hkv][CELL], K's then V's (bf16 scores)
    std::vector<float> lane_scales(2 * Hkv * CELL, 0.f);
    float* kv_base = kv_buf.data() + (16 - reinterpret_cast<uintptr_t>(kv_buf.data()) / 4 % 16) % 16;
    auto kr = [&](int64_t h) { return kv_base + h * CELL * D; };
    auto kt = [&](int64_t h) { return kv_base + (Hkv + h) * CELL * D; };
    auto vb = [&](int64_t h) { return kv_base + (2 * Hkv + h) * CELL * D; };
    kvserve_items::Claims claims(items, counter, cell_lines);
    while (const Item* it = claims.next()) {
      const Item& item = *it;
      const int64_t s = item.seq, nr = item.r1 - item.r0, h0 = item.h0, h1 = item.h1;
      const int64_t n = qs[s + 1] - qs[s], first_pos = lp[s] - n;
      const int64_t lo = item.lo, hi = item.hi;
      for (int64_t r = 0; r < nr; ++r) {
        vis[r] = visible(first_pos + item.r0 + r + 1, window, sinks);
        const int64_t tok = qs[s] + item.r0 + r;
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t g = 0; g < G; ++g) {
            const qt* src = qp + tok * q_row + (h * G + g) * D;
            if constexpr (bf16_scores)
              std::memcpy(qb.data() + (h * per_head + (r * G + g) * D) / 2, src, D * sizeof(qt));
            else
              for (int64_t d = 0; d < D; ++d)
                qf[h * per_head + (r * G + g) * D + d] = load(src, d) * static_cast<float>(scale);
          }
      }
      for (int64_t h = h0; h < h1; ++h) {
        std::fill(acc.begin() + h * per_head, acc.begin() + h * per_head + nr * G * D, 0.f);
        std::fill(m.begin() + h * tile * G, m.begin() + h * tile * G + nr * G, NEG_BIG);
        std::fill(l.begin() + h * tile * G, l.begin() + h * tile * G + nr * G, 0.f);
      }
      for (int64_t c = lo; c < hi;) {
        // the cell holding position c: fixed boundaries every CELL positions and at blocks
        const int64_t cell_lo = c - c % CELL;
        const int64_t cell_hi = std::min(cell_lo + CELL, (c / BS + 1) * BS);
        const int64_t cell_lo_b = std::max(cell_lo, c / BS * BS);
        // the part of the cell some row of the tile sees: convert it once for all of them
        int64_t a = cell_hi, b = cell_lo_b;
        for (int64_t r = 0; r < nr; ++r) {
          const Visible& v = vis[r];
          const int64_t sb = std::min(cell_hi, v.sink_end);
          if (cell_lo_b < sb) a = std::min(a, cell_lo_b), b = std::max(b, sb);
          const int64_t wa = std::max(cell_lo_b, v.start), wb = std::min(cell_hi, v.len);
          if (wa < wb) a = std::min(a, wa), b = std::max(b, wb);
        }
        // K and V rows PREFETCH_CELLS cells ahead, fetched while this cell runs (a
        // sequence's blocks are scattered, so the hardware prefetcher loses the stream at
        // every block); past the item's last cell, the next item's first cells. The lines
        // are spread over this cell's slot loop: issued in one burst, most prefetches find
        // the miss buffers full.
        const Lines pf = claims.ahead((cell_lo - lo / CELL * CELL) / CELL);
        if (a < b) {
          const int64_t slot0 = tp[s * MB + a / BS] * BS + a % BS;
          const int64_t pf_step = (pf.n + (b - a) - 1) / (b - a);
          for (int64_t t = 0; t < b - a; ++t) {
            const int64_t slot = slot0 + t, lane = a - cell_lo + t;
            prefetch(pf, t * pf_step, (t + 1) * pf_step);
            for (int64_t h = h0; h < h1; ++h) {
              const ct* ksrc = kp + slot * row + h * D;
              const ct* vsrc = vp + slot * row + h * D;
              float* kd = kr(h) + lane * D;
              float* vd = vb(h) + lane * D;
              float ks = 1.f, vs = 1.f;
              if constexpr (scaled) {
                ks = scales.k ? static_cast<float>(scales.k[slot * Hkv + h])
                              : (scales.k_head ? scales.k_head[h] : 1.f);
                vs = scales.v ? static_cast<float>(scales.v[slot * Hkv + h])
                              : (scales.v_head ? scales.v_head[h] : 1.f);
              }
              if constexpr (!bf16_scores) {
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) kd[d] = scaled ? load(ksrc, d) * ks : load(ksrc, d);
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) vd[d] = scaled ? load(vsrc, d) * vs : load(vsrc, d);
              } else {  // V as bf16 key pairs, here where the slot loop spaces the prefetches
                const uint16_t* vrow = reinterpret_cast<const uint16_t*>(vsrc);
                alignas(64) uint16_t v16[D];
                if constexpr (scaled) {  // 8-bit codes as bf16 rows, K's in kr(h)
                  codes_to_bf16<D>(ksrc, reinterpret_cast<uint16_t*>(kr(h)) + lane * D);
                  codes_to_bf16<D>(vsrc, v16);
                  lane_scales[h * CELL + lane] = ks;
                  lane_scales[(Hkv + h) * CELL + lane] = vs;
                  vrow = v16;
                }
                kvserve_cell::put_v_pair<D>(vrow, lane, reinterpret_cast<uint32_t*>(vb(h)));
              }
            }
          }
          for (int64_t h = h0; h < h1; ++h) {
            const uint32_t* kth = reinterpret_cast<const uint32_t*>(kt(h));
            const uint32_t* vph = reinterpret_cast<const uint32_t*>(vb(h));
            if constexpr (bf16_scores) {  // K pairs (from the cache, or as converted) transposed
              for (int64_t i = 0; i < CELL; ++i) {
                const int64_t p = cell_lo + i;
                rows[i] = zero_row.data();
                if (p >= a && p < b && scaled)
                  rows[i] = reinterpret_cast<const uint32_t*>(
                      reinterpret_cast<const uint16_t*>(kr(h)) + i * D);
                else if (p >= a && p < b)
                  rows[i] = reinterpret_cast<const uint32_t*>(kp + (slot0 + p - a) * row + h * D);
              }
              kvserve_cell::transpose_cell<D / 2>(rows, reinterpret_cast<uint32_t*>(kt(h)));
            } else {
              for (int64_t i = 0; i < CELL; ++i)
                rows[i] = reinterpret_cast<const uint32_t*>(kr(h) + i * D);
              kvserve_cell::transpose_cell<D>(rows, reinterpret_cast<uint32_t*>(kt(h)));
            }
            for (int64_t r = 0; r < nr; ++r) {
              const Visible& v = vis[r];
              const int64_t qoff = h * per_head + r * G * D;  // into qb (halved) or qf
              float* ar = acc.data() + qoff;
              float* mr = m.data() + h * tile * G + r * G;
              float* lr = l.data() + h * tile * G + r * G;
              const int64_t sb = std::min(cell_hi, v.sink_end);
              auto fold = [&](int64_t t0, int64_t t1) {  // lanes [t0, t1) of the cell
                if constexpr (bf16_scores)
                  kvserve_cell::fold_bf16<D, scaled>(
                      qb.data() + qoff / 2, G, static_cast<float>(scale), cap, kth, vph,
                      lane_scales.data() + h * CELL,
                      lane_scales.data() + (Hkv + h) * CELL, t0, t1, mr, lr, ar);
                else
                  kvserve_cell::fold<D>(qf.data() + qoff, G, cap, kt(h), vb(h), t0, t1, mr, lr,
                                        ar);
              };
              if (cell_lo_b < sb)  // the sinks' part of the cell, then the window's
                fold(cell_lo_b - cell_lo, sb - cell_lo);
              const int64_t wa = std::max(cell_lo_b, v.start), wb = std::min(cell_hi, v.len);
              if (wa < wb) fold(wa - cell_lo, wb - cell_lo);
            }
          }
        }
        c = cell_hi;
      }
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t tok = qs[s] + item.r0 + r;
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t a = h * tile * G + r * G + g;
            const float inv = kvserve_cell::row_scale(
                m[a], l[a], sink_logits ? sink_logits + h * G + g : nullptr);
            for (int64_t d = 0; d < D; ++d)
              store(op, (tok * Hq + h * G + g) * D + d,
                    acc[h * per_head + (r * G + g) * D + d] * inv);
          }
      }
    }
  }
}

#define KV_ARGS q, k, v, t, l, qs, o, s, cp, w, sk, sc, sl
#define KV_PARAMS                                                                         \
  const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &t,    \
      const at::Tensor &l, const at::Tensor &qs, at::Tensor &o, double s, double cp,      \
      int64_t w, int64_t sk, Scales sc, const float* sl

template <typename qt, typename ct>
void dispatch_dim(KV_PARAMS) {
  switch (q.size(2)) {
    case 16: return attention_kernel<16, qt, ct>(KV_ARGS);
    case 32: return attention_kernel<32, qt, ct>(KV_ARGS);
    case 64: return attention_kernel<64, qt, ct>(KV_ARGS);
    case 80: return attention_kernel<80, qt, ct>(KV_ARGS);
    case 96: return attention_kernel<96, qt, ct>(KV_ARGS);
    case 128: return attention_kernel<128, qt, ct>(KV_ARGS);
    case 256: return attention_kernel<256, qt, ct>(KV_ARGS);
    default: TORCH_CHECK(false, "paged_attention: unsupported head_dim ", q.size(2));
  }
}

template <typename qt>
void dispatch_cache(KV_PARAMS) {
  switch (k.scalar_type()) {
    case at::kFloat: return dispatch_dim<qt, float>(KV_ARGS);
    case at::kBFloat16: return dispatch_dim<qt, c10::BFloat16>(KV_ARGS);
    case at::kHalf: return dispatch_dim<qt, c10::Half>(KV_ARGS);
    case at::kChar: return dispatch_dim<qt, int8_t>(KV_ARGS);
    case at::kFloat8_e4m3fn: return dispatch_dim<qt, c10::Float8_e4m3fn>(KV_ARGS);
    case at::kFloat8_e5m2: return dispatch_dim<qt, c10::Float8_e5m2>(KV_ARGS);
    default: TORCH_CHECK(false, "paged_attention: unsupported cache dtype ", k.scalar_type());
  }
}

// q [T, Hq, D] (rows may be strided): the query rows of S sequences, sequence s owning rows
// query_start[s] .. query_start[s+1]-1, which are the last of its lens[s] positions (a
// decode token is a sequence with one row). Caches [num_blocks, block_size, Hkv, D] (rows),
// or [num_blocks, block_size / 16, Hkv, 16, D] (tiles, kv_tiles.h: bf16, or int8 / fp8 with
// float16 scales [slots / 16, kv_heads, 16] per token and head);
// tables [S, max_blocks] int64; lens [S] int64 (context length after this step, the rows'
// own K/V already written); window <= 0 means no window; with a window, the first `sinks`
// positions are attended as well. An int8 cache comes with float16 scales [slots, kv_heads]
// per token and head (k_scale, v_scale), an fp8 cache with the same or with float32 scales
// [kv_heads] per head. softcap > 0 soft-caps the scaled scores, cap · tanh(score / cap)
// (Gemma 2's attn_logit_softcapping); 0 leaves them as they are. sink_logits, float32
// [heads] (gpt-oss), adds one softmax column per head holding that logit, whose value is
// dropped: a row's weights then sum to less than 1 (row_scale).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& tables,
                           const at::Tensor& lens, const at::Tensor& query_start, double scale,
                           int64_t window, int64_t sinks, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale, double softcap,
                           const std::optional<at::Tensor>& sink_logits) {
  TORCH_CHECK(softcap >= 0, "paged_attention: softcap must be >= 0 (0: none)");
  TORCH_CHECK(!sink_logits.has_value() ||
                  (sink_logits->scalar_type() == at::kFloat && sink_logits->dim() == 1 &&
                   sink_logits->size(0) == q.size(1) && sink_logits->is_contiguous()),
              "paged_attention: sink_logits must be contiguous float32 [heads]");
  const float* sl = sink_logits.has_value() ? sink_logits->data_ptr<float>() : nullptr;
  TORCH_CHECK(q.dim() == 3 && (k_cache.dim() == 4 || k_cache.dim() == 5) &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(-1) == q.size(2),
              "paged_attention: caches must be [blocks, block_size, kv_heads, head_dim] (rows) "
              "or [blocks, block_size / 16, kv_heads, 16, head_dim] (tiles)");
  TORCH_CHECK(k_cache.dim() == 4 || k_cache.size(3) == kvserve_cell::CELL,
              "paged_attention: a tile holds ", kvserve_cell::CELL, " slots");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention: CPU only");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_attention: heads not divisible");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  query_start.scalar_type() == at::kLong,
              "paged_attention: tables/lens/query_start must be int64");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == lens.size(0) &&
                  query_start.numel() == lens.size(0) + 1,
              "paged_attention: tables [S, max_blocks], lens [S], query_start [S + 1]");
  // rows may be strided (q is a view of the fused QKV output); heads must be contiguous
  auto qc = q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
  auto kc = k_cache.contiguous();
  auto vc = v_cache.contiguous();
  auto tc = tables.contiguous();
  auto lc = lens.contiguous();
  auto qsc = query_start.contiguous();
  {
    const int64_t* qs = qsc.data_ptr<int64_t>();
    const int64_t* lp = lc.data_ptr<int64_t>();
    const int64_t S = lc.size(0), BS = kc.size(1) * (kc.dim() == 5 ? kvserve_cell::CELL : 1);
    TORCH_CHECK(qs[0] == 0 && qs[S] == qc.size(0), "paged_attention: query_start must span q");
    for (int64_t s = 0; s < S; ++s) {
      const int64_t n = qs[s + 1] - qs[s];
      TORCH_CHECK(n >= 1 && n <= lp[s], "paged_attention: sequence ", s, " has ", n,
                  " query rows for context length ", lp[s]);
      TORCH_CHECK((lp[s] + BS - 1) / BS <= tc.size(1), "paged_attention: sequence ", s,
                  " needs more blocks than its table has");
    }
  }
  auto out = at::empty(qc.sizes(), qc.options());
  at::Tensor ksc, vsc;  // keep contiguous copies alive for the call
  if (kc.dim() == 5) {  // tiles: paged_attention_tiles.cpp
    TORCH_CHECK(kvserve_tiles::tiles_readable(qc.scalar_type(), kc.scalar_type(), qc.size(2)),
                "paged_attention: a tiled cache needs a bf16 query, a bf16, int8 or fp8 cache, "
                "head_dim 32, 64, 96, 128 or 256 and AVX-512-BF16 (tiled_kv_supported)");
    const c10::Half* ks = nullptr;
    const c10::Half* vs = nullptr;
    if (kc.scalar_type() != at::kBFloat16) {
      TORCH_CHECK(k_scale.has_value() && v_scale.has_value(),
                  "paged_attention: a tiled 8-bit cache needs k_scale and v_scale");
      ksc = k_scale->contiguous();
      vsc = v_scale->contiguous();
      TORCH_CHECK(ksc.scalar_type() == at::kHalf && vsc.scalar_type() == at::kHalf &&
                      ksc.numel() == kc.numel() / kc.size(4) && vsc.numel() == ksc.numel(),
                  "paged_attention: a tiled cache's scales must be float16 "
                  "[slots / 16, kv_heads, 16]");
      ks = ksc.data_ptr<c10::Half>();
      vs = vsc.data_ptr<c10::Half>();
    }
    kvserve_tiles::attention_tiles(qc, kc, vc, tc, lc, qsc, out, scale, softcap, window, sinks,
                                   ks, vs, sl);
    return out;
  }
  Scales scales;
  if (kc.scalar_type() == at::kChar) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(),
                "paged_attention: an int8 cache needs k_scale and v_scale");
    ksc = k_scale->contiguous();
    vsc = v_scale->contiguous();
    TORCH_CHECK(ksc.scalar_type() == at::kHalf && vsc.scalar_type() == at::kHalf,
                "paged_attention: scales must be float16 [slots, kv_heads]");
    TORCH_CHECK(ksc.numel() == kc.size(0) * kc.size(1) * kc.size(2) &&
                vsc.numel() == ksc.numel(), "paged_attention: scale shape mismatch");
    scales.k = ksc.data_ptr<c10::Half>();
    scales.v = vsc.data_ptr<c10::Half>();
  } else if (kc.scalar_type() == at::kFloat8_e4m3fn || kc.scalar_type() == at::kFloat8_e5m2) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(),
                "paged_attention: an fp8 cache needs k_scale and v_scale");
    ksc = k_scale->contiguous();
    vsc = v_scale->contiguous();
    if (ksc.scalar_type() == at::kHalf) {  // per (slot, KV head), as int8
      TORCH_CHECK(vsc.scalar_type() == at::kHalf &&
                      ksc.numel() == kc.size(0) * kc.size(1) * kc.size(2) &&
                      vsc.numel() == ksc.numel(),
                  "paged_attention: fp8 token scales must be float16 [slots, kv_heads]");
      scales.k = ksc.data_ptr<c10::Half>();
      scales.v = vsc.data_ptr<c10::Half>();
    } else {
      TORCH_CHECK(ksc.scalar_type() == at::kFloat && vsc.scalar_type() == at::kFloat &&
                      ksc.numel() == kc.size(2) && vsc.numel() == kc.size(2),
                  "paged_attention: fp8 head scales must be float32 [kv_heads]");
      scales.k_head = ksc.data_ptr<float>();
      scales.v_head = vsc.data_ptr<float>();
    }
  }
  switch (qc.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(qc, kc, vc, tc, lc, qsc, out, scale, softcap, window, sinks,
                                    scales, sl);
      break;
    case at::kBFloat16:
      dispatch_cache<c10::BFloat16>(qc, kc, vc, tc, lc, qsc, out, scale, softcap, window, sinks,
                                    scales, sl);
      break;
    case at::kHalf:
      dispatch_cache<c10::Half>(qc, kc, vc, tc, lc, qsc, out, scale, softcap, window, sinks,
                                    scales, sl);
      break;
    default: TORCH_CHECK(false, "paged_attention: unsupported query dtype ", qc.scalar_type());
  }
  return out;
}

// True when this build reads tiled caches of head_dim `d` (tiles_readable: bf16 queries on
// bf16, int8 and fp8 caches alike).
bool tiled_kv_supported(int64_t d) {
  return kvserve_tiles::tiles_readable(at::kBFloat16, at::kBFloat16, d);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("tiled_kv_supported(int head_dim) -> bool", TORCH_FN(tiled_kv_supported));
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
        "Tensor lens, Tensor query_start, float scale, int window, int sinks=0, "
        "Tensor? k_scale=None, Tensor? v_scale=None, float softcap=0., "
        "Tensor? sink_logits=None) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}

namespace kvserve {  // entry point for C++ callers (ops.h)
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& tables,
                           const at::Tensor& lens, const at::Tensor& query_start, double scale,
                           int64_t window, int64_t sinks,
                           const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale, double softcap) {
  return ::paged_attention(q, k_cache, v_cache, tables, lens, query_start, scale, window, sinks,
                           k_scale, v_scale, softcap, std::nullopt);
}
}  // namespace kvserve
