#pragma once
// A decorator: traced_backend<Inner> wraps a backend that takes call records (the ring backend)
// and keeps, per collective kind, how many calls it ran, their bytes and the time spent in the
// wrapped backend. A user's tracing, logging or fault-injection layer starts the same way: it
// receives each call as one ddp::collective_call in run(), does its part and hands the record on.
//
//   ddp::register_backend("traced", [](const ddp::backend_context& c) {
//     return ddp::group(ddp::process_group<example::traced_backend<ddp::ring_backend>>(
//         example::traced_backend(ddp::make_ring_backend(c)), {.timeout = c.options.timeout}));
//   });
//   auto g = ddp::init_process_group("traced");
//   ...
//   auto* traced = g.get_if<example::traced_backend<ddp::ring_backend>>();
//   traced->backend().of(ddp::collective::all_reduce).calls

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <ddp/core/collective.hpp>
#include <ddp/core/concepts.hpp>
#include <ddp/core/deadline.hpp>

namespace example {

template <class Inner>
class traced_backend {
 public:
  static constexpr ddp::memory_space memory = Inner::memory;
  static constexpr std::string_view name = "traced";
  static constexpr bool takes_call_records = true;

  struct totals {
    std::uint64_t calls = 0;
    std::uint64_t bytes = 0;
    std::chrono::nanoseconds time{0};
  };

  explicit traced_backend(Inner inner) : inner_(std::move(inner)) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  void abort() noexcept { inner_.abort(); }

  /// Every call of ddp's own reductions arrives here, checked and numbered by process_group.
  void run(const ddp::collective_call& c, const ddp::collective_desc& d, ddp::deadline until) {
    const auto start = std::chrono::steady_clock::now();
    inner_.run(c, d, until);
    totals& t = totals_[static_cast<std::size_t>(c.op)];
    ++t.calls;
    t.bytes += c.traffic_bytes();
    t.time += std::chrono::steady_clock::now() - start;
  }

  // The ddp::backend minimum, forwarded (a user's own reduce op reaches the backend this way).
  template <ddp::dtype_like T, class Op>
  void all_reduce(std::span<T> data, Op op) {
    inner_.all_reduce(data, op);
  }
  template <ddp::dtype_like T>
  void broadcast(std::span<T> data, int root) {
    inner_.broadcast(data, root);
  }

  // Sub-groups and shared memory, forwarded: new_group and allocate work as on the inner backend.
  traced_backend split(std::span<const int> ranks, const std::string& tag) const { return traced_backend(inner_.split(ranks, tag)); }
  template <ddp::dtype_like T>
  auto allocate(std::size_t n) {
    return inner_.template allocate<T>(n);
  }

  const totals& of(ddp::collective op) const { return totals_[static_cast<std::size_t>(op)]; }
  Inner& inner() noexcept { return inner_; }

 private:
  Inner inner_;
  std::array<totals, 12> totals_{};
};

}  // namespace example
