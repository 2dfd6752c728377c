#pragma once
// The typed calls of process_group<B> into its backend: for a backend that does not take call
// records (a user's, NCCL, MPI) and for a user's own reduce op. Each uses what B declares
// (B::capabilities), in its extended form when it declares deadlines, and otherwise the fallback
// that backend_capabilities documents. A *_call returns the closure the group runs at execution
// time with the sequenced fingerprint and the deadline. `State` is the group's shared state
// (backend, rank, size).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "ddp/core/bulk_copy.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/process_group/backend_traits.hpp"

namespace ddp::detail {

/// Whether two byte ranges share a byte (then the input is copied before the backend runs).
inline bool pg_overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) noexcept {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto* a0 = static_cast<const std::byte*>(a);
  const auto* b0 = static_cast<const std::byte*>(b);
  return std::less<>{}(a0, b0 + b_bytes) && std::less<>{}(b0, a0 + a_bytes);
}
template <class T, class U>
bool pg_overlap(std::span<T> a, std::span<U> b) noexcept {
  return pg_overlap(a.data(), a.size_bytes(), b.data(), b.size_bytes());
}

template <class B, class State>
struct pg_backend_calls {
  // Each uses what the backend declares (B::capabilities), in its extended form when it declares
  // deadlines, and otherwise the fallback that backend_capabilities documents.
  static constexpr backend_capabilities caps = pg_capabilities<B>();

  // ddp's own ops reach a backend that takes runtime reductions as the runtime_op of their kind:
  // one call (and one backend instantiation) per element type for the five kinds.
  template <class Op>
  static constexpr bool as_runtime_op = pg_runtime_reductions<B> && builtin_reduce_op<Op>;

  template <class T, class Op>
  static auto all_reduce_call(State* st, std::span<T> data, Op op) {
    if constexpr (as_runtime_op<Op>) return all_reduce_call(st, data, runtime_op{Op::kind});
    else return [st, data, op](const collective_desc& d, deadline until) { backend_all_reduce(*st, data, op, d, until); };
  }
  template <class T, class Op>
  static auto all_reduce_call(State* st, std::span<const T> in, std::span<T> out, Op op) {
    if constexpr (as_runtime_op<Op>) {
      return all_reduce_call(st, in, out, runtime_op{Op::kind});
    } else {
      return [st, in, out, op](const collective_desc& d, deadline until) {
        if (in.data() != out.data()) copy_within(*st, out.data(), in.data(), in.size_bytes());
        backend_all_reduce(*st, out, op, d, until);
      };
    }
  }
  template <class T, class Op>
  static void backend_all_reduce(State& s, std::span<T> data, Op op, const collective_desc& d, deadline until) {
    if constexpr (caps.deadlines) s.backend.all_reduce(data, op, d, until);
    else s.backend.all_reduce(data, op);
  }
  template <class T>
  static void backend_broadcast(State& s, std::span<T> data, int root, const collective_desc& d, deadline until) {
    if constexpr (caps.deadlines) s.backend.broadcast(data, root, d, until);
    else s.backend.broadcast(data, root);
  }

  template <class T>
  static auto broadcast_call(State* st, std::span<T> data, int root) {
    return [st, data, root](const collective_desc& d, deadline until) { backend_broadcast(*st, data, root, d, until); };
  }

  template <class T, class Op>
  static auto reduce_call(State* st, std::span<T> data, int root, Op op) {
    if constexpr (as_runtime_op<Op>) return reduce_call(st, data, root, runtime_op{Op::kind});
    else return [st, data, root, op](const collective_desc& d, deadline until) {
      if constexpr (caps.reduce && caps.deadlines) st->backend.reduce(data, root, op, d, until);
      else if constexpr (caps.reduce) st->backend.reduce(data, root, op);
      else {
        (void)root;  // every rank gets the result: a valid reduce
        backend_all_reduce(*st, data, op, d, until);
      }
    };
  }

