#pragma once
// shared_buffer<T>: memory allocated collectively by the ranks of one host, addressable by all.
//
// Every rank of a group calls allocate<T>(n) with the same n, in the same order
// (e.g. ddp::algo::shm_communicator::allocate). Each rank gets its own n elements, in a
// shared-memory segment that every rank of the group has mapped, so collectives on spans inside
// it read and write the peers' memory in place instead of copying through staging buffers.
// Segments are anonymous memory (memfd): nothing is ever named in /dev/shm.
//
// To the owner it is a plain contiguous, zero-initialized, move-only container of T.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/backends/ring/transport/shm_segment.hpp"

namespace ddp {

namespace detail {

/// One collective allocation: rank r's segment, as mapped in this process, for every r.
struct shared_allocation {
  std::uint64_t id = 0;     // the allocation's number in its group (the same on every rank)
  int rank = 0;             // this process's rank in the group
  std::size_t bytes = 0;    // per rank
  std::vector<shm::shm_segment> segments;

  std::byte* base(int r) const noexcept { return segments[static_cast<std::size_t>(r)].data(); }
  std::byte* own() const noexcept { return base(rank); }
};

/// The live allocations of one group in this process, so a collective can tell whether a span
/// lies inside one (and where the peers' copies are). It holds weak references: freeing a
/// buffer unmaps it once no collective is using it. Used by one communicator, whose calls (and
/// allocations) run one at a time: no lock.
class shared_registry {
 public:
  void add(const std::shared_ptr<shared_allocation>& a) {
    prune();
    by_id_[a->id] = a;
    by_start_[a->own()] = entry{a, a.get(), a->bytes};
  }
  std::shared_ptr<shared_allocation> find(std::uint64_t id) const {
    const auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : it->second.lock();
  }
  struct location {
    const shared_allocation* allocation;  // alive as long as the memory at the span is
    std::size_t offset;
  };
  /// The allocation whose own segment holds [p, p + bytes), if any: the one that starts last at
  /// or before p (a collective looks this up on every call; a DDP model has one per bucket).
  /// Entries never overlap: add() drops the freed ones before a new mapping can reuse their
  /// addresses, so no live segment can hold p when that one does not. No reference is taken (a
  /// collective's own span must stay valid until the call returns, so its allocation does);
  /// the entry's address range is kept beside the weak reference, so a freed entry is never
  /// dereferenced.
  std::optional<location> find_span(const void* p, std::size_t bytes) const noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    auto it = by_start_.upper_bound(b);
    if (it == by_start_.begin()) return std::nullopt;
    --it;
    const entry& e = it->second;
    if (b + bytes > it->first + e.bytes || e.allocation.expired()) return std::nullopt;
    return location{e.raw, static_cast<std::size_t>(b - it->first)};
  }

 private:
  struct entry {
    std::weak_ptr<shared_allocation> allocation;
    const shared_allocation* raw;  // only while `allocation` has not expired
    std::size_t bytes;
  };
  void prune() {
    std::erase_if(by_id_, [](const auto& e) { return e.second.expired(); });
    std::erase_if(by_start_, [](const auto& e) { return e.second.allocation.expired(); });
  }
  std::map<std::uint64_t, std::weak_ptr<shared_allocation>> by_id_;
  std::map<const std::byte*, entry> by_start_;  // the same, by the start of this rank's segment
};

}  // namespace detail

template <class T>
class shared_buffer {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>,
                "shared_buffer holds raw shared memory: T must be trivially copyable and destructible");

 public:
  using value_type = T;
  using size_type = std::size_t;
  using iterator = T*;
  using const_iterator = const T*;

  shared_buffer() = default;
  shared_buffer(const shared_buffer&) = delete;
  shared_buffer& operator=(const shared_buffer&) = delete;
  shared_buffer(shared_buffer&& o) noexcept : allocation_(std::move(o.allocation_)), size_(std::exchange(o.size_, 0)) {}
  shared_buffer& operator=(shared_buffer&& o) noexcept {
    allocation_ = std::move(o.allocation_);
    size_ = std::exchange(o.size_, 0);
    return *this;
  }
  ~shared_buffer() = default;

  /// For communicators: wraps an allocation of at least n * sizeof(T) bytes per rank.
  shared_buffer(std::shared_ptr<detail::shared_allocation> allocation, std::size_t n) noexcept
      : allocation_(std::move(allocation)), size_(n) {}

  T* data() noexcept { return allocation_ ? reinterpret_cast<T*>(allocation_->own()) : nullptr; }
  const T* data() const noexcept { return allocation_ ? reinterpret_cast<const T*>(allocation_->own()) : nullptr; }
  std::size_t size() const noexcept { return size_; }
  std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  bool empty() const noexcept { return size_ == 0; }

  T& operator[](std::size_t i) noexcept { return data()[i]; }
  const T& operator[](std::size_t i) const noexcept { return data()[i]; }
  T* begin() noexcept { return data(); }
  T* end() noexcept { return data() + size_; }
  const T* begin() const noexcept { return data(); }
  const T* end() const noexcept { return data() + size_; }

  std::span<T> span() noexcept { return {data(), size_}; }
  std::span<const T> span() const noexcept { return {data(), size_}; }
  operator std::span<T>() noexcept { return span(); }
  operator std::span<const T>() const noexcept { return span(); }

  /// The number of this allocation in its group (the same on every rank).
  std::uint64_t id() const noexcept { return allocation_ ? allocation_->id : 0; }

 private:
  std::shared_ptr<detail::shared_allocation> allocation_;
  std::size_t size_ = 0;
};

}  // namespace ddp
