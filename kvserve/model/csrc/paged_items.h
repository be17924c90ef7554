// Work items and K/V prefetch for the paged attention kernels (paged_attention.cpp for caches
// of rows, paged_attention_tiles.cpp for tiled bf16 caches): which query rows and KV heads a
// thread takes at a time, which positions they see, and where a cell's bytes are.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace kvserve_items {

constexpr int64_t CELL = 16;           // positions per cell (kvserve_cell::CELL)
// how far ahead a sequence's K/V are prefetched; also how many cells' lines a Trickle holds,
// which must be at least a span's (paged_attention_tiles.cpp checks)
constexpr int64_t PREFETCH_CELLS = 4;
constexpr int64_t TILE_FLOATS = 4096;  // query rows per work item: this many floats of q

// A row's visible keys: [0, sink_end) and [start, len), in position order.
struct Visible {
  int64_t sink_end, start, len;
};

inline Visible visible(int64_t len, int64_t window, int64_t sinks) {
  const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  return {std::min(sinks, start), start, len};
}

// The lanes of the cell at position `cl` that a row with visible keys `v` sees.
inline uint16_t row_lanes(const Visible& v, int64_t cl) {
  auto range = [](int64_t a, int64_t b) -> uint32_t {  // lanes [a, b) clipped to the cell
    a = std::max<int64_t>(a, 0), b = std::min<int64_t>(b, CELL);
    return a < b ? ((1u << b) - 1u) & ~((1u << a) - 1u) : 0u;
  };
  return static_cast<uint16_t>(range(-cl, v.sink_end - cl) | range(v.start - cl, v.len - cl));
}

struct Item {  // one sequence's query rows [r0, r1) against its KV heads [h0, h1)
  int64_t seq, r0, r1, h0, h1, cost;
  int64_t lo, hi;  // the positions some row of the item sees lie in [lo, hi)
};

