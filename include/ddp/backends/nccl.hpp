#pragma once
// ddp::nccl_backend: collectives on device memory through NCCL, modelling ddp::backend.
//
// - one device per local rank (cudaSetDevice(local_rank)); fewer visible devices than local
//   ranks is errc::cuda saying so;
// - the communicator is set up through the process group's store: rank 0 creates the
//   ncclUniqueId and publishes it; it is created non-blocking (config.blocking = 0), so no
//   NCCL call can hang the host;
// - operations are stream-ordered on the backend's own stream (natively asynchronous);
//   completion is a CUDA event; waiting polls the event and ncclCommGetAsyncError, and a
//   deadline that passes aborts the communicator (ncclCommAbort), so a dead peer is an
//   error, not a hang;
// - every CUDA and NCCL return code is checked and reported with its error string and
//   ncclGetLastError's text.
//
// Spans point to device memory. ddp::float16 / ddp::bfloat16 have the device types' bit
// layout and map to ncclFloat16 / ncclBfloat16 (NCCL accumulates them itself).

#if !defined(DDP_HAS_NCCL)
#error "<ddp/backends/nccl.hpp> needs CUDA and NCCL: link the CMake target ddp::nccl (found when CUDA and NCCL are installed)"
#endif

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/store/store.hpp"

namespace ddp {

namespace detail {

inline void cuda_check(cudaError_t code, const char* call, const error_context& context = {}) {
  if (code == cudaSuccess) return;
  error_context c = context;
  c.backend_code = static_cast<int>(code);
  throw error(errc::cuda, std::string(call) + " failed: " + cudaGetErrorName(code) + ": " + cudaGetErrorString(code), std::move(c));
}

inline void nccl_check(ncclResult_t code, const char* call, ncclComm_t comm = nullptr, const error_context& context = {}) {
  if (code == ncclSuccess || code == ncclInProgress) return;
  error_context c = context;
  c.backend_code = static_cast<int>(code);
  std::string text = std::string(call) + " failed: " + ncclGetErrorString(code);
  if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0') text += " (" + std::string(last) + ")";
  if (code == ncclSystemError) text += "; if this runs in a container, a small /dev/shm is a common cause (use --ipc=host or --shm-size)";
  throw error(errc::nccl, text, std::move(c));
}

template <class T>
constexpr ncclDataType_t nccl_datatype() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) return ncclFloat32;
  else if constexpr (std::is_same_v<U, double>) return ncclFloat64;
  else if constexpr (std::is_same_v<U, float16>) return ncclFloat16;
  else if constexpr (std::is_same_v<U, bfloat16>) return ncclBfloat16;
  else if constexpr (std::is_same_v<U, std::int32_t>) return ncclInt32;
  else if constexpr (std::is_same_v<U, std::int64_t>) return ncclInt64;
  else return ncclUint8;
}

constexpr ncclRedOp_t nccl_op(reduce_kind kind) {
  switch (kind) {
    case reduce_kind::sum: return ncclSum;
    case reduce_kind::avg: return ncclAvg;
    case reduce_kind::min: return ncclMin;
    case reduce_kind::max: return ncclMax;
    case reduce_kind::prod: break;
  }
  return ncclProd;
}

}  // namespace detail

struct nccl_options {
  int local_rank = 0;                       // selects the device
  std::string key_prefix = "ddp/nccl/";     // where rank 0 publishes the unique id
  bool check_collectives = true;            // agree on each call's fingerprint (one 16-byte all-reduce ahead of it)
};

class nccl_backend {
 public:
  static constexpr memory_space memory = memory_space::device;
  /// Reducing collectives take a ddp::runtime_op as well as the static ops (ddp::group uses it).
  static constexpr bool runtime_reductions = true;
  static constexpr bool natively_async = true;