  template <class T, class V>
  static void backend_all_gather(State& s, std::span<const T> in, std::span<V> out, const collective_desc& d, deadline until) {
    if constexpr (caps.all_gather && caps.deadlines) {
      s.backend.all_gather(in, out, d, until);
    } else if constexpr (caps.all_gather) {
      s.backend.all_gather(in, out);
    } else {
      // One broadcast from each rank in turn, straight into its block of out.
      const std::size_t n = in.size();
      if (!in.empty()) copy_within(s, out.data() + static_cast<std::size_t>(s.rank) * n, in.data(), in.size_bytes());
      for (int r = 0; r < s.size; ++r) backend_broadcast(s, out.subspan(static_cast<std::size_t>(r) * n, n), r, d, until);
    }
  }

  template <class T>
  static auto all_gather_call(State* st, std::span<const T> in, std::span<T> out) {
    return [st, in, out](const collective_desc& d, deadline until) {
      const auto input = unaliased(*st, in, out);  // e.g. in is this rank's slice of out
      backend_all_gather(*st, std::span<const T>(input.data), out, d, until);
    };
  }

  template <class T, class Op>
  static auto reduce_scatter_call(State* st, std::span<const T> in, std::span<T> out, Op op) {
    if constexpr (as_runtime_op<Op>) return reduce_scatter_call(st, in, out, runtime_op{Op::kind});
    else return [st, in, out, op](const collective_desc& d, deadline until) {
      if constexpr (caps.reduce_scatter) {
        const auto input = unaliased(*st, in, out);
        const std::span<const T> src = input.data;
        if constexpr (caps.deadlines) st->backend.reduce_scatter(src, out, op, d, until);
        else st->backend.reduce_scatter(src, out, op);
      } else {
        // The whole input reduced on every rank (a copy: the input stays untouched), then this
        // rank's block of it.
        static_assert(B::memory == memory_space::host || (pg_has_allocate<B, T> && pg_has_copy_memory<B>),
                      "a device-memory backend without reduce_scatter provides allocate<T>(n) and copy_memory(dst, src, bytes)");
        using V = std::remove_cv_t<T>;
        auto whole = [&] {
          if constexpr (B::memory == memory_space::device) return st->backend.template allocate<V>(in.size());
          else return std::vector<V>(in.size());
        }();
        copy_within(*st, whole.data(), in.data(), in.size_bytes());
        backend_all_reduce(*st, std::span<V>(whole.data(), in.size()), op, d, until);
        copy_within(*st, out.data(), whole.data() + static_cast<std::size_t>(st->rank) * out.size(), out.size_bytes());
      }
    };
  }

  template <class T>
  static auto all_to_all_call(State* st, std::span<const T> in, std::span<T> out) {
    return [st, in, out](const collective_desc& d, deadline until) {
      using V = std::remove_cv_t<T>;
      const auto input = unaliased(*st, in, out);
      const std::span<const T> src = input.data;
      if constexpr (caps.all_to_all && caps.deadlines) {
        st->backend.all_to_all(src, out, d, until);
      } else if constexpr (caps.all_to_all) {
        st->backend.all_to_all(src, out);
      } else {
        // Through all_gather: p times the traffic, but any backend can do it.
        const auto p = static_cast<std::size_t>(st->size);
        const std::size_t block = src.size() / p;
        const auto me = static_cast<std::size_t>(st->rank);
        std::vector<V> everything(src.size() * p);
        backend_all_gather(*st, src, std::span<V>(everything), d, until);
        for (std::size_t j = 0; j < p; ++j) {
          std::copy_n(everything.begin() + static_cast<std::ptrdiff_t>(j * src.size() + me * block), block,
                      out.begin() + static_cast<std::ptrdiff_t>(j * block));
        }
      }
    };
  }