// The items of a call: each sequence's query rows (qs[s] .. qs[s + 1] - 1, the last of its
// lp[s] positions) in tiles of `tile` rows. A thread takes all KV heads of a (sequence,
// tile): slot rows are [Hkv, D], so an item reads each cell in one contiguous sweep instead
// of Hkv strided ones (measured: decode attention ~20 % faster from DRAM). With fewer such
// items than twice the threads (one sequence decoding alone), the heads are split into
// groups so every thread has work. Longest first, so the dynamic schedule ends with short
// items (results do not depend on the order: every item writes its own rows).
inline std::vector<Item> make_items(int64_t S, const int64_t* qs, const int64_t* lp,
                                    int64_t tile, int64_t Hkv, int64_t window, int64_t sinks,
                                    int threads) {
  int64_t tiles = 0;
  for (int64_t s = 0; s < S; ++s) tiles += (qs[s + 1] - qs[s] + tile - 1) / tile;
  const int64_t groups =
      std::min<int64_t>(Hkv, std::max<int64_t>(1, (2 * threads + tiles - 1) / tiles));
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = qs[s + 1] - qs[s];
    for (int64_t r0 = 0; r0 < n; r0 += tile) {
      const int64_t r1 = std::min(n, r0 + tile);
      const int64_t keys = std::min(lp[s] - n + r1, window > 0 ? window + sinks : lp[s]);
      // a row's start is monotonic in its position: the first row sees the lowest keys
      const Visible v0 = visible(lp[s] - n + r0 + 1, window, sinks);
      const int64_t lo = v0.sink_end > 0 ? 0 : v0.start, hi = lp[s] - n + r1;
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t h0 = gi * Hkv / groups, h1 = (gi + 1) * Hkv / groups;
        items.push_back({s, r0, r1, h0, h1, keys * (r1 - r0) * (h1 - h0), lo, hi});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

// A run of K and V bytes (n 64-byte lines from k and from v) to prefetch.
struct Lines {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t n = 0;
};

// Lines [i0, i1) of c into L1 (locality 3, prefetcht0), although 4 cells of K and V are as
// large as a Zen 5 L1 for 3 KV heads of 64 (48 KiB). Measured against locality 1 (L2) on
// that machine: decode attention from DRAM 5-8 % faster, prefill unchanged; 2 cells ahead
// gave the same, 6 less (benchmarks/history/notebook.md, tenth round). Used by the rows kernel and for the
// first cells of an item; a tiled decode span spreads its own into L2 instead (Trickle).
inline void prefetch(const Lines& c, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < std::min(c.n, i1); ++i) {
    __builtin_prefetch(c.k + 64 * i, 0, 3);
    __builtin_prefetch(c.v + 64 * i, 0, 3);
  }
}

// The lines of the cells a span prefetches, issued a few at a time from inside the span's
// arithmetic (step) instead of in one burst before it, and into L2 (prefetcht2), not L1.
// A burst of a span's lines into L1 (768 for bf16 and 3 KV heads of 64) outruns the
// core's L1 miss buffers: the prefetches wait for free ones, and so does every load behind
// them, so the span's arithmetic does not start until most of the burst has left. Spread
// over the span's dot products, the misses stay in flight while it runs; sent to L2, they
// take L2's miss buffers, of which there are more, and the span's own loads find their
// lines there. Decode attention from DRAM, paired against the burst (attention_ab.py
// --layout tiles, Zen 4): L1 spread 0.83-0.86x the time, L2 spread 0.65-0.73x; prefetcht1
// 0.74x, non-temporal 0.85x; issued over half the span or 8 cells ahead instead of 4, no
// better. What is prefetched, and so every result, is the same either way.
class Trickle {
 public:
  // Forgets what is left.
  void reset() {
    n_ = next_ = 0;
    rem_ = per_ = 0;
  }
  // Queues a run of lines: up to PREFETCH_CELLS runs, any beyond that are dropped; empty
  // ones are skipped (a run in the queue is never empty, which step() relies on).
  void add(const Lines& c) {
    if (c.n > 0 && n_ < PREFETCH_CELLS) runs_[n_++] = c;
    if (rem_ == 0) load();
  }
  // K and V lines left to issue.
  int64_t left() const {
    int64_t t = rem_;
    for (int i = next_; i < n_; ++i) t += runs_[i].n;
    return t;
  }
  // Sets how many lines each step() issues: enough that `points` calls leave none (fewer
  // calls leave some, for drain()).
  void pace(int64_t points) { per_ = points > 0 ? (left() + points - 1) / points : left(); }
  // Issues the next per_ K lines and as many V lines (fewer when fewer are left).
  inline void step() {
    for (int64_t i = 0; i < per_ && rem_ > 0; ++i) {
      __builtin_prefetch(k_, 0, 1);
      __builtin_prefetch(v_, 0, 1);
      k_ += 64, v_ += 64;
      if (--rem_ == 0) load();
    }
  }
  // Issues everything left.
  void drain() {
    per_ = left();
    step();
  }

 private:
  void load() {
    if (next_ == n_) return;
    k_ = runs_[next_].k, v_ = runs_[next_].v, rem_ = runs_[next_].n;
    ++next_;
  }
  Lines runs_[PREFETCH_CELLS];
  int n_ = 0, next_ = 0;
  const char* k_ = nullptr;
  const char* v_ = nullptr;
  int64_t rem_ = 0, per_ = 0;
};

// Where cell k of an item (cells counted from the one holding item.lo) lies in caches of
// `bs`-slot blocks, `row_bytes` a slot: the item's positions in it, or the whole cell when
// `whole` (a tile is read whole). Lines{} past the item's last cell.
struct CellLines {
  const char* kp;
  const char* vp;
  const int64_t* tables;
  int64_t max_blocks, bs, row_bytes;
  bool whole;

  Lines operator()(const Item& item, int64_t k) const {
    const int64_t aligned = item.lo - item.lo % CELL + k * CELL;
    const int64_t p = std::max(aligned, item.lo), end = std::min(aligned + CELL, item.hi);
    if (p >= end) return Lines{};
    const int64_t first = whole ? aligned : p;
    const int64_t slot = tables[item.seq * max_blocks + first / bs] * bs + first % bs;
    const int64_t bytes = (whole ? CELL : std::min(end - p, bs - p % bs)) * row_bytes;
    return Lines{kp + slot * row_bytes, vp + slot * row_bytes, (bytes + 63) / 64};
  }
};

// One thread's items, claimed one ahead from a counter shared by the threads of a call: a
// dynamic schedule in which each thread knows its next item, so an item's last cells
// prefetch the next item's first ones and a new sequence does not start on a stall.
class Claims {
 public:
  Claims(const std::vector<Item>& items, std::atomic<int64_t>& counter, const CellLines& lines)
      : items_(items), counter_(counter), lines_(lines),
        next_(counter.fetch_add(1, std::memory_order_relaxed)) {}

  // The thread's next item, or nullptr when none is left. The first cells of it that the
  // item before did not prefetch (all of them, for a thread's first item) are fetched now,
  // in one burst.
  const Item* next() {
    const int64_t n = static_cast<int64_t>(items_.size());
    if (next_ >= n) return nullptr;
    cur_ = items_[next_];
    next_ = counter_.fetch_add(1, std::memory_order_relaxed);
    after_ = next_ < n ? &items_[next_] : nullptr;
    cells_ = (cur_.hi - 1) / CELL - cur_.lo / CELL + 1;
    for (int64_t k = 0; k < std::min(head_fetched_, cells_); ++k)
      prefetch(lines_(cur_, k), 0, INT64_MAX);
    head_fetched_ = std::max<int64_t>(0, PREFETCH_CELLS - cells_);
    return &cur_;
  }

  // What to prefetch while cell k of the current item runs: its cell k + PREFETCH_CELLS,
  // or past its last cell the next item's first ones (Lines{} after the last item).
  Lines ahead(int64_t k) const {
    const int64_t a = k + PREFETCH_CELLS;
    if (a < cells_) return lines_(cur_, a);
    return after_ ? lines_(*after_, a - cells_) : Lines{};
  }

 private:
  const std::vector<Item>& items_;
  std::atomic<int64_t>& counter_;
  const CellLines& lines_;
  int64_t next_;
  Item cur_{};
  const Item* after_ = nullptr;
  int64_t cells_ = 0;
  int64_t head_fetched_ = PREFETCH_CELLS;  // cells of the next item prefetched already
};

}  // namespace kvserve_items
