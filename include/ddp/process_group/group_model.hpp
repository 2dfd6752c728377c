#pragma once
// The run-time interface behind ddp::group and its implementation over a process_group<B>.
//
// A call crosses the interface as one ddp::collective_call. For a backend that takes call
// records (ring, MPI, NCCL) the model hands it to process_group::call as it is: no type is
// recovered above the backend's own reduction loops. For any other backend it switches on dtype
// and reduce_kind back to the typed process_group call (a backend that declares
// `runtime_reductions` gets a ddp::runtime_op instead of a switch over the five static ops), so
// the argument checks, sequencing and async queue are exactly those of process_group.

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ddp/core/collective.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/process_group/backend_traits.hpp"
#include "ddp/process_group.hpp"
#include "ddp/work.hpp"

namespace ddp::detail {

class pg_group_interface {
 public:
  virtual ~pg_group_interface() = default;
  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  virtual std::string_view backend_name() const noexcept = 0;
  virtual memory_space memory() const noexcept = 0;
  virtual work call(const collective_call& c, bool async) = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
  virtual void set_timeout(std::chrono::milliseconds t) = 0;
  virtual std::uint64_t next_sequence() const = 0;
  virtual group_stats stats() const = 0;
  virtual bool broken() const noexcept = 0;
  /// nullptr for a non-member.
  virtual std::unique_ptr<pg_group_interface> new_group(std::vector<int> ranks) = 0;
  /// Memory for n elements of `type`; *data points at it, *shared says whether same-host ranks can address it.
  virtual std::shared_ptr<void> allocate(dtype type, std::size_t n, void** data, bool* shared) = 0;
  virtual void copy_memory(void* dst, const void* src, std::size_t bytes) = 0;
};

template <class B>
class pg_group_model final : public pg_group_interface {
 public:
  explicit pg_group_model(process_group<B> g) : group_(std::move(g)) {}

  process_group<B>& group() noexcept { return group_; }

  int rank() const noexcept override { return group_.rank(); }
  int size() const noexcept override { return group_.size(); }
  std::string_view backend_name() const noexcept override { return process_group<B>::backend_name(); }
  memory_space memory() const noexcept override { return B::memory; }
  std::chrono::milliseconds timeout() const override { return group_.timeout(); }
  void set_timeout(std::chrono::milliseconds t) override { group_.set_timeout(t); }
  std::uint64_t next_sequence() const override { return group_.next_sequence(); }
  group_stats stats() const override { return group_.stats(); }
  bool broken() const noexcept override { return group_.broken(); }

  std::unique_ptr<pg_group_interface> new_group(std::vector<int> ranks) override {
    auto sub = group_.new_group(std::move(ranks));
    if (!sub.valid()) return nullptr;
    return std::make_unique<pg_group_model>(std::move(sub));
  }

  std::shared_ptr<void> allocate(dtype type, std::size_t n, void** data, bool* shared) override {
    return visit_dtype(type, [&](auto tag) -> std::shared_ptr<void> {
      using T = typename decltype(tag)::type;
      using buffer = decltype(group_.template allocate<T>(n));
      auto holder = std::make_shared<buffer>(group_.template allocate<T>(n));
      *data = static_cast<void*>(std::data(*holder));
      if constexpr (requires { holder->shared(); }) *shared = holder->shared();
      else *shared = !std::is_same_v<buffer, std::vector<T>>;
      return holder;
    });
  }

  void copy_memory(void* dst, const void* src, std::size_t bytes) override { group_.copy_memory(dst, src, bytes); }

  work call(const collective_call& c, bool async) override {
    if constexpr (pg_takes_call_records<B>) {
      return group_.call(c, async);
    } else {
      if (c.op == collective::barrier) {  // moves no elements: whatever dtypes the backend supports
        if (async) return group_.barrier_async();
        group_.barrier();
        return {};
      }
      return visit_dtype(c.type, [&](auto tag) -> work {
        using T = typename decltype(tag)::type;
        if constexpr (!supports_dtype_v<B, T>) {
          throw error(errc::invalid_argument,
                      "backend '" + std::string(backend_name()) + "' does not support " + std::string(to_string(c.type)),
                      {.rank = rank(), .op = std::string(to_string(c.op))});
        } else {
          return typed<T>(c, async);
        }
      });
    }
  }

 private:
  template <class T>
  work typed(const collective_call& c, bool async) {
    const std::span<const T> in(static_cast<const T*>(c.in), c.in_count);
    const std::span<T> out(static_cast<T*>(c.out), c.out_count);
    auto& g = group_;
    switch (c.op) {
      case collective::all_reduce:
        return reducing<T>(c, [&](auto op) -> work {
          if (c.in == c.out) {
            if (async) return g.all_reduce_async(out, op);
            g.all_reduce(out, op);
          } else {
            if (async) return g.all_reduce_async(in, out, op);
            g.all_reduce(in, out, op);
          }
          return {};
        });
      case collective::broadcast:
        if (async) return g.broadcast_async(out, c.root);
        g.broadcast(out, c.root);
        return {};
      case collective::reduce:
        return reducing<T>(c, [&](auto op) -> work {
          if (async) return g.reduce_async(out, c.root, op);
          g.reduce(out, c.root, op);
          return {};
        });
      case collective::all_gather:
        if (async) return g.all_gather_async(in, out);
        g.all_gather(in, out);
        return {};
      case collective::reduce_scatter:
        return reducing<T>(c, [&](auto op) -> work {
          if (async) return g.reduce_scatter_async(in, out, op);
          g.reduce_scatter(in, out, op);
          return {};
        });
      case collective::all_to_all:
        if (async) return g.all_to_all_async(in, out);
        g.all_to_all(in, out);
        return {};
      case collective::barrier:
        if (async) return g.barrier_async();
        g.barrier();
        return {};
      case collective::send:
        if (async) return g.send_async(in, c.root);
        g.send(in, c.root);
        return {};
      case collective::recv:
        if (async) return g.recv_async(out, c.root);
        g.recv(out, c.root);
        return {};
    }
    throw error(errc::unavailable, std::string(to_string(c.op)) + " is not offered by ddp::group", {.rank = rank()});
  }

  template <class T, class F>
  work reducing(const collective_call& c, F&& f) {
    // One instantiation for every reduction where the backend takes it at run time.
    if constexpr (pg_runtime_reductions<B>) return f(runtime_op{c.reduction});
    else return visit_reduce_kind(c.reduction, [&](auto op) -> work {
      if constexpr (!supports_op_v<B, decltype(op)>) {
        throw error(errc::invalid_argument,
                    "backend '" + std::string(backend_name()) + "' does not support the reduction " + std::string(to_string(c.reduction)),
                    {.rank = rank(), .op = std::string(to_string(c.op))});
      } else {
        return f(op);
      }
    });
  }

  process_group<B> group_;
};

}  // namespace ddp::detail
