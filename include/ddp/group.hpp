#pragma once
// ddp::group: a process group whose backend is chosen at run time (what
// init_process_group returns). Same member API as process_group<B>; each call is dispatched on
// its dtype and reduce_kind into the concrete process_group, so it behaves exactly like it
// (argument checks, sequence numbers, async queue, timeouts, statistics).
//
// Reduce ops cross the type erasure by their kind (sum, avg, min, max, prod), as they do for
// NCCL and MPI. group is move-only; a default-constructed group is invalid (not a member).
// get_if<B>() gives back the concrete process_group<B> when code needs the backend itself.

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddp/core/collective.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/process_group/group_model.hpp"
#include "ddp/process_group/range_calls.hpp"
#include "ddp/process_group.hpp"
#include "ddp/work.hpp"

namespace ddp {

/// Memory from group::allocate: n elements, shared with same-host ranks when shared() is true.
/// Move-only owner semantics through a shared holder; contiguous, so every collective takes it.
template <dtype_like T>
class group_buffer {
 public:
  group_buffer() = default;
  group_buffer(std::shared_ptr<void> owner, T* data, std::size_t n, bool shared)
      : owner_(std::move(owner)), data_(data), size_(n), shared_(shared) {}

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  T* begin() noexcept { return data_; }
  T* end() noexcept { return data_ + size_; }
  const T* begin() const noexcept { return data_; }
  const T* end() const noexcept { return data_ + size_; }
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }
  std::span<T> span() noexcept { return {data_, size_}; }
  std::span<const T> span() const noexcept { return {data_, size_}; }
  /// Whether every same-host rank of the group can address this memory (zero-copy collectives).
  bool shared() const noexcept { return shared_; }

 private:
  std::shared_ptr<void> owner_;
  T* data_ = nullptr;
  std::size_t size_ = 0;
  bool shared_ = false;
};

class group : public detail::pg_range_calls<group> {
 public:
  /// An invalid group (what non-members of a sub-group get).
  group() = default;
  template <ddp::backend B>
  explicit group(process_group<B> g)
      : impl_(g.valid() ? std::make_unique<detail::pg_group_model<B>>(std::move(g)) : nullptr) {}
  group(group&&) noexcept = default;
  group& operator=(group&&) noexcept = default;

  bool valid() const noexcept { return impl_ != nullptr; }
  explicit operator bool() const noexcept { return valid(); }
  int rank() const noexcept { return impl_ ? impl_->rank() : -1; }
  int size() const noexcept { return impl_ ? impl_->size() : 0; }
  /// "ring", "nccl", "mpi", or the backend's own name.
  std::string_view backend_name() const noexcept { return impl_ ? impl_->backend_name() : std::string_view("none"); }
  memory_space memory() const { return live().memory(); }
  std::chrono::milliseconds timeout() const { return live().timeout(); }
  void set_timeout(std::chrono::milliseconds t) { live().set_timeout(t); }
  std::uint64_t next_sequence() const { return live().next_sequence(); }
  group_stats stats() const { return live().stats(); }
  bool broken() const noexcept { return impl_ && impl_->broken(); }

  /// The concrete process group, or nullptr when the backend is not B.
  template <ddp::backend B>
  process_group<B>* get_if() noexcept {
    auto* model = dynamic_cast<detail::pg_group_model<B>*>(impl_.get());
    return model ? &model->group() : nullptr;
  }