  static auto barrier_call(State* st) {
    return [st](const collective_desc& d, deadline until) {
      if constexpr (caps.barrier && caps.deadlines) {
        st->backend.barrier(d, until);
      } else if constexpr (caps.barrier) {
        st->backend.barrier();
      } else {
        // One element of the first type the backend takes, summed.
        using V = std::conditional_t<supports_dtype_v<B, float>, float, std::conditional_t<supports_dtype_v<B, std::int32_t>, std::int32_t, double>>;
        static_assert(B::memory == memory_space::host || pg_has_allocate<B, V>,
                      "a device-memory backend without barrier provides allocate<T>(n)");
        auto one = [&] {
          if constexpr (B::memory == memory_space::device) return st->backend.template allocate<V>(1);
          else return std::vector<V>(1);
        }();
        backend_all_reduce(*st, std::span<V>(one.data(), 1), sum{}, d, until);
      }
    };
  }

  template <class T>
  static auto send_call(State* st, std::span<const T> data, int peer) {
    if constexpr (!caps.send_recv) {
      throw error(errc::unavailable, std::string("backend '") + std::string(pg_backend_name<B>()) + "' has no send/recv", error_context{.rank = st->rank, .op = std::string(to_string(collective::send))});
      return [](const collective_desc&, deadline) {};  // never reached; gives the function its type
    } else {
      return [st, data, peer](const collective_desc& d, deadline until) {
        if constexpr (caps.deadlines) st->backend.send(data, peer, d, until);
        else st->backend.send(data, peer);
      };
    }
  }
  template <class T>
  static auto recv_call(State* st, std::span<T> data, int peer) {
    if constexpr (!caps.send_recv) {
      throw error(errc::unavailable, std::string("backend '") + std::string(pg_backend_name<B>()) + "' has no send/recv", error_context{.rank = st->rank, .op = std::string(to_string(collective::recv))});
      return [](const collective_desc&, deadline) {};  // never reached; gives the function its type
    } else {
      return [st, data, peer](const collective_desc& d, deadline until) {
        if constexpr (caps.deadlines) st->backend.recv(data, peer, d, until);
        else st->backend.recv(data, peer);
      };
    }
  }

  // --- memory the calls need -----------------------------------------------------------------
  static void copy_within(State& s, void* dst, const void* src, std::size_t bytes) {
    if constexpr (pg_has_copy_memory<B>) {
      s.backend.copy_memory(dst, src, bytes);
    } else {
      (void)s;
      if (bytes > 0 && dst != src) ddp::detail::bulk_copy(dst, src, bytes);
    }
  }

  // An input the backend may read while it writes the output: a private copy when the two
  // overlap (in the backend's memory space), else the input itself.
  template <class T>
  struct private_input {
    std::shared_ptr<void> owner;
    std::span<const T> data;
  };
  template <class T, class U>
  static private_input<T> unaliased(State& s, std::span<const T> in, std::span<U> out) {
    if (!pg_overlap(in, out)) return {nullptr, in};
    using V = std::remove_cv_t<T>;
    if constexpr (B::memory == memory_space::device) {
      using A = std::conditional_t<std::is_same_v<V, std::byte>, std::uint8_t, V>;  // a record's bytes
      static_assert(pg_has_allocate<B, A> && pg_has_copy_memory<B>,
                    "a device-memory backend provides allocate<T>(n) and copy_memory(dst, src, bytes)");
      using buffer = decltype(s.backend.template allocate<A>(in.size()));
      auto owned = std::make_shared<buffer>(s.backend.template allocate<A>(in.size()));
      copy_within(s, owned->data(), in.data(), in.size_bytes());
      return {owned, std::span<const T>(reinterpret_cast<const T*>(owned->data()), in.size())};
    } else {
      (void)s;
      auto owned = std::make_shared<std::vector<V>>(in.begin(), in.end());
      return {owned, std::span<const T>(*owned)};
    }
  }
};

}  // namespace ddp::detail
