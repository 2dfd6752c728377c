#pragma once
// shared_buffer<T>: memory allocated collectively by the ranks of one host, addressable by all.
//
// Every rank of a group calls allocate<T>(n) with the same n, in the same order
// (e.g. ddp::algo::shm_communicator::allocate). Each rank gets its own n elements, in a
// shared-memory segment that every rank of the group has mapped, so collectives on spans inside
// it read and write the peers' memory in place instead of copying through staging buffers.
// Segments are unlinked right after every rank has mapped them: nothing stays in /dev/shm.
//
// To the owner it is a plain contiguous, zero-initialized, move-only container of T.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/transport/detail/shm_segment.hpp"

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
/// buffer unmaps it once no collective is using it.
class shared_registry {
 public:
  void add(const std::shared_ptr<shared_allocation>& a) {
    std::lock_guard lock(mutex_);
    prune_locked();
    by_id_[a->id] = a;
    by_start_[a->own()] = a;
  }
  std::shared_ptr<shared_allocation> find(std::uint64_t id) const {
    std::lock_guard lock(mutex_);
    const auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : it->second.lock();
  }
  struct location {
    std::shared_ptr<shared_allocation> allocation;
    std::size_t offset;
  };
  /// The allocation whose own segment holds [p, p + bytes), if any: the one that starts last at
  /// or before p (a collective looks this up on every call; a DDP model has one per bucket).
  /// Entries never overlap: add() drops the freed ones before a new mapping can reuse their
  /// addresses, so no live segment can hold p when that one does not.
  std::optional<location> find_span(const void* p, std::size_t bytes) const {
    const auto* b = static_cast<const std::byte*>(p);
    std::lock_guard lock(mutex_);
    auto it = by_start_.upper_bound(b);
    if (it == by_start_.begin()) return std::nullopt;
    auto a = std::prev(it)->second.lock();
    if (!a) return std::nullopt;
    const std::byte* own = a->own();
    if (b >= own && b + bytes <= own + a->bytes) return location{std::move(a), static_cast<std::size_t>(b - own)};
    return std::nullopt;
  }

 private:
  void prune_locked() {
    const auto freed = [](const auto& entry) { return entry.second.expired(); };
    std::erase_if(by_id_, freed);
    std::erase_if(by_start_, freed);
  }
  mutable std::mutex mutex_;
  std::map<std::uint64_t, std::weak_ptr<shared_allocation>> by_id_;
  std::map<const std::byte*, std::weak_ptr<shared_allocation>> by_start_;  // the same, by the start of this rank's segment
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