  // --- collectives (see process_group for the semantics) -----------------------------------
  template <dtype_like T, reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  void all_reduce(std::span<T> data, Op = {}) { call(collective::all_reduce, dtype_of<T>, Op::kind, data.data(), data.size(), data.data(), data.size()); }
  template <dtype_like T, reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  void all_reduce(std::span<const T> in, std::span<T> out, Op = {}) {
    call(collective::all_reduce, dtype_of<T>, Op::kind, in.data(), in.size(), out.data(), out.size());
  }
  template <dtype_like T, reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  work all_reduce_async(std::span<T> data, Op = {}) {
    return call(collective::all_reduce, dtype_of<T>, Op::kind, data.data(), data.size(), data.data(), data.size(), -1, true);
  }
  template <dtype_like T, reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  work all_reduce_async(std::span<const T> in, std::span<T> out, Op = {}) {
    return call(collective::all_reduce, dtype_of<T>, Op::kind, in.data(), in.size(), out.data(), out.size(), -1, true);
  }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  void broadcast(std::span<T> data, int root) { call(collective::broadcast, dtype_of<T>, reduce_kind::sum, data.data(), data.size(), data.data(), data.size(), root); }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  work broadcast_async(std::span<T> data, int root) {
    return call(collective::broadcast, dtype_of<T>, reduce_kind::sum, data.data(), data.size(), data.data(), data.size(), root, true);
  }
  template <dtype_like T, reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  void reduce(std::span<T> data, int root, Op = {}) { call(collective::reduce, dtype_of<T>, Op::kind, data.data(), data.size(), data.data(), data.size(), root); }
  template <dtype_like T, reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  work reduce_async(std::span<T> data, int root, Op = {}) {
    return call(collective::reduce, dtype_of<T>, Op::kind, data.data(), data.size(), data.data(), data.size(), root, true);
  }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  void all_gather(std::span<const T> in, std::span<T> out) { call(collective::all_gather, dtype_of<T>, reduce_kind::sum, in.data(), in.size(), out.data(), out.size()); }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  work all_gather_async(std::span<const T> in, std::span<T> out) {
    return call(collective::all_gather, dtype_of<T>, reduce_kind::sum, in.data(), in.size(), out.data(), out.size(), -1, true);
  }
  template <dtype_like T, reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op = {}) {
    call(collective::reduce_scatter, dtype_of<T>, Op::kind, in.data(), in.size(), out.data(), out.size());
  }
  template <dtype_like T, reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  work reduce_scatter_async(std::span<const T> in, std::span<T> out, Op = {}) {
    return call(collective::reduce_scatter, dtype_of<T>, Op::kind, in.data(), in.size(), out.data(), out.size(), -1, true);
  }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  void all_to_all(std::span<const T> in, std::span<T> out) { call(collective::all_to_all, dtype_of<T>, reduce_kind::sum, in.data(), in.size(), out.data(), out.size()); }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  work all_to_all_async(std::span<const T> in, std::span<T> out) {
    return call(collective::all_to_all, dtype_of<T>, reduce_kind::sum, in.data(), in.size(), out.data(), out.size(), -1, true);
  }
  void barrier() { call(collective::barrier, dtype::uint8, reduce_kind::sum, nullptr, 0, nullptr, 0); }
  work barrier_async() { return call(collective::barrier, dtype::uint8, reduce_kind::sum, nullptr, 0, nullptr, 0, -1, true); }
  template <dtype_like T>
  void send(std::span<const T> data, int peer) { call(collective::send, dtype_of<T>, reduce_kind::sum, data.data(), data.size(), nullptr, 0, peer); }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  void recv(std::span<T> data, int peer) { call(collective::recv, dtype_of<T>, reduce_kind::sum, nullptr, 0, data.data(), data.size(), peer); }
  template <dtype_like T>
  work send_async(std::span<const T> data, int peer) {
    return call(collective::send, dtype_of<T>, reduce_kind::sum, data.data(), data.size(), nullptr, 0, peer, true);
  }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  work recv_async(std::span<T> data, int peer) {
    return call(collective::recv, dtype_of<T>, reduce_kind::sum, nullptr, 0, data.data(), data.size(), peer, true);
  }

  // --- any contiguous range (std::vector, std::array, thrust::host_vector, ...) ------------
  using ranges = detail::pg_range_calls<group>;
  using ranges::all_reduce, ranges::all_reduce_async, ranges::broadcast, ranges::broadcast_async, ranges::reduce;
  using ranges::all_gather, ranges::all_gather_async, ranges::reduce_scatter, ranges::reduce_scatter_async;
  using ranges::all_to_all, ranges::send, ranges::recv;

  /// Any collective as one record (op, dtype, reduction, buffers, counts, root or peer): what
  /// code that holds untyped buffers (the data-parallel wrapper's buckets) calls. Checked as the
  /// typed calls are; async when `async`.
  work call(const collective_call& c, bool async = false) { return live().call(c, async); }

  // --- memory and sub-groups -----------------------------------------------------------------
  template <dtype_like T>
  group_buffer<T> allocate(std::size_t n) {
    void* data = nullptr;
    bool shared = false;
    auto owner = live().allocate(dtype_of<T>, n, &data, &shared);
    return group_buffer<T>(std::move(owner), static_cast<T*>(data), n, shared);
  }
  /// Copies bytes in the backend's memory space (std::memcpy on host, cudaMemcpy for nccl).
  void copy_memory(void* dst, const void* src, std::size_t bytes) { live().copy_memory(dst, src, bytes); }
  /// See process_group::new_group: every rank calls it; non-members get an invalid group.
  group new_group(std::vector<int> ranks) { return group(live().new_group(std::move(ranks))); }

 private:
  explicit group(std::unique_ptr<detail::pg_group_interface> impl) : impl_(std::move(impl)) {}

  detail::pg_group_interface& live() const {
    if (!impl_) {
      throw error(errc::invalid_argument,
                  "this process is not a member of the group (an invalid group, e.g. from new_group() on a non-member rank)");
    }
    return *impl_;
  }

  work call(collective op, dtype type, reduce_kind k, const void* in, std::size_t in_n, void* out, std::size_t out_n, int root = -1,
            bool async = false) {
    return live().call({.op = op, .type = type, .reduction = k, .root = root, .in = in, .in_count = in_n, .out = out, .out_count = out_n},
                       async);
  }

  std::unique_ptr<detail::pg_group_interface> impl_;
};

}  // namespace ddp
