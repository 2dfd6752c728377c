#pragma once
// store_backend: a ddp backend written by a user against the public ddp::backend concept only.
// Every collective goes through the rendezvous store (each rank posts its bytes under a key for
// the call and reads everyone's): slow, but simple, and it works wherever the store works.
// ddp::process_group<store_backend> adds argument checks, sequence numbers, the async queue,
// timeouts (its watchdog calls abort()), statistics; all_to_all comes from process_group too.

#include <atomic>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <ddp/core/concepts.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/reduce_op.hpp>
#include <ddp/store/store.hpp>

namespace example {

class store_backend {
 public:
  static constexpr ddp::memory_space memory = ddp::memory_space::host;
  static constexpr std::string_view name = "store";
  // Beyond the minimum (rank, size, all_reduce, broadcast, abort): one store round each instead
  // of process_group's fallbacks.
  static constexpr ddp::backend_capabilities capabilities{.all_gather = true, .reduce_scatter = true, .barrier = true};

  store_backend(std::shared_ptr<ddp::store::store> store, int rank, int size, std::string prefix = "store_backend")
      : store_(std::move(store)), rank_(rank), size_(size), prefix_(std::move(prefix)) {}

  int rank() const { return rank_; }
  int size() const { return size_; }

  template <ddp::dtype_like T, ddp::reduce_op Op>
  void all_reduce(std::span<T> data, Op op) {
    const auto all = exchange(std::as_bytes(data));
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = reduced<T>(all, i, op);
  }
  template <ddp::dtype_like T>
  void broadcast(std::span<T> data, int root) {
    const auto all = exchange(rank_ == root ? std::as_bytes(data) : std::span<const std::byte>{});
    if (!data.empty()) std::memcpy(data.data(), all[static_cast<std::size_t>(root)].data(), data.size_bytes());
  }
  template <ddp::dtype_like T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    const auto all = exchange(std::as_bytes(in));
    for (std::size_t r = 0; r < all.size(); ++r)
      if (!in.empty()) std::memcpy(out.data() + r * in.size(), all[r].data(), in.size_bytes());
  }
  template <ddp::dtype_like T, ddp::reduce_op Op>
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op) {
    const auto all = exchange(std::as_bytes(in));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = reduced<T>(all, static_cast<std::size_t>(rank_) * out.size() + i, op);
  }
  void barrier() { exchange({}); }

  // Called by process_group's watchdog when a deadline passes: the waiting loop below notices.
  void abort() noexcept { aborted_->store(true); }

 private:
  // Element i over all ranks, in the accumulation type (float for float16/bfloat16).
  template <class T, class Op>
  T reduced(const std::vector<std::vector<std::byte>>& all, std::size_t i, Op op) const {
    auto at = [&](std::size_t r) {
      T v;
      std::memcpy(&v, all[r].data() + i * sizeof(T), sizeof(T));
      return static_cast<ddp::accumulate_t<T>>(v);
    };
    auto acc = at(0);
    for (std::size_t r = 1; r < all.size(); ++r) acc = op(acc, at(r));
    return T(op.finish(acc, size_));
  }

  // Call k: rank r sets <prefix>/<k>/<r>; everyone waits for all, reads all; the last reader
  // erases the call's keys so the store does not grow.
  std::vector<std::vector<std::byte>> exchange(std::span<const std::byte> mine) {
    const std::string call = prefix_ + "/" + std::to_string(calls_++) + "/";
    store_->set(call + std::to_string(rank_), mine);
    std::vector<std::string> keys;
    for (int r = 0; r < size_; ++r) keys.push_back(call + std::to_string(r));
    for (;;) {  // short waits, so abort() is noticed within one of them
      if (aborted_->load()) throw ddp::error(ddp::errc::peer_lost, "store_backend was aborted while waiting for the other ranks");
      try {
        store_->wait(keys, std::chrono::milliseconds(20));
        break;
      } catch (const ddp::error& e) {
        if (e.code() != ddp::errc::timeout) throw;
      }
    }
    std::vector<std::vector<std::byte>> all;
    for (const auto& k : keys) all.push_back(store_->get(k));
    if (store_->add(call + "read", 1) == size_) {
      for (const auto& k : keys) store_->erase(k);
      store_->erase(call + "read");
    }
    return all;
  }

  std::shared_ptr<ddp::store::store> store_;
  int rank_;
  int size_;
  std::string prefix_;
  std::uint64_t calls_ = 0;
  std::shared_ptr<std::atomic<bool>> aborted_ = std::make_shared<std::atomic<bool>>(false);  // keeps the backend movable
};

static_assert(ddp::backend<store_backend>);

}  // namespace example
