#pragma once
// ddp::mpi_backend: collectives through MPI (host memory), modelling ddp::backend.
//
// - dtypes map to MPI datatypes; float16/bfloat16 are reduced in float32 (converted in a
//   scratch buffer), so every MPI implementation works without user-defined ops;
// - ops map to MPI_SUM/PROD/MIN/MAX; avg is a sum divided once at the end;
// - process_group hands every call down as one record (takes_call_records), whose dtype and
//   reduction map to MPI's at run time: nothing is compiled once per element type but the
//   float32 conversions of the half types and avg's division;
// - every call is nonblocking MPI (MPI_Iallreduce, ...) polled with MPI_Test, so the
//   deadline is honoured and abort() unblocks a waiter (MPI cannot cancel a collective:
//   after a timeout or abort the communicator is unusable, as with NCCL);
// - with check_collectives (the default) each call first agrees on the collective's
//   fingerprint with one 16-byte MPI_Allreduce, so ranks that call different collectives
//   get errc::mismatch describing both calls instead of undefined behaviour;
// - MPI errors are returned (MPI_ERRORS_RETURN) and become ddp::error(errc::mpi) with
//   MPI_Error_string's text and the native code.
//
// Thread use: process_group issues every call from its one communication thread, so MPI is
// initialised with MPI_THREAD_SERIALIZED (mpi_environment).

#if !defined(DDP_HAS_MPI) && !defined(DDP_MPI_STANDALONE)
#error "<ddp/backends/mpi.hpp> needs MPI: link the CMake target ddp::mpi (found with find_package(MPI))"
#endif

#include <mpi.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <span>
#include <string>
#include <vector>

#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/function_ref.hpp"
#include "ddp/core/reduce_op.hpp"

namespace ddp {

namespace detail {

inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

inline void mpi_check(int code, const char* call, const error_context& context = {}) {
  if (code == MPI_SUCCESS) return;
  error_context c = context;
  c.backend_code = code;
  throw error(errc::mpi, std::string(call) + " failed: " + mpi_error_text(code), std::move(c));
}

/// The MPI type a dtype is reduced in (float16 and bfloat16: float32, converted by the backend).
inline MPI_Datatype mpi_datatype(dtype type) {
  switch (type) {
    case dtype::float32:
    case dtype::float16:
    case dtype::bfloat16: return MPI_FLOAT;
    case dtype::float64: return MPI_DOUBLE;
    case dtype::int32: return MPI_INT32_T;
    case dtype::int64: return MPI_INT64_T;
    case dtype::uint8: break;
  }
  return MPI_UINT8_T;
}

inline MPI_Op mpi_op(reduce_kind kind) {
  switch (kind) {
    case reduce_kind::sum:
    case reduce_kind::avg: return MPI_SUM;
    case reduce_kind::min: return MPI_MIN;
    case reduce_kind::max: return MPI_MAX;
    case reduce_kind::prod: break;
  }
  return MPI_PROD;
}

}  // namespace detail

/// Initialises MPI (MPI_THREAD_SERIALIZED) unless it already is, and finalises it on
/// destruction if it initialised it. Keep one alive for as long as MPI backends are used.
class mpi_environment {
 public:
  mpi_environment() : mpi_environment(nullptr, nullptr) {}
  mpi_environment(int* argc, char*** argv) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) return;
    int provided = 0;
    detail::mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    owner_ = true;
    if (provided < MPI_THREAD_SERIALIZED) {
      throw error(errc::mpi, "the MPI library provides thread level " + std::to_string(provided) +
                                 ", ddp needs MPI_THREAD_SERIALIZED (collectives run on a communication thread)");
    }
  }
  mpi_environment(const mpi_environment&) = delete;
  mpi_environment& operator=(const mpi_environment&) = delete;
  ~mpi_environment() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owner_ && !finalized) MPI_Finalize();
  }

 private:
  bool owner_ = false;
};

struct mpi_options {
  bool check_collectives = true;  // agree on each call's fingerprint first (one tiny all-reduce)
};

class mpi_backend {
 public:
  static constexpr memory_space memory = memory_space::host;
  /// Reducing collectives take a ddp::runtime_op as well as the static ops (ddp::group uses it).
  static constexpr bool runtime_reductions = true;
  /// process_group hands every call to run() as one record.
  static constexpr bool takes_call_records = true;
  /// Every collective, each with the call's fingerprint and deadline.
  static constexpr backend_capabilities capabilities = all_capabilities;