  nccl_backend(store::store& rendezvous, int rank, int size, nccl_options options = {},
               deadline until = deadline::after(default_timeout()))
      : rank_(rank), size_(size), options_(std::move(options)) {
    int devices = 0;
    detail::cuda_check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    if (options_.local_rank >= devices) {
      throw error(errc::cuda, "local rank " + std::to_string(options_.local_rank) + " needs device " +
                                  std::to_string(options_.local_rank) + " but only " + std::to_string(devices) +
                                  " CUDA device(s) are visible (check CUDA_VISIBLE_DEVICES and --nproc-per-node)",
                  {.rank = rank});
    }
    device_ = options_.local_rank;
    detail::cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    detail::cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    detail::cuda_check(cudaMalloc(reinterpret_cast<void**>(&fingerprint_), 2 * sizeof(std::uint64_t)), "cudaMalloc");

    ncclUniqueId id;
    const std::string key = options_.key_prefix + "unique_id";
    if (rank == 0) {
      detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
      rendezvous.set(key, std::as_bytes(std::span(id.internal)));
    } else {
      const auto bytes = rendezvous.get(key);
      if (bytes.size() != sizeof id.internal) throw error(errc::store, "store key '" + key + "' does not hold an NCCL unique id");
      std::memcpy(id.internal, bytes.data(), sizeof id.internal);
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    detail::nccl_check(ncclCommInitRankConfig(&comm_, size, id, rank, &config), "ncclCommInitRankConfig", comm_);
    wait_comm_ready({.rank = rank, .op = "nccl init"}, until);
  }

  nccl_backend(const nccl_backend&) = delete;
  nccl_backend& operator=(const nccl_backend&) = delete;
  // Movable so that a process_group can own it; the moved-from backend holds nothing.
  nccl_backend(nccl_backend&& other) noexcept
      : rank_(other.rank_), size_(other.size_), device_(other.device_), options_(std::move(other.options_)),
        stream_(std::exchange(other.stream_, nullptr)), comm_(std::exchange(other.comm_, nullptr)),
        fingerprint_(std::exchange(other.fingerprint_, nullptr)), seq_(other.seq_), aborted_(other.aborted_.load()) {}
  nccl_backend& operator=(nccl_backend&&) = delete;

  ~nccl_backend() {
    if (comm_ != nullptr) {
      if (aborted_.load()) {
        ncclCommAbort(comm_);
      } else {
        ncclCommFinalize(comm_);
        ncclResult_t state = ncclInProgress;
        const auto until = deadline::after(std::chrono::seconds(10));
        while (state == ncclInProgress && !until.expired()) ncclCommGetAsyncError(comm_, &state);
        if (state == ncclSuccess) ncclCommDestroy(comm_);
        else ncclCommAbort(comm_);
      }
    }
    if (fingerprint_ != nullptr) cudaFree(fingerprint_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  int device() const noexcept { return device_; }
  cudaStream_t stream() const noexcept { return stream_; }
  ncclComm_t communicator() const noexcept { return comm_; }

  // --- the plain backend interface ---------------------------------------------------
  template <dtype_like T, any_reduce_op Op>
  void all_reduce(std::span<T> data, Op op) { all_reduce(data, op, next<T>(collective::all_reduce, data.size(), kind_of(op)), default_deadline()); }
  template <dtype_like T>
  void broadcast(std::span<T> data, int root) {
    broadcast(data, root, next<T>(collective::broadcast, data.size(), reduce_kind::sum, root), default_deadline());
  }
  template <dtype_like T>
  void all_gather(std::span<const T> in, std::span<T> out) { all_gather(in, out, next<T>(collective::all_gather, in.size()), default_deadline()); }
  template <dtype_like T, any_reduce_op Op>
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op) {
    reduce_scatter(in, out, op, next<T>(collective::reduce_scatter, out.size(), kind_of(op)), default_deadline());
  }
  void barrier() { barrier(next<std::uint8_t>(collective::barrier, 0), default_deadline()); }

  // --- stream-ordered enqueue + wait (the extended interface) --------------------------
  template <dtype_like T, any_reduce_op Op>
  void all_reduce(std::span<T> data, Op op, const collective_desc& desc, deadline until) {
    run(desc, until, [&] {
      return ncclAllReduce(data.data(), data.data(), data.size(), detail::nccl_datatype<T>(), detail::nccl_op(kind_of(op)), comm_, stream_);
    });
  }
  template <dtype_like T>
  void broadcast(std::span<T> data, int root, const collective_desc& desc, deadline until) {
    run(desc, until, [&] { return ncclBroadcast(data.data(), data.data(), data.size(), detail::nccl_datatype<T>(), root, comm_, stream_); });
  }
  template <dtype_like T, any_reduce_op Op>
  void reduce(std::span<T> data, int root, Op op, const collective_desc& desc, deadline until) {
    run(desc, until, [&] {
      return ncclReduce(data.data(), data.data(), data.size(), detail::nccl_datatype<T>(), detail::nccl_op(kind_of(op)), root, comm_, stream_);
    });
  }
  template <dtype_like T>
  void all_gather(std::span<const T> in, std::span<T> out, const collective_desc& desc, deadline until) {
    run(desc, until, [&] { return ncclAllGather(in.data(), out.data(), in.size(), detail::nccl_datatype<T>(), comm_, stream_); });
  }
  template <dtype_like T, any_reduce_op Op>
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op, const collective_desc& desc, deadline until) {
    run(desc, until, [&] {
      return ncclReduceScatter(in.data(), out.data(), out.size(), detail::nccl_datatype<T>(), detail::nccl_op(kind_of(op)), comm_, stream_);
    });
  }
  template <dtype_like T>
  void all_to_all(std::span<const T> in, std::span<T> out, const collective_desc& desc, deadline until) {
    const std::size_t block = in.size() / static_cast<std::size_t>(size_);
    run(desc, until, [&] {
      ncclResult_t result = ncclGroupStart();
      for (int peer = 0; peer < size_ && result == ncclSuccess; ++peer) {
        const auto offset = block * static_cast<std::size_t>(peer);
        result = ncclSend(in.data() + offset, block, detail::nccl_datatype<T>(), peer, comm_, stream_);
        if (result == ncclSuccess) result = ncclRecv(out.data() + offset, block, detail::nccl_datatype<T>(), peer, comm_, stream_);
      }
      const ncclResult_t end = ncclGroupEnd();
      return result != ncclSuccess ? result : end;
    });
  }
  void barrier(const collective_desc& desc, deadline until) {
    run(desc, until, [&] { return ncclAllReduce(fingerprint_, fingerprint_, 1, ncclUint64, ncclMax, comm_, stream_); });
  }
  template <dtype_like T>
  void send(std::span<const T> data, int peer, const collective_desc& desc, deadline until) {
    run_unchecked(desc, until, [&] { return ncclSend(data.data(), data.size(), detail::nccl_datatype<T>(), peer, comm_, stream_); });
  }
  template <dtype_like T>
  void recv(std::span<T> data, int peer, const collective_desc& desc, deadline until) {
    run_unchecked(desc, until, [&] { return ncclRecv(data.data(), data.size(), detail::nccl_datatype<T>(), peer, comm_, stream_); });
  }
  template <dtype_like T>
  void send(std::span<const T> data, int peer) { send(data, peer, collective_desc{.op = collective::send, .type = dtype_of<T>, .count = data.size()}, default_deadline()); }
  template <dtype_like T>
  void recv(std::span<T> data, int peer) { recv(data, peer, collective_desc{.op = collective::recv, .type = dtype_of<T>, .count = data.size()}, default_deadline()); }

  /// Aborts the communicator: every waiter returns with errc::peer_lost; the backend is unusable afterwards.
  void abort() noexcept { aborted_.store(true); }

 private:
  template <class T>
  collective_desc next(collective op, std::size_t n, reduce_kind reduction = reduce_kind::sum, int root = -1) {
    return collective_desc{.seq = seq_++, .op = op, .type = dtype_of<T>, .reduction = reduction, .root = root, .count = n};
  }
  static deadline default_deadline() { return deadline::after(default_timeout()); }

  // Agrees on the fingerprint (MAX over {h, ~h} is {h, ~h} everywhere only if all are equal),
  // enqueues the operation, and waits for both.
  template <class Enqueue>
  void run(const collective_desc& desc, deadline until, Enqueue&& enqueue) {
    const auto context = desc.context(rank_);
    std::uint64_t mine[2] = {0, 0};
    if (options_.check_collectives && size_ > 1) {
      const auto header = wire_header::encode(normalized(desc));
      std::uint64_t h = 1469598103934665603ull;
      for (unsigned char b : header.bytes) h = (h ^ b) * 1099511628211ull;
      mine[0] = h;
      mine[1] = ~h;
      detail::cuda_check(cudaMemcpyAsync(fingerprint_, mine, sizeof mine, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync", context);
      detail::nccl_check(ncclAllReduce(fingerprint_, fingerprint_, 2, ncclUint64, ncclMax, comm_, stream_), "ncclAllReduce", comm_, context);
      wait_stream(context, until);
      std::uint64_t agreed[2];
      detail::cuda_check(cudaMemcpy(agreed, fingerprint_, sizeof agreed, cudaMemcpyDeviceToHost), "cudaMemcpy", context);
      if (agreed[0] != mine[0] || agreed[1] != mine[1]) {
        throw error(errc::mismatch, "ranks called different collectives at this sequence number (NCCL reports no details: run with "
                                    "the ring backend to see both calls)", context);
      }
    }
    run_unchecked(desc, until, std::forward<Enqueue>(enqueue));
  }

  template <class Enqueue>
  void run_unchecked(const collective_desc& desc, deadline until, Enqueue&& enqueue) {
    const auto context = desc.context(rank_);
    if (aborted_.load() || comm_ == nullptr) throw error(errc::peer_lost, "the NCCL communicator was aborted by an earlier error", context);
    detail::nccl_check(enqueue(), to_string(desc.op).data(), comm_, context);
    wait_comm_ready(context, until);
    wait_stream(context, until);
  }

  // Non-blocking communicators return ncclInProgress while an enqueue completes.
  void wait_comm_ready(const error_context& context, deadline until) {
    ncclResult_t state = ncclInProgress;
    while (true) {
      detail::nccl_check(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError", comm_, context);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) detail::nccl_check(state, "NCCL (asynchronous error)", comm_, context);
      check_abort_or_deadline(context, until);
    }
  }

  void wait_stream(const error_context& context, deadline until) {
    while (true) {
      const cudaError_t done = cudaStreamQuery(stream_);
      if (done == cudaSuccess) return;
      if (done != cudaErrorNotReady) detail::cuda_check(done, "cudaStreamQuery", context);
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) detail::nccl_check(state, "NCCL (asynchronous error)", comm_, context);
      check_abort_or_deadline(context, until);
    }
  }

  void check_abort_or_deadline(const error_context& context, deadline until) {
    if (aborted_.load(std::memory_order_relaxed)) {
      abort_communicator();
      throw error(errc::peer_lost, "the NCCL communicator was aborted while waiting", context);
    }
    if (until.expired()) {
      aborted_.store(true);
      abort_communicator();
      throw error(errc::timeout, "not completed before the deadline: a peer is missing, dead or stuck; the communicator was aborted",
                  context);
    }
  }

  // Called by the waiting thread only (ncclCommAbort must not race with other calls on the communicator).
  void abort_communicator() noexcept {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  static collective_desc normalized(collective_desc d) {
    if (!d.has_reduction()) d.reduction = reduce_kind::sum;
    if (!d.has_root()) d.root = -1;
    return d;
  }

  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  nccl_options options_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  std::uint64_t* fingerprint_ = nullptr;
  std::uint64_t seq_ = 0;
  std::atomic<bool> aborted_{false};
};

static_assert(backend<nccl_backend>);

}  // namespace ddp
