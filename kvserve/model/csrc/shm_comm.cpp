// Collectives between the tensor-parallel ranks of one machine over a shared-memory
// segment: torch.ops.kvserve.{shm_all_reduce, shm_gather}. Gloo moves a 9 KB decode
// activation between two local ranks in ~1.2 ms (TCP over loopback plus thread hand-offs);
// here it is a copy, a flag and a sum.
//
// Segment layout (zeroed at creation): one 64-byte line per rank holding its round counter
// (std::atomic<int64_t>), then two parities x world ranks x `capacity` bytes of data. Round
// s (1, 2, ...) of a collective: rank r copies its part into buffer (s % 2, r), publishes s
// with release order, and waits (acquire) until every rank has published s. The two
// parities make the next round's write safe without a second barrier: a rank that
// published s has finished reading round s - 1's buffers, and a rank starts round s + 1
// only after seeing every rank publish s. Tensors larger than `capacity` take several
// rounds. `seq` (an int64 CPU tensor the caller owns) counts rounds; every rank makes the
// same calls in the same order.
//
// Determinism: every rank sums the ranks' parts in rank order with float accumulation and
// rounds once, so all ranks get bit-identical results, and an element's sum does not depend
// on the tensor's size or on the chunking (the batch-invariance rule of the kernels).
// A rank that does not arrive within `timeout` seconds fails the call (RuntimeError): no
// wait is unbounded.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "float_convert.h"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLine = 64;

struct Segment {
  uint8_t* base;
  int64_t world;
  int64_t capacity;

  std::atomic<int64_t>* flag(int64_t r) const {
    return reinterpret_cast<std::atomic<int64_t>*>(base + r * kLine);
  }
  uint8_t* buf(int64_t parity, int64_t r) const {
    return base + world * kLine + (parity * world + r) * capacity;
  }
};

Segment segment(const at::Tensor& shm, int64_t world, int64_t capacity) {
  TORCH_CHECK(shm.dtype() == at::kByte && shm.is_contiguous(), "shm must be contiguous uint8");
  TORCH_CHECK(shm.numel() >= world * kLine + 2 * world * capacity, "shm segment too small");
  return Segment{shm.data_ptr<uint8_t>(), world, capacity};
}

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

void publish_and_wait(const Segment& s, int64_t rank, int64_t round, double timeout) {
  s.flag(rank)->store(round, std::memory_order_release);
  const auto start = std::chrono::steady_clock::now();
  int64_t spins = 0;
  for (int64_t p = 0; p < s.world; ++p) {
    while (s.flag(p)->load(std::memory_order_acquire) < round) {
      if (++spins < 20000) {
        relax();
        continue;
      }
      sched_yield();  // more ranks than free cores: let the peer run
      if ((spins & 255) == 0) {
        const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
        TORCH_CHECK(waited.count() < timeout, "shm collective: rank ", p,
                    " did not arrive within ", timeout, " s (dead?)");
      }
    }
  }
}

using kvserve_cpu::from_f;
using kvserve_cpu::to_f;

// out = the ranks' parts summed in rank order, in L1-sized tiles of float accumulators
// (loops over contiguous elements, which the compiler vectorizes).
template <typename T>
void reduce_into(T* out, const Segment& s, int64_t parity, int64_t n) {
  constexpr int64_t kTile = 1024;
  alignas(64) float acc[kTile];
  for (int64_t base = 0; base < n; base += kTile) {
    const int64_t m = std::min(kTile, n - base);
    const T* first = reinterpret_cast<const T*>(s.buf(parity, 0)) + base;
    for (int64_t i = 0; i < m; ++i) acc[i] = to_f(first[i]);
    for (int64_t p = 1; p < s.world; ++p) {
      const T* part = reinterpret_cast<const T*>(s.buf(parity, p)) + base;
      for (int64_t i = 0; i < m; ++i) acc[i] += to_f(part[i]);
    }
    for (int64_t i = 0; i < m; ++i) out[base + i] = from_f<T>(acc[i]);
  }
}

template <typename T>
void all_reduce_impl(at::Tensor& x, const Segment& s, int64_t* seq, int64_t rank,
                     double timeout) {
  T* data = x.data_ptr<T>();
  const int64_t total = x.numel();
  const int64_t chunk = s.capacity / static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < total; off += chunk) {
    const int64_t n = std::min(chunk, total - off);
    const int64_t round = ++*seq;
    const int64_t parity = round & 1;
    std::memcpy(s.buf(parity, rank), data + off, n * sizeof(T));
    publish_and_wait(s, rank, round, timeout);
    reduce_into<T>(data + off, s, parity, n);
  }
}

// x (in place) = the sum of every rank's x.
at::Tensor shm_all_reduce(at::Tensor x, const at::Tensor& shm, at::Tensor seq, int64_t rank,
                          int64_t world, int64_t capacity, double timeout) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "shm_all_reduce: contiguous CPU x");
  TORCH_CHECK(seq.dtype() == at::kLong && seq.numel() == 1, "seq: one int64");
  const Segment s = segment(shm, world, capacity);
  int64_t* sq = seq.data_ptr<int64_t>();
  switch (x.scalar_type()) {
    case at::kFloat: all_reduce_impl<float>(x, s, sq, rank, timeout); break;
    case at::kBFloat16: all_reduce_impl<c10::BFloat16>(x, s, sq, rank, timeout); break;
    case at::kHalf: all_reduce_impl<c10::Half>(x, s, sq, rank, timeout); break;
    default: TORCH_CHECK(false, "shm_all_reduce: float32, bfloat16 or float16, got ",
                         x.scalar_type());
  }
  return x;
}

// [world, *x.shape]: every rank's x (every rank's shape must be equal), on rank `dst`;
// other ranks get an empty tensor.
at::Tensor shm_gather(const at::Tensor& x, const at::Tensor& shm, at::Tensor seq, int64_t rank,
                      int64_t world, int64_t capacity, double timeout, int64_t dst) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "shm_gather: contiguous CPU x");
  const Segment s = segment(shm, world, capacity);
  int64_t* sq = seq.data_ptr<int64_t>();
  std::vector<int64_t> shape{world};
  for (auto d : x.sizes()) shape.push_back(d);
  at::Tensor out = rank == dst ? at::empty(shape, x.options()) : at::empty({0}, x.options());
  const int64_t total = x.numel() * x.element_size();
  const auto* src = static_cast<const uint8_t*>(x.data_ptr());
  auto* dstp = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t off = 0; off < total; off += capacity) {
    const int64_t n = std::min(capacity, total - off);
    const int64_t round = ++*sq;
    const int64_t parity = round & 1;
    std::memcpy(s.buf(parity, rank), src + off, n);
    publish_and_wait(s, rank, round, timeout);
    if (rank == dst) {
      for (int64_t p = 0; p < world; ++p) {
        std::memcpy(dstp + p * total + off, s.buf(parity, p), n);
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("shm_all_reduce(Tensor(a!) x, Tensor shm, Tensor(b!) seq, int rank, int world, "
        "int capacity, float timeout) -> Tensor(a!)");
  m.def("shm_gather(Tensor x, Tensor shm, Tensor(b!) seq, int rank, int world, int capacity, "
        "float timeout, int dst) -> Tensor");
  m.impl("shm_all_reduce", c10::DispatchKey::CPU, TORCH_FN(shm_all_reduce));
  m.impl("shm_gather", c10::DispatchKey::CPU, TORCH_FN(shm_gather));
}