  /// Works on a duplicate of `comm`, so its traffic never mixes with the user's.
  explicit mpi_backend(MPI_Comm comm = MPI_COMM_WORLD, mpi_options options = {}) : options_(options) {
    detail::mpi_check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  mpi_backend(const mpi_backend&) = delete;
  mpi_backend& operator=(const mpi_backend&) = delete;
  mpi_backend(mpi_backend&& other) noexcept
      : comm_(std::exchange(other.comm_, MPI_COMM_NULL)), rank_(other.rank_), size_(other.size_), options_(other.options_),
        seq_(other.seq_) {}
  ~mpi_backend() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm_ != MPI_COMM_NULL && !finalized && !aborted_.load()) MPI_Comm_free(&comm_);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  MPI_Comm communicator() const noexcept { return comm_; }

  // --- the plain backend interface (sequence and deadline of its own) -------------------
  template <dtype_like T, any_reduce_op Op>
  void all_reduce(std::span<T> data, Op op) {
    all_reduce(data, op, next<T>(collective::all_reduce, data.size(), kind_of(op)), deadline::never());
  }
  template <dtype_like T>
  void broadcast(std::span<T> data, int root) {
    broadcast(data, root, next<T>(collective::broadcast, data.size(), reduce_kind::sum, root), deadline::never());
  }
  template <dtype_like T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    all_gather(in, out, next<T>(collective::all_gather, in.size()), deadline::never());
  }
  template <dtype_like T, any_reduce_op Op>
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op) {
    reduce_scatter(in, out, op, next<T>(collective::reduce_scatter, out.size(), kind_of(op)), deadline::never());
  }
  void barrier() { barrier(next<std::uint8_t>(collective::barrier, 0), deadline::never()); }

  // --- the extended interface used by process_group: its fingerprint and deadline -------
  template <dtype_like T, any_reduce_op Op>
  void all_reduce(std::span<T> data, Op op, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::all_reduce, data, data, kind_of(op)), desc, until);
  }
  template <dtype_like T>
  void broadcast(std::span<T> data, int root, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::broadcast, data, data, reduce_kind::sum, root), desc, until);
  }
  template <dtype_like T, any_reduce_op Op>
  void reduce(std::span<T> data, int root, Op op, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::reduce, data, data, kind_of(op), root), desc, until);
  }
  template <dtype_like T>
  void all_gather(std::span<const T> in, std::span<T> out, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::all_gather, in, out), desc, until);
  }
  template <dtype_like T, any_reduce_op Op>
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::reduce_scatter, in, out, kind_of(op)), desc, until);
  }
  template <dtype_like T>
  void all_to_all(std::span<const T> in, std::span<T> out, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::all_to_all, in, out), desc, until);
  }
  void barrier(const collective_desc& desc, deadline until) { run(collective_call{.op = collective::barrier}, desc, until); }
  template <dtype_like T>
  void send(std::span<const T> data, int peer, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::send, data, std::span<T>(), reduce_kind::sum, peer), desc, until);
  }
  template <dtype_like T>
  void recv(std::span<T> data, int peer, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::recv, std::span<const T>(), data, reduce_kind::sum, peer), desc, until);
  }

  /// One collective as a record (process_group has checked it; in place for all_reduce,
  /// broadcast and reduce). Collectives first agree on the fingerprint; send and recv carry a
  /// header instead.
  void run(const collective_call& c, const collective_desc& desc, deadline until) {
    if (c.op != collective::send && c.op != collective::recv) agree(desc, until);
    MPI_Request request;
    switch (c.op) {
      case collective::all_reduce:
        return reducing(c, true, desc, until, "MPI_Iallreduce", [&](const void*, void* data, MPI_Datatype type, MPI_Request* r) {
          return MPI_Iallreduce(MPI_IN_PLACE, data, count(c.out_count), type, detail::mpi_op(c.reduction), comm_, r);
        });
      case collective::reduce:
        return reducing(c, rank_ == c.root, desc, until, "MPI_Ireduce", [&](const void*, void* data, MPI_Datatype type, MPI_Request* r) {
          const void* send = rank_ == c.root ? MPI_IN_PLACE : data;
          return MPI_Ireduce(send, data, count(c.out_count), type, detail::mpi_op(c.reduction), c.root, comm_, r);
        });
      case collective::reduce_scatter:
        return reducing(c, true, desc, until, "MPI_Ireduce_scatter_block", [&](const void* in, void* out, MPI_Datatype type, MPI_Request* r) {
          return MPI_Ireduce_scatter_block(in, out, count(c.out_count), type, detail::mpi_op(c.reduction), comm_, r);
        });
      case collective::broadcast:
        if (c.out_count == 0) return;
        call(MPI_Ibcast(c.out, count(c.out_bytes()), MPI_BYTE, c.root, comm_, &request), "MPI_Ibcast", desc);
        return wait(request, desc, until);
      case collective::all_gather:
        if (c.in_count == 0) return;
        call(MPI_Iallgather(c.in, count(c.in_bytes()), MPI_BYTE, c.out, count(c.in_bytes()), MPI_BYTE, comm_, &request), "MPI_Iallgather", desc);
        return wait(request, desc, until);
      case collective::all_to_all: {
        if (c.in_count == 0) return;
        const int block = count(c.in_bytes() / static_cast<std::size_t>(size_));
        call(MPI_Ialltoall(c.in, block, MPI_BYTE, c.out, block, MPI_BYTE, comm_, &request), "MPI_Ialltoall", desc);
        return wait(request, desc, until);
      }
      case collective::barrier:
        call(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier", desc);
        return wait(request, desc, until);
      case collective::send: return send_bytes(c.in, c.in_bytes(), c.root, desc, until);
      case collective::recv: return recv_bytes(c.out, c.out_bytes(), c.root, desc, until);
    }
    throw error(errc::unavailable, std::string(to_string(c.op)) + " is not offered by the MPI backend", desc.context(rank_));
  }

  template <dtype_like T>
  void send(std::span<const T> data, int peer) { send(data, peer, point_to_point<T>(collective::send, data.size()), deadline::never()); }
  template <dtype_like T>
  void recv(std::span<T> data, int peer) { recv(data, peer, point_to_point<T>(collective::recv, data.size()), deadline::never()); }

  /// Makes every wait of this backend return with errc::peer_lost. MPI cannot cancel a
  /// collective in flight: the communicator is unusable afterwards.
  void abort() noexcept { aborted_.store(true); }

 private:
  static constexpr int point_to_point_tag = 0x0ddb;

  template <class T>
  collective_desc next(collective op, std::size_t n, reduce_kind reduction = reduce_kind::sum, int root = -1) {
    return collective_desc{.seq = seq_++, .op = op, .type = dtype_of<T>, .reduction = reduction, .root = root, .count = n};
  }

  // Point-to-point calls involve two ranks only, so they do not take a collective sequence number.
  template <class T>
  collective_desc point_to_point(collective op, std::size_t n) {
    return collective_desc{.seq = p2p_seq_++, .op = op, .type = dtype_of<T>, .count = n};
  }

  static int count(std::size_t n) {
    if (n > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
      throw error(errc::invalid_argument, "MPI counts are int: " + std::to_string(n) + " elements is too many for one call");
    }
    return static_cast<int>(n);
  }

  void call(int code, const char* what, const collective_desc& desc) const { detail::mpi_check(code, what, desc.context(rank_)); }

  // Polls the request so the deadline and abort() are honoured.
  void wait(MPI_Request& request, const collective_desc& desc, deadline until) {
    for (unsigned spins = 0;; ++spins) {
      int done = 0;
      call(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test", desc);
      if (done) return;
      if (aborted_.load(std::memory_order_relaxed)) {
        throw error(errc::peer_lost, "the MPI backend was aborted while waiting", desc.context(rank_));
      }
      if ((spins & 1023u) == 1023u) {
        if (until.expired()) {
          aborted_.store(true);
          throw error(errc::timeout, "not completed by every rank before the deadline (MPI cannot tell which ranks are missing)",
                      desc.context(rank_));
        }
        sched_yield();
      }
    }
  }

  // Ranks agree on (seq, op, dtype, count, root, reduction): MAX over {h, ~h} equals {h, ~h}
  // on every rank only if all fingerprints are equal. On a difference all ranks gather the
  // headers and describe the first rank whose call differs from this one.
  void agree(const collective_desc& desc, deadline until) {
    if (!options_.check_collectives || size_ == 1) return;
    const auto header = wire_header::encode(desc.normalized());
    const std::uint64_t h = header.fingerprint();
    std::uint64_t both[2] = {h, ~h};
    MPI_Request request;
    call(MPI_Iallreduce(MPI_IN_PLACE, both, 2, MPI_UINT64_T, MPI_MAX, comm_, &request), "MPI_Iallreduce", desc);
    wait(request, desc, until);
    if (both[0] == h && both[1] == ~h) return;
    std::vector<unsigned char> all(wire_header::size * static_cast<std::size_t>(size_));
    call(MPI_Iallgather(header.bytes, wire_header::size, MPI_BYTE, all.data(), wire_header::size, MPI_BYTE, comm_, &request),
         "MPI_Iallgather", desc);
    wait(request, desc, until);
    for (int r = 0; r < size_; ++r) {
      wire_header theirs;
      std::memcpy(theirs.bytes, all.data() + wire_header::size * static_cast<std::size_t>(r), wire_header::size);
      check_same_collective(desc, theirs.decode(), rank_, r);
    }
    throw error(errc::mismatch, "ranks called different collectives (this rank's call matches every other rank's, another pair differs)",
                desc.context(rank_));
  }



  // Starts a nonblocking reduction of `in` into `out` (in place: the same buffer) in `type`.
  using start_reduction = detail::function_ref<int(const void* in, void* out, MPI_Datatype type, MPI_Request* request)>;

  // A reducing collective: half types go through float32 copies (converted back after), and
  // avg's sum is divided once where `owns_result` (the root of a reduce; every rank otherwise).
  void reducing(const collective_call& c, bool owns_result, const collective_desc& desc, deadline until, const char* name,
                start_reduction start) {
    if (c.out_count == 0) return;
    const bool in_place = c.in == c.out;
    visit_dtype(c.type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      using A = accumulate_t<T>;
      T* out = static_cast<T*>(c.out);
      const T* in = static_cast<const T*>(c.in);
      std::vector<A> wide_in, wide_out;
      A* result = nullptr;
      const A* source = nullptr;
      if constexpr (half_precision<T>) {
        const auto widen = [](const T* from, std::size_t n) {
          std::vector<A> wide(n);
          for (std::size_t i = 0; i < n; ++i) wide[i] = static_cast<A>(from[i]);
          return wide;
        };
        wide_out = in_place ? widen(out, c.out_count) : std::vector<A>(c.out_count);
        result = wide_out.data();
        source = result;
        if (!in_place) {
          wide_in = widen(in, c.in_count);
          source = wide_in.data();
        }
      } else {
        result = out;
        source = in;
      }
      MPI_Request request;
      call(start(source, result, detail::mpi_datatype(c.type), &request), name, desc);
      wait(request, desc, until);
      if (owns_result && c.reduction == reduce_kind::avg) {
        for (std::size_t i = 0; i < c.out_count; ++i) result[i] = avg{}.finish(result[i], size_);
      }
      if constexpr (half_precision<T>) {
        for (std::size_t i = 0; i < c.out_count; ++i) out[i] = T(result[i]);
      }
    });
  }

  void send_bytes(const void* data, std::size_t bytes, int peer, const collective_desc& desc, deadline until) {
    const auto header = wire_header::encode(desc);
    MPI_Request requests[2];
    call(MPI_Isend(header.bytes, wire_header::size, MPI_BYTE, peer, point_to_point_tag, comm_, &requests[0]), "MPI_Isend", desc);
    call(MPI_Isend(data, count(bytes), MPI_BYTE, peer, point_to_point_tag, comm_, &requests[1]), "MPI_Isend", desc);
    wait(requests[0], desc, until);
    wait(requests[1], desc, until);
  }

  void recv_bytes(void* data, std::size_t bytes, int peer, const collective_desc& desc, deadline until) {
    wire_header header;
    MPI_Request request;
    call(MPI_Irecv(header.bytes, wire_header::size, MPI_BYTE, peer, point_to_point_tag, comm_, &request), "MPI_Irecv", desc);
    wait(request, desc, until);
    if (!header.has_magic() || header.decode().op != collective::send || header.decode().count != desc.count ||
        header.decode().type != desc.type) {
      throw error(errc::mismatch,
                  "rank " + std::to_string(peer) + " sent " + (header.has_magic() ? header.decode().describe() : "no ddp header") +
                      ", this rank expected to receive " + desc.detail(),
                  desc.context(rank_));
    }
    call(MPI_Irecv(data, count(bytes), MPI_BYTE, peer, point_to_point_tag, comm_, &request), "MPI_Irecv", desc);
    wait(request, desc, until);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  mpi_options options_;
  std::uint64_t seq_ = 0;
  std::uint64_t p2p_seq_ = 0;
  std::atomic<bool> aborted_{false};
};

static_assert(backend<mpi_backend>);

}  // namespace ddp
